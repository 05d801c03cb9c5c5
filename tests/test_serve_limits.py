"""What a request may cost `cacheblend-rag serve`, against a real server subprocess and raw sockets: the key is
checked before the body is read, the body is capped, headers are due within a deadline, oversized prompts and bad
input are refused before they reach the engine's worker, a missing Chroma collection is a 404 that creates
nothing, and clients that left give their queue slots back.

The server serves a tiny random-weight Llama with a 16k context (saved with the real tokenizer): its decode steps
take milliseconds, so a request with a large max_tokens keeps the one engine slot busy while the queue is probed,
and is cancelled (its stream closed) when the test is done with it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from cacheblend_bench.faults import oversized_upload  # noqa: E402
from test_serve import ServerProcess, _home  # noqa: E402

MODEL = "tiny-llama-16k"
KEY = "limits-key-9d2e"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 2 * 1024**2
MAX_DOCUMENTS = 16
MAX_GRAMMAR_BYTES = 24 * 1024
CONTEXT = 16384
BUSY_TOKENS = CONTEXT - 512  # a request that keeps the engine busy until its stream is closed


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    from conftest import tiny_model

    folder = tmp_path_factory.mktemp("models") / MODEL
    tiny_model("llama", len(tokenizer), max_position_embeddings=CONTEXT).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return _home(tmp_path_factory.mktemp("serve-limits"))


@pytest.fixture(scope="module")
def server(home, tiny_folder):
    # one request decodes at a time and two may wait, so the queue can be filled and watched
    srv = ServerProcess(home, "--model", str(tiny_folder), "--api-key", KEY, "--max-batch", "1", "--max-queue", "2",
                        "--max-body-bytes", str(MAX_BODY), "--max-documents", str(MAX_DOCUMENTS),
                        "--max-grammar-bytes", str(MAX_GRAMMAR_BYTES), "--header-timeout", "2", "--timeout", "1800")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=600)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


def _post(server, body: dict | bytes, headers: dict[str, str] | None = None, timeout: float = 120) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH if headers is None else headers,
                      timeout=timeout, **kw)


def _chat_body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Name a bee."}], **extra}


class Busy:
    """A streamed request holding the one engine slot (`--max-batch 1`) until `release()` closes it."""

    def __init__(self, client) -> None:
        self.stream = client.chat.completions.create(
            model=MODEL, max_tokens=BUSY_TOKENS, stream=True, messages=[{"role": "user", "content": "Go on."}])
        next(iter(self.stream))  # the engine is on it now

    def release(self) -> None:
        self.stream.close()  # the client leaves: the server cancels it


# ---- 1: the key before the body; the body capped -------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_no_key_is_answered_401_before_the_body_is_read(server):
    rss_before = _rss_bytes(server.proc.pid)
    status, sent, raw = oversized_upload(server.port, {}, limit=256 * 1024**2)
    assert status == 401, (sent, raw[:300])
    assert sent < 64 * 1024**2  # answered while the client was still sending, not after 256 MiB
    assert b"invalid_api_key" in raw and b"connection: close" in raw.lower()
    assert _rss_bytes(server.proc.pid) - rss_before < 64 * 1024**2
    r = _post(server, b"{not json", headers={})  # malformed and unauthenticated: the key is what is wrong
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # needs no key


@pytest.mark.model
@pytest.mark.slow
def test_a_body_over_the_cap_is_413_and_never_held(server):
    rss_before = _rss_bytes(server.proc.pid)
    status, sent, raw = oversized_upload(server.port, AUTH, limit=256 * 1024**2)
    assert status == 413, (sent, raw[:300])
    assert sent < 64 * 1024**2
    assert _rss_bytes(server.proc.pid) - rss_before < 64 * 1024**2
    declared = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, content=b" " * (MAX_BODY + 1),
                          timeout=60)  # a Content-Length over the cap: refused from the header
    assert declared.status_code == 413 and _error(declared)["code"] == "request_too_large"
    r = _post(server, b"{not json")  # with the key, a malformed body is the client's 400 as before
    assert r.status_code == 400


# ---- idle and half-sent connections ----------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_half_sent_headers_are_closed_and_others_still_served(server, client):
    socks = []
    try:
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")  # never finished
            socks.append(sock)
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=60)  # sends nothing at all
        socks.append(idle)
        out = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].message.content is not None
        for sock in socks:  # --header-timeout 2: the server hangs up (the 60 s is only a bound against a hang)
            assert sock.recv(1024) == b""
    finally:
        for sock in socks:
            sock.close()


# ---- 2: oversized prompts refused before they queue -------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_too_many_or_too_long_documents_are_refused_without_queueing(server, client):
    busy = Busy(client)
    waiting: list = []
    threads = [threading.Thread(target=lambda: waiting.append(_post(server, _chat_body(), timeout=600)))
               for _ in range(2)]
    try:
        for t in threads:
            t.start()
        server.wait_for(lambda h: h["queue_depth"] == 2, "the queue full")
        # the queue is full: a request that reaches it gets 429; these are refused for their size first
        many = _post(server, _chat_body(documents=[f"passage {i} about bees" for i in range(MAX_DOCUMENTS + 1)]))
        assert many.status_code == 400 and _error(many)["code"] == "too_many_documents", many.text
        long_docs = ["honeybee " * 12_000] * MAX_DOCUMENTS  # 1.7M characters: more than 16k tokens can hold
        long = _post(server, _chat_body(documents=long_docs))
        assert long.status_code == 400 and _error(long)["code"] == "context_length_exceeded", long.text
        assert server.health()["running"] == 1  # all the while the engine was busy with another request
        full = _post(server, _chat_body())
        assert full.status_code == 429  # a request that fits does reach the (full) queue
    finally:
        busy.release()
        for t in threads:
            t.join(600)
    assert [r.status_code for r in waiting] == [200, 200]


# ---- 7: a client that left gives its queue slot back ------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_clients_gone_while_queued_free_their_slots(server, client):
    busy = Busy(client)
    body = json.dumps(_chat_body()).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        for _ in range(2):  # two non-streaming requests whose clients give up while they wait
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(request)
                server.wait_for(lambda h: h["queue_depth"] >= 1, "a request queued")
        server.wait_for(lambda h: h["queue_depth"] == 0 or h["running"] == 0, "the queue emptied")
        health = server.health()
        assert health["queue_depth"] == 0 and health["running"] == 1, health  # freed while the engine is busy
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(_post(server, _chat_body(), timeout=600)))
        thread.start()
        server.wait_for(lambda h: h["queue_depth"] == 1 or bool(accepted), "the next request queued")
        assert not accepted or accepted[0].status_code != 429
    finally:
        busy.release()
    thread.join(600)
    assert accepted and accepted[0].status_code == 200


# ---- 5: input the tokenizer or the sampler cannot take is a 400 -------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_unencodable_text_and_a_huge_seed_are_400(server, home):
    lone_surrogate = "Bees \\ud800 dance."  # a JSON escape Python decodes to a lone surrogate
    bodies = [
        f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", "content": "Why?"}}], '
        f'"documents": ["{lone_surrogate}"]}}',
        f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "system", "content": "{lone_surrogate}"}}, '
        f'{{"role": "user", "content": "Why?"}}], "documents": ["Bees dance to point at flowers."]}}',
        json.dumps(_chat_body(seed=2**70, temperature=0.7)),
    ]
    for raw in bodies:
        r = _post(server, raw.encode(), headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert _error(r)["type"] == "invalid_request_error"
    assert "Traceback" not in server.log.read_text()


# ---- 3, 4: retrieval never creates a collection; a bad name is a 400 without paths --------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_retrieval_from_a_missing_collection_is_404_and_creates_nothing(server, home):
    r = _post(server, _chat_body(retrieval={"collection": "never_ingested", "k": 2}))
    assert r.status_code == 404 and _error(r)["code"] == "collection_not_found", r.text
    assert "never_ingested" in _error(r)["message"] and str(home) not in r.text
    assert not (home / "chroma").exists()  # a read wrote nothing: no database, no collection


@pytest.mark.model
@pytest.mark.slow
def test_a_bad_collection_name_is_400_without_server_paths(server, home):
    for name in ("../../../x", "a/b/c", "..", "x" * 600, "127.0.0.1"):
        r = _post(server, _chat_body(retrieval={"collection": name}))
        assert r.status_code == 400, (name, r.text)
        assert str(home) not in r.text and "/chroma" not in r.text
    assert not (home / "chroma").exists()


# ---- 12-15 of issue 38: what the tool and schema paths cannot take is a 400, never a 500 -----------------------


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _tools(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "lookup", "parameters": parameters}}]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _history(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "Look it up."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "found"},
            {"role": "user", "content": "And then?"}]


@pytest.mark.model
@pytest.mark.slow
def test_tool_and_schema_input_the_server_cannot_take_is_400(server):
    big = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2**70}}}
    bad = [  # before: 500 (AttributeError, ValueError from the grammar engine, RecursionError, RecursionError)
        ({"tools": _tools({"type": "object"}), "tool_choice": {"type": "function", "function": "lookup"}},
         'tool_choice\'s "function" must be an object'),
        ({"tools": _tools(big)}, "signed 64-bit range"),
        ({"response_format": _schema_format({"type": "integer", "maximum": 2**65})}, "signed 64-bit range"),
        ({"tools": _tools(_nested_schema(300))}, "more than 64 levels"),
        ({"response_format": _schema_format(_nested_schema(300))}, "more than 64 levels"),
        ({"tools": _tools({"type": "object"}), "messages": _history("[" * 5_000 + "]" * 5_000)}, "more than 64 levels"),
    ]
    for extra, says in bad:
        r = _post(server, _chat_body(**extra))
        assert r.status_code == 400, (says, r.text)
        error = _error(r)
        assert error["type"] == "invalid_request_error" and says in error["message"], error
    fine = [{"response_format": _schema_format(_nested_schema(20))},  # nested, but within the bound
            {"tools": _tools({"type": "object"}), "messages": _history(json.dumps({"a": [[[1]]]}))}]
    for extra in fine:
        r = _post(server, _chat_body(**extra))
        assert r.status_code == 200, r.text
    assert "Traceback" not in server.log.read_text()


# ---- 1 of issue 38 (open part): a grammar is counted before it compiles, compiled once, within limits ------------


def _compilations(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "cacheblend_grammar_compilations_total")


def _wide_schema(num_properties: int, name: str = "property") -> dict:
    return {"type": "object", "properties": {f"{name}_{i}": {"type": "string"} for i in range(num_properties)}}


@pytest.mark.model
@pytest.mark.slow
def test_a_schema_too_long_for_the_context_is_refused_before_it_compiles_or_queues(server, client):
    busy = Busy(client)
    waiting: list = []
    threads = [threading.Thread(target=lambda: waiting.append(_post(server, _chat_body(), timeout=600)))
               for _ in range(2)]
    try:
        for t in threads:
            t.start()
        server.wait_for(lambda h: h["queue_depth"] == 2, "the queue full")
        compiled = _compilations(server)
        # 20 KB of schema (under --max-grammar-bytes), ~7k tokens of instructions, beside a question of ~12k tokens
        # that fits the 16k context alone: together they do not. Before: compiled (twice) while the queue was full,
        # then answered 429 (or, queued, refused by the worker)
        question = [{"role": "user", "content": "bee " * 12_000}]
        bomb = _post(server, _chat_body(messages=question, response_format=_schema_format(_wide_schema(550))))
        assert bomb.status_code == 400 and _error(bomb)["code"] == "context_length_exceeded", bomb.text
        assert _compilations(server) == compiled  # refused from its token count: nothing compiled
        assert server.health()["running"] == 1
    finally:
        busy.release()
        for t in threads:
            t.join(600)
    assert [r.status_code for r in waiting] == [200, 200]


@pytest.mark.model
@pytest.mark.slow
def test_a_grammar_compiles_once_and_one_over_the_size_limit_is_400(server):
    schema = _schema_format(_wide_schema(3, name="compiled_once"))
    compiled = _compilations(server)
    first = _post(server, _chat_body(response_format=schema, max_tokens=8))
    assert first.status_code == 200, first.text
    assert _compilations(server) == compiled + 1  # before: admission, its check, and the worker (3)
    again = _post(server, _chat_body(response_format=schema, max_tokens=8))
    assert again.status_code == 200 and _compilations(server) == compiled + 1  # the same schema: kept compiled
    large = _post(server, _chat_body(response_format=_schema_format(_wide_schema(800))))  # 29 KB, ~10k tokens
    assert large.status_code == 400 and _error(large)["code"] == "grammar_too_large", large.text
    assert _compilations(server) == compiled + 1


# ---- 1 of issue 38 (what remained): a schema bomb's body parsed off the event loop, refused before it is validated -

# `cacheblend-rag serve` whose parsing of a body over INLINE_BODY_BYTES waits until the file `release` exists
# (having created `held`): while it waits, what else the server answers shows where that parsing runs
HOLDING_LAUNCHER = """
import pathlib, runpy, sys, time
from cacheblend_rag.serve import app
held, release = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
parse_json = app.parse_json

