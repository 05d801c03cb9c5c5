"""Cache-Craft's chunk-cache variants (§3.3): a chunk's KV as computed after given chunks, and its metadata.

A variant is keyed by the chunk id and the exact tokens before it (their digest); its KV lives in the same
KVStore as every chunk KV, under a derived chunk id in the same namespace (keys before RoPE, like all stored KV).
Its metadata — the chunks before it (ids, in order), inter-attention to each, intra-attention, CCI (eq. 11), the
chunk's tokens ranked by inter-attention, the usefulness f_r and its size — lives in SQLite (WAL mode, busy
timeout; each row with a crc32 of what was written, all but the use counts f_r and created) in the store's side-car
folder (`KVStore.side_car_dir()`: the disk tier's, beside the chunk index), so every process serving the same store
sees the same variants. A store without a folder gets a temporary database of
its own. Cache-Craft keeps one VariantStore per chunk cache as its per-chunk state (`CacheCraft.chunk_state`,
made by `ChunkCache.policy_state` on first use); no other module makes one.

Nothing here can fail a request: an unreadable row is no variant, a locked database is waited on briefly then
read as "no variants", a row that fails its checksum is skipped, and a variant whose KV is gone is forgotten when it
is found missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import sqlite3
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ....ingest.chunks import Chunk
from ....store import ChunkKV, KVKey, KVStore, LayerReader
from ...chunk_cache import part_of

logger = logging.getLogger(__name__)

VARIANTS_FILE = "cachecraft-variants.sqlite"  # beside the disk tier's entries, like chunk-index.sqlite
BUSY_TIMEOUT_S = 0.25  # a read waits this long for a locked database, then the request goes on without variants
LOCKED_BACKOFF_S = 2.0  # after a lock timeout, the database is left alone this long (requests go on without it)
WRITE_TIMEOUT_S = 5.0  # a write (after the first token) waits longer: two processes adding variants both land

_SCHEMA = """
CREATE TABLE IF NOT EXISTS variants (
    namespace TEXT NOT NULL,
    chunk_id TEXT NOT NULL,
    kv_id TEXT NOT NULL,          -- the derived chunk id its KV is stored under (same namespace)
    context TEXT NOT NULL,        -- JSON: ids of the chunks before it, in order
    lead_digest TEXT NOT NULL,    -- sha256 of every token before it: equal → the variant is exact here
    num_tokens INTEGER NOT NULL,
    inter TEXT NOT NULL,          -- JSON {chunk id: inter-attention (eq. 3), layer mean}
    intra REAL NOT NULL,          -- intra-attention (eq. 4), layer mean
    cci REAL NOT NULL,            -- Cache Context Impact (eq. 11)
    ranking TEXT NOT NULL,        -- JSON: the chunk's token indices by inter-attention, highest first (eq. 14)
    nbytes INTEGER NOT NULL,
    f_r REAL NOT NULL DEFAULT 0,  -- usefulness: += 1/CFO per use (§3.3)
    created REAL NOT NULL,
    crc INTEGER,                  -- crc32 of the row as written (`_row_crc`); a row whose fields fail it is skipped
    PRIMARY KEY (namespace, chunk_id, kv_id)
);
"""


def token_digest(token_ids: torch.Tensor | Sequence[int]) -> str:
    """sha256 (32 hex) of a token id sequence: the identity of the tokens a variant was computed after."""
    ids = token_ids.cpu() if isinstance(token_ids, torch.Tensor) else torch.tensor(list(token_ids))
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:32]


_VARIANT_KV_ID = re.compile(r"^var-[0-9a-f]{32}$")  # what `variant_kv_id` makes: a row naming anything else is skipped


def variant_kv_id(chunk_id: str, lead_digest: str) -> str:
    """The derived chunk id a variant's KV is stored under ([a-z0-9-], a valid KVKey chunk id)."""
    return "var-" + hashlib.sha256(f"{chunk_id}:{lead_digest}".encode()).hexdigest()[:32]


