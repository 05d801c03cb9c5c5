"""`cacheblend-rag serve` end to end: a real server in a subprocess on a free loopback port, real clients.

One server (module-scoped, so the model loads once) answers the openai SDK (sync, async, streaming, extra_body),
LangChain's ChatOpenAI and LlamaIndex's OpenAILike, and the error, auth, queue and disconnect cases; a second
one is stopped with SIGTERM while a request is in flight. The scheduler's queue is also checked on its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from cacheblend_rag import settings  # noqa: E402
from cacheblend_rag.models.loader import model_folder  # noqa: E402
from cacheblend_rag.fuse.policies import DEFAULT_METHOD  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
KEY = "test-key-5f1c"
DOCS = [
    "Honeybees have five eyes: two large compound eyes and three small simple eyes called ocelli on top of the head.",
    "A honeybee colony has one queen, a few hundred drones and tens of thousands of female worker bees.",
]
QUESTION = "How many eyes does a honeybee have?"
COLLECTION = "serve_test_bees"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               ANONYMIZED_TELEMETRY="False")
    env.pop(settings.ENV_HOME, None)  # --home must be enough
    env.pop(settings.ENV_API_KEY, None)
    env.pop(settings.ENV_METRICS_KEY, None)
    return env


def _home(tmp: Path) -> Path:
    home = tmp / "home"
    home.mkdir()
    model_folder(MODEL)  # converted once into the default home; the test home links to it
    (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
    return home


class ServerProcess:
    """`cacheblend-rag serve` in a subprocess; ready once /health answers."""

    def __init__(self, home: Path, *args: str, env: dict[str, str] | None = None,
                 launch: tuple[str, ...] = ("-m", "cacheblend_rag.cli")) -> None:
        """`launch`: what Python runs, given the CLI's arguments (a test's own script that wraps the CLI)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / f"serve-{self.port}.log"
        cmd = [sys.executable, *launch, "serve", "--port", str(self.port), "--home", str(home),
               "--model", MODEL, "--dtype", "float32", "--device", "cpu", *args]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or _env(), cwd=REPO)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy:\n{self.log.read_text()}")
            time.sleep(0.5)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_for(self, predicate, what: str, limit_s: float = 300) -> None:
        """Poll /health until `predicate(health)` holds (a bound against hangs, not a timing assertion)."""
        deadline = time.monotonic() + limit_s
        while not predicate(self.health()):
            if time.monotonic() > deadline:
                raise AssertionError(f"server never reached: {what}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = _home(tmp_path_factory.mktemp("serve"))
    ingest = subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", "ingest", str(REPO / "examples" / "data"),
                             "--home", str(home), "--collection", COLLECTION, "--quiet", "--dtype", "float32",
                             "--device", "cpu"], capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert ingest.returncode == 0, ingest.stderr
    # one request decodes at a time (--max-batch 1), so the queue tests can fill the queue with two requests;
    # continuous batching has its own server in test_serve_batching.py
    srv = ServerProcess(home, "--api-key", KEY, "--max-queue", "1", "--max-batch", "1", "--timeout", "300")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _chat(client, **kw):
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], **kw)


# ---- the openai SDK ---------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{server.url}/health", timeout=10)  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.model
@pytest.mark.slow
def test_documents_are_cached_and_reported_as_cached_tokens(client):
    docs = [f"{d} (cached-tokens test)" for d in DOCS]  # texts no other test sends: the first request misses
    first = _chat(client, extra_body={"documents": [docs[0], {"id": "colony", "text": docs[1]}]})
    assert first.choices[0].message.content
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    stats = first.usage.model_extra["cacheblend"]
    assert stats["method"] == DEFAULT_METHOD and stats["chunk_misses"] == 2 and stats["chunk_hits"] == 0

    second = _chat(client, extra_body={"documents": docs})  # same texts: both chunks' KV now comes from the store
    stats = second.usage.model_extra["cacheblend"]
    assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == stats["reused_tokens"] + stats["exact_cached_tokens"]
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    # no ratio named: the model's own (the fidelity gate's decision shipped for SmolLM2), and the usage says so
    from cacheblend_rag import gate

    decision = gate.find("", MODEL, dtype="float32")
    assert stats["fidelity"] == decision.stats() and stats["recompute_ratio"] == decision.ratio
    named = _chat(client, extra_body={"documents": docs, "cacheblend": {"recompute_ratio": 0.15}})
    assert named.usage.model_extra["cacheblend"]["recompute_ratio"] == 0.15
    assert "fidelity" not in named.usage.model_extra["cacheblend"]


