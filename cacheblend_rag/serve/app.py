"""The OpenAI-compatible HTTP app: routes, errors, auth and streaming over one engine.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (JSON or SSE), `GET /v1/models`, `GET /health`,
`GET /metrics`. Every error is `{"error": {"message", "type", "code"}}` with its HTTP status. Engine work runs on
the scheduler's worker thread; handlers only queue a job and relay its events, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import tools as generic_tools
from ..decode.generate import SamplingOptions
from ..decode.grammar import Grammar
from ..errors import (
    CacheBlendError,
    ChunkError,
    CollectionNotFoundError,
    ConfigError,
    MissingDependencyError,
    PromptTooLongError,
    VectorStoreError,
)
from ..tool_format import GENERIC, ToolFormat
from .limits import RequestGuard, check_fits, grammar_floor, json_content, max_token_chars
from .metrics import ServerMetrics
from .runner import EngineCall, Retriever, admit_documents, make_scheduler, prompt_tokens, request_salt
from .schemas import ChatCompletionRequest, CompletionRequest, _Generation
from .scheduler import Cancelled, Done, Failed, Job, Piece, QueueFull, RequestTimeout
from .tooling import CallStream, ChatPlan, answer_message, plan_chat

logger = logging.getLogger(__name__)

GRAMMAR_WORKERS = 2  # threads compiling grammars: a schema bomb holds at most these, never the default pool
# a request body up to this many bytes is parsed, validated and planned on the event loop (well under a millisecond);
# a larger one on one of PARSE_WORKERS threads of its own, so the loop keeps answering while a 368 KB schema bomb or
# 8 MiB of documents is parsed, and requests with small bodies never wait behind one
INLINE_BODY_BYTES = 64 * 1024
PARSE_WORKERS = 2


@dataclass(frozen=True)
class ServeConfig:
    """Settings of one server."""

    model_name: str  # the name clients send as `model`, listed by /v1/models
    # other names a request's `model` may say: the --model argument as given (a folder path), as vLLM answers to it
    model_aliases: tuple[str, ...] = ()
    # when set, every route but /health needs `Authorization: Bearer <one of them>`; each key is a cache namespace
    # of its own (its requests' salt), so clients with different keys never share cached prompts
    api_keys: tuple[str, ...] = ()
    max_queue: int = 16  # requests that may wait for the engine; one more gets 429
    timeout_s: float = 300.0  # per request, from arrival to the last token
    default_max_tokens: int = 256  # when a request sets no max_tokens
    home: str | None = None  # package home of the Chroma collections used by `retrieval`
    chroma_host: str | None = None
    chroma_port: int | None = None
    poll_s: float = 0.5  # how often a waiting non-streaming request checks that its client is still there
    max_batch: int = 8  # sequences decoded together (continuous batching); 1: one request at a time
    max_body_bytes: int = 8 * 1024**2  # a larger request body gets 413, read no further
    max_documents: int = 256  # documents + chunk_ids of one request; more get 400 before queueing
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (uvicorn protocol, command.py)
    body_timeout_s: float = 60.0  # and its body within this after them (408)
    max_grammar_bytes: int = 128 * 1024  # a request's schema or tool grammar, as text; a larger one gets 400
    grammar_timeout_s: float = 10.0  # a grammar must compile (waiting for a compile thread included) within this
    # answer `usage` without cache facts (cached tokens, the `cacheblend` stats): on a server shared by clients who
    # must not learn what the others sent (docs/serve.md, "What a shared server reveals")
    hide_cache_usage: bool = False
    # the operator's key for /metrics, which then needs it (the clients' keys get 401 there) and opens nothing else:
    # the counters sum every client's cached tokens, so a client reading them around its own request learns whether
    # another client sent the same prompt. Without it /metrics is open to every API key, and off (403) under
    # `hide_cache_usage`
    metrics_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be ≥ 1, got {self.max_queue}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be ≥ 1, got {self.max_batch}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be ≥ 1, got {self.default_max_tokens}")
        if not isinstance(self.api_keys, tuple) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ConfigError(f"api_keys must be a tuple of non-empty keys, got {self.api_keys!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be ≥ 1024, got {self.max_body_bytes}")
        if self.max_documents < 1:
            raise ConfigError(f"max_documents must be ≥ 1, got {self.max_documents}")
        if self.max_grammar_bytes < 1024:
            raise ConfigError(f"max_grammar_bytes must be ≥ 1024, got {self.max_grammar_bytes}")
        if not self.grammar_timeout_s > 0:
            raise ConfigError(f"grammar_timeout_s must be > 0 seconds, got {self.grammar_timeout_s}")
        if self.metrics_key is not None and (not isinstance(self.metrics_key, str) or not self.metrics_key):
            raise ConfigError(f"metrics_key must be a non-empty string or None, got {self.metrics_key!r}")
        if self.metrics_key is not None and self.metrics_key in self.api_keys:
            raise ConfigError("the metrics key is also an API key: give the operator a key that no client has "
                              "(--metrics-key)")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ConfigError(f"the header and body timeouts must be > 0 seconds, got {self.header_timeout_s} and "
                              f"{self.body_timeout_s}")


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type, code, headers

    def body(self) -> dict:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}

    def response(self) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: BaseException) -> APIError:
    """The API error for an exception raised while serving a request. A server-side failure's own message (which
    may name files and folders of this machine) goes to the log only; the client gets its kind."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, (ConfigError, ChunkError)):
        return APIError(400, str(exc), code="invalid_value")
    if isinstance(exc, CollectionNotFoundError):  # the retriever's message names the collection, not the path
        return APIError(404, str(exc), code="collection_not_found")
    if isinstance(exc, RequestTimeout):
        return APIError(504, f"{exc}; retry with fewer documents or a smaller max_tokens", "timeout_error", "timeout")
    if isinstance(exc, Cancelled):
        return APIError(499, str(exc), "cancelled", "cancelled")
    if isinstance(exc, MissingDependencyError):
        return APIError(500, str(exc), "server_error", "missing_dependency")
    logger.error("request failed", exc_info=(type(exc), exc, exc.__traceback__))
    if isinstance(exc, VectorStoreError):
        return APIError(503, "the vector store for `retrieval` is unavailable (the server's log says why)",
                        "server_error", "vector_store_unavailable")
    code = type(exc).__name__ if isinstance(exc, CacheBlendError) else "internal_error"
    return APIError(500, f"internal error ({type(exc).__name__}); the server's log has the details", "server_error",
                    code)


