"""One finish path (issue #37): how an answer ended is decided once, by its `decode.text.Answer`, and the server
reports what the engine decided — never a recount of tokens.

The real SmolLM2 model behind the app (in process, as test_tool_format.py serves it) on both decoders: every request
the server hands the engine is recorded, run again through `engine.generate_request`, and the server's
`finish_reason` (plain and streamed) must be the engine's — for an answer ended by EOS, by a stop string, by
max_tokens, by EOS or a stop string on exactly the max_tokens-th token (where counting tokens says "length"), and
for a grammar that completed (a json_schema answer, a forced tool call: "tool_calls" is the server's name for the
engine's "stop" of a complete call).
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

ASK = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


class Served:
    """The app over `engine`, recording the engine requests it runs."""

    def __init__(self, engine, http) -> None:
        self.engine, self.http, self.requests = engine, http, []
        for name in ("start_request", "stream_request"):  # the batched path and the one-at-a-time path
            run = getattr(engine, name)
            setattr(engine, name, self._recording(run))

    def _recording(self, run):
        def recorded(request, *args, **kwargs):
            self.requests.append(request)
            return run(request, *args, **kwargs)
        return recorded

    def ask(self, **body) -> tuple[dict, dict, object]:
        """(the server's choice, its streamed finish, the engine's Generation of the same request)."""
        body = {"model": "smol", "messages": ASK, **body}
        self.requests.clear()
        answer = self.http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        (request,) = self.requests
        with self.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
            finishes = [c["choices"][0]["finish_reason"] for c in _chunks(streamed) if c["choices"]
                        and c["choices"][0]["finish_reason"]]
        assert len(finishes) == 1, finishes
        return choice, finishes[0], self.engine.generate_request(request)


def _chunks(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


@pytest.fixture(scope="module", params=["kv", "hf"])
def served(request, default_model):
    from fastapi.testclient import TestClient

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.serve.app import ServeConfig, create_app

    model, tokenizer = default_model
    # no stored prefixes: the engine's second run of a request prefills exactly as the server's did
    engine = CacheBlendEngine(model, tokenizer, decoder=request.param, prefix_reuse=False)
    with TestClient(create_app(engine, ServeConfig(model_name="smol", max_batch=2))) as http:
        yield Served(engine, http)


def _same(served: Served, expected: str, **body):
    choice, streamed, out = served.ask(**body)
    assert out.finish_reason == expected, (body, out)
    assert choice["finish_reason"] == streamed == expected, (body, choice, streamed)
    assert choice["message"]["content"] == out.text  # the text came out of the same path too
    return out


def test_the_servers_finish_reason_is_the_engines_for_stop_and_length(served):
    tokenizer = served.engine.tokenizer
    natural = _same(served, "stop", max_tokens=64)
    ids = natural.token_ids
    assert ids[-1] == tokenizer.eos_token_id and len(ids) > 3, natural  # ended by EOS
    _same(served, "length", max_tokens=3)
    # EOS as the max_tokens-th token: the answer ended by itself ("stop"), though it used every token
    exact = _same(served, "stop", max_tokens=len(ids))
    assert exact.token_ids == ids
    # a stop string that first appears in the last text token, with max_tokens ending there: "stop" again
    last = tokenizer.decode(ids[-2:-1]).strip()
    assert last and last not in tokenizer.decode(ids[:-2]), (last, natural.text)
    cut = _same(served, "stop", max_tokens=len(ids) - 1, stop=[last])
    assert len(cut.token_ids) == len(ids) - 1 and last not in cut.text
    # and a stop string early in the answer
    word = natural.text.split()[1]
    early = _same(served, "stop", max_tokens=64, stop=[word])
    assert word not in early.text and len(early.token_ids) < len(ids)


@pytest.mark.parametrize("served", ["kv"], indirect=True)  # constrained decoding needs the kv decoder
def test_the_servers_finish_reason_is_the_engines_for_a_completed_grammar(served):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Alice is 30 years old. Extract her name and age."}]
    out = _same(served, "stop", messages=messages, max_tokens=64, response_format=schema)
    assert out.grammar_satisfied is True and json.loads(out.text)["age"] == 30
    cut = _same(served, "length", messages=messages, max_tokens=3, response_format=schema)
    assert cut.grammar_satisfied is False

    forced = {"type": "function", "function": {"name": "get_weather"}}
    choice, streamed, out = served.ask(max_tokens=64, tools=[WEATHER], tool_choice=forced,
                                       messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert out.finish_reason == "stop" and out.grammar_satisfied is True  # the engine: a complete call
    assert choice["finish_reason"] == streamed == "tool_calls"  # the server's name for it
    assert "Paris" in json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["city"]


def test_a_starting_server_warms_the_grammar_compiler_in_the_background(default_model):
    """The server's start-up begins the grammar compiler's one-time set-up while it is idle (#41), so its first
    tool call does not pay 0.5-1.9 s for it."""
    from fastapi.testclient import TestClient

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.serve.app import ServeConfig, create_app

    model, tokenizer = default_model
    engine = CacheBlendEngine(model, tokenizer, prefix_reuse=False)
    assert not engine.grammars.warm
    with TestClient(create_app(engine, ServeConfig(model_name="smol"))):
        warming = engine.grammars._warming
        assert warming is not None
        warming.join(timeout=60)
        assert engine.grammars.warm and engine.grammars.num_compiled == 0
