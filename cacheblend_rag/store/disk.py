"""On-disk KV store: one self-validating safetensors file per chunk, LRU-bounded by bytes."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from ..errors import ConfigError
from .base import ChunkKV, KVKey, token_ids_digest

logger = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = "cacheblend-kv"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
QUARANTINE_DIR = ".quarantine"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_READ_ATTEMPTS = 3
_INT_FIELDS = ("num_layers", "num_tokens", "num_kv_heads", "head_dim", "v_head_dim", "positions_start")


class _Corrupt(Exception):
    """Internal: the file at a key's path is not a valid entry for that key."""


class _LayerOutOfRange(IndexError):
    """Internal: get_layer asked for a layer the (valid) entry does not have."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _crc(t: torch.Tensor) -> str:
    return str(zlib.crc32(t.contiguous().view(torch.uint8).numpy()))


def _overflows(src: torch.Tensor, cast: torch.Tensor) -> bool:
    """Whether casting turned finite values into inf/nan."""
    return bool((torch.isfinite(src.to(cast.device)) & ~torch.isfinite(cast)).any())


class DiskStore:
    """KV entries as `root/<namespace>/<chunk_id[:2]>/<chunk_id>.safetensors`.

    Every read is validated (header, key, token digest, per-tensor crc32, shapes); a bad
    file is quarantined and reads as a miss. Writes are atomic (temp file + os.replace),
    so concurrent writers, threads or processes, always leave one complete file.
    The byte budget is tracked per process from a scan at init; recency is file mtime.
    """

    def __init__(self, root: str | Path, max_bytes: int | None = None, dtype: torch.dtype = torch.float16) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        if _dtype_name(dtype) not in _DTYPES:
            raise ConfigError(f"disk dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.dtype = dtype
        self._lock = threading.Lock()
        self._index: OrderedDict[Path, int] = OrderedDict()  # path -> size, least recent first
        self._bytes = 0
        self._clock = 0
        self._hits = self._misses = self._puts = self._evictions = self._corrupt = 0
        self._scan()

    # ---- public API -------------------------------------------------------------------

    def path_for(self, key: KVKey) -> Path:
        """Where the entry for `key` lives (KVKey's charset makes this traversal-safe)."""
        return self.root / key.namespace / key.chunk_id[:2] / f"{key.chunk_id}{SUFFIX}"

    def get(self, key: KVKey) -> ChunkKV | None:
        """The validated entry on CPU in its stored dtype, or None (missing or corrupt)."""
        path = self.path_for(key)
        loaded = self._guarded(path, lambda f: self._read(f, key, path, None))
        if loaded is None:
            with self._lock:
                self._misses += 1
            return None
        meta, token_ids, layers = loaded
        with self._lock:
            self._hits += 1
            self._touch(path)
        return ChunkKV(
            keys=tuple(k for k, _ in layers),
            values=tuple(v for _, v in layers),
            token_ids=token_ids,
            positions_start=int(meta["positions_start"]),
        )

    def get_layer(self, key: KVKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer's (keys, values), read alone and validated, or None (missing or corrupt)."""
        path = self.path_for(key)
        loaded = self._guarded(path, lambda f: self._read(f, key, path, layer))
        return None if loaded is None else loaded[2][0]

    def get_token_ids(self, key: KVKey) -> torch.Tensor | None:
        """The entry's token ids alone, validated against its digest, or None."""
        path = self.path_for(key)

        def read(f):
            meta = self._check_meta(f.metadata(), key)
            token_ids = self._tensor(f, meta, "token_ids", (int(meta["num_tokens"]),), torch.int64)
            if token_ids_digest(key.namespace, token_ids) != meta.get("kv_digest"):
                raise _Corrupt("kv_digest does not match the stored token ids")
            return token_ids

        return self._guarded(path, read)

    def read_meta(self, key: KVKey) -> dict | None:
        """The entry's header (str -> str) after checking it names this key, or None."""
        path = self.path_for(key)
        return self._guarded(path, lambda f: self._check_meta(f.metadata(), key))

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Write (or replace) an entry atomically, then evict LRU files to stay in budget."""
        data = self._serialize(key, kv)
        path = self.path_for(key)
        if self.max_bytes is not None and len(data) > self.max_bytes:
            logger.debug("not caching %s on disk: %d bytes > budget %d", key, len(data), self.max_bytes)
            self.delete(key)  # a put replaces: do not keep an older version around
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unique temp name in the same directory, so os.replace is an atomic same-filesystem rename.
        tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        with self._lock:
            self._puts += 1
            self._touch(path, size=len(data))
            self._evict()

    def contains(self, key: KVKey) -> bool:
        """Whether a file exists for the key (validated only when read)."""
        return self.path_for(key).is_file()

    def delete(self, key: KVKey) -> bool:
        """Remove an entry; True if a file was removed."""
        path = self.path_for(key)
        with self._lock:
            self._forget(path)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False

    def stats(self) -> dict:
        """Counters and occupancy of this tier (bytes/entries as seen by this process)."""
        with self._lock:
            return {
                "tier": "disk",
                "hits": self._hits,
                "misses": self._misses,
                "puts": self._puts,
                "evictions": self._evictions,
                "corrupt": self._corrupt,
                "bytes": self._bytes,
                "entries": len(self._index),
                "max_bytes": self.max_bytes,
                "root": str(self.root),
            }

    # ---- writing ----------------------------------------------------------------------

    def _serialize(self, key: KVKey, kv: ChunkKV) -> bytes:
        if kv.positions_start < 0:
            raise ConfigError(f"positions_start must be >= 0, got {kv.positions_start}")
        src = [t.detach() for pair in zip(kv.keys, kv.values) for t in pair]
        dtype = self.dtype
        cast = [t.to("cpu", dtype) for t in src]
        if any(s.dtype != c.dtype and _overflows(s, c) for s, c in zip(src, cast)):
            logger.warning("KV of %s overflows %s; storing this entry in float32", key, _dtype_name(dtype))
            dtype = torch.float32
            cast = [t.to("cpu", dtype) for t in src]
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for i, t in enumerate(cast):
            t = t.contiguous()
            # safetensors refuses tensors that share memory (e.g. keys[i] is values[i]).
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(ptr)
            tensors[f"{'kv'[i % 2]}.{i // 2}"] = t
        token_ids = kv.token_ids.detach().to("cpu", torch.int64).contiguous()
        tensors["token_ids"] = token_ids
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "namespace": key.namespace,
            "chunk_id": key.chunk_id,
            "kv_digest": token_ids_digest(key.namespace, token_ids),
            "num_layers": str(kv.num_layers),
            "num_tokens": str(kv.num_tokens),
            "num_kv_heads": str(tensors["k.0"].shape[1]),
            "head_dim": str(tensors["k.0"].shape[2]),
            "v_head_dim": str(tensors["v.0"].shape[2]),
            "dtype": _dtype_name(dtype),
            "positions_start": str(int(kv.positions_start)),
        }
        meta.update({f"crc.{name}": _crc(t) for name, t in tensors.items()})
        return st_save(tensors, meta)

    # ---- reading and validation -------------------------------------------------------

    def _guarded(self, path: Path, fn: Callable[[Any], T]) -> T | None:
        """Run fn on the opened file; a bad file is logged, quarantined and becomes None."""
        # safe_open re-opens the path for tensor data, so a concurrent os.replace can mix two
        # files in one read. The crc32s catch that; a changed file signature tells it apart
        # from real corruption, and we simply read again.
        for _ in range(_READ_ATTEMPTS):
            sig = self._signature(path)
            if sig is None:
                return None
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    return fn(f)
            except FileNotFoundError:  # evicted or deleted meanwhile: a plain miss
                with self._lock:
                    self._forget(path)
                return None
            except _LayerOutOfRange:
                raise  # the caller's bug, not a bad file
            except Exception as e:  # noqa: BLE001 - anything unreadable is a corrupt entry
                if self._signature(path) != sig:
                    continue
                self._quarantine(path, sig, f"{type(e).__name__}: {e}")
                return None
        logger.debug("KV file %s kept changing while being read; treating it as a miss", path)
        return None

    def _signature(self, path: Path) -> tuple[int, ...] | None:
        """Identity of the file now at path (changes on every atomic replace), or None."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            with self._lock:
                self._forget(path)
            return None
        except OSError as e:
            logger.warning("cannot stat KV file %s: %s", path, e)
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)

    def _check_meta(self, meta: dict | None, key: KVKey) -> dict:
        if not meta:
            raise _Corrupt("no metadata header")
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise _Corrupt(f"format {meta.get('format')!r} v{meta.get('format_version')!r}")
        if meta.get("namespace") != key.namespace or meta.get("chunk_id") != key.chunk_id:
            raise _Corrupt(f"file holds {meta.get('namespace')}/{meta.get('chunk_id')}, not {key}")
        if meta.get("dtype") not in _DTYPES:
            raise _Corrupt(f"unknown dtype {meta.get('dtype')!r}")
        for name in _INT_FIELDS:
            if not str(meta.get(name, "")).isdigit():
                raise _Corrupt(f"bad {name}={meta.get(name)!r}")
        if int(meta["num_layers"]) < 1:
            raise _Corrupt("num_layers < 1")
        return dict(meta)

    def _tensor(self, f, meta: dict, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = f.get_tensor(name)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise _Corrupt(f"{name} is {t.dtype}{tuple(t.shape)}, expected {dtype}{shape}")
        if meta.get(f"crc.{name}") != _crc(t):
            raise _Corrupt(f"checksum mismatch in {name}")
        return t

    def _read(self, f, key: KVKey, path: Path, layer: int | None):
        """(meta, token_ids, [(k, v), ...]) for all layers, or just `layer`."""
        meta = self._check_meta(f.metadata(), key)
        n_layers, n, h = (int(meta[x]) for x in ("num_layers", "num_tokens", "num_kv_heads"))
        if layer is not None and not 0 <= layer < n_layers:
            raise _LayerOutOfRange(f"layer {layer} out of range for {n_layers} layers in {path}")
        expected = {"token_ids"} | {f"{c}.{i}" for i in range(n_layers) for c in "kv"}
        if set(f.keys()) != expected:
            raise _Corrupt("unexpected tensor names")
        token_ids = self._tensor(f, meta, "token_ids", (n,), torch.int64)
        if token_ids_digest(key.namespace, token_ids) != meta.get("kv_digest"):
            raise _Corrupt("kv_digest does not match the stored token ids")
        dtype = _DTYPES[meta["dtype"]]
        k_shape, v_shape = (n, h, int(meta["head_dim"])), (n, h, int(meta["v_head_dim"]))
        wanted = range(n_layers) if layer is None else (layer,)
        layers = [
            (self._tensor(f, meta, f"k.{i}", k_shape, dtype), self._tensor(f, meta, f"v.{i}", v_shape, dtype))
            for i in wanted
        ]
        return meta, token_ids, layers

    def _quarantine(self, path: Path, sig: tuple[int, ...], reason: str) -> None:
        logger.warning("corrupt KV file %s (%s); moving it to %s", path, reason, QUARANTINE_DIR)
        with self._lock:
            self._corrupt += 1
            self._forget(path)
        if self._signature(path) != sig:
            return  # gone, or a writer replaced it with a fresh file: leave that one alone
        qdir = self.root / QUARANTINE_DIR
        dest = qdir / f"{path.parent.parent.name}__{path.stem}.{uuid.uuid4().hex[:8]}.bad"
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(path, dest)
        except OSError:
            try:
                path.unlink()
            except OSError as e:
                logger.warning("could not remove corrupt KV file %s: %s", path, e)

    # ---- LRU bookkeeping (callers hold self._lock) ------------------------------------

    def _scan(self) -> None:
        found = []
        for p in self.root.glob(f"*/*/*{SUFFIX}"):
            if p.relative_to(self.root).parts[0].startswith("."):
                continue
            with contextlib.suppress(OSError):
                st = p.stat()
                found.append((st.st_mtime_ns, str(p), p, st.st_size))
        for _, _, p, size in sorted(found):
            self._index[p] = size
            self._bytes += size

    def _touch(self, path: Path, size: int | None = None) -> None:
        """Mark path most recently used (in the index and as file mtime for other processes)."""
        if size is None:
            size = self._index.get(path)
            if size is None:  # written by another process since our scan
                with contextlib.suppress(OSError):
                    size = path.stat().st_size
        self._forget(path)
        if size is not None:
            self._index[path] = size
            self._bytes += size
        # A strictly increasing clock: kernel mtimes are coarse and would tie within a tick.
        self._clock = max(time.time_ns(), self._clock + 1)
        with contextlib.suppress(OSError):
            os.utime(path, ns=(self._clock, self._clock))

    def _forget(self, path: Path) -> None:
        size = self._index.pop(path, None)
        if size is not None:
            self._bytes -= size

    def _evict(self) -> None:
        while self.max_bytes is not None and self._bytes > self.max_bytes and len(self._index) > 1:
            oldest = next(iter(self._index))
            self._forget(oldest)
            self._evictions += 1
            with contextlib.suppress(FileNotFoundError):
                oldest.unlink()
            logger.debug("evicted %s from disk cache", oldest)