def cci(inter: dict[str, float], intra: float, num_tokens: int, sizes: dict[str, int]) -> float:
    """Cache Context Impact, eq. 9–11: sigmoid(ā / b̄), ā = Σ_j inter(C_j, C)/(|C||C_j|), b̄ = intra/|C|²."""
    a = sum(v / (num_tokens * max(sizes.get(j, 1), 1)) for j, v in inter.items())
    b = intra / (num_tokens * num_tokens)
    if b <= 0:
        return 1.0 if a > 0 else 0.5
    return 1.0 / (1.0 + math.exp(-a / b))


@dataclass
class Variant:
    """One stored variant's metadata (the isolated precompute is `Variant.isolated`, context ())."""

    chunk_id: str
    kv_id: str | None  # None: the isolated precompute (the chunk's own KV)
    context: tuple[str, ...]
    lead_digest: str
    num_tokens: int
    inter: dict[str, float] = field(default_factory=dict)
    intra: float = 0.0
    cci: float = 0.5
    ranking: list[int] | None = None
    nbytes: int = 0
    f_r: float = 0.0

    @classmethod
    def isolated(cls, chunk_id: str, num_tokens: int) -> "Variant":
        """The no-context variant: the chunk's ingestion precompute."""
        return cls(chunk_id, None, (), "", num_tokens)


def _row_crc(namespace: str, chunk_id: str, fields: Sequence) -> int:
    """crc32 of a row's fields as SQLite gives them back (kv_id .. nbytes): a field changed in place, even to a
    value of the right type (a CCI of 0), no longer matches. -0.0 is written as 0.0, as SQLite may read it."""
    canon = [f + 0.0 if isinstance(f, float) else f for f in fields]
    return zlib.crc32(json.dumps([namespace, chunk_id, *canon]).encode())


def _locked(e: Exception) -> bool:
    """Whether SQLite said the database is locked or busy (another process holds it)."""
    return "locked" in str(e) or "busy" in str(e)