def _documents_prompt(tokenizer, docs: list[str], messages: list[dict]) -> list[int]:
    """The documents path's prompt for a chat, assembled here as the engine does (the chunks in the first user
    turn, the turns after it as the chat template writes them)."""
    from cacheblend_rag.fuse.layout import PromptTemplate
    from cacheblend_rag.ingest.chunks import make_chunk

    prefix, sep, suffix = PromptTemplate().render(tokenizer, messages[-1]["content"], messages[:-1])
    ids = list(prefix)
    for i, doc in enumerate(docs):
        ids += (sep if i else []) + make_chunk(doc, tokenizer).token_ids.tolist()
    return ids + suffix


@pytest.mark.model
@pytest.mark.slow
def test_documents_keep_the_conversation_and_its_prefix(client, tokenizer):
    """Issue 27 item 5: with `documents`, a 3-turn chat stayed at one turn's prompt (earlier turns dropped)."""
    docs = [f"{d} (conversation test)" for d in DOCS]
    messages = [{"role": "user", "content": QUESTION}]
    turns = []
    for follow in ("What are the three small ones called?", "Answer in one word."):  # "ones": the eyes of turn 1
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                             extra_body={"documents": docs})
        turns.append((out, _documents_prompt(tokenizer, docs, messages)))
        messages = messages + [{"role": "assistant", "content": out.choices[0].message.content},
                               {"role": "user", "content": follow}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_body={"documents": docs})
    turns.append((out, _documents_prompt(tokenizer, docs, messages)))
    for (out, prompt), (_, before) in zip(turns[1:], turns):
        # the prompt the server ran is the whole chat: its token count is this rendering's, which holds the
        # previous turn's prompt, its answer and the follow-up (whose "ones" needs turn 1 to be understood)
        assert out.usage.prompt_tokens == len(prompt) and prompt[:len(before)] == before
        text = tokenizer.decode(prompt)
        assert QUESTION in text and messages[1]["content"] in text and messages[2]["content"] in text
    (first, _), (second, _), (third, _) = turns
    assert first.usage.prompt_tokens < second.usage.prompt_tokens < third.usage.prompt_tokens
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    # each turn starts from the previous turn's stored KV (prompt and answer, kept in whole blocks of PREFIX_BLOCK
    # rows; the last generated token has no KV yet): all of those rows are cached tokens
    from cacheblend_rag.fuse.chunk_cache import PREFIX_BLOCK

    for (out, _), (before, _) in zip(turns[1:], turns):
        kept = before.usage.prompt_tokens + before.usage.completion_tokens - 1
        assert out.usage.prompt_tokens_details.cached_tokens >= kept // PREFIX_BLOCK * PREFIX_BLOCK
        assert out.usage.prompt_tokens_details.cached_tokens >= before.usage.prompt_tokens - PREFIX_BLOCK
        assert out.usage.model_extra["cacheblend"]["chunk_misses"] == 0


