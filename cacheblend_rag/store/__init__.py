"""KV-cache stores: in-memory LRU, validated on-disk safetensors, and the two tiered."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from .base import ChunkKV, KVKey, KVStore, LayerReader, LayerReadError, ResidentReader, token_ids_digest
from .disk import DiskReader, DiskStore
from .memory import MemoryStore
from .tiered import TieredStore

__all__ = [
    "ChunkKV",
    "DiskReader",
    "DiskStore",
    "KVKey",
    "KVStore",
    "LayerReadError",
    "LayerReader",
    "MemoryStore",
    "ResidentReader",
    "TieredStore",
    "open_store",
    "token_ids_digest",
]


def open_store(
    path: str | Path | KVStore | None,
    *,
    memory_bytes: int | None = 2 * 1024**3,
    disk_bytes: int | None = None,
    disk_dtype: torch.dtype = torch.float16,
    codec: str = "fp16",
) -> KVStore:
    """None -> MemoryStore; a directory -> memory tier over a DiskStore there (writing `codec`); a KVStore -> itself."""
    if path is None:
        return MemoryStore(memory_bytes)
    if isinstance(path, (str, Path)):
        # "~/kv" means the home folder, never a literal "./~" folder
        return TieredStore(MemoryStore(memory_bytes), DiskStore(Path(path).expanduser(), disk_bytes, disk_dtype,
                                                                codec=codec))
    if isinstance(path, KVStore):
        return path
    raise ConfigError(f"open_store expects None, a path or a KVStore, got {type(path).__name__}")
