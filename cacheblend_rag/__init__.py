"""cacheblend_rag: fast RAG by fusing the cached KV of retrieved chunks (CacheBlend) on HF transformers."""

from .decode.generate import SamplingOptions
from .decode.grammar import Grammar, GrammarError
from .engine import CacheBlendEngine, Generation, Prefill
from .errors import (
    CacheBlendError,
    CacheFormatError,
    ChunkError,
    ConfigError,
    MissingDependencyError,
    ModelNotCachedError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from .fuse.layout import PromptTemplate
from .fuse.policies import METHODS, CacheBlend, CacheCraft, FullPrefill, FullReuse, PrefixCache, Relevance, make_policy
from .ingest.chunks import Chunk, chunk_id
from .models.loader import DEFAULT_MODEL, load_model
from .request import Request

__all__ = [
    "DEFAULT_MODEL", "METHODS", "CacheBlend", "CacheBlendEngine", "CacheCraft", "CacheBlendError", "CacheFormatError", "Chunk",
    "ChunkError", "ConfigError", "FullPrefill", "FullReuse", "Generation", "Grammar", "GrammarError",
    "MissingDependencyError", "ModelNotCachedError", "ModelNotFoundError", "Prefill", "PrefixCache", "PromptTemplate", "PromptTooLongError",
    "Relevance", "Request", "SamplingOptions", "UnsupportedModelError", "chunk_id", "load_model", "make_policy",
]
__version__ = "0.1.0"