@pytest.mark.model
@pytest.mark.slow
def test_stream_matches_the_answer_and_ends_with_usage(client):
    body = {"documents": DOCS, "cacheblend": {"method": "cacheblend", "recompute_ratio": 0.15}}
    _chat(client, extra_body=body)  # the chunks are stored from here on, so both calls below fuse the same KV
    whole = _chat(client, extra_body=body)
    chunks = list(_chat(client, extra_body=body, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.rstrip() == whole.choices[0].message.content  # a JSON answer is stripped, like engine.generate's
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens_details.cached_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.model
@pytest.mark.slow
def test_async_client_chat_stream_and_completions(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300) as c:
            chat = await c.chat.completions.create(model=MODEL, max_tokens=6, extra_body={"documents": DOCS},
                                                   messages=[{"role": "system", "content": "Answer briefly."},
                                                             {"role": "user", "content": QUESTION}])
            stream = await c.chat.completions.create(model=MODEL, max_tokens=6, stream=True,
                                                     messages=[{"role": "user", "content": "Name a color."}])
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
            completion = await c.completions.create(model=MODEL, prompt=QUESTION, max_tokens=6,
                                                    extra_body={"documents": DOCS})
            return chat, "".join(pieces), completion

    chat, streamed, completion = asyncio.run(run())
    assert chat.choices[0].message.content and chat.object == "chat.completion"
    assert streamed  # no documents at all still answers
    assert completion.object == "text_completion" and completion.choices[0].text
    assert completion.usage.model_extra["cacheblend"]["chunk_hits"] == 2


@pytest.mark.model
@pytest.mark.slow
def test_retrieval_from_the_servers_collection(client):
    out = _chat(client, extra_body={"retrieval": {"collection": COLLECTION, "k": 2}})
    stats = out.usage.model_extra["cacheblend"]
    assert stats["num_retrieved"] == 2
    assert stats["chunk_hits"] == 2  # `cacheblend-rag ingest` precomputed their KV
    assert out.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.model
@pytest.mark.slow
def test_a_clients_own_rag_prompt_reuses_the_ingested_chunks(client):
    """No extension field: the client pastes retrieved passages into its own prompt, as RAG apps do."""
    passages = [(REPO / "examples" / "data" / name).read_text() for name in ("07_senses.txt", "05_wax.txt")]
    context = "\n\n".join(f"Source {i + 1}:\n{p}" for i, p in enumerate(passages))
    out = client.chat.completions.create(
        model=MODEL, max_tokens=6,
        messages=[{"role": "system", "content": "You are terse. Use the sources."},
                  {"role": "user", "content": f"{context}\n\nQuestion: {QUESTION}"}])
    stats = out.usage.model_extra["cacheblend"]
    assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0
    assert out.usage.prompt_tokens_details.cached_tokens > 0


# ---- LangChain and LlamaIndex -----------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_langchain_chat_openai(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, max_tokens=6,
                                      temperature=0, max_retries=0, extra_body={"documents": DOCS})
    msg = llm.invoke([("system", "Answer in a few words."), ("human", QUESTION)])
    assert msg.content and msg.usage_metadata["input_tokens"] > 0
    assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
    pieces = [chunk.content for chunk in llm.stream(QUESTION)]
    assert "".join(pieces)


@pytest.mark.model
@pytest.mark.slow
def test_llama_index_openai_like(server):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    llm = openai_like.OpenAILike(model=MODEL, api_base=f"{server.url}/v1", api_key=KEY, is_chat_model=True,
                                 max_tokens=6, temperature=0, max_retries=0, context_window=8192,
                                 additional_kwargs={"extra_body": {"documents": DOCS}})
    response = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert response.message.content
    assert response.raw.usage.prompt_tokens_details.cached_tokens > 0
    assert "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))


# ---- errors -----------------------------------------------------------------------------------


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


@pytest.mark.model
@pytest.mark.slow
def test_api_key_is_required_except_for_health(server):
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions")]:
        r = httpx.request(method, f"{server.url}{path}", json={}, timeout=10)
        assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        _chat(wrong)


@pytest.mark.model
@pytest.mark.slow
def test_bad_requests_get_openai_shaped_errors_and_the_server_lives_on(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.code == "model_not_found"
    for body in ({"cacheblend": {"recompute_ratio": 2}}, {"cacheblend": {"bogus_option": 1}},
                 {"cacheblend": {"method": "full_prefill", "check_layers": [1]}}, {"cacheblend": {"method": "nope"}},
                 {"chunk_ids": ["not a chunk id"]}, {"documents": [""]}, {"n": 2},
                 {"chunk_ids": ["0123456789abcdef0123456789abcdef"]},  # well formed, unknown: the engine refuses it
                 {"documents": ["honeybee " * 9000]}):  # longer than the context window
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, extra_body=body)
        assert e.value.status_code == 400, body
    assert e.value.code == "context_length_exceeded"
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers=headers, timeout=10)
    assert r.status_code == 400 and _error(r)["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=headers,
                   timeout=10)
    assert r.status_code == 400
    assert _chat(client, max_tokens=2).choices[0].message.content is not None  # still serving


