"""What a client of a shared server can learn about the others (#50): a chunk id resolves only in the namespace that
sent its text (or in the operator's ingested corpus), /metrics is the operator's (--metrics-key), and the model is
served under the --model argument as given as well as under its short name.

Real `cacheblend-rag serve` subprocesses on loopback ports with two API keys, driven by the `openai` SDK and httpx.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from cacheblend_rag.ingest.chunks import chunk_id  # noqa: E402
from cacheblend_rag.models.loader import model_folder  # noqa: E402

from test_serve import MODEL, REPO, ServerProcess, _env, _home  # noqa: E402

KEY_A = "privacy-test-key-a-7d41"
KEY_B = "privacy-test-key-b-c2e9"
METRICS_KEY = "privacy-test-metrics-0b5a"
MEMO = ("Board memo: the Lyon plant closes on 30 June; its 212 staff move to the Grenoble site, "
        "announced to them on 2 June.")
CORPUS = "The Rhône and the Saône meet in Lyon, at the southern tip of the Presqu'île."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = _home(tmp_path_factory.mktemp("privacy"))
    corpus = home / "corpus.txt"
    corpus.write_text(CORPUS + "\n")
    ingest = subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", "ingest", str(corpus), "--home", str(home),
                             "--collection", "privacy_corpus", "--quiet", "--dtype", "float32", "--device", "cpu"],
                            capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert ingest.returncode == 0, ingest.stderr
    # the model given as a folder path, as vLLM users pass it
    srv = ServerProcess(home, "--model", str(model_folder(MODEL)), "--api-key", KEY_A, "--api-key", KEY_B,
                        "--hide-cache-usage", "--metrics-key", METRICS_KEY, "--max-batch", "2")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def _client(server, key: str):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def _ask(client, model: str, **body):
    return client.chat.completions.create(model=model, max_tokens=2, extra_body=body,
                                          messages=[{"role": "user", "content": "Which site?"}])


def _served(server) -> str:
    return str(model_folder(MODEL))


@pytest.mark.model
@pytest.mark.slow
def test_a_chunk_id_resolves_only_for_the_key_that_sent_its_text(server):
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    model = _served(server)
    memo_id = chunk_id(MEMO)
    _ask(a, model, documents=[MEMO])
    assert _ask(a, model, chunk_ids=[memo_id]).choices  # the key that sent it finds it again by id
    # another key: the id of A's memo is as unknown as that of a memo nobody sent (no yes/no oracle)
    answers = {}
    for name, cid in (("a's memo", memo_id), ("an edited memo", chunk_id(MEMO.replace("212", "213")))):
        with pytest.raises(openai.BadRequestError) as e:
            _ask(b, model, chunk_ids=[cid])
        answers[name] = e.value.body["message"].replace(cid, "<id>")
    assert answers["a's memo"] == answers["an edited memo"]
    # a cache_salt is a namespace too: A's own id under a salt it never used is unknown
    with pytest.raises(openai.BadRequestError):
        _ask(a, model, chunk_ids=[memo_id], cache_salt="another-tenant")
    # the corpus the operator ingested is shared: every key resolves its ids
    assert _ask(b, model, chunk_ids=[chunk_id(CORPUS)]).choices


@pytest.mark.model
@pytest.mark.slow
def test_metrics_need_the_operators_key_not_a_clients(server):
    for key in (KEY_A, KEY_B, None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)
        assert response.status_code == 401, response.text
        assert "--metrics-key" in response.json()["error"]["message"]
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=10)
    assert response.status_code == 200 and "cacheblend_cached_prompt_tokens_total" in response.text
    # the metrics key is the operator's: it opens /metrics only
    response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=10)
    assert response.status_code == 401


@pytest.mark.model
@pytest.mark.slow
def test_the_model_answers_to_the_model_argument_as_given_and_to_its_name(server):
    client = _client(server, KEY_A)
    folder = model_folder(MODEL)
    assert [m.id for m in client.models.list().data] == [folder.name]
    for name in (str(folder), folder.name):
        assert _ask(client, name).model == folder.name
    assert client.models.retrieve(str(folder)).id == folder.name
    with pytest.raises(openai.NotFoundError):
        _ask(client, "another-model")


@pytest.mark.model
@pytest.mark.slow
def test_hide_cache_usage_without_a_metrics_key_serves_no_metrics(tmp_path):
    srv = ServerProcess(_home(tmp_path), "--api-key", KEY_A, "--hide-cache-usage")
    try:
        response = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10)
        assert response.status_code == 403, response.text
        assert "--metrics-key" in response.json()["error"]["message"]
    finally:
        assert srv.stop() == 0, srv.log.read_text()


@pytest.mark.model
@pytest.mark.slow
def test_served_model_name_replaces_the_model_argument(tmp_path):
    srv = ServerProcess(_home(tmp_path), "--served-model-name", "bees-v1")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["bees-v1"]
        assert _ask(client, "bees-v1").model == "bees-v1"
        with pytest.raises(openai.NotFoundError):
            _ask(client, MODEL)
    finally:
        assert srv.stop() == 0, srv.log.read_text()