class VariantStore:
    """Variants' metadata in SQLite and their KV in the engine's KVStore (same namespace as chunk KV)."""

    def __init__(self, store: KVStore, path: str | Path | None) -> None:
        self.store = store
        self._path = None if path is None else Path(path)
        self._tmp: tempfile.TemporaryDirectory | None = None
        # One connection shared by the threads that use this object (the engine serialises requests), each
        # statement under the lock: SQLite connections are not to be used by two threads at once.
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._warned = False
        self._skip_until = 0.0
        self.num_added = 0  # variants this object stored (KV and row), for callers that count what a request kept

    @classmethod
    def beside(cls, store: KVStore) -> "VariantStore":
        """A variant store in `store`'s side-car folder (a private temporary database when it has none)."""
        folder = store.side_car_dir()
        return cls(store, None if folder is None else folder / VARIANTS_FILE)

    @property
    def path(self) -> Path:
        """The SQLite file (a private temporary one, made on first use, for a store without a folder)."""
        with self._lock:
            if self._path is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="cachecraft-")
                self._path = Path(self._tmp.name) / VARIANTS_FILE
            return self._path

    def close(self) -> None:
        """Close the database connection (the next use opens a new one)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ---- database -----------------------------------------------------------------------

    def _execute(self, sql: str, args: tuple, timeout_s: float) -> list[tuple]:
        """One statement on the shared connection (opened on first use), waiting up to `timeout_s` for a lock."""
        if time.monotonic() < self._skip_until:  # locked a moment ago: don't make every chunk wait again
            raise sqlite3.OperationalError("database is locked (backing off)")
        with self._lock:
            if self._conn is None:
                path = self.path
                path.parent.mkdir(parents=True, exist_ok=True)
                db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
                try:
                    db.execute("PRAGMA journal_mode = WAL")
                    db.executescript(_SCHEMA)
                    if "crc" not in {row[1] for row in db.execute("PRAGMA table_info(variants)")}:
                        # a database from before rows were checksummed: its rows (crc NULL) are skipped
                        db.execute("ALTER TABLE variants ADD COLUMN crc INTEGER")
                except sqlite3.Error:
                    db.close()
                    raise
                self._conn = db
            self._conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            return self._conn.execute(sql, args).fetchall()

    def _read(self, sql: str, args: tuple) -> list[tuple]:
        return self._execute(sql, args, BUSY_TIMEOUT_S)

    def _write(self, sql: str, args: tuple, timeout_s: float = WRITE_TIMEOUT_S) -> None:
        # SQLite answers some contention without calling its busy handler (a WAL snapshot gone stale, the WAL
        # index being rebuilt by another process's first open: SQLITE_BUSY at once), so a write that may wait
        # retries until its own deadline instead of failing on the first "locked".
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._execute(sql, args, timeout_s)
                return
            except sqlite3.OperationalError as e:
                if not _locked(e) or "backing off" in str(e) or time.monotonic() + 0.05 > deadline:
                    raise
                time.sleep(0.02 + 0.03 * random.random())

    def _degraded(self, what: str, e: Exception) -> None:
        if _locked(e):
            self._skip_until = time.monotonic() + LOCKED_BACKOFF_S
        if not self._warned:
            logger.warning("cachecraft variant metadata %s failed (%s: %s); serving without variants (said once)",
                           what, type(e).__name__, e)
        self._warned = True

    # ---- reads --------------------------------------------------------------------------

    def lookup(self, namespace: str, chunk_id: str) -> list[Variant]:
        """The chunk's stored variants; a row that does not parse is skipped, a locked database gives []."""
        try:
            rows = self._read(
                "SELECT kv_id, context, lead_digest, num_tokens, inter, intra, cci, ranking, nbytes, f_r, crc "
                "FROM variants WHERE namespace = ? AND chunk_id = ?", (namespace, chunk_id))
        except (sqlite3.Error, OSError) as e:
            self._degraded("lookup", e)
            return []
        out = []
        for row in rows:
            try:
                out.append(_parse(namespace, chunk_id, row))
            except (ValueError, TypeError, KeyError, OverflowError) as e:  # 1e309 in an integer column: inf
                logger.info("skipping an unreadable variant row of chunk %s (%s)", chunk_id, e)
        return out

    def reader(self, namespace: str, variant: Variant, chunk: Chunk) -> LayerReader | None:
        """A reader of the variant's KV for the chunk's rows (the chunk's tokens, or the part a prompt placed); a
        variant whose KV is gone is forgotten, one stored for other tokens (another part) is only passed over."""
        reader = self.store.reader(KVKey(namespace, variant.kv_id))
        if reader is None:
            self.forget(namespace, variant)
            return None
        if torch.equal(reader.token_ids.cpu(), chunk.token_ids.cpu()):
            return reader
        return part_of(reader, chunk)

    def total_nbytes(self, namespace: str) -> int:
        """Bytes of the namespace's variants (as recorded when stored)."""
        try:
            return int(self._read("SELECT COALESCE(SUM(nbytes), 0) FROM variants WHERE namespace = ?",
                                  (namespace,))[0][0])
        except (sqlite3.Error, OSError) as e:
            self._degraded("size", e)
            return 0

    # ---- writes -------------------------------------------------------------------------

    def touch(self, namespace: str, variant: Variant, cfo: float) -> None:
        """One use of a variant at this CFO: f_r += 1/CFO (§3.3; a CFO of 0 counts as 1e-3)."""
        if variant.kv_id is None:
            return
        try:
            self._write("UPDATE variants SET f_r = f_r + ? WHERE namespace = ? AND chunk_id = ? AND kv_id = ?",
                        (1.0 / max(cfo, 1e-3), namespace, variant.chunk_id, variant.kv_id),
                        BUSY_TIMEOUT_S)  # on the request's path: a lost increment beats a wait
        except (sqlite3.Error, OSError) as e:
            self._degraded("update", e)

    def forget(self, namespace: str, variant: Variant) -> None:
        """Drop a variant's row (its KV is gone or bad)."""
        try:
            self._write("DELETE FROM variants WHERE namespace = ? AND chunk_id = ? AND kv_id = ?",
                        (namespace, variant.chunk_id, variant.kv_id), BUSY_TIMEOUT_S)
        except (sqlite3.Error, OSError) as e:
            self._degraded("delete", e)

    def add(self, namespace: str, variant: Variant, kv: ChunkKV) -> bool:
        """Store the variant's KV, then its row (KV first: a row always names KV that was written). True if kept."""
        try:
            self.store.put(KVKey(namespace, variant.kv_id), kv)
        except Exception as e:  # noqa: BLE001 - a store that cannot keep it: no variant, never a failed request
            self._degraded("KV write", e)
            return False
        nbytes = self.store.entry_nbytes(KVKey(namespace, variant.kv_id)) or kv.nbytes
        variant.nbytes = int(nbytes)
        fields = (variant.kv_id, json.dumps(list(variant.context)), variant.lead_digest, int(variant.num_tokens),
                  json.dumps(variant.inter), float(variant.intra) + 0.0, float(variant.cci) + 0.0,
                  json.dumps(variant.ranking or []), variant.nbytes)
        try:
            self._write(
                "INSERT OR REPLACE INTO variants (namespace, chunk_id, kv_id, context, lead_digest, num_tokens, "
                "inter, intra, cci, ranking, nbytes, f_r, created, crc) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                "COALESCE((SELECT f_r FROM variants WHERE namespace = ? AND chunk_id = ? AND kv_id = ?), 0), ?, ?)",
                (namespace, variant.chunk_id, *fields, namespace, variant.chunk_id, variant.kv_id, time.time(),
                 _row_crc(namespace, variant.chunk_id, fields)))
        except (sqlite3.Error, OSError) as e:
            self._degraded("insert", e)
            return False
        with self._lock:
            self.num_added += 1
        return True

    def evict(self, namespace: str, budget_bytes: int) -> list[str]:
        """Evict the least useful variants (lowest f_r, oldest first) until the namespace fits `budget_bytes`."""
        evicted: list[str] = []
        try:
            total = self.total_nbytes(namespace)
            if total <= budget_bytes:
                return evicted
            rows = self._read("SELECT chunk_id, kv_id, nbytes FROM variants WHERE namespace = ? "
                              "ORDER BY f_r ASC, created ASC", (namespace,))
            for chunk_id, kv_id, nbytes in rows:
                if total <= budget_bytes:
                    break
                self._write("DELETE FROM variants WHERE namespace = ? AND chunk_id = ? AND kv_id = ?",
                           (namespace, chunk_id, kv_id))
                self.store.delete(KVKey(namespace, kv_id))
                total -= int(nbytes)
                evicted.append(kv_id)
        except (sqlite3.Error, OSError) as e:
            self._degraded("eviction", e)
        return evicted


