"""Shared caches without a cross-client leak (#38): a request's `cache_salt` and each API key's namespace keep
clients' cached prompts apart, as vLLM's salt does; the stored-prefix store's size is in /metrics.

A real `cacheblend-rag serve` subprocess on the default model, with two API keys, driven by the `openai` SDK.
"""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from test_serve import MODEL, ServerProcess, _home  # noqa: E402

KEY_A = "salt-test-key-a-61c0"
KEY_B = "salt-test-key-b-93d2"
# long enough for whole prefix blocks; each test's system text starts with its own tag, so that no test finds
# another's stored prefix (a prefix is shared from the first token on)
CONTEXT = ("Honeybees have five eyes: two large compound eyes and three small simple eyes called ocelli on top of "
           "the head. A colony has one queen, a few hundred drones and tens of thousands of female workers.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the keys as an operator may give them: one flag repeated, one of them a comma-separated list
    srv = ServerProcess(_home(tmp_path_factory.mktemp("salt")), "--api-key", f"{KEY_A},{KEY_A}", "--api-key", KEY_B,
                        "--max-batch", "2", "--timeout", "300")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def _client(server, key: str):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def _cached(client, question: str, salt: str | None = None) -> int:
    """Cached prompt tokens of a chat asking `question` about CONTEXT (with `cache_salt`, if given); the question
    (the test's own) opens the system text too."""
    extra = {"cache_salt": salt} if salt is not None else None
    response = client.chat.completions.create(
        model=MODEL, max_tokens=4, extra_body=extra,
        messages=[{"role": "system", "content": f"{question}\n\n{CONTEXT}"}, {"role": "user", "content": question}])
    assert response.usage.prompt_tokens > 0
    return response.usage.prompt_tokens_details.cached_tokens


@pytest.mark.model
@pytest.mark.slow
def test_the_same_salt_shares_the_prompt_another_salt_does_not(server):
    client = _client(server, KEY_B)
    question = "How many simple eyes does a honeybee have? (salt test)"
    first = _cached(client, question, salt="tenant-1")
    assert _cached(client, question, salt="tenant-1") > first  # the same salt: the stored prefix is found
    assert _cached(client, question, salt="tenant-2") == first  # another salt: nothing of the first is
    assert _cached(client, question) == first  # nor for a request without a salt


@pytest.mark.model
@pytest.mark.slow
def test_clients_with_different_api_keys_share_nothing_with_the_same_key_they_do(server):
    question = "How many queens does a colony have? (key test)"
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    first = _cached(a, question)
    assert _cached(b, question) == first  # another key: a namespace of its own
    assert _cached(a, question) > first  # the same key: its own earlier request is found
    # an explicit salt combines with the key's namespace: the same salt under another key still shares nothing
    salted = _cached(a, question, salt="shared-name")
    assert _cached(b, question, salt="shared-name") == salted
    assert _cached(a, question, salt="shared-name") > salted


@pytest.mark.model
@pytest.mark.slow
def test_metrics_show_the_stored_prefix_stores_bytes_and_entries(server):
    """And the chunk KV store's, by tier: a document sent is stored (so an operator sees what bounds the RSS)."""
    from prometheus_client.parser import text_string_to_metric_families

    _cached(_client(server, KEY_A), "What are ocelli? (metrics test)")
    _client(server, KEY_A).chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "What do drones do?"}],
        extra_body={"documents": ["Drones are male honeybees; they mate with a queen and do not forage. (metrics)"]})
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=10).text
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("cacheblend_prefix_store_bytes", "memory")] > 0
    assert samples[("cacheblend_prefix_store_entries", "memory")] >= 1
    assert samples[("cacheblend_kv_store_bytes", "memory")] > 0 and samples[("cacheblend_kv_store_entries", "memory")] >= 1