def holding(raw, content_type):
    if len(raw) > app.INLINE_BODY_BYTES:
        held.touch()
        deadline = time.monotonic() + 300
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return parse_json(raw, content_type)

app.parse_json = holding
sys.argv = ["cacheblend-rag", *sys.argv[3:]]
runpy.run_module("cacheblend_rag.cli", run_name="__main__")
"""


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


@pytest.mark.model
@pytest.mark.slow
def test_a_schema_bomb_is_parsed_off_the_event_loop_while_small_requests_are_served(home, tiny_folder, tmp_path):
    # before: FastAPI parsed and validated every body on the event loop, and a bomb's ~10k dicts set off full
    # collections of Python's GC over the model's ~420k objects (~250 ms each, GIL held): `bench faults
    # --fault-scenarios schema_bomb` measured an unrelated 4-token request at 3.8× (up to 5.7×) its baseline
    launcher = tmp_path / "serve_holding.py"
    launcher.write_text(HOLDING_LAUNCHER)
    held, release = tmp_path / "held", tmp_path / "release"
    srv = ServerProcess(home, "--model", str(tiny_folder), "--max-grammar-bytes", str(MAX_GRAMMAR_BYTES),
                        "--grammar-timeout", "0.001", launch=(str(launcher), str(held), str(release)))
    try:
        assert _metric(srv.url, "cacheblend_gc_frozen_objects") > 10_000  # the model's objects, out of the GC
        bomb = json.dumps(_chat_body(response_format=_schema_format(_wide_schema(10_000)))).encode()  # ~370 KB
        answers: list = []
        sender = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{srv.url}/v1/chat/completions", content=bomb, headers={"Content-Type": "application/json"},
            timeout=300)))
        sender.start()
        deadline = time.monotonic() + 120  # a bound against hangs, not a timing assertion
        while not held.exists():
            assert sender.is_alive() and time.monotonic() < deadline, answers
            time.sleep(0.05)
        # the bomb's parsing is held on its parse thread: the event loop answers, and a small request (parsed on
        # the loop, admitted on the default pool) is served from start to finish meanwhile
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        small = httpx.post(f"{srv.url}/v1/chat/completions", json=_chat_body(), timeout=120)
        assert small.status_code == 200, small.text
        assert sender.is_alive() and not answers
        release.touch()
        sender.join(120)
        assert answers and answers[0].status_code == 400, answers
        error = _error(answers[0])
        # refused from the parsed JSON's size, before the body was validated or the grammar built
        assert error["code"] == "grammar_too_large" and "has at least" in error["message"], error
        # a grammar under the size limit that does not compile within --grammar-timeout (1 ms here): a 400 (before:
        # a NameError while logging it, a 500)
        slow = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120,
                          json=_chat_body(response_format=_schema_format(_wide_schema(300, "slow"))))
        assert slow.status_code == 400 and _error(slow)["code"] == "grammar_too_complex", slow.text
    finally:
        release.touch()
        assert srv.stop() == 0, srv.log.read_text()


def _planned_grammar_bytes(body: dict) -> int:
    from cacheblend_rag.serve.schemas import ChatCompletionRequest
    from cacheblend_rag.serve.tooling import plan_chat

    grammar = plan_chat(ChatCompletionRequest.model_validate(body)).grammar
    return len(grammar.source.encode()) if grammar is not None else 0


def test_the_grammar_floor_never_exceeds_the_grammar_the_request_builds():
    from cacheblend_rag.serve.limits import grammar_floor

    wide = _wide_schema(40)
    two = [*_tools(wide), {"type": "function", "function": {"name": "other", "parameters": _wide_schema(30, "x")}}]
    bodies = [_chat_body(response_format=_schema_format(wide)),
              _chat_body(response_format=_schema_format(_nested_schema(20))),
              _chat_body(tools=two), _chat_body(tools=two, tool_choice="required"),
              _chat_body(tools=two, tool_choice="auto", response_format=_schema_format(_wide_schema(9, "y"))),
              _chat_body(tools=two, tool_choice="none", response_format=_schema_format(_wide_schema(9, "y"))),
              _chat_body(tools=two, tool_choice={"type": "function", "function": {"name": "other"}}),
              _chat_body(tools=two, tool_choice="none"), _chat_body(response_format={"type": "json_object"}),
              _chat_body(tools=[{"type": "function", "function": {"name": "bare"}}])]
    floors = []
    for body in bodies:
        floor = grammar_floor(json.loads(json.dumps(body)))
        floors.append(floor)
        assert floor is None or floor[1] <= _planned_grammar_bytes(body), (body, floor)
    assert floors[0] == ("json_schema", len(json.dumps(wide)))  # a schema bomb's floor is its schema's text
    assert floors[2][0] == "lark" and floors[2][1] > len(json.dumps(wide))  # every tool's parameters under "auto"
    assert floors[6] is None and floors[8] is None  # a named tool: the built grammar decides; no schema: none


def test_a_body_is_read_with_errors_that_say_what_is_wrong():
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from cacheblend_rag.serve.calls import read_body, validation_message
    from cacheblend_rag.serve.schemas import ChatCompletionRequest

    def message(raw: bytes, content_type: str | None = "application/json") -> str:
        with pytest.raises(RequestValidationError) as e:
            read_body(raw, content_type, ChatCompletionRequest)
        return validation_message(e.value)

    # the errors FastAPI gave, each saying what is wrong with the body (#53: "1: JSON decode error" did not)
    assert message(b"{not json") == \
        "invalid request: the body is not valid JSON (Expecting property name enclosed in double quotes at character 1)"
    assert message(b"") == message(b"null") == "invalid request: the body is empty (or null): send a JSON object"
    assert message(b"{not json", None) == \
        "invalid request: the body: Input should be a valid dictionary or object to extract fields from"
    assert message(b'{"model": "m"}', "text/plain") == message(b"[1, 2]")
    assert message(b'{"model": "m"}') == "invalid request: messages: Field required"
    with pytest.raises(HTTPException) as e:
        read_body(b"[" * 100_000 + b"]" * 100_000, "application/json", ChatCompletionRequest)
    assert e.value.status_code == 400 and e.value.detail == \
        "the body's JSON nests arrays or objects too deeply to parse"
    with pytest.raises(HTTPException) as e:
        read_body(b'{"model": "\xff"}', "application/json", ChatCompletionRequest)
    assert e.value.status_code == 400 and e.value.detail.startswith(
        "the body is not valid UTF-8 (byte 0xff at offset 11)")
    body = read_body(json.dumps(_chat_body()).encode(), "application/vnd.api+json; charset=utf-8",
                     ChatCompletionRequest)
    assert body.model == MODEL and body.messages[0].text() == "Name a bee."


# ---- 3 of issue 38: a grammar that fails is an error, never an empty "stop" ---------------------------------------

BLOWN_PATTERN = {"type": "string", "pattern": "^(a{1000}){1000}$"}  # compiles; its lexer gives up at the first token


@pytest.mark.model
@pytest.mark.slow
def test_a_grammar_failing_at_admission_or_at_its_first_token_is_400(server):
    # before: 200 with content "" and finish_reason "stop", nothing logged
    ref = _post(server, _chat_body(response_format=_schema_format({"$ref": "#"})))
    assert ref.status_code == 400, ref.text
    assert "does not compile" in _error(ref)["message"]
    blown = {"type": "object", "properties": {"a": BLOWN_PATTERN}, "required": ["a"]}
    first = _post(server, _chat_body(response_format=_schema_format(blown), max_tokens=32))
    assert first.status_code == 400, first.text
    assert "failed while decoding" in _error(first)["message"]
    streamed = _post(server, _chat_body(response_format=_schema_format(blown), max_tokens=32, stream=True))
    assert streamed.status_code == 400 and "failed while decoding" in _error(streamed)["message"], streamed.text
    assert "grammar failed while decoding" in server.log.read_text()


# ---- 10 of issue 38: a stop string inside a constrained answer does not cut it ------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_a_stop_string_inside_a_json_schema_answer_is_ignored(client):
    schema = {"type": "object", "properties": {"word": {"enum": ["bee, wasp"]}}, "required": ["word"]}
    format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for stop in ([","], ['"}']):  # before: '{"word": "bee' with finish_reason "stop"
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A word?"}],
                                             max_tokens=24, stop=stop, response_format=format)
        assert json.loads(out.choices[0].message.content) == {"word": "bee, wasp"}, (stop, out)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A word?"}],
                                                max_tokens=24, stop=stop, response_format=format, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert json.loads(text) == {"word": "bee, wasp"}, (stop, text)


# ---- 2 of issue 38 (part): a shared server can keep its cache facts out of `usage` --------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_hide_cache_usage_leaves_the_cache_facts_out_of_usage(home, tiny_folder):
    srv = ServerProcess(home, "--model", str(tiny_folder), "--api-key", KEY, "--hide-cache-usage")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        ask = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Name a bee. " * 20}])
        for _ in range(2):  # the second would report the first one's stored prefix as cached tokens
            usage = client.chat.completions.create(**ask).usage.model_dump(exclude_none=True)
            assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}, usage  # before: +cacheblend
        streamed = [c.usage for c in client.chat.completions.create(**ask, stream=True,
                                                                    stream_options={"include_usage": True})]
        assert set(streamed[-1].model_dump(exclude_none=True)) == {"prompt_tokens", "completion_tokens",
                                                                   "total_tokens"}
    finally:
        assert srv.stop() == 0, srv.log.read_text()