def read_body(raw: bytes, content_type: str | None, model: type[_Generation]) -> _Generation:
    """A request body as `model`, read as FastAPI reads a route's body parameter, with its errors: JSON only with a
    JSON Content-Type, RequestValidationError for JSON that does not parse or does not validate, a 400 for a body
    that cannot be decoded at all."""
    return validate_body(parse_json(raw, content_type), model)


def parse_json(raw: bytes, content_type: str | None) -> Any:
    """The body's JSON value (the raw bytes when it is not JSON, None when empty), as FastAPI parses it."""
    if not raw:
        return None
    if not json_content(content_type):
        return raw  # FastAPI validates the bytes, which no model takes: a 400 saying so
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from e
    except Exception as e:  # not UTF-8, nested past the recursion limit
        raise StarletteHTTPException(400, "There was an error parsing the body") from e


def validate_body(data: Any, model: type[_Generation]) -> _Generation:
    """`data` (parse_json's) validated as `model`: RequestValidationError, as FastAPI raises it, otherwise."""
    if data is None:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(data, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


class _CountRequests:
    """ASGI middleware counting answered requests by route and status."""

    def __init__(self, app, metrics: ServerMetrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _usage(stats: dict, job: Job, ttft_s: float | None) -> dict:
    """OpenAI's usage, with cached tokens, plus the CacheBlend stats."""
    prompt = int(stats.get("num_tokens", 0))
    completion = int(stats.get("num_generated", 0))
    cached = int(stats.get("num_reused", 0)) + int(stats.get("num_exact_cached", 0))
    hits, misses = list(stats.get("chunk_hits", ())), list(stats.get("chunk_misses", ()))
    timing = stats.get("timing", {})
    cacheblend = {
        "method": stats.get("method"),
        "chunk_hits": len(hits), "chunk_misses": len(misses), "hit_ids": hits, "miss_ids": misses,
        "reused_tokens": int(stats.get("num_reused", 0)), "exact_cached_tokens": int(stats.get("num_exact_cached", 0)),
        "recomputed_tokens": int(stats.get("num_recomputed", 0)),
        "recomputed_share": float(stats.get("recompute_ratio_effective", 0.0)),
        "recompute_ratio": stats.get("recompute_ratio"),
        "prefill_s": stats.get("ttft_s"),  # the engine's time to first token
        "ttft_s": ttft_s,  # from the request's arrival, queueing included
        "queue_s": (job.started - job.arrived) if job.started is not None else None,
        "decode_s": timing.get("decode_s"),
    }
    if "num_retrieved" in stats:
        cacheblend["num_retrieved"] = stats["num_retrieved"]
    if stats.get("fidelity") is not None:  # the model's calibrated ratio ran (the fidelity gate)
        cacheblend["fidelity"] = stats["fidelity"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "cacheblend": cacheblend}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Server:
    """The app's state: engine, scheduler, metrics, config; the handlers are its methods."""

    def __init__(self, engine, config: ServeConfig) -> None:
        self.engine, self.config = engine, config
        self.retriever = Retriever(config.home, config.chroma_host, config.chroma_port)
        self.scheduler = make_scheduler(engine, self.retriever, config.max_queue, config.max_batch)
        self.metrics = ServerMetrics(self.scheduler.depth, self.scheduler.batch_size, engine.kv_store.stats,
                                     lambda: engine.grammars.num_compiled, engine.prefix_store.stats)
        self.created = int(time.time())
        self._mean_latency_s: float | None = None
        self.chars_per_token = max_token_chars(engine.tokenizer)  # bounds a prompt's tokens from its length
        # grammars compile here, apart from the default pool that admits every request: plain requests never
        # wait behind a schema; the engine's compiler keeps what compiled, so the worker does not compile again
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_WORKERS, "cacheblend-grammar")
        # bodies over INLINE_BODY_BYTES are parsed here: never on the event loop, never on the pool admitting requests
        self.parse_pool = concurrent.futures.ThreadPoolExecutor(PARSE_WORKERS, "cacheblend-parse")

    # ---- requests to engine calls ---------------------------------------------------------

    async def read(self, request: Request, build: Callable[[bytes, str | None, str | None], Any]) -> Any:
        """`build(raw body, Content-Type, the key's cache namespace)`: on the event loop for a small body, on a parse
        thread for one over INLINE_BODY_BYTES (its parsing, validation and planning take milliseconds a request)."""
        raw = await request.body()  # read whole by RequestGuard already, within --max-body-bytes
        args = (raw, request.headers.get("content-type"), request.state.key_namespace)
        if len(raw) <= INLINE_BODY_BYTES:
            return build(*args)
        return await asyncio.wrap_future(self.parse_pool.submit(build, *args))

    def chat_request(self, raw: bytes, content_type: str | None, key_namespace: str | None,
                     ) -> tuple[ChatCompletionRequest, EngineCall, ChatPlan]:
        """A chat request's raw body → (body, engine call, plan), every check that needs no tokenizer done: a grammar
        that is surely over --max-grammar-bytes is refused from the parsed JSON, before the body is validated and the
        grammar built (`grammar_floor`); the built grammar's exact size is checked after."""
        data = parse_json(raw, content_type)
        floor = grammar_floor(data)
        if floor is not None:
            self._check_grammar_bytes(*floor, at_least=True)
        body = validate_body(data, ChatCompletionRequest)
        self._check_model(body)
        call, plan = self.chat_call(body, request_salt(key_namespace, body.cache_salt))
        if call.sampling.grammar is not None:
            self._check_grammar_size(call.sampling.grammar)
        return body, call, plan

    def completion_request(self, raw: bytes, content_type: str | None, key_namespace: str | None,
                           ) -> tuple[CompletionRequest, EngineCall]:
        """A completion request's raw body → (body, engine call)."""
        body = read_body(raw, content_type, CompletionRequest)
        self._check_model(body)
        return body, self.completion_call(body, request_salt(key_namespace, body.cache_salt))

    def serves(self, model: str) -> bool:
        """Whether `model` names the served model: its name or one of its aliases."""
        return model == self.config.model_name or model in self.config.model_aliases

    def _check_model(self, body: _Generation) -> None:
        if not self.serves(body.model):
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.config.model_name!r} (GET /v1/models)", code="model_not_found")

    def _call(self, body: _Generation, question: str, system: str | None, default_max_tokens: int,
              cache_salt: str | None, messages: tuple[dict, ...] = (), grammar=None) -> EngineCall:
        documents: list[str] = []
        for doc in body.documents or []:
            documents.append(doc if isinstance(doc, str) else (doc.text if doc.text is not None else doc.id or ""))
        documents += body.chunk_ids or []
        opts = body.cacheblend
        return EngineCall(
            question=question,
            system=system,
            messages=messages,
            documents=tuple(documents),
            retrieval=(body.retrieval.collection, body.retrieval.k) if body.retrieval else None,
            policy=opts.policy,
            auto_ratio=opts.auto_ratio,
            calibrated_ratio=opts.calibrated_ratio,
            sampling=SamplingOptions(body.new_tokens(default_max_tokens), body.temperature, body.top_p,
                                     tuple(body.stop or ()), body.seed, grammar),
            cache_salt=cache_salt,
        )

    def chat_call(self, body: ChatCompletionRequest, cache_salt: str | None) -> tuple[EngineCall, ChatPlan]:
        """Chat messages → engine call: the last user message is the question, system messages (and the tools' or
        schema's instructions) the system text; the plan says which tools an answer may call. `cache_salt`: the
        request's (`request_salt`)."""
        try:
            system = "\n\n".join(m.text() for m in body.messages if m.role in ("system", "developer")) or None
            users = [m for m in body.messages if m.role == "user"]
            if not users:
                raise APIError(400, "messages need at least one user message (the question)", code="invalid_value")
            question = users[-1].text()
            # the chat template renders the whole chat (its own tool format, if any) only without documents: on
            # the documents path the engine's prompt template places the turns, as text
            whole = not (body.documents or body.chunk_ids or body.retrieval)
            plan = plan_chat(body, ToolFormat.of(self.engine.tokenizer) if whole else GENERIC)
        except (ValueError, ConfigError) as e:
            raise APIError(400, str(e), code="invalid_value") from e
        if plan.system_text:
            system = f"{system}\n\n{plan.system_text}" if system else plan.system_text
        call = self._call(body, question, system, self.config.default_max_tokens, cache_salt, tuple(plan.messages),
                          plan.grammar)
        if plan.tools is not None:
            call = replace(call, tools=tuple(plan.tools))
        return call, plan

    def completion_call(self, body: CompletionRequest, cache_salt: str | None) -> EngineCall:
        """A completion prompt → engine call (the prompt is the question); `cache_salt`: the request's."""
        return self._call(body, body.prompt_text(), None, self.config.default_max_tokens, cache_salt)

    def _admitted(self, call: EngineCall) -> EngineCall:
        """The call, checked for size and its documents tokenized: what cannot fit is refused here, before its
        grammar compiles, before it takes a queue slot or the engine's worker (which tokenized it before)."""
        if len(call.documents) > self.config.max_documents:
            raise APIError(400, f"{len(call.documents)} documents and chunk ids; this server takes at most "
                           f"{self.config.max_documents} per request", code="too_many_documents")
        context_window = int(self.engine.context_window)
        check_fits(call, context_window, self.chars_per_token)
        call = admit_documents(self.engine, call)
        tokens = prompt_tokens(self.engine, call)  # the schema's and tools' instructions included
        if tokens + call.sampling.max_new_tokens > context_window:
            raise PromptTooLongError(f"the prompt has {tokens} tokens (system text, tools and schema included) + "
                                     f"max_tokens={call.sampling.max_new_tokens}, more than the model's context "
                                     f"window of {context_window} tokens; send a shorter prompt, schema or tools")
        return call

    def _check_grammar_size(self, grammar: Grammar) -> None:
        """A 400 for a grammar over --max-grammar-bytes: checked first, before its text is tokenized (a schema bomb's
        tokenizing alone took the CPU from every other request: `bench faults --fault-scenarios schema_bomb`)."""
        self._check_grammar_bytes(grammar.kind, len(grammar.source.encode()))

    def _check_grammar_bytes(self, kind: str, size: int, at_least: bool = False) -> None:
        if size > self.config.max_grammar_bytes:
            raise APIError(400, f"the request's {kind} grammar (its schema or tools) has {'at least ' * at_least}"
                           f"{size} bytes, more than this server's limit of {self.config.max_grammar_bytes} "
                           "(--max-grammar-bytes)", code="grammar_too_large")

    async def _compile(self, grammar: Grammar) -> None:
        """Compile the call's grammar on the grammar threads within the time limit: a 400 otherwise."""
        compiled = asyncio.wrap_future(self.grammar_pool.submit(self.engine.grammars.compile, grammar))
        try:
            await asyncio.wait_for(compiled, self.config.grammar_timeout_s)
        except TimeoutError:
            logger.warning("a %s grammar of %d bytes did not compile within %g s", grammar.kind,
                           len(grammar.source.encode()), self.config.grammar_timeout_s)
            raise APIError(400, f"the request's {grammar.kind} grammar did not compile within "
                           f"{self.config.grammar_timeout_s:g} s (--grammar-timeout); send a simpler schema or fewer "
                           "tools", code="grammar_too_complex") from None

    async def admit(self, call: EngineCall) -> EngineCall:
        """`_admitted` on a thread of its own (neither the event loop nor the engine's worker tokenizes), then its
        grammar compiled (GrammarError, a 400, for one that does not compile or fails at its first token)."""
        if call.sampling.grammar is not None:
            self._check_grammar_size(call.sampling.grammar)
        call = await asyncio.to_thread(self._admitted, call)
        if call.sampling.grammar is not None:
            await self._compile(call.sampling.grammar)
        return call

    # ---- running a job ----------------------------------------------------------------------

    def _retry_after(self) -> str:
        mean = self._mean_latency_s or 1.0
        return str(max(1, math.ceil(mean * (self.scheduler.depth() + 1))))

    def _submit(self, call: EngineCall) -> Job:
        job = Job(call, asyncio.get_running_loop(), deadline=time.monotonic() + self.config.timeout_s)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({e}); retry later", "rate_limit_error", "queue_full",
                           headers={"Retry-After": self._retry_after()}) from e
        return job

    def _finished(self, job: Job, stats: dict, ttft_s: float | None) -> dict:
        """The usage to answer with (its cache facts left out under `hide_cache_usage`); the metrics see them all."""
        usage = _usage(stats, job, ttft_s)
        latency = time.monotonic() - job.arrived
        self.metrics.observe_finished(usage, stats, ttft_s, latency)
        self._mean_latency_s = latency if self._mean_latency_s is None else 0.8 * self._mean_latency_s + 0.2 * latency
        if self.config.hide_cache_usage:
            return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return usage

    async def respond(self, request: Request, body: _Generation, call: EngineCall, chat: bool,
                      plan: ChatPlan | None = None):
        """Queue the call and answer with JSON, or with SSE once the first piece (or an error) is known."""
        try:
            call = await self.admit(call)
        except CacheBlendError as e:
            raise api_error(e) from e
        job = self._submit(call)
        streaming = False
        try:
            try:
                first = await job.next_event(self.config.poll_s, request.is_disconnected)
            except (RequestTimeout, Cancelled) as e:
                raise api_error(e) from e
            if isinstance(first, Failed):
                raise api_error(first.error)
            ttft_s = time.monotonic() - job.arrived
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if body.stream:
                streaming = True
                return StreamingResponse(self._stream(job, first, body, chat, rid, ttft_s, plan),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            texts, event, checked = [], first, time.monotonic()
            while not isinstance(event, Done):
                if isinstance(event, Failed):
                    raise api_error(event.error)
                texts.append(event.text)
                if time.monotonic() - checked > self.config.poll_s:  # pieces keep coming: is anyone still there?
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise api_error(Cancelled("the client disconnected"))
                try:
                    event = await job.next_event(self.config.poll_s, request.is_disconnected)
                except (RequestTimeout, Cancelled) as e:
                    raise api_error(e) from e
            text = "".join(texts).strip()
            if plan is not None and plan.answered and plan.repeats(self._calls(text, plan)):
                body, (call, plan) = self._answer_instead(body, plan, call.cache_salt)
                return await self.respond(request, body, call, chat, plan)
            usage = self._finished(job, event.stats, ttft_s)
            choice: dict = {"index": 0, "finish_reason": event.finish_reason, "logprobs": None}
            if chat:
                choice["message"], choice["finish_reason"] = answer_message(
                    text, event.finish_reason, plan.functions if plan else (), plan.format if plan else GENERIC)
            else:
                choice["text"] = text
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": self.config.model_name, "choices": [choice], "usage": usage}
        finally:
            if not streaming:
                job.cancel()  # a no-op once the job is done; stops it when the handler failed or its client left

    @staticmethod
    def _calls(text: str, plan: ChatPlan) -> list[generic_tools.ToolCall]:
        """The calls an answer's text makes under `plan`."""
        return generic_tools.parse_tool_calls(text, plan.functions, plan.format)[1] if plan.functions else []

    def _answer_instead(self, body: ChatCompletionRequest, plan: ChatPlan, cache_salt: str | None,
                        ) -> tuple[ChatCompletionRequest, tuple[EngineCall, ChatPlan]]:
        """The request again under tool_choice "none", for an "auto" answer that only repeated answered calls."""
        logger.info("tool_choice 'auto': the answer repeats calls whose results the chat holds; answering under "
                    "'none' instead")
        body = body.model_copy(update={"tool_choice": "none"})
        return body, self.chat_call(body, cache_salt)

    async def _stream(self, job: Job, first: Piece | Done, body: _Generation, chat: bool, rid: str,
                      ttft_s: float, plan: ChatPlan | None = None) -> AsyncIterator[str]:
        """SSE chunks: the role, content (or tool-call) deltas, the finish reason, usage (if asked), then [DONE]."""
        created, model = int(time.time()), self.config.model_name
        include_usage = body.include_usage()
        calls = CallStream(plan.functions, plan.format) if plan is not None and plan.functions else None

        def chunk(content: str | dict | None, finish_reason: str | None = None, role: bool = False) -> dict:
            if chat:
                delta: dict = {"role": "assistant"} if role else {}
                if isinstance(content, dict):  # a delta from CallStream
                    delta.update(content)
                elif content is not None:
                    delta["content"] = content
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": content or "", "finish_reason": finish_reason, "logprobs": None}
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                   "model": model, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return out

        try:
            if chat:
                yield _sse(chunk("", role=True))
            event: Piece | Done | Failed = first
            leading = True  # strip the answer's leading whitespace, as the non-streaming answer is stripped
            # under "auto" after tool results a call is held back until the answer ends: one that only repeats
            # answered calls is not sent, the answer under "none" is streamed instead (see `respond`)
            guarded = plan is not None and bool(plan.answered)
            held: list[dict] = []
            text = ""
            while True:
                if isinstance(event, Piece) and calls is not None:
                    text += event.text
                    for delta in calls.feed(event.text):
                        if guarded and "tool_calls" in delta:
                            held.append(delta)
                        else:
                            yield _sse(chunk(delta))
                elif isinstance(event, Piece):
                    text = event.text.lstrip() if leading else event.text
                    if text:
                        leading = False
                        yield _sse(chunk(text))
                elif isinstance(event, Done):
                    finish_reason = event.finish_reason
                    if calls is not None:
                        held += calls.finish()
                        if guarded and plan.repeats(self._calls(text, plan)):
                            body, (call, plan) = self._answer_instead(body, plan, job.call.cache_salt)
                            job.cancel()
                            try:
                                job = self._submit(await self.admit(call))
                                event = await job.next_event(self.config.poll_s)
                            except (CacheBlendError, APIError, RequestTimeout) as e:
                                yield _sse((e if isinstance(e, APIError) else api_error(e)).body())
                                break
                            calls, guarded, held = None, False, []
                            continue
                        for delta in held:
                            yield _sse(chunk(delta))
                        if calls.called and finish_reason != "length":
                            finish_reason = "tool_calls"
                    usage = self._finished(job, event.stats, ttft_s)
                    yield _sse(chunk(None if chat else "", finish_reason))
                    if include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model, "choices": [], "usage": usage})
                    break
                else:
                    yield _sse(api_error(event.error).body())
                    break
                try:
                    event = await job.next_event(self.config.poll_s)  # a disconnect cancels this coroutine
                except RequestTimeout as e:
                    yield _sse(api_error(e).body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client left (or the stream ended): the worker stops at its next piece

    # ---- plain routes -----------------------------------------------------------------------

    def model_card(self) -> dict:
        """The one model, as /v1/models lists it."""
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "cacheblend-rag",
                "max_model_len": int(self.engine.adapter.max_positions)}


