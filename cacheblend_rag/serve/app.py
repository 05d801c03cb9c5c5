"""The OpenAI-compatible HTTP app: routes, auth and error answers over one engine.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (JSON or SSE), `GET /v1/models`, `GET /health`,
`GET /metrics`. Every error is `{"error": {"message", "type", "code"}}` with its HTTP status. Engine work runs on
the scheduler's worker thread; handlers only queue a job and relay its events, so the event loop stays free.
A body is read here into an engine call (`calls.py`), checked and queued (`admission.py`) and answered
(`responses.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import CacheBlendError
from .admission import Admission
from .calls import (
    APIError,
    api_error,
    chat_call,
    completion_call,
    parse_json,
    request_salt,
    validate_body,
    validation_message,
)
from .config import ServeConfig
from .limits import RequestGuard, grammar_floor
from .metrics import ServerMetrics
from .responses import Responder
from .runner import EngineCall, Retriever, make_scheduler
from .schemas import ChatCompletionRequest, CompletionRequest, _Generation, openapi_body
from .tooling import ChatPlan

logger = logging.getLogger(__name__)

# a request body up to this many bytes is parsed, validated and planned on the event loop (well under a millisecond);
# a larger one on one of PARSE_WORKERS threads of its own, so the loop keeps answering while a 368 KB schema bomb or
# 8 MiB of documents is parsed, and requests with small bodies never wait behind one
INLINE_BODY_BYTES = 64 * 1024
PARSE_WORKERS = 2
ANSWERED_WAIT_S = 1.0  # for the connection of a request the HTTP server answered itself to close (_AnsweredAlready)


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


class _AnsweredAlready:
    """ASGI middleware, outermost: a response the HTTP server will not take is dropped, not a failure of the app.

    uvicorn answers a request whose framing is broken (a bad chunk of a chunked body) with its own 400 and closes
    the connection, while the app may already be answering it from the headers alone (a 401 before the body is
    read): h11 then refuses the app's response. The client has its answer; without this, the refusal rose through
    the app as an internal error, logged with a traceback as if the server had failed."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused: list[BaseException] = []

        async def watched_send(message) -> None:
            try:
                await send(message)
            except Exception as e:
                refused.append(e)
                raise

        try:
            await self.app(scope, receive, watched_send)
        except Exception as e:
            if not any(e is r for r in refused):  # the app's own failure (or one it made of the refusal): not ours
                raise
            logger.debug("the connection took no more of this answer (%s: %s): the server had answered already",
                         type(e).__name__, e)
            # uvicorn marks the request done once its connection is gone (a moment later): wait for that, or it
            # logs an error for an answer the app left unfinished
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ANSWERED_WAIT_S):
                    while (await receive())["type"] != "http.disconnect":
                        pass


class _Server:
    """The app's state: engine, scheduler, admission, responder, metrics, config; reads bodies into calls."""

    def __init__(self, engine, config: ServeConfig) -> None:
        self.engine, self.config = engine, config
        self.retriever = Retriever(config.home, config.chroma_host, config.chroma_port)
        self.scheduler = make_scheduler(engine, self.retriever, config.max_queue, config.max_batch)
        self.metrics = ServerMetrics(self.scheduler.depth, self.scheduler.batch_size, engine.kv_store.stats,
                                     lambda: engine.grammars.num_compiled, engine.prefix_store.stats)
        self.created = int(time.time())
        self.admission = Admission(engine, self.scheduler, config)
        self.responder = Responder(engine, config, self.admission, self.metrics)
        # bodies over INLINE_BODY_BYTES are parsed here: never on the event loop, never on the pool admitting requests
        self.parse_pool = concurrent.futures.ThreadPoolExecutor(PARSE_WORKERS, "cacheblend-parse")

    # ---- request bodies to engine calls ---------------------------------------------------------

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
            self.admission.check_grammar_bytes(*floor, at_least=True)
        body = validate_body(data, ChatCompletionRequest)
        self._check_model(body)
        call, plan = chat_call(body, self.engine.tokenizer, self.config.default_max_tokens,
                               request_salt(key_namespace, body.cache_salt))
        if call.request.sampling.grammar is not None:
            self.admission.check_grammar_size(call.request.sampling.grammar)
        return body, call, plan

    def completion_request(self, raw: bytes, content_type: str | None, key_namespace: str | None,
                           ) -> tuple[CompletionRequest, EngineCall]:
        """A completion request's raw body → (body, engine call)."""
        body = validate_body(parse_json(raw, content_type), CompletionRequest)
        self._check_model(body)
        return body, completion_call(body, self.config.default_max_tokens, request_salt(key_namespace,
                                                                                        body.cache_salt))

    def serves(self, model: str) -> bool:
        """Whether `model` names the served model: its name or one of its aliases."""
        return model == self.config.model_name or model in self.config.model_aliases

    def _check_model(self, body: _Generation) -> None:
        if not self.serves(body.model):
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.config.model_name!r} (GET /v1/models)", code="model_not_found")

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
        warming = engine.grammars.warm_up()
        logger.info("serving %r (queue %d, timeout %.0f s, auth %s)", config.model_name, config.max_queue,
                    config.timeout_s, f"{len(config.api_keys)} key(s)" if config.api_keys else "off")
        try:
            yield
        finally:  # uvicorn has finished the in-flight requests by now
            await asyncio.to_thread(server.scheduler.stop, config.timeout_s)
            server.admission.shutdown()
            server.parse_pool.shutdown(wait=False, cancel_futures=True)
            # a server stopped within a second or two of starting: the warm-up thread is still inside llguidance's
            # native code, and an interpreter finalizing under a running native thread can die of SIGSEGV (a CI
            # run's exit -11); it is a few seconds at most
            if warming is not None:
                await asyncio.to_thread(warming.join, 60)

    app = FastAPI(title="cacheblend-rag", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, validation_message(exc), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), kind, code).response()

    # the package's own errors raised while a body becomes a call (a ConfigError of `Request.of`: an empty question)
    # are the client's: answered here, not by the handler of last resort below, which answers too but then has
    # Starlette re-raise the error, logged with its traceback as a server failure
    @app.exception_handler(CacheBlendError)
    async def _ours(request: Request, exc: CacheBlendError) -> JSONResponse:
        return api_error(exc).response()

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
    # event loop, a schema bomb's included, before the route runs; the OpenAPI document still says what they take
    served = (config.model_name, *config.model_aliases)
    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest, served))
    async def chat_completions(request: Request):
        body, call, plan = await server.read(request, server.chat_request)
        return await server.responder.respond(request, body, call, chat=True, plan=plan)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest, served))
    async def completions(request: Request):
        body, call = await server.read(request, server.completion_request)
        return await server.responder.respond(request, body, call, chat=False)

    def refuse(status: int, message: str, code: str, headers: dict[str, str]) -> JSONResponse:
        return APIError(status, message, code=code, headers=headers).response()

    # the guard checks the key and reads the body before any route (or FastAPI's JSON parsing) runs
    path_keys = {"/metrics": (config.metrics_key,)} if config.metrics_key is not None else {}
    app.add_middleware(RequestGuard, api_keys=config.api_keys, open_paths=frozenset({"/health"}), path_keys=path_keys,
                       max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s, refuse=refuse)
    routes = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}
    app.add_middleware(_CountRequests, metrics=server.metrics, routes=routes)  # outside the guard: counts all
    app.add_middleware(_AnsweredAlready)  # added last: outermost
    return app


__all__ = ["APIError", "ServeConfig", "api_error", "create_app"]
