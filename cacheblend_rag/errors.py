"""Errors raised by cacheblend_rag; every one derives from CacheBlendError."""

from __future__ import annotations


class CacheBlendError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(CacheBlendError, ValueError):
    """A setting or argument is out of range or inconsistent."""


class UnsupportedModelError(CacheBlendError):
    """The model's architecture has no adapter."""


class ModelNotFoundError(CacheBlendError, FileNotFoundError):
    """A model name or path could not be resolved locally."""


class ModelNotCachedError(ModelNotFoundError):
    """A hub model id is not in the Hugging Face cache and cannot be downloaded (offline, or the hub unreachable)."""


class ChunkError(CacheBlendError, ValueError):
    """A chunk is empty, unknown, or otherwise unusable."""


class PromptTooLongError(CacheBlendError, ValueError):
    """The assembled prompt does not fit the model's context window."""


class CacheFormatError(CacheBlendError):
    """A stored KV file is truncated, corrupt, or belongs to another model."""


class MissingDependencyError(CacheBlendError, ImportError):
    """An optional dependency is not installed; the message names the extra."""


class KVWriteError(CacheBlendError, OSError):
    """The KV of a chunk could not be stored (disk full, read-only folder, ...); the message says where and why."""


class ProfileError(CacheBlendError):
    """The compute or storage profile of the loading controller could not be measured or cached."""


class VectorStoreError(CacheBlendError):
    """The vector store (Chroma) cannot be reached, refused the credentials, or lacks the collection."""


class CollectionNotFoundError(VectorStoreError, LookupError):
    """The named Chroma collection (or the whole embedded database) does not exist; nothing was created."""
