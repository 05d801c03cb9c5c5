"""On-disk KV store: one self-validating safetensors file per chunk, LRU-bounded by bytes.

Raw files (format version 1, fp16 by default) hold `k.<layer>`/`v.<layer>`; coded files (version 2) name their
codec in the header and hold each layer's codec tensors as `<layer>.<name>` (docs/design.md, "Stored format").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors.torch import save as st_save

from ..errors import ConfigError, KVWriteError
from .base import (LOGGED_CHARS, STORED_DTYPES, ChunkKV, EntryReader, KVKey, KVStore, LayerReadError, cast_overflows,
                   dtype_name, raw_layer_nbytes, short_repr, token_ids_digest)
from .codecs import CODECS, KVCodec, RawCodec, get_codec

logger = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = "cacheblend-kv"
FORMAT_VERSION = "2"  # coded files (codec named in the header); raw files are still written as version 1
RAW_FORMAT_VERSION = "1"  # k.<layer>/v.<layer> tensors in one float dtype (the fp16 default)
SUFFIX = ".safetensors"
QUARANTINE_DIR = ".quarantine"
_READ_ATTEMPTS = 3
_TORCH_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "U16": torch.uint16, "I16": torch.int16, "F16": torch.float16,
                 "BF16": torch.bfloat16, "U32": torch.uint32, "I32": torch.int32, "F32": torch.float32,
                 "U64": torch.uint64, "I64": torch.int64, "F64": torch.float64, "BOOL": torch.bool}
_INT_FIELDS = ("num_layers", "num_tokens", "num_kv_heads", "head_dim", "v_head_dim", "positions_start")
MAX_HEADER_BYTES = 1024**2  # ours are ~10 kB; a larger header is hostile or foreign and never parsed
QUARANTINE_MAX_FILES = 32  # oldest quarantined files beyond this are deleted
STALE_TEMP_S = 24 * 3600  # a temp file this old is stale even if its writer's pid was reused


class _Corrupt(Exception):
    """Internal: the file at a key's path is not a valid entry for that key."""


class _LayerOutOfRange(IndexError):
    """Internal: get_layer asked for a layer the (valid) entry does not have."""


def _crc(t: torch.Tensor) -> str:
    return str(zlib.crc32(t.contiguous().view(torch.uint8).numpy()))


HEADER_CRC = "crc.header"


