"""KV-cache stores: in-memory LRU, validated on-disk safetensors, a shared Redis tier, and chains of them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import ConfigError
from .codecs import CODECS
from .base import ChunkKV, KVKey, KVStore, LayerReader, LayerReadError, ResidentReader, SlicedReader, token_ids_digest
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
    "RedisStore",
    "ResidentReader",
    "SlicedReader",
    "TieredStore",
    "open_store",
    "token_ids_digest",
]

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
StoreSpec = str | Path | KVStore


def __getattr__(name: str):
    """RedisStore on first use (redis-py is an optional dependency)."""
    if name == "RedisStore":
        from .redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_redis(spec: str) -> bool:
    return spec.startswith(REDIS_SCHEMES)


def _is_tier_spec(spec: str) -> bool:
    """Whether a string names a tier ("memory", "disk:PATH", either with ?codec=) rather than a folder."""
    return spec.partition("?")[0] == "memory" or spec.startswith("disk:") or "?codec=" in spec


DEFAULT_MEMORY_BYTES = 2 * 1024**3  # the memory tier's LRU budget
DEFAULT_DISK_BYTES = 20 * 1024**3  # the disk tier's LRU budget (least recently used files deleted beyond it)


def open_store(
    path: StoreSpec | Sequence[StoreSpec] | None,
    *,
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
    disk_bytes: int | None = DEFAULT_DISK_BYTES,
    disk_dtype: torch.dtype = torch.float16,
    codec: str = "fp16",
) -> KVStore:
    """Build the KV store from a spec.

    None or "memory" -> MemoryStore; a directory or "disk:PATH" -> memory over a DiskStore there (writing new
    entries with `codec`); "redis://host:port/db[?prefix=NAME]" ->
    memory over Redis; a KVStore -> itself; a list of tiers fastest first, each "memory", "disk:PATH" (or a Path),
    "redis://..." or a KVStore -> a TieredStore of them (e.g. ["memory", "disk:~/kv", "redis://cache:6379/0"]).

    Per-tier codecs: "memory?codec=int8" and "disk:PATH?codec=cachegen" code that tier's entries with the named
    codec (any of `store.codecs.CODECS`, or "auto": the codec with the lowest measured fetch time for that tier,
    see `loading.controller.choose_codec`). A disk tier without one uses `codec`; memory keeps KV as put.
    """
    if path is None:
        return MemoryStore(memory_bytes)
    if isinstance(path, KVStore):
        return path
    if isinstance(path, str) and _is_redis(path):
        return TieredStore(MemoryStore(memory_bytes), _redis(path, disk_dtype))
    if isinstance(path, str) and _is_tier_spec(path):
        # one tier spec, never a folder of that name: "memory" alone, "disk:PATH" memory over disk as a folder is
        tiers = [path] if path.partition("?")[0] == "memory" else ["memory", path]
        return open_store(tiers, memory_bytes=memory_bytes, disk_bytes=disk_bytes, disk_dtype=disk_dtype,
                          codec=codec)
    if isinstance(path, str) and "://" in path:
        raise ConfigError(f"unknown KV store URL {path!r}; the URL schemes are {', '.join(REDIS_SCHEMES)} "
                          "(a folder is given as its path, or as disk:PATH)")
    if isinstance(path, (str, Path)):
        # "~/kv" means the home folder, never a literal "./~" folder
        return TieredStore(MemoryStore(memory_bytes), DiskStore(Path(path).expanduser(), disk_bytes, disk_dtype,
                                                                codec=codec))
    if isinstance(path, Sequence):
        tiers = [_tier(spec, i, memory_bytes, disk_bytes, disk_dtype, codec) for i, spec in enumerate(path)]
        if not tiers:
            raise ConfigError("open_store got an empty list of tiers; give at least one, e.g. ['memory']")
        return tiers[0] if len(tiers) == 1 else TieredStore(*tiers)
    raise ConfigError(f"open_store expects None, a path, a redis:// URL, a KVStore or a list of them, "
                      f"got {type(path).__name__}")


def split_codec(spec: str) -> tuple[str, str | None]:
    """("disk:PATH", "cachegen") from "disk:PATH?codec=cachegen"; (spec, None) without a codec query.

    Only memory and disk tiers take one (a redis URL keeps its own query string).
    """
    if _is_redis(spec) or "?" not in spec:
        return spec, None
    base, _, query = spec.rpartition("?")
    name, eq, value = query.partition("=")
    if name != "codec" or not eq or not value:
        raise ConfigError(f"unknown tier option {query!r} in {spec!r}; the one option is ?codec=NAME, NAME one "
                          f"of {sorted(CODECS)} or auto")
    if value != "auto" and value not in CODECS:
        raise ConfigError(f"unknown KV codec {value!r} in {spec!r}; choose one of {sorted(CODECS)} or auto")
    return base, value


def _tier_codec(value: str, tier: str, root: Path | None = None) -> str:
    """The codec a tier uses: `value`, or for "auto" the one with the lowest measured fetch time on that tier."""
    if value != "auto":
        return value
    from .probe import auto_codec  # measures; imported only when asked

    return auto_codec(tier, root)


def _tier(spec: StoreSpec, index: int, memory_bytes: int | None, disk_bytes: int | None,
          disk_dtype: torch.dtype, codec: str = "fp16") -> KVStore:
    """One tier of a list spec."""
    if isinstance(spec, KVStore):
        return spec
    if isinstance(spec, Path):
        return DiskStore(spec.expanduser(), disk_bytes, disk_dtype, codec=codec)
    if isinstance(spec, str):
        spec, tier_codec = split_codec(spec)
        if spec == "memory":
            if index:
                raise ConfigError('"memory" must be the first tier: tiers are listed fastest first')
            return MemoryStore(memory_bytes, codec=_tier_codec(tier_codec, "memory") if tier_codec else None)
        if spec == "disk:":
            raise ConfigError('a "disk:" tier needs its folder, e.g. "disk:~/kv"')
        if spec.startswith("disk:"):
            root = Path(spec[5:]).expanduser()
            return DiskStore(root, disk_bytes, disk_dtype,
                             codec=_tier_codec(tier_codec, "disk", root) if tier_codec else codec)
        if _is_redis(spec):
            return _redis(spec, disk_dtype)
    raise ConfigError(f"unknown KV tier {spec!r}; use \"memory\", \"disk:PATH\", \"redis://host:port/db\" "
                      "or a KVStore")


def _redis(url: str, dtype: torch.dtype) -> KVStore:
    from .redis import RedisStore  # redis-py is an optional dependency

    return RedisStore.from_url(url, dtype=dtype)