@pytest.mark.model
@pytest.mark.slow
def test_full_queue_answers_429_with_retry_after(server, client):
    # --max-queue 1: one request runs, one waits, the next is refused at once.
    running = _chat(client, stream=True, max_tokens=16, extra_body={"documents": DOCS})
    next(iter(running))  # the first request is on the engine now
    waiting: list = []
    thread = threading.Thread(target=lambda: waiting.append(_chat(client, max_tokens=4)))
    thread.start()
    server.wait_for(lambda h: h["queue_depth"] == 1, "one request queued")
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert _error(r)["type"] == "rate_limit_error"
    assert any(c.choices and c.choices[0].finish_reason for c in running)  # the running one completes
    thread.join(300)
    assert waiting and waiting[0].choices[0].message.content is not None


@pytest.mark.model
@pytest.mark.slow
def test_client_disconnect_mid_stream_does_not_break_the_next_request(server, client):
    stream = _chat(client, stream=True, max_tokens=16, extra_body={"documents": DOCS})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()  # the client goes away mid-answer
    server.wait_for(lambda h: h["running"] == 0 and h["queue_depth"] == 0, "the engine idle again")
    out = _chat(client, max_tokens=4, extra_body={"documents": DOCS})
    assert out.choices[0].message.content and out.usage.model_extra["cacheblend"]["chunk_hits"] == 2


def _metric(server, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.model
@pytest.mark.slow
def test_a_client_gone_while_queued_is_cancelled(server, client):
    gone_before = _metric(server, "cacheblend_requests_total", status="499")
    running = _chat(client, stream=True, max_tokens=64, extra_body={"documents": DOCS})
    next(iter(running))  # on the engine
    body = json.dumps({"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": QUESTION}]}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # a non-streaming request, then hang up
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        server.wait_for(lambda h: h["queue_depth"] == 1, "the second request queued")
    deadline = time.monotonic() + 300
    while _metric(server, "cacheblend_requests_total", status="499") == gone_before:
        assert time.monotonic() < deadline, "the abandoned request was never cancelled"
        time.sleep(0.1)
    assert any(c.choices and c.choices[0].finish_reason for c in running)
    server.wait_for(lambda h: h["running"] == 0 and h["queue_depth"] == 0, "the engine idle again")
    assert _chat(client, max_tokens=2).choices[0].message.content is not None