def _parse(namespace: str, chunk_id: str, row: tuple) -> Variant:
    *fields, f_r, crc = row
    if crc is None or crc != _row_crc(namespace, chunk_id, fields):
        raise ValueError("checksum mismatch")
    kv_id, context, lead_digest, num_tokens, inter, intra, cci_value, ranking, nbytes = fields
    ctx = json.loads(context)
    inter_d = json.loads(inter)
    rank = json.loads(ranking)
    if (not isinstance(ctx, list) or not all(isinstance(c, str) for c in ctx) or not isinstance(inter_d, dict)
            or not isinstance(rank, list) or not all(isinstance(r, int) for r in rank)
            or not isinstance(kv_id, str) or not _VARIANT_KV_ID.match(kv_id) or int(num_tokens) <= 0):
        raise ValueError("malformed fields")
    if not all(math.isfinite(float(x)) for x in (num_tokens, intra, nbytes, f_r)):
        raise ValueError("non-finite fields")
    inter_f = {str(k): float(v) for k, v in inter_d.items()}
    if any(not math.isfinite(v) for v in inter_f.values()) or not math.isfinite(float(cci_value)):
        raise ValueError("non-finite attention")
    n = int(num_tokens)
    if any(r < 0 or r >= n for r in rank):
        raise ValueError("ranking outside the chunk")
    return Variant(chunk_id, kv_id, tuple(ctx), str(lead_digest), n, inter_f, float(intra), float(cci_value),
                   rank or None, int(nbytes), float(f_r))

