"""Shared KV tier on Redis (or Valkey), one server or a Redis Cluster: one hash per entry, read one layer per round
trip.

Layout of an entry, key `{prefix}:{namespace}:{chunk_id}` (a hash, so Redis's LRU evicts it whole); on a cluster
`{prefix}:{namespace}:{{chunk_id}}`, the chunk id a hash tag, so every entry of one chunk (each model's, each
prefix's) lives in one slot, on one master:

    meta   JSON header: format, version, namespace, chunk_id, kv_digest, shapes, dtype, positions_start,
           put_id (unique per write), ids_crc32, layer_crc32[num_layers], meta_crc32 (of the other fields)
    ids    token ids, int64 little-endian
    L{l}   layer l: keys (num_tokens, num_kv_heads, head_dim) then values (num_tokens, num_kv_heads, v_head_dim);
           with a codec (int8, cachegen: version 2, the codec named in meta) the codec's tensors of layer l, one
           after another, as meta's `layer_tensors` lists them ([name, dtype, shape] per tensor)

A put is one MULTI/EXEC (DEL + HSET): readers see the old entry or the new one, never a mix. A reader does one
HMGET(meta, ids) at open (header bounded, key binding, digest checked once) and one HGET per layer (crc-checked).
A value that fails a check is deleted and reads as a miss. Redis down or slow never raises out of this store:
reads are misses, a put raises KVWriteError, a warning is logged once per outage. On a cluster a master that dies
is an outage until its replica takes over; redis-py's cluster client follows the new topology, and the store counts
each change of the set of masters (`failovers` in `stats()`, `cacheblend_kv_store_failovers` in /metrics).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import torch

from ..errors import ConfigError, KVWriteError, MissingDependencyError
from .base import (LOGGED_CHARS, STORED_DTYPES, ChunkKV, EntryReader, KVKey, KVStore, LayerReadError, cast_overflows,
                   dtype_name, raw_layer_nbytes, short_repr, token_ids_digest)
from .codecs import CODECS, CodecError, KVCodec, RawCodec, get_codec

if TYPE_CHECKING:
    from .probe import CodecProfile, TierProfile

logger = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = "cacheblend-kv-redis"
FORMAT_VERSION = 1  # raw tensors in `dtype`
CODED_VERSION = 2  # a codec's tensors per layer (int8, cachegen, ...)
MAX_META_BYTES = 256 * 1024  # ours are ~1 kB; a larger header is hostile or foreign and never parsed
# What a codec's tensors may be (read back from meta, so a closed list, never getattr on stored text)
_CODEC_DTYPES = {**STORED_DTYPES, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "uint16": torch.uint16,
                 "int32": torch.int32, "int64": torch.int64}
_INT_FIELDS = ("num_layers", "num_tokens", "num_kv_heads", "head_dim", "v_head_dim", "positions_start")
META_CRC = "meta_crc32"  # over the header's other fields: positions_start, the codec's parameters


def _meta_crc(meta: dict) -> int:
    return zlib.crc32(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())


def _sealed(meta: dict) -> bytes:
    """The header as stored: its JSON with META_CRC (entries written before it have none and are read as before)."""
    return json.dumps({**meta, META_CRC: _meta_crc(meta)}, separators=(",", ":")).encode()
_INT_MAX = 10**9
_META, _IDS = b"meta", b"ids"
# Delete the entry only if it is still the version we judged bad (a concurrent put may have replaced it).
_DELETE_IF_META = """
local m = redis.call('HGET', KEYS[1], 'meta')
if (m == false and ARGV[1] == '') or m == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class _Failure(Exception):
    """Internal: Redis could not answer (down, slow, in an outage's back-off, or it refused the command)."""


class _Corrupt(Exception):
    """Internal: the value at a key is not a valid entry for that key."""


def _import_redis():
    try:
        import redis
    except ImportError as e:
        raise MissingDependencyError(
            "the Redis KV tier needs redis-py: pip install 'cacheblend-rag[redis]'") from e
    return redis