def header_crc(meta: dict) -> str:
    """crc32 of a header's other entries, as sorted JSON: every field a read trusts (positions_start, the codec's
    parameters) is covered, not only the tensors. Files written before it have none and are read as before."""
    fields = {k: v for k, v in meta.items() if k != HEADER_CRC}
    return str(zlib.crc32(json.dumps(fields, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")))


class _PinnedFile:
    """A safetensors file read through one open descriptor with `os.pread`, never memory-mapped.

    Tensors read from a map stay backed by the file: a file truncated in place (by a tool, a bad copy) killed the
    process with SIGBUS when a page past its new end was touched, even while a tensor was being copied out. A read
    here is a copy into memory of its own; a file shorter than its header says is a short read, and _Corrupt. The
    descriptor pins the inode, so every read of one entry sees one file even while writers replace its path.
    The header is the safetensors format's (an 8-byte length, then JSON); each tensor's bytes are checked against
    its dtype and shape here, and against its crc32 by the store."""

    def __init__(self, fd: int, size: int, header_len: int) -> None:
        self._fd = -1  # owned once the header is read: until then a failure leaves the caller to close it
        raw = os.pread(fd, header_len, 8)
        if len(raw) != header_len:
            raise _Corrupt("the header is cut short")
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise _Corrupt(f"the header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise _Corrupt("the header is not a JSON object")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise _Corrupt("the header's metadata is not a map of strings")
        self._meta: dict[str, str] = meta
        self._base = 8 + header_len
        self._specs: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, spec in header.items():
            self._specs[name] = self._checked(name, spec, size - self._base)
        self._fd = fd

    @staticmethod
    def _checked(name: str, spec: Any, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of one tensor's header entry, its bytes within the file's data."""
        if not isinstance(spec, dict) or spec.get("dtype") not in _TORCH_DTYPES:
            raise _Corrupt(f"tensor {short_repr(name)} has no known dtype")
        shape, offsets = spec.get("shape"), spec.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise _Corrupt(f"tensor {short_repr(name)} has a bad shape {short_repr(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):
            raise _Corrupt(f"tensor {short_repr(name)} has data offsets {short_repr(offsets)} outside the file")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * _TORCH_DTYPES[spec["dtype"]].itemsize:
            raise _Corrupt(f"tensor {short_repr(name)}'s bytes do not match its dtype and shape")
        return spec["dtype"], tuple(shape), offsets[0], offsets[1]

    def metadata(self) -> dict[str, str]:
        """The header's `__metadata__`."""
        return dict(self._meta)

    def keys(self) -> list[str]:
        """The tensor names, as the header lists them."""
        return list(self._specs)

    def spec(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, shape) of a tensor, from the header alone."""
        dtype, shape, _, _ = self._specs[name]
        return dtype, shape

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor, read into memory of its own."""
        dtype, shape, begin, end = self._specs[name]
        out = torch.empty(end - begin, dtype=torch.uint8)
        buffer, done = memoryview(out.numpy()), 0
        while done < len(buffer):  # read straight into the tensor: one copy, as from the map
            got = os.preadv(self._fd, [buffer[done:]], self._base + begin + done)
            if got == 0:
                raise _Corrupt(f"tensor {short_repr(name)} is cut short: the file is shorter than its header says")
            done += got
        return out.view(_TORCH_DTYPES[dtype]).reshape(shape)

    def close(self) -> None:
        """Release the descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = close  # a reader nobody closed still releases its descriptor

    def __enter__(self) -> "_PinnedFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_pinned(path: Path) -> tuple[_PinnedFile, tuple[int, ...]]:
    """The file now at path, open and pinned (`_PinnedFile`), and its signature; _Corrupt if it is not sane.

    It is opened non-blocking and checked with fstat first (so a FIFO or device at a KV path never hangs a
    request), and the header length is bounded before the header is parsed."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Corrupt("not a regular file")
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise _Corrupt("shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > st.st_size:
            raise _Corrupt(f"header length {header_len} is out of bounds for a {st.st_size}-byte file")
        handle = _PinnedFile(fd, st.st_size, header_len)
    except BaseException:
        os.close(fd)
        raise
    return handle, (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


class DiskStore(KVStore):
    """KV entries as `root/<namespace>/<chunk_id[:2]>/<chunk_id>.safetensors`.

    Every read is validated (header, key, token digest, per-tensor crc32, shapes, and the codec's own
    checks for coded files); a bad file, or one naming a codec this version cannot read, is quarantined
    and reads as a miss. `codec` ("fp16", "int8", "cachegen", ... or a KVCodec) is what new entries are
    written with; every file says its own, so one store may mix them. Writes are atomic (temp file + os.replace),
    so concurrent writers, threads or processes, always leave one complete file.
    The byte budget is tracked per process from a scan at init; recency is file mtime.
    """

    def __init__(self, root: str | Path, max_bytes: int | None = None, dtype: torch.dtype = torch.float16,
                 codec: str | KVCodec = "fp16") -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        if dtype_name(dtype) not in STORED_DTYPES:
            raise ConfigError(f"disk dtype must be one of {sorted(STORED_DTYPES)}, got {dtype}")
        if isinstance(codec, str):
            if codec not in CODECS:
                raise ConfigError(f"unknown KV codec {codec!r}; choose one of {sorted(CODECS)}")
            codec = get_codec(codec)
        if not isinstance(codec, KVCodec):
            raise ConfigError(f"codec must be a codec name {sorted(CODECS)} or a KVCodec, got {type(codec).__name__}")
        # Raw codecs keep writing the version-1 layout; "fp16" (the default) stores in `dtype`, as before.
        self.codec: KVCodec | None = None if isinstance(codec, RawCodec) else codec
        if isinstance(codec, RawCodec) and codec.name != "fp16":
            dtype = codec.dtype
        self.root = Path(root).expanduser()
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

    def reader(self, key: KVKey) -> "DiskReader | None":
        """A reader of the entry: the file is opened, its header and token ids validated, once; or None."""
        path = self.path_for(key)
        for _ in range(_READ_ATTEMPTS):
            sig = self._signature(path)
            if sig is None:
                break
            try:
                handle, sig = _open_pinned(path)  # held: reads stay on this inode
            except FileNotFoundError:
                break
            except Exception as e:  # noqa: BLE001 - anything unreadable is a corrupt entry
                if self._signature(path) != sig:
                    continue
                self._quarantine(path, sig, f"{type(e).__name__}: {e}")
                break
            try:
                meta, token_ids = self._header(handle, key)
            except Exception as e:  # noqa: BLE001
                handle.close()
                self._quarantine(path, sig, f"{type(e).__name__}: {e}")
                break
            with self._lock:
                self._hits += 1
                self._touch(path)
            # touching changed the file's ctime: take the signature again, while the open handle pins the inode
            # (so the same device, inode and size are this very file), or a bad layer could not be quarantined
            now = self._signature(path)
            if now is not None and now[:3] == sig[:3]:
                sig = now
            return DiskReader(self, key, path, sig, handle, meta, token_ids)
        with self._lock:
            self._misses += 1
        return None

    def get_layer(self, key: KVKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer's (keys, values), read alone and validated, or None (missing or corrupt)."""
        path = self.path_for(key)
        loaded = self._guarded(path, lambda f: self._read(f, key, path, layer))
        return None if loaded is None else loaded[2][0]

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """The entry's token ids alone, validated against its header and digest, or None."""
        loaded = self._guarded(self.path_for(key), lambda f: self._header(f, key))
        return None if loaded is None else loaded[1]

    get_token_ids = token_ids

    def tiers(self) -> dict[str, Path | None]:
        """One tier, on the file system under root."""
        return {"disk": self.root}

    def side_car_dir(self) -> Path | None:
        """The store's root: side-car files live beside the entries, shared by every process using the folder."""
        return self.root

    def entry_nbytes(self, key: KVKey) -> int | None:
        """The entry's file size, or None."""
        try:
            return os.lstat(self.path_for(key)).st_size
        except OSError:
            return None

    def read_meta(self, key: KVKey) -> dict | None:
        """The entry's header (str -> str) after checking it names this key, or None."""
        path = self.path_for(key)
        meta = self._guarded(path, lambda f: self._check_meta(f.metadata(), key))
        return None if meta is None else {k: v for k, v in meta.items() if not k.startswith("_")}

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Write (or replace) an entry atomically, then evict LRU files to stay in budget."""
        data = self._serialize(key, kv)
        path = self.path_for(key)
        if self.max_bytes is not None and len(data) > self.max_bytes:
            logger.debug("not caching %s on disk: %d bytes > budget %d", key, len(data), self.max_bytes)
            self.delete(key)  # a put replaces: do not keep an older version around
            return
        # Unique temp name in the same directory, so os.replace is an atomic same-filesystem rename.
        tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(e, OSError):
                raise KVWriteError(f"could not write the KV of {key} to {path}: {e.strerror or e}; "
                                   "free space or fix the folder's permissions (or pick another kv_store)") from e
            raise
        with self._lock:
            self._puts += 1
            self._touch(path, size=len(data))
            self._evict()

    def contains(self, key: KVKey) -> bool:
        """Whether a valid-looking entry is stored: header, size and token digest checked (a bad file is quarantined)."""
        return self.token_ids(key) is not None

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
        if self.codec is not None:
            return self._serialize_coded(key, kv, self.codec)
        src = [t.detach() for pair in zip(kv.keys, kv.values) for t in pair]
        dtype = self.dtype
        cast = [t.to("cpu", dtype) for t in src]
        if any(s.dtype != c.dtype and cast_overflows(s, c) for s, c in zip(src, cast)):
            logger.warning("KV of %s overflows %s; storing this entry in float32", key, dtype_name(dtype))
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
            "format_version": RAW_FORMAT_VERSION,
            "namespace": key.namespace,
            "chunk_id": key.chunk_id,
            "kv_digest": token_ids_digest(key.namespace, token_ids),
            "num_layers": str(kv.num_layers),
            "num_tokens": str(kv.num_tokens),
            "num_kv_heads": str(tensors["k.0"].shape[1]),
            "head_dim": str(tensors["k.0"].shape[2]),
            "v_head_dim": str(tensors["v.0"].shape[2]),
            "dtype": dtype_name(dtype),
            "positions_start": str(int(kv.positions_start)),
        }
        meta.update({f"crc.{name}": _crc(t) for name, t in tensors.items()})
        meta[HEADER_CRC] = header_crc(meta)
        return st_save(tensors, meta)

    def _serialize_coded(self, key: KVKey, kv: ChunkKV, codec: KVCodec) -> bytes:
        """Version 2: each layer's codec tensors as `<layer>.<name>`, the codec named in the header."""
        dtype = self.dtype  # what readers decode to
        if any(k.dtype != dtype and (cast_overflows(k, k.to(dtype)) or cast_overflows(v, v.to(dtype)))
               for k, v in zip(kv.keys, kv.values)):
            logger.warning("KV of %s overflows %s; this entry decodes to float32", key, dtype_name(dtype))
            dtype = torch.float32
        tensors: dict[str, torch.Tensor] = {}
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            for name, t in codec.encode_layer(k.detach(), v.detach(), layer, kv.num_layers).items():
                tensors[f"{layer}.{name}"] = t.detach().cpu().contiguous().clone()
        token_ids = kv.token_ids.detach().to("cpu", torch.int64).contiguous()
        tensors["token_ids"] = token_ids
        k0, v0 = kv.keys[0], kv.values[0]
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "namespace": key.namespace,
            "chunk_id": key.chunk_id,
            "kv_digest": token_ids_digest(key.namespace, token_ids),
            "num_layers": str(kv.num_layers),
            "num_tokens": str(kv.num_tokens),
            "num_kv_heads": str(k0.shape[1]),
            "head_dim": str(k0.shape[2]),
            "v_head_dim": str(v0.shape[2]),
            "dtype": dtype_name(dtype),
            "positions_start": str(int(kv.positions_start)),
            "codec": codec.name,
            "codec_version": codec.version,
            "codec_params": json.dumps(codec.params(), sort_keys=True),
        }
        meta.update({f"crc.{name}": _crc(t) for name, t in tensors.items()})
        meta[HEADER_CRC] = header_crc(meta)
        return st_save(tensors, meta)

    # ---- reading and validation -------------------------------------------------------

    def _guarded(self, path: Path, fn: Callable[[Any], T]) -> T | None:
        """Run fn on the opened file; a bad file is logged, quarantined and becomes None."""
        # A read is pinned to the inode it opened (_PinnedFile); a file replaced between the signature and the open
        # fails its crc32s, and a changed signature tells that apart from real corruption: we simply read again.
        for _ in range(_READ_ATTEMPTS):
            sig = self._signature(path)
            if sig is None:
                return None
            try:
                handle, sig = _open_pinned(path)
                with handle as f:
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
            st = os.lstat(path)
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
        if HEADER_CRC in meta and meta[HEADER_CRC] != header_crc(meta):
            raise _Corrupt("header checksum mismatch")
        if meta.get("format") != FORMAT or meta.get("format_version") not in (RAW_FORMAT_VERSION, FORMAT_VERSION):
            raise _Corrupt(f"format {short_repr(meta.get('format'))} v{short_repr(meta.get('format_version'))}")
        if meta.get("namespace") != key.namespace or meta.get("chunk_id") != key.chunk_id:
            raise _Corrupt(f"file holds {short_repr(meta.get('namespace'))}/{short_repr(meta.get('chunk_id'))}, not {key}")
        if meta.get("dtype") not in STORED_DTYPES:
            raise _Corrupt(f"unknown dtype {short_repr(meta.get('dtype'))}")
        for name in _INT_FIELDS:
            value = str(meta.get(name, ""))
            if not (value.isascii() and value.isdigit() and len(value) < 10):
                raise _Corrupt(f"bad {name}={short_repr(meta.get(name))}")
        if int(meta["num_layers"]) < 1:
            raise _Corrupt("num_layers < 1")
        out = dict(meta)
        if meta["format_version"] == FORMAT_VERSION:
            out["_codec"] = self._codec_of(meta)
        return out

    @staticmethod
    def _codec_of(meta: dict) -> KVCodec:
        """The codec a version-2 header names, rebuilt from its parameters; _Corrupt if unknown or invalid."""
        name, version = meta.get("codec"), meta.get("codec_version")
        try:
            params = json.loads(meta.get("codec_params", ""))
        except ValueError as e:
            raise _Corrupt(f"codec_params is not JSON: {e}") from None
        if not isinstance(params, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in params.items()):
            raise _Corrupt(f"codec_params must be a JSON object of strings, got {short_repr(params)}")
        if name not in CODECS:
            raise _Corrupt(f"unknown codec {short_repr(name)}")
        try:
            codec = get_codec(name, **params)
        except ConfigError as e:
            raise _Corrupt(f"codec {name} cannot be built from {short_repr(params)}: {e}") from None
        if codec.version != version:
            raise _Corrupt(f"codec {name} v{short_repr(version)} is not readable by this version (v{codec.version})")
        return codec

    def _tensor(self, f, meta: dict, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = f.get_tensor(name)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise _Corrupt(f"{name} is {t.dtype}{tuple(t.shape)}, expected {dtype}{shape}")
        if meta.get(f"crc.{name}") != _crc(t):
            raise _Corrupt(f"checksum mismatch in {name}")
        return t

    def _header(self, f, key: KVKey) -> tuple[dict, torch.Tensor]:
        """The validated header and token ids of an open file (names, digest): what every read checks first."""
        meta = self._check_meta(f.metadata(), key)
        n_layers = int(meta["num_layers"])
        if meta["format_version"] == RAW_FORMAT_VERSION:
            expected = {"token_ids"} | {f"{c}.{i}" for i in range(n_layers) for c in "kv"}
            if set(f.keys()) != expected:
                raise _Corrupt("unexpected tensor names")
        else:
            meta["_layers"] = self._coded_layout(f, n_layers)
        token_ids = self._tensor(f, meta, "token_ids", (int(meta["num_tokens"]),), torch.int64)
        if token_ids_digest(key.namespace, token_ids) != meta.get("kv_digest"):
            raise _Corrupt("kv_digest does not match the stored token ids")
        return meta, token_ids

    @staticmethod
    def _coded_layout(f, n_layers: int) -> list[tuple[list[str], int]]:
        """Per layer of a version-2 file: its codec tensor names and stored bytes (read from the header only)."""
        layers: list[tuple[list[str], int]] = [([], 0) for _ in range(n_layers)]
        for full in f.keys():
            if full == "token_ids":
                continue
            index, _, name = full.partition(".")
            if not (index.isascii() and index.isdigit() and len(index) < 10 and name) or int(index) >= n_layers:
                raise _Corrupt(f"unexpected tensor name {short_repr(full)}")
            dtype, shape = f.spec(full)
            numel = 1
            for d in shape:
                numel *= d
            names, nbytes = layers[int(index)]
            names.append(name)
            layers[int(index)] = (names, nbytes + numel * _TORCH_DTYPES[dtype].itemsize)
        if any(not names for names, _ in layers):
            raise _Corrupt("a layer has no tensors")
        return layers

    def _layer(self, f, meta: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's validated (keys, values) from an open file whose header was checked (decoded if coded)."""
        n, h = int(meta["num_tokens"]), int(meta["num_kv_heads"])
        dtype = STORED_DTYPES[meta["dtype"]]
        if meta["format_version"] == FORMAT_VERSION:
            tensors = {}
            for name in meta["_layers"][layer][0]:
                t = f.get_tensor(f"{layer}.{name}")
                if meta.get(f"crc.{layer}.{name}") != _crc(t):
                    raise _Corrupt(f"checksum mismatch in {layer}.{name}")
                tensors[name] = t
            return meta["_codec"].decode_layer(tensors, num_tokens=n, num_kv_heads=h, head_dim=int(meta["head_dim"]),
                                               v_head_dim=int(meta["v_head_dim"]), layer=layer,
                                               num_layers=int(meta["num_layers"]), dtype=dtype)
        return (self._tensor(f, meta, f"k.{layer}", (n, h, int(meta["head_dim"])), dtype),
                self._tensor(f, meta, f"v.{layer}", (n, h, int(meta["v_head_dim"])), dtype))

    def _read(self, f, key: KVKey, path: Path, layer: int | None):
        """(meta, token_ids, [(k, v), ...]) for all layers, or just `layer`."""
        meta, token_ids = self._header(f, key)
        n_layers = int(meta["num_layers"])
        if layer is not None and not 0 <= layer < n_layers:
            raise _LayerOutOfRange(f"layer {layer} out of range for {n_layers} layers in {path}")
        wanted = range(n_layers) if layer is None else (layer,)
        return meta, token_ids, [self._layer(f, meta, i) for i in wanted]

    def _quarantine(self, path: Path, sig: tuple[int, ...], reason: str) -> None:
        logger.warning("corrupt KV file %s (%s); moving it to %s", path, reason[:LOGGED_CHARS], QUARANTINE_DIR)
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
            return
        self._bound_quarantine(qdir)

    @staticmethod
    def _bound_quarantine(qdir: Path) -> None:
        """Keep the newest QUARANTINE_MAX_FILES quarantined files (kept for a post-mortem, never read again)."""
        with contextlib.suppress(OSError):
            bad = sorted(qdir.glob("*.bad"), key=lambda p: p.stat().st_mtime_ns)
            for old in bad[:-QUARANTINE_MAX_FILES]:
                with contextlib.suppress(OSError):
                    old.unlink()

    def _remove_stale_temp_files(self) -> None:
        """Delete temp files left by writers killed mid-write (dead pid, or older than a day); live writers' stay."""
        now = time.time()
        for tmp in self.root.glob(f"*/*/.*{SUFFIX}.*.tmp"):
            try:
                pid = int(tmp.name.split(".")[-3])
            except (ValueError, IndexError):
                continue
            with contextlib.suppress(OSError):
                if not _pid_alive(pid) or now - tmp.lstat().st_mtime > STALE_TEMP_S:
                    tmp.unlink()
                    logger.info("removed stale temp file %s", tmp)

    # ---- LRU bookkeeping (callers hold self._lock) ------------------------------------

    def _scan(self) -> None:
        self._remove_stale_temp_files()
        found = []
        for p in self.root.glob(f"*/*/*{SUFFIX}"):
            if p.relative_to(self.root).parts[0].startswith("."):
                continue
            with contextlib.suppress(OSError):
                st = p.lstat()
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


class DiskReader(EntryReader):
    """One stored entry, opened once per request: header and token ids checked at open, each layer crc-checked
    as it is read. A bad layer quarantines the file and raises LayerReadError (the caller recomputes the chunk)."""

    tier = "disk"

    def __init__(self, store: DiskStore, key: KVKey, path: Path, sig: tuple[int, ...], handle: _PinnedFile,
                 meta: dict, token_ids: torch.Tensor) -> None:
        if "_layers" in meta:  # coded: what each layer's tensors take in the file
            self._layer_bytes = [nbytes for _, nbytes in meta["_layers"]]
        else:
            self._layer_bytes = [raw_layer_nbytes(meta)] * int(meta["num_layers"])
        # stored bytes of a layer (mean)
        super().__init__(key, meta, token_ids, -(-sum(self._layer_bytes) // len(self._layer_bytes)))
        self.store = store
        self.path = path
        self._sig = sig
        self._handle = handle
        self._failed = False

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and validate one layer."""
        self._check_index(layer, f"in {self.path}")
        with self._lock:
            if self._handle is None:
                raise LayerReadError(self.key, layer, "reader closed")
            if self._failed:  # the file was quarantined already (e.g. promotion after a failed request)
                raise LayerReadError(self.key, layer, "entry was found corrupt")
            try:
                loaded = self.store._layer(self._handle, self._meta, layer)
            except Exception as e:  # noqa: BLE001 - a bad layer is a bad file
                self._failed = True
                self.store._quarantine(self.path, self._sig, f"layer {layer}: {type(e).__name__}: {e}")
                raise LayerReadError(self.key, layer, type(e).__name__) from e
            self._read[layer] = loaded
            self.bytes_read += self._layer_bytes[layer]
        return loaded

    def complete(self) -> ChunkKV | None:
        """The whole entry (to promote into a faster tier), reading the layers not read yet; None if one fails."""
        try:
            for i in range(self.num_layers):
                if i not in self._read:
                    self.layer(i)
        except LayerReadError:
            return None
        return self._whole()

    def close(self) -> None:
        """Release the file handle."""
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None