@pytest.mark.model
@pytest.mark.slow
def test_metrics_count_requests_tokens_and_kv_hits(server, client):
    _chat(client, max_tokens=4, extra_body={"documents": DOCS})
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    ok = ("cacheblend_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))
    assert samples[ok] >= 1
    assert samples[("cacheblend_prompt_tokens_total", ())] > 0
    assert samples[("cacheblend_completion_tokens_total", ())] > 0
    assert samples[("cacheblend_cached_prompt_tokens_total", ())] > 0
    assert samples[("cacheblend_kv_chunk_hits_total", ())] + samples[("cacheblend_kv_chunk_misses_total", ())] >= 2
    assert samples[("cacheblend_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("cacheblend_time_per_output_token_seconds_count", ())] >= 1
    assert ("cacheblend_queue_depth", ()) in samples and ("cacheblend_batch_size", ()) in samples


# ---- shutdown ---------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_sigterm_finishes_the_request_in_flight_then_exits_0(tmp_path):
    env = dict(_env(), **{settings.ENV_API_KEY: "env-key"})  # the key from the environment
    srv = ServerProcess(_home(tmp_path), env=env)
    try:
        assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 401
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="env-key", max_retries=0, timeout=300)
        stream = _chat(c, stream=True, max_tokens=12, stream_options={"include_usage": True})
        chunks = [next(iter(stream))]  # in flight
        srv.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        assert srv.proc.wait(120) == 0, srv.log.read_text()
    finally:
        srv.stop()


# ---- the scheduler alone ------------------------------------------------------------------------


def test_scheduler_bounds_its_queue_and_skips_cancelled_jobs():
    from cacheblend_rag.serve.scheduler import Done, Failed, Job, QueueFull, Scheduler

    release = threading.Event()
    ran: list[int] = []

    def run(job: Job) -> None:
        release.wait(30)
        ran.append(job.call)
        job.emit(Done({}, "stop"))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sched = Scheduler(run, max_queue=1)
        sched.start()
        jobs = [Job(i, loop, deadline=time.monotonic() + 60) for i in range(3)]
        sched.submit(jobs[0])
        while sched.batch_size() == 0:  # the worker took job 0; the queue is empty again
            await asyncio.sleep(0.01)
        sched.submit(jobs[1])
        with pytest.raises(QueueFull):
            sched.submit(jobs[2])
        assert sched.depth() == 1
        jobs[1].cancel()
        release.set()
        assert isinstance(await jobs[0].next_event(1.0), Done)
        assert isinstance(await jobs[1].next_event(1.0), Failed)
        await asyncio.to_thread(sched.stop, 30)
        assert ran == [0]

    asyncio.run(main())


def test_a_cancelled_queued_job_frees_its_slot_at_once():
    """A client that left while its request waited gives the slot back now, not when the worker reaches it."""
    from cacheblend_rag.serve.scheduler import Cancelled, Done, Failed, Job, QueueFull, Scheduler

    release = threading.Event()

    def run(job: Job) -> None:
        release.wait(30)
        job.emit(Done({}, "stop"))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sched = Scheduler(run, max_queue=2)
        sched.start()
        jobs = [Job(i, loop, deadline=time.monotonic() + 60) for i in range(5)]
        sched.submit(jobs[0])
        while sched.batch_size() == 0:  # job 0 holds the worker until released
            await asyncio.sleep(0.01)
        sched.submit(jobs[1])
        sched.submit(jobs[2])
        with pytest.raises(QueueFull):
            sched.submit(jobs[3])
        jobs[1].cancel()
        jobs[2].cancel()
        assert sched.depth() == 0 and sched.batch_size() == 1  # freed while the worker is still busy
        sched.submit(jobs[3])  # room again
        for gone in jobs[1:3]:
            event = await gone.next_event(1.0)
            assert isinstance(event, Failed) and isinstance(event.error, Cancelled)
        release.set()
        assert isinstance(await jobs[0].next_event(1.0), Done)
        assert isinstance(await jobs[3].next_event(1.0), Done)
        await asyncio.to_thread(sched.stop, 30)

    asyncio.run(main())


def test_run_job_streams_then_finishes_and_stops_a_cancelled_or_late_job(tokenizer):
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.request import Request
    from cacheblend_rag.serve.runner import EngineCall, Retriever, run_job
    from cacheblend_rag.serve.scheduler import Cancelled, Done, Failed, Job, Piece, RequestTimeout

    from conftest import tiny_model

    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, None)
    call = EngineCall(Request.of(("A short passage about bees and their five eyes.",), "What is in the passage?",
                                 max_new_tokens=6))

    async def run(deadline_s: float, cancel: bool = False) -> list:
        job = Job(call, asyncio.get_running_loop(), deadline=time.monotonic() + deadline_s)
        if cancel:
            job.cancel()
        await asyncio.to_thread(run_job, engine, Retriever(None), job)
        await asyncio.sleep(0)
        return [job.events.get_nowait() for _ in range(job.events.qsize())]

    async def main() -> tuple[list, list, list]:
        return await run(120), await run(120, cancel=True), await run(-1)

    finished, cancelled, late = asyncio.run(main())
    assert isinstance(finished[-1], Done) and all(isinstance(e, Piece) for e in finished[:-1])
    assert finished[:-1], "a random model still writes something"
    done = finished[-1]
    assert done.stats["num_generated"] <= 6 and done.stats["chunk_misses"]
    assert done.finish_reason == ("length" if done.stats["num_generated"] == 6 else "stop")
    # stopped at the first piece: nothing is relayed, the stream is closed
    assert len(cancelled) == 1 and isinstance(cancelled[0], Failed) and isinstance(cancelled[0].error, Cancelled)
    assert len(late) == 1 and isinstance(late[0], Failed) and isinstance(late[0].error, RequestTimeout)