def _field(layer: int) -> bytes:
    return f"L{layer}".encode()


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _from_bytes(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor owning a copy of `data` (one copy; Redis's reply bytes are immutable)."""
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


_OUR_OPTIONS = ("prefix", "dtype", "codec", "cluster")


def split_url(url: str) -> tuple[str, dict[str, str], list[str]]:
    """(the URL redis-py understands, our own options `prefix`, `dtype`, `codec` and `cluster` taken from its query,
    the cluster's further startup nodes: each `node=host:port`)."""
    parts = urlsplit(url)
    ours, theirs, nodes = {}, [], []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "node":
            nodes.append(value)
        elif name in _OUR_OPTIONS:
            ours[name] = value
        else:
            theirs.append((name, value))
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours, nodes


def _startup_node(spec: str):
    """A redis-py ClusterNode from "host:port"; ConfigError naming the spec otherwise."""
    from redis.cluster import ClusterNode

    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"a Redis Cluster node must be host:port, got {spec[:LOGGED_CHARS]!r}")
    return ClusterNode(host.strip("[]"), int(port))


def _display(url: str) -> str:
    """The URL without credentials or query (for logs and stats)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class RedisStore(KVStore):
    """KV entries as Redis hashes under `{prefix}:{namespace}:{chunk_id}`, validated on every read.

    Eviction is Redis's own (`maxmemory` + `maxmemory-policy allkeys-lru`): an entry is one key, so it goes whole.
    After a failed call (connection refused, timeout), calls in the next `retry_after_s` seconds are not tried
    (counted as `skipped`), so a dead or slow Redis costs a request at most one timeout per back-off period.
    `cluster=True` talks to a Redis Cluster through redis-py's `RedisCluster` (`url` is any one node; `nodes` adds
    further startup nodes as "host:port", tried when that one is down); it connects on first use.
    `codec="auto"` measures this connection's read speed and stores with the codec that is fastest to fetch and
    decode; `codec_profiles` gives the codecs' sizes and decode speeds it decides from (default: measured once per
    process).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "cacheblend",
        dtype: torch.dtype = torch.float16,
        socket_timeout: float = 1.0,
        connect_timeout: float = 0.5,
        max_connections: int = 32,
        retry_after_s: float = 1.0,
        codec: str | KVCodec = "fp16",
        codec_profiles: Mapping[str, CodecProfile] | None = None,
        cluster: bool = False,
        nodes: Sequence[str] = (),
    ) -> None:
        redis = _import_redis()
        if not prefix or not all(c.isalnum() or c in "-_." for c in prefix):
            raise ConfigError(f"Redis key prefix must be non-empty [A-Za-z0-9_.-], got {prefix!r}")
        if dtype_name(dtype) not in STORED_DTYPES:
            raise ConfigError(f"Redis tier dtype must be one of {sorted(STORED_DTYPES)}, got {dtype}")
        if socket_timeout <= 0 or connect_timeout <= 0 or max_connections < 1 or retry_after_s < 0:
            raise ConfigError("socket_timeout and connect_timeout must be > 0, max_connections >= 1, "
                              "retry_after_s >= 0")
        if isinstance(codec, str) and codec != "auto" and codec not in CODECS:
            raise ConfigError(f"unknown KV codec {codec!r} for the Redis tier; choose one of {sorted(CODECS)} "
                              "or auto")
        if not isinstance(codec, (str, KVCodec)):
            raise ConfigError(f"codec must be a codec name {sorted(CODECS)} or a KVCodec, got {type(codec).__name__}")
        if not isinstance(cluster, bool):
            raise ConfigError(f"cluster must be True or False, got {short_repr(cluster)}")
        if nodes and not cluster:
            raise ConfigError("startup nodes (node=host:port) are for a Redis Cluster: add cluster=true")
        self.url = _display(url)
        self.prefix = prefix
        self.cluster = cluster
        self.retry_after_s = retry_after_s
        self._socket_timeout = socket_timeout
        self._redis = redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One immediate retry on a dropped connection (a restarted server), none on a timeout (a slow one).
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        self._client = None
        self._pool = None
        if cluster:
            self._connect = self._cluster_connector(url, nodes, retry, socket_timeout=socket_timeout,
                                                    socket_connect_timeout=connect_timeout,
                                                    max_connections=max_connections)
        else:
            try:
                self._pool = redis.BlockingConnectionPool.from_url(
                    url, max_connections=max_connections, timeout=socket_timeout, socket_timeout=socket_timeout,
                    socket_connect_timeout=connect_timeout, decode_responses=False, retry=retry)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"bad Redis URL {self.url!r}: {e}; expected redis://[:password@]host:port/db"
                                  "[?prefix=NAME&dtype=float16]") from e
            self._connect = lambda: redis.Redis(connection_pool=self._pool)
        # a cluster's client raises RedisClusterException (not a RedisError) when no node answers, ClusterDownError
        # while a dead master's slots have no owner yet: both are an outage, like a dead server
        self._outage_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                               redis.exceptions.RedisClusterException, redis.exceptions.ClusterError)
        self._masters: frozenset[str] | None = None  # a cluster's masters (host:port) when last seen
        self._failovers = 0
        self._lock = threading.Lock()
        # outages by where they are: None for the one server, a node's host:port on a cluster (one dead master
        # must not hold back the others)
        self._down_since: dict[str | None, float] = {}
        self._retry_at: dict[str | None, float] = {}
        self._hits = self._misses = self._puts = self._corrupt = 0
        self._errors = self._skipped = self._outages = 0
        self._bytes_read = self._bytes_written = 0
        if codec == "auto":  # measured over this connection: a remote link is what the choice is about
            from .probe import auto_codec

            codec = auto_codec("redis", profile=self.measure_read(), codecs=codec_profiles)
        codec = get_codec(codec) if isinstance(codec, str) else codec
        # A raw codec keeps the version-1 layout (fp16 stores in `dtype`, as before; bf16/fp32 in theirs).
        self.codec: KVCodec | None = None if isinstance(codec, RawCodec) else codec
        self.dtype = codec.dtype if isinstance(codec, RawCodec) and codec.name != "fp16" else dtype
        logger.info("Redis KV tier at %s, prefix %r, %s", self.url, prefix,
                    self.codec.name if self.codec is not None else dtype_name(dtype))

    @classmethod
    def from_url(cls, url: str, *, dtype: torch.dtype = torch.float16, **options: Any) -> "RedisStore":
        """A store from `redis://host:port/db?prefix=NAME&dtype=float16` (our options read from the query)."""
        plain, ours, nodes = split_url(url)
        if "dtype" in ours:
            if ours["dtype"] not in STORED_DTYPES:
                raise ConfigError(f"dtype={ours['dtype']!r} in {_display(url)}; use one of {sorted(STORED_DTYPES)}")
            dtype = STORED_DTYPES[ours["dtype"]]
        if "prefix" in ours:
            options["prefix"] = ours["prefix"]
        if "codec" in ours:
            options["codec"] = ours["codec"]
        if "cluster" in ours:
            if ours["cluster"].lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"cluster={ours['cluster'][:LOGGED_CHARS]!r} in {_display(url)}; use true or false")
            options["cluster"] = ours["cluster"].lower() in ("true", "1", "yes")
        if nodes:
            options["nodes"] = nodes
        return cls(plain, dtype=dtype, **options)

    def _cluster_connector(self, url: str, nodes: Sequence[str], retry: Any, **options: Any) -> Callable[[], Any]:
        """What builds the cluster client on first use (RedisCluster connects to a node as it is made); bad URLs and
        node specs are ConfigErrors now."""
        from redis.cluster import RedisCluster

        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError(f"a Redis Cluster is reached over redis:// or rediss://, not {parts.scheme}://")
        if parts.path.strip("/") not in ("", "0"):
            raise ConfigError(f"a Redis Cluster has only database 0, not {parts.path.strip('/')!r} ({self.url})")
        try:
            seed = f"{parts.hostname}:{parts.port or 6379}"
        except ValueError as e:
            raise ConfigError(f"bad Redis URL {self.url!r}: {e}") from e
        startup = [_startup_node(spec) for spec in (seed, *nodes)]
        plain = urlunsplit(parts._replace(path=""))

        # the masters may be partly down: serve the slots that are up (require_full_coverage=False)
        return lambda: RedisCluster.from_url(plain, startup_nodes=startup, retry=retry, require_full_coverage=False,
                                             decode_responses=False, **options)

    # ---- public API -------------------------------------------------------------------

    def measure_read(self, num_bytes: int = 1024**2, repeats: int = 3) -> "TierProfile | None":
        """Read throughput of this connection (the best of `repeats` GETs of a probe value), or None when Redis
        cannot be reached or written. The probe key expires by itself if this process dies before deleting it."""
        from .probe import TierProfile

        name = f"{self.prefix}:.probe:{uuid.uuid4().hex}"
        # redis-py's timeouts and outages are RedisErrors; a cluster none of whose nodes answers is not
        failures = (self._redis.exceptions.RedisError, self._redis.exceptions.RedisClusterException, OSError)
        try:
            self._connected().set(name, bytes(num_bytes), px=60_000)
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                data = self._client.get(name)
                best = min(best, time.perf_counter() - started)
                if data is None or len(data) != num_bytes:
                    return None
            return TierProfile("redis", num_bytes / max(best, 1e-9))
        except self._redis.exceptions.TimeoutError:  # slower than the timeout allows: that is the measurement
            logger.warning("the Redis tier at %s took over %.1f s for a %d-byte probe", self.url,
                           self._socket_timeout, num_bytes)
            return TierProfile("redis", num_bytes / self._socket_timeout)
        except failures as e:
            logger.warning("cannot measure the Redis tier at %s (%s)", self.url, e)
            return None
        finally:
            try:
                if self._client is not None:
                    self._client.delete(name)
            except failures:
                pass

    def name_for(self, key: KVKey) -> str:
        """The Redis key of an entry (on a cluster, the chunk id is its hash tag)."""
        if self.cluster:
            return f"{self.prefix}:{key.namespace}:{{{key.chunk_id}}}"
        return f"{self.prefix}:{key.namespace}:{key.chunk_id}"

    def get(self, key: KVKey) -> ChunkKV | None:
        """The validated entry on CPU in its stored dtype (one HGETALL), or None."""
        name = self.name_for(key)

        def fetch() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.hgetall(name)
            return pipe.execute(raise_on_error=False)[0]

        try:
            fields = self._call(fetch, name)
        except _Failure:
            return self._count_miss()
        if isinstance(fields, Exception):  # an error reply (WRONGTYPE): not one of ours, as in _open
            self._drop(key, None, f"not a hash: {fields}", force=True)
            return self._count_miss()
        if not fields:
            return self._count_miss()
        raw_meta = fields.get(_META)
        try:
            meta, token_ids = self._header(key, raw_meta, fields.get(_IDS))
            n = meta["num_layers"]
            if set(fields) != {_META, _IDS} | {_field(i) for i in range(n)}:
                raise _Corrupt("unexpected fields")
            layers = [self._layer(meta, i, fields[_field(i)]) for i in range(n)]
        except _Corrupt as e:
            self._drop(key, raw_meta, str(e))
            return self._count_miss()
        with self._lock:
            self._hits += 1
            self._bytes_read += sum(len(fields[_field(i)]) for i in range(n))
        return ChunkKV(tuple(k for k, _ in layers), tuple(v for _, v in layers), token_ids, meta["positions_start"])

    def reader(self, key: KVKey) -> "RedisReader | None":
        """A per-layer reader: header and token ids fetched (one HMGET) and validated now, or None."""
        opened = self._open(key)
        if opened is None:
            return self._count_miss()
        with self._lock:
            self._hits += 1
        return RedisReader(self, key, *opened)

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """The entry's token ids, validated against its header and digest (no layer is read), or None."""
        opened = self._open(key)
        return None if opened is None else opened[2]

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Store or replace an entry in one MULTI/EXEC; KVWriteError if Redis is down or refuses it."""
        fields = self._serialize(key, kv)
        name = self.name_for(key)

        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(name)
            pipe.hset(name, mapping=fields)
            pipe.execute()

        try:
            self._call(write, name)
        except _Failure as e:
            raise KVWriteError(f"could not write the KV of {key} to Redis at {self.url}: {e}; check that Redis "
                               "is up and reachable and that its maxmemory-policy evicts (allkeys-lru)") from e
        with self._lock:
            self._puts += 1
            self._bytes_written += sum(len(v) for v in fields.values())

    def contains(self, key: KVKey) -> bool:
        """Whether a valid-looking entry is stored (header, field count and token digest checked)."""
        return self._open(key) is not None

    def delete(self, key: KVKey) -> bool:
        """Remove an entry; True if one was removed (False too when Redis is unavailable)."""
        try:
            name = self.name_for(key)
            return bool(self._call(lambda: self._client.delete(name), name))
        except _Failure:
            return False

    def tiers(self) -> dict[str, Path | None]:
        """One tier, in Redis."""
        return {"redis": None}

    def entry_nbytes(self, key: KVKey) -> int | None:
        """Redis's own count of the entry's memory (MEMORY USAGE), or None (missing, or Redis unavailable)."""
        try:
            name = self.name_for(key)
            size = self._call(lambda: self._client.memory_usage(name), name)
        except _Failure:
            return None
        return int(size) if size else None

    def stats(self) -> dict:
        """Counters of this process's use of the tier (Redis's own occupancy: INFO memory)."""
        with self._lock:
            return {
                "tier": "redis",
                "url": self.url,
                "prefix": self.prefix,
                "hits": self._hits,
                "misses": self._misses,
                "puts": self._puts,
                "corrupt": self._corrupt,
                "errors": self._errors,
                "skipped": self._skipped,
                "outages": self._outages,
                **({"failovers": self._failovers, "masters": sorted(self._masters or ())} if self.cluster else {}),
                "available": not self._down_since,
                "bytes_read": self._bytes_read,
                "bytes_written": self._bytes_written,
            }

    def close(self) -> None:
        """Close the pooled connections."""
        if self._pool is not None:
            self._pool.disconnect()
        elif self._client is not None:
            self._client.close()

    # ---- Redis calls and outages --------------------------------------------------------

    def _call(self, fn: Callable[[], T], name: str) -> T:
        """Run one Redis round trip on key `name`; every failure becomes _Failure (nothing from redis-py leaks out).
        Where an outage is: None for the one server or a whole cluster, a master's host:port for its slots."""
        self._unless_waiting(None)
        try:
            client = self._connected()
            # on a cluster, the master holding `name` (the client's slot cache, no round trip)
            where = client.get_node_from_key(name).name if self.cluster else None
        except self._outage_errors as e:  # no node answered, or no master holds the slot yet
            self._went_down(None, e)
            raise _Failure(f"{type(e).__name__}: {short_repr(str(e))}") from e
        self._unless_waiting(where)
        try:
            result = fn()
        except self._outage_errors as e:
            self._went_down(where, e)
            raise _Failure(f"{type(e).__name__}: {e}") from e
        except self._redis.exceptions.RedisError as e:  # up, but refused the command (OOM, WRONGTYPE, ...)
            with self._lock:
                self._errors += 1
            raise _Failure(f"{type(e).__name__}: {short_repr(str(e))}") from e
        if self.cluster:
            self._check_masters()
        if self._down_since:
            with self._lock:
                came_back = [(w, self._down_since.pop(w)) for w in {None, where} if w in self._down_since]
            for w, since in came_back:
                logger.info("Redis KV tier at %s is available again after %.1f s", self.url if w is None else
                            f"{self.url} (master {w})", time.monotonic() - since)
        return result

    def _unless_waiting(self, where: str | None) -> None:
        """_Failure while `where` is in an outage's back-off (the call is not tried)."""
        with self._lock:
            if where in self._down_since and time.monotonic() < self._retry_at[where]:
                self._skipped += 1
                raise _Failure("unavailable (waiting before trying again)")

    def _connected(self) -> Any:
        """The client, made on first use (a cluster's is made by talking to one of its nodes)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    client = self._connect()
                    self._delete_if = client.register_script(_DELETE_IF_META)
                    self._client = client
        return self._client

    def _check_masters(self) -> None:
        """Count a change in the cluster's masters as the client sees them now (no round trip: its slot cache);
        a master that left is no longer an outage (its replica serves its slots)."""
        masters = frozenset(node.name for node in self._client.get_primaries())
        with self._lock:
            before, self._masters = self._masters, masters
            changed = before is not None and masters != before
            if changed:
                self._failovers += 1
                for gone in before - masters:
                    self._down_since.pop(gone, None)
        if changed:
            logger.warning("Redis Cluster at %s changed masters (a failover): %s left, %s joined", self.url,
                           ", ".join(sorted(before - masters)) or "none", ", ".join(sorted(masters - before)) or "none")

    def _went_down(self, where: str | None, e: BaseException) -> None:
        with self._lock:
            self._errors += 1
            self._retry_at[where] = time.monotonic() + self.retry_after_s
            first = where not in self._down_since
            if first:
                self._down_since[where] = time.monotonic()
                self._outages += 1
        if first:
            logger.warning("Redis KV tier at %s is unavailable (%s: %s); reads are misses and writes are skipped "
                           "until it is back (said once per outage)", self.url if where is None else
                           f"{self.url} (master {where})", type(e).__name__, short_repr(str(e)))

    def _count_miss(self) -> None:
        with self._lock:
            self._misses += 1
        return None

    # ---- writing ----------------------------------------------------------------------

    def _serialize(self, key: KVKey, kv: ChunkKV) -> dict[bytes, bytes]:
        if kv.positions_start < 0:
            raise ConfigError(f"positions_start must be >= 0, got {kv.positions_start}")
        if self.codec is not None:
            return self._serialize_coded(key, kv, self.codec)
        dtype = self.dtype
        src = [(k.detach().cpu(), v.detach().cpu()) for k, v in zip(kv.keys, kv.values)]
        cast = [(k.to(dtype), v.to(dtype)) for k, v in src]
        if dtype != torch.float32 and any(cast_overflows(s, c) for pair, cpair in zip(src, cast)
                                          for s, c in zip(pair, cpair) if s.dtype != c.dtype):
            logger.warning("KV of %s overflows %s; storing this entry in float32", key, dtype_name(dtype))
            dtype = torch.float32
            cast = [(k.to(dtype), v.to(dtype)) for k, v in src]
        layers = [_to_bytes(k) + _to_bytes(v) for k, v in cast]
        token_ids = kv.token_ids.detach().to("cpu", torch.int64).contiguous()
        ids = _to_bytes(token_ids)
        k0, v0 = cast[0]
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "namespace": key.namespace,
            "chunk_id": key.chunk_id,
            "kv_digest": token_ids_digest(key.namespace, token_ids),
            "num_layers": kv.num_layers,
            "num_tokens": kv.num_tokens,
            "num_kv_heads": int(k0.shape[1]),
            "head_dim": int(k0.shape[2]),
            "v_head_dim": int(v0.shape[2]),
            "dtype": dtype_name(dtype),
            "positions_start": int(kv.positions_start),
            "put_id": uuid.uuid4().hex,
            "ids_crc32": zlib.crc32(ids),
            "layer_crc32": [zlib.crc32(b) for b in layers],
        }
        fields = {_META: _sealed(meta), _IDS: ids}
        fields.update({_field(i): b for i, b in enumerate(layers)})
        return fields

    def _serialize_coded(self, key: KVKey, kv: ChunkKV, codec: KVCodec) -> dict[bytes, bytes]:
        """Version 2: each layer's codec tensors in one field, their names, dtypes and shapes in the header."""
        dtype = self.dtype  # what readers decode to
        if any(k.dtype != dtype and (cast_overflows(k, k.to(dtype)) or cast_overflows(v, v.to(dtype)))
               for k, v in zip(kv.keys, kv.values)):
            logger.warning("KV of %s overflows %s; this entry decodes to float32", key, dtype_name(dtype))
            dtype = torch.float32
        layers, tables = [], []
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            tensors = codec.encode_layer(k.detach().cpu(), v.detach().cpu(), layer, kv.num_layers)
            tables.append([[name, dtype_name(t.dtype), list(t.shape)] for name, t in tensors.items()])
            layers.append(b"".join(_to_bytes(t) for t in tensors.values()))
        token_ids = kv.token_ids.detach().to("cpu", torch.int64).contiguous()
        ids = _to_bytes(token_ids)
        k0, v0 = kv.keys[0], kv.values[0]
        meta = {
            "format": FORMAT, "version": CODED_VERSION, "namespace": key.namespace, "chunk_id": key.chunk_id,
            "kv_digest": token_ids_digest(key.namespace, token_ids), "num_layers": kv.num_layers,
            "num_tokens": kv.num_tokens, "num_kv_heads": int(k0.shape[1]), "head_dim": int(k0.shape[2]),
            "v_head_dim": int(v0.shape[2]), "dtype": dtype_name(dtype), "positions_start": int(kv.positions_start),
            "codec": codec.name, "codec_version": codec.version, "codec_params": codec.params(),
            "layer_tensors": tables, "layer_bytes": [len(b) for b in layers],
            "put_id": uuid.uuid4().hex, "ids_crc32": zlib.crc32(ids), "layer_crc32": [zlib.crc32(b) for b in layers],
        }
        fields = {_META: _sealed(meta), _IDS: ids}
        fields.update({_field(i): b for i, b in enumerate(layers)})
        return fields

    # ---- reading and validation -------------------------------------------------------

    def _open(self, key: KVKey) -> tuple[dict, bytes, torch.Tensor] | None:
        """(meta, raw meta, token ids) after one round trip (HMGET meta ids + HLEN), validated; or None."""
        name = self.name_for(key)

        def fetch() -> list:
            pipe = self._client.pipeline(transaction=False)
            pipe.hmget(name, [_META, _IDS])
            pipe.hlen(name)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._call(fetch, name)
        except _Failure:
            return None
        if any(isinstance(r, Exception) for r in replies):  # an error reply (WRONGTYPE): not one of ours
            self._drop(key, None, f"not a hash: {replies}", force=True)
            return None
        (raw_meta, raw_ids), num_fields = replies
        if raw_meta is None and raw_ids is None and not num_fields:
            return None
        try:
            meta, token_ids = self._header(key, raw_meta, raw_ids)
            if num_fields != meta["num_layers"] + 2:
                raise _Corrupt(f"{num_fields} fields for {meta['num_layers']} layers")
        except _Corrupt as e:
            self._drop(key, raw_meta, str(e))
            return None
        return meta, raw_meta, token_ids

    def _header(self, key: KVKey, raw_meta: bytes | None, raw_ids: bytes | None) -> tuple[dict, torch.Tensor]:
        """The validated header and token ids: bounded size, format, key binding, shapes, crc, digest."""
        if raw_meta is None or raw_ids is None:
            raise _Corrupt("meta or ids field missing")
        if len(raw_meta) > MAX_META_BYTES:
            raise _Corrupt(f"header of {len(raw_meta)} bytes is over the {MAX_META_BYTES}-byte bound")
        try:
            meta = json.loads(raw_meta)
        except (ValueError, UnicodeDecodeError) as e:
            raise _Corrupt(f"header is not JSON ({e})") from None
        if not isinstance(meta, dict):
            raise _Corrupt("header is not an object")
        if META_CRC in meta and meta.pop(META_CRC) != _meta_crc(meta):
            raise _Corrupt("header checksum mismatch")
        if meta.get("format") != FORMAT or meta.get("version") not in (FORMAT_VERSION, CODED_VERSION):
            raise _Corrupt(f"format {short_repr(meta.get('format'))} v{short_repr(meta.get('version'))}")
        if meta.get("namespace") != key.namespace or meta.get("chunk_id") != key.chunk_id:
            raise _Corrupt(f"entry holds {short_repr(meta.get('namespace'))}/{short_repr(meta.get('chunk_id'))}, not {key}")
        if meta.get("dtype") not in STORED_DTYPES:
            raise _Corrupt(f"unknown dtype {short_repr(meta.get('dtype'))}")
        for name in _INT_FIELDS:
            value = meta.get(name)
            if type(value) is not int or not 0 <= value < _INT_MAX:
                raise _Corrupt(f"bad {name}={short_repr(value)}")
        n_layers, n_tokens = meta["num_layers"], meta["num_tokens"]
        crcs = meta.get("layer_crc32")
        if n_layers < 1 or not isinstance(crcs, list) or len(crcs) != n_layers:
            raise _Corrupt("num_layers and layer_crc32 disagree")
        if meta["version"] == CODED_VERSION:
            meta["_codec"] = self._codec_of(meta)
        if len(raw_ids) != 8 * n_tokens or zlib.crc32(raw_ids) != meta.get("ids_crc32"):
            raise _Corrupt("token ids do not match their length or checksum")
        token_ids = _from_bytes(memoryview(raw_ids), torch.int64, (n_tokens,))
        if token_ids_digest(key.namespace, token_ids) != meta.get("kv_digest"):
            raise _Corrupt("kv_digest does not match the stored token ids")
        return meta, token_ids

    @staticmethod
    def _codec_of(meta: dict) -> KVCodec:
        """The codec a version-2 header names, rebuilt from its parameters, its layer table checked; or _Corrupt."""
        name, params = meta.get("codec"), meta.get("codec_params")
        if not isinstance(name, str) or name not in CODECS:
            raise _Corrupt(f"unknown codec {short_repr(name)}")
        if not isinstance(params, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise _Corrupt(f"codec_params must be an object of strings, got {short_repr(params)}")
        try:
            codec = get_codec(name, **params)
        except (CodecError, ConfigError, ValueError, TypeError) as e:
            raise _Corrupt(f"codec {name} cannot be built from {short_repr(params)}: {e}") from None
        if codec.version != meta.get("codec_version"):
            raise _Corrupt(f"codec {name} v{short_repr(meta.get('codec_version'))} is not readable here (v{codec.version})")
        tables, sizes, n = meta.get("layer_tensors"), meta.get("layer_bytes"), meta["num_layers"]
        if not (isinstance(tables, list) and isinstance(sizes, list) and len(tables) == len(sizes) == n):
            raise _Corrupt("layer_tensors and layer_bytes must list every layer")
        for table, size in zip(tables, sizes):
            if not isinstance(table, list) or not table or type(size) is not int:
                raise _Corrupt("a layer has no tensors")
            total = 0
            for entry in table:
                if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                        and entry[1] in _CODEC_DTYPES and isinstance(entry[2], list)
                        and all(type(d) is int and 0 <= d < _INT_MAX for d in entry[2])):
                    raise _Corrupt(f"bad layer tensor entry {short_repr(entry)}")
                total += math.prod(entry[2]) * torch.empty(0, dtype=_CODEC_DTYPES[entry[1]]).element_size()
            if total != size:
                raise _Corrupt("a layer's tensor sizes do not add up to its byte count")
        return codec

    @staticmethod
    def layer_nbytes(meta: dict) -> int:
        """Stored bytes of one layer (keys then values; with a codec, the mean over layers)."""
        if meta["version"] == CODED_VERSION:
            return sum(meta["layer_bytes"]) // meta["num_layers"]
        return raw_layer_nbytes(meta)

    def _layer(self, meta: dict, layer: int, data: bytes | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's validated (keys, values) from its field's bytes."""
        if data is None:
            raise _Corrupt(f"layer {layer} missing")
        coded = meta["version"] == CODED_VERSION
        size = meta["layer_bytes"][layer] if coded else self.layer_nbytes(meta)
        if len(data) != size or zlib.crc32(data) != meta["layer_crc32"][layer]:
            raise _Corrupt(f"layer {layer} has the wrong size or checksum")
        n, h, dtype = meta["num_tokens"], meta["num_kv_heads"], STORED_DTYPES[meta["dtype"]]
        if coded:
            return self._decode(meta, layer, memoryview(data), dtype)
        split = n * h * meta["head_dim"] * torch.empty(0, dtype=dtype).element_size()
        view = memoryview(data)
        return (_from_bytes(view[:split], dtype, (n, h, meta["head_dim"])),
                _from_bytes(view[split:], dtype, (n, h, meta["v_head_dim"])))

    @staticmethod
    def _decode(meta: dict, layer: int, view: memoryview, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A coded layer: its tensors cut from the field as the header lists them, then the codec's decoder."""
        tensors, at = {}, 0
        for name, tname, shape in meta["layer_tensors"][layer]:
            tdtype = _CODEC_DTYPES[tname]
            size = math.prod(shape) * torch.empty(0, dtype=tdtype).element_size()
            tensors[name] = _from_bytes(view[at:at + size], tdtype, tuple(shape))
            at += size
        try:
            return meta["_codec"].decode_layer(
                tensors, num_tokens=meta["num_tokens"], num_kv_heads=meta["num_kv_heads"], head_dim=meta["head_dim"],
                v_head_dim=meta["v_head_dim"], layer=layer, num_layers=meta["num_layers"], dtype=dtype)
        except CodecError as e:
            raise _Corrupt(f"layer {layer}: {e}") from None

    def _drop(self, key: KVKey, raw_meta: bytes | None, reason: str, *, force: bool = False) -> None:
        """Delete a bad entry (unless a put replaced it meanwhile) and log it."""
        logger.warning("corrupt KV entry %s in Redis at %s (%s); deleting it", self.name_for(key), self.url,
                       reason[:LOGGED_CHARS])
        with self._lock:
            self._corrupt += 1
        name = self.name_for(key)
        try:
            if force:
                self._call(lambda: self._client.delete(name), name)
            else:
                self._call(lambda: self._delete_if(keys=[name], args=[raw_meta or b""]), name)
        except _Failure as e:
            logger.debug("could not delete corrupt entry %s: %s", name, e)


class RedisReader(EntryReader):
    """One Redis entry for one request: the header was checked at open; each layer is one HGET, crc-checked.

    A missing or bad layer deletes the entry (unless a put replaced it) and raises LayerReadError, so the
    request recomputes the chunk; Redis unavailable mid-request raises LayerReadError too.
    """

    tier = "redis"

    def __init__(self, store: RedisStore, key: KVKey, meta: dict, raw_meta: bytes, token_ids: torch.Tensor) -> None:
        super().__init__(key, meta, token_ids, store.layer_nbytes(meta))
        self.store = store
        self._raw_meta = raw_meta

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fetch and validate one layer (one HGET)."""
        self._check_index(layer, f"of {self.key}")
        name = self.store.name_for(self.key)
        try:
            data = self.store._call(lambda: self.store._client.hget(name, _field(layer)), name)
        except _Failure as e:
            raise LayerReadError(self.key, layer, f"Redis: {e}") from e
        loaded = self._check(layer, data)
        with self._lock:
            self._read[layer] = loaded
            self.bytes_read += len(data)
        with self.store._lock:
            self.store._bytes_read += len(data)
        return loaded

    def complete(self) -> ChunkKV | None:
        """The whole entry (to promote into a faster tier): the layers not read yet in one HMGET; None on failure."""
        missing = [i for i in range(self.num_layers) if i not in self._read]
        if missing:
            name = self.store.name_for(self.key)
            try:
                datas = self.store._call(lambda: self.store._client.hmget(name, [_field(i) for i in missing]),
                                         name)
                for i, data in zip(missing, datas):
                    self._read[i] = self._check(i, data)
            except (_Failure, LayerReadError):
                return None
        return self._whole()

    def close(self) -> None:
        """Nothing to release (connections are pooled per call)."""

    def _check(self, layer: int, data: bytes | None) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.store._layer(self._meta, layer, data)
        except _Corrupt as e:
            if data is None:  # evicted or deleted since the open: gone, not corrupt
                raise LayerReadError(self.key, layer, "entry gone from Redis") from e
            self.store._drop(self.key, self._raw_meta, f"layer {layer}: {e}")
            raise LayerReadError(self.key, layer, str(e)) from e