def create_app(engine, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan starts and stops the engine's worker thread."""
    server = _Server(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        # the grammar compiler's one-time set-up (0.5-1.9 s, GIL-bound) while the server is still idle, not in the
        # first tool call's latency; a request arriving meanwhile waits for the part it needs
        engine.grammars.warm_up()
        logger.info("serving %r (queue %d, timeout %.0f s, auth %s)", config.model_name, config.max_queue,
                    config.timeout_s, f"{len(config.api_keys)} key(s)" if config.api_keys else "off")
        try:
            yield
        finally:  # uvicorn has finished the in-flight requests by now
            await asyncio.to_thread(server.scheduler.stop, config.timeout_s)
            server.grammar_pool.shutdown(wait=False, cancel_futures=True)
            server.parse_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="cacheblend-rag", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, _validation_message(exc), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), kind, code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": config.model_name, "queue_depth": server.scheduler.depth(),
                "running": server.scheduler.batch_size()}

    @app.get("/metrics")
    async def metrics() -> Response:
        if config.hide_cache_usage and config.metrics_key is None:
            raise APIError(403, "/metrics is off under --hide-cache-usage: its counters would tell a client what the "
                           "others sent; give the operator a key of its own with --metrics-key",
                           "permission_error", "metrics_disabled")
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if not server.serves(model):
            raise APIError(404, f"the model {model!r} does not exist", code="model_not_found")
        return server.model_card()

    # the routes read their bodies themselves (`_Server.read`): FastAPI would parse and validate every body on the
    # event loop, a schema bomb's included, before the route runs
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, call, plan = await server.read(request, server.chat_request)
        return await server.respond(request, body, call, chat=True, plan=plan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, call = await server.read(request, server.completion_request)
        return await server.respond(request, body, call, chat=False)

    def refuse(status: int, message: str, code: str, headers: dict[str, str]) -> JSONResponse:
        return APIError(status, message, code=code, headers=headers).response()

    # the guard checks the key and reads the body before any route (or FastAPI's JSON parsing) runs
    path_keys = {"/metrics": (config.metrics_key,)} if config.metrics_key is not None else {}
    app.add_middleware(RequestGuard, api_keys=config.api_keys, open_paths=frozenset({"/health"}), path_keys=path_keys,
                       max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s, refuse=refuse)
    routes = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}
    app.add_middleware(_CountRequests, metrics=server.metrics, routes=routes)  # added last: outermost, counts all
    return app


__all__ = ["APIError", "ServeConfig", "api_error", "create_app"]
