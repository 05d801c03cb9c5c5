"""Tests of the KV stores on real files: round trips, LRU budgets, corruption, concurrency."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from cacheblend_rag.store import (
    ChunkKV,
    DiskStore,
    KVKey,
    KVStore,
    MemoryStore,
    TieredStore,
    open_store,
    token_ids_digest,
)

REPO = Path(__file__).resolve().parents[1]
LAYERS, TOKENS, HEADS, DIM = 4, 16, 2, 8


def make_kv(seed: int = 0, tokens: int = TOKENS, dtype: torch.dtype = torch.float32) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, HEADS, DIM)
    return ChunkKV(
        keys=tuple(torch.randn(shape, generator=g, dtype=dtype) for _ in range(LAYERS)),
        values=tuple(torch.randn(shape, generator=g, dtype=dtype) for _ in range(LAYERS)),
        token_ids=torch.randint(0, 50_000, (tokens,), generator=g),
        positions_start=3,
    )


def assert_kv_equal(a: ChunkKV, b: ChunkKV) -> None:
    assert a.num_layers == b.num_layers and a.positions_start == b.positions_start
    assert torch.equal(a.token_ids, b.token_ids)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and torch.equal(x, y)


def key(chunk: str = "abcdef01", ns: str = "model-a") -> KVKey:
    return KVKey(ns, chunk)


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of a tensor's data inside a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def quarantined(store: DiskStore) -> list[Path]:
    q = store.root / ".quarantine"
    return sorted(q.iterdir()) if q.exists() else []


# ---- memory ---------------------------------------------------------------------------


def test_memory_round_trip_and_stats() -> None:
    store = MemoryStore()
    kv = make_kv()
    assert store.get(key()) is None
    store.put(key(), kv)
    assert store.get(key()) is kv and store.contains(key())
    s = store.stats()
    assert (s["tier"], s["hits"], s["misses"], s["puts"], s["entries"]) == ("memory", 1, 1, 1, 1)
    assert s["bytes"] == kv.nbytes
    assert store.delete(key()) and not store.delete(key()) and store.stats()["bytes"] == 0


def test_memory_lru_eviction_under_budget() -> None:
    size = make_kv().nbytes
    evicted: list[KVKey] = []
    store = MemoryStore(max_bytes=3 * size, on_evict=lambda k, kv: evicted.append(k))
    for i in range(3):
        store.put(key(f"c{i}"), make_kv(i))
    store.get(key("c0"))  # c0 becomes most recent, so c1 goes first
    store.put(key("c3"), make_kv(3))
    assert evicted == [key("c1")]
    assert not store.contains(key("c1")) and store.contains(key("c0"))
    s = store.stats()
    assert s["evictions"] == 1 and s["entries"] == 3 and s["bytes"] <= 3 * size
    store.put(key("huge"), make_kv(9, tokens=TOKENS * 4))  # larger than the whole budget
    assert not store.contains(key("huge")) and store.stats()["entries"] == 3


# ---- disk: round trips ----------------------------------------------------------------


def test_disk_float32_round_trip_is_bit_exact(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, dtype=torch.float32)
    kv = make_kv()
    store.put(key(), kv)
    assert store.path_for(key()) == tmp_path / "model-a" / "ab" / "abcdef01.safetensors"
    got = store.get(key())
    assert got is not None
    assert_kv_equal(got, kv)
    meta = store.read_meta(key())
    assert meta is not None
    assert meta["format"] == "cacheblend-kv" and meta["format_version"] == "1"
    assert meta["kv_digest"] == token_ids_digest("model-a", kv.token_ids)
    assert (meta["num_layers"], meta["num_tokens"], meta["dtype"]) == ("4", "16", "float32")
    assert "crc.k.3" in meta and "crc.token_ids" in meta
    s = store.stats()
    assert (s["tier"], s["hits"], s["puts"], s["entries"], s["corrupt"]) == ("disk", 1, 1, 1, 0)
    assert s["bytes"] == store.path_for(key()).stat().st_size


def test_disk_fp16_default_equals_fp16_cast(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    kv = make_kv()
    store.put(key(), kv)
    got = store.get(key())
    assert got is not None
    assert_kv_equal(got, kv.to(dtype=torch.float16))
    assert store.get(KVKey("model-a", "missing")) is None and store.stats()["misses"] == 1


def test_disk_fp16_overflow_falls_back_to_float32(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    kv = make_kv()
    kv.keys[1][0, 0, 0] = 1e6  # finite, but inf in fp16
    store.put(key(), kv)
    got = store.get(key())
    assert got is not None and got.keys[0].dtype == torch.float32
    assert_kv_equal(got, kv)


def test_get_layer_matches_get(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put(key(), make_kv())
    full = store.get(key())
    assert full is not None
    for layer in range(LAYERS):
        pair = store.get_layer(key(), layer)
        assert pair is not None
        assert torch.equal(pair[0], full.keys[layer]) and torch.equal(pair[1], full.values[layer])
    assert store.get_layer(KVKey("model-a", "nothere"), 0) is None
    with pytest.raises(IndexError):
        store.get_layer(key(), LAYERS)


# ---- disk: budget ---------------------------------------------------------------------


def test_disk_lru_eviction_under_budget(tmp_path: Path) -> None:
    probe = DiskStore(tmp_path / "probe")
    probe.put(key(), make_kv())
    size = probe.stats()["bytes"]
    store = DiskStore(tmp_path / "s", max_bytes=3 * size)
    for i in range(3):
        store.put(key(f"c{i}"), make_kv(i))
    assert store.get(key("c0")) is not None  # c0 becomes most recent
    store.put(key("c3"), make_kv(3))
    assert [store.contains(key(f"c{i}")) for i in range(4)] == [True, False, True, True]
    s = store.stats()
    assert s["evictions"] == 1 and s["entries"] == 3 and s["bytes"] <= 3 * size
    # A new process (here: a new store) rebuilds recency from file mtimes.
    again = DiskStore(tmp_path / "s", max_bytes=3 * size)
    assert again.stats()["bytes"] == s["bytes"]
    again.put(key("c4"), make_kv(4))
    assert not again.contains(key("c2")) and again.contains(key("c0"))


# ---- disk: corruption -----------------------------------------------------------------


def test_truncated_file_is_quarantined_then_rewritable(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put(key(), make_kv())
    path = store.path_for(key())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert store.get(key()) is None
    assert not path.exists() and len(quarantined(store)) == 1
    assert store.stats()["corrupt"] == 1 and store.stats()["entries"] == 0
    store.put(key(), make_kv(1))
    got = store.get(key())
    assert got is not None
    assert_kv_equal(got, make_kv(1).to(dtype=torch.float16))


@pytest.mark.parametrize("payload", [b"", b"garbage" * 100, b"\xff" * 8 + b"{}"])
def test_garbage_file_is_a_miss(tmp_path: Path, payload: bytes) -> None:
    store = DiskStore(tmp_path)
    path = store.path_for(key())
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    assert store.get(key()) is None
    assert store.read_meta(key()) is None and store.get_layer(key(), 0) is None
    assert not path.exists() and store.stats()["corrupt"] == 1


def test_file_from_other_namespace_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put(key(ns="model-b"), make_kv())
    mine = store.path_for(key(ns="model-a"))
    mine.parent.mkdir(parents=True)
    shutil.copy(store.path_for(key(ns="model-b")), mine)
    assert store.get(key(ns="model-a")) is None
    assert store.get_layer(key(ns="model-a"), 0) is None
    assert store.get(key(ns="model-b")) is not None  # the genuine entry is untouched


def test_checksum_mismatch_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put(key(), make_kv())
    path = store.path_for(key())
    start, end = tensor_span(path, "v.2")
    raw = bytearray(path.read_bytes())
    for i in range(start + 4, start + 8):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))
    assert store.get_layer(key(), 0) is not None  # other layers still check out
    assert store.get_layer(key(), 2) is None  # ... this one does not, and is quarantined
    assert store.get(key()) is None and store.stats()["corrupt"] == 1


def test_rewritten_header_with_wrong_digest_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, dtype=torch.float32)
    store.put(key(), make_kv())
    path = store.path_for(key())
    other = DiskStore(tmp_path / "o", dtype=torch.float32)
    other.put(key(), make_kv(5))  # same key, different tokens
    raw, fake = path.read_bytes(), other.path_for(key()).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    (m,) = struct.unpack("<Q", fake[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["kv_digest"] = json.loads(fake[8 : 8 + m])["__metadata__"]["kv_digest"]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    assert store.get(key()) is None and store.stats()["corrupt"] == 1


# ---- tiered ---------------------------------------------------------------------------


def test_tiered_promotion_and_write_through(tmp_path: Path) -> None:
    disk = DiskStore(tmp_path)
    store = TieredStore(MemoryStore(), disk)
    kv = make_kv()
    store.put(key(), kv)
    assert disk.contains(key()) and store.memory.contains(key())
    store.memory.clear()
    got = store.get(key())
    assert got is not None and store.memory.contains(key())  # promoted from disk
    assert store.get(key()) is got  # now served from memory
    s = store.stats()
    assert (s["tier"], s["hits"], s["misses"]) == ("tiered", 2, 0)
    assert s["disk"]["hits"] == 1 and s["memory"]["hits"] == 1
    assert store.delete(key()) and not store.contains(key()) and store.get(key()) is None


def test_tiered_spills_memory_evictions_to_disk(tmp_path: Path) -> None:
    size = make_kv().nbytes
    disk = DiskStore(tmp_path, dtype=torch.float32)
    store = TieredStore(MemoryStore(max_bytes=2 * size), disk)
    store.memory.put(key("c0"), make_kv(0))  # memory only, as if the disk write was lost
    store.put(key("c1"), make_kv(1))
    store.put(key("c2"), make_kv(2))  # evicts c0 from memory -> spilled
    assert not store.memory.contains(key("c0")) and disk.contains(key("c0"))
    got = store.get(key("c0"))
    assert got is not None
    assert_kv_equal(got, make_kv(0))


def test_open_store(tmp_path: Path) -> None:
    assert isinstance(open_store(None), MemoryStore)
    tiered = open_store(tmp_path / "kv", memory_bytes=1024, disk_dtype=torch.float32)
    assert isinstance(tiered, TieredStore) and isinstance(tiered, KVStore)
    assert tiered.memory.max_bytes == 1024 and tiered.disk.dtype == torch.float32
    assert open_store(tiered) is tiered


# ---- concurrency ----------------------------------------------------------------------


def test_concurrent_threads_same_key(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, dtype=torch.float32)
    kvs = [make_kv(i) for i in range(8)]
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for _ in range(5):
                store.put(key(), kvs[i])
                got = store.get(key())
                assert got is not None and any(torch.equal(got.token_ids, kv.token_ids) for kv in kvs)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = store.get(key())
    assert got is not None
    assert_kv_equal(got, next(kv for kv in kvs if torch.equal(kv.token_ids, got.token_ids)))
    assert store.stats()["corrupt"] == 0 and not quarantined(store)
    assert not list(store.path_for(key()).parent.glob("*.tmp"))


WRITER = textwrap.dedent(
    """
    import sys, torch
    from cacheblend_rag.store import ChunkKV, DiskStore, KVKey
    store, who = DiskStore(sys.argv[1], dtype=torch.float32), int(sys.argv[2])
    for i in range(40):
        s = who * 1000 + i  # every tensor of a write carries its seed, so readers can check it
        kv = ChunkKV(
            keys=tuple(torch.full((16, 2, 8), float(s)) for _ in range(4)),
            values=tuple(torch.full((16, 2, 8), -float(s)) for _ in range(4)),
            token_ids=torch.arange(16) + s,
        )
        store.put(KVKey("model-a", "shared"), kv)
    """
)


def test_concurrent_processes_same_key(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(who)], env=env, stderr=subprocess.PIPE)
        for who in (1, 2)
    ]
    store = DiskStore(tmp_path, dtype=torch.float32)
    k = KVKey("model-a", "shared")
    reads = 0
    while any(p.poll() is None for p in procs):  # read while they write: never torn data
        got = store.get(k)
        if got is not None:
            reads += 1
            s = int(got.token_ids[0])
            assert torch.equal(got.token_ids, torch.arange(16) + s)
            assert all(torch.all(x == s) for x in got.keys) and all(torch.all(v == -s) for v in got.values)
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err.decode()
    assert reads > 0, "the reader never overlapped the writers"
    got = store.get(k)
    assert got is not None and int(got.token_ids[0]) in (1039, 2039)
    assert store.stats()["corrupt"] == 0 and not quarantined(store)
    assert not list(store.path_for(k).parent.glob("*.tmp"))


# ---- hygiene --------------------------------------------------------------------------


def test_store_sources_never_unpickle() -> None:
    sources = sorted((REPO / "cacheblend_rag" / "store").glob("*.py"))
    assert sources
    for path in sources:
        text = path.read_text()
        for banned in ("pickle", "torch.load"):
            assert banned not in text, f"{path.name} mentions {banned}"
