"""A request body → the engine call: the body parsed and validated as FastAPI would, errors as OpenAI answers them,
and the one place an API request becomes the engine's `Request`, built once when the body is read (on the event
loop, or a parse thread for a large body) with the policy its validation built:
- with `documents`, `chunk_ids` or `retrieval`: chunks, a question, a template and history —
  the chunks are those passages (the retrieved ones added by the worker, `runner.retrieved_request`), the question
  the last user message (or the completion prompt), the turns before it the history (the chunks stay in the first
  user turn, so a follow-up starts with the previous turn's prompt and answer: a stored prefix), a system message
  the template's system text;
- otherwise the request's own prompt — the whole chat, rendered with the model's chat template, or the
  completion prompt as is — is the request's prompt, in which the engine reuses the KV of every ingested chunk whose
  text it carries (a client's own RAG prompt gets reuse without any extension field).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from ..fuse.layout import PromptTemplate
from ..request import Request
from ..tool_format import GENERIC, ToolFormat
from .limits import json_content
from .runner import EngineCall, RetrievalQuery
from .scheduler import Cancelled, RequestTimeout
from .schemas import ChatCompletionRequest, CompletionRequest, _Generation
from .tooling import ChatPlan, plan_chat

logger = logging.getLogger(__name__)


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
    """The body's JSON value (the raw bytes when it is not JSON, None when empty), as FastAPI parses it, with
    errors that say what is wrong with the body: RequestValidationError for JSON that does not parse, a 400 for
    bytes that are not UTF-8 or nest past what the parser can read."""
    if not raw:
        return None
    if not json_content(content_type):
        return raw  # FastAPI validates the bytes, which no model takes: a 400 saying so
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from e
    except UnicodeDecodeError as e:
        raise StarletteHTTPException(400, f"the body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                                     f"{e.start}); send JSON as UTF-8 text") from e
    except RecursionError as e:
        raise StarletteHTTPException(400, "the body's JSON nests arrays or objects too deeply to parse") from e
    except Exception as e:
        raise StarletteHTTPException(400, "There was an error parsing the body") from e


def validate_body(data: Any, model: type[_Generation]) -> _Generation:
    """`data` (parse_json's) validated as `model`: RequestValidationError, as FastAPI raises it, otherwise."""
    if data is None:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(data, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def validation_message(exc: RequestValidationError) -> str:
    """The 400's message for a body that does not validate: each error's field and what is wrong with it (the body
    itself where no field is at fault: not a JSON object, not JSON at all)."""
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            where = err.get("loc", ("body", "?"))[-1]
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'JSON decode error')} at "
                         f"character {where})")
            continue
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "missing" and not where:
            parts.append("the body is empty (or null): send a JSON object")
        else:
            parts.append(f"{where or 'the body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def request_salt(key_namespace: str | None, cache_salt: str | None) -> str | None:
    """The engine's cache salt for a request: its API key's namespace combined with (not replaced by) the
    `cache_salt` it sent, unambiguously (no client salt can name another key's namespace); None for neither."""
    if key_namespace is None and cache_salt is None:
        return None
    return json.dumps([key_namespace, cache_salt], ensure_ascii=False)


def conversation(messages: Sequence[dict], question: str) -> tuple[str, tuple[dict, ...]]:
    """(question, earlier turns) of a request on the documents path: the last user message of a chat (a tool's
    result is one) and the messages before it, system messages left to the template; a completion (no messages)
    has no earlier turns."""
    turns = [m for m in messages if m["role"] not in ("system", "developer")]
    last = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=None)
    if last is None:
        return question, ()
    return turns[last]["content"], tuple(turns[:last])


def engine_call(body: _Generation, question: str, sampling: SamplingOptions, cache_salt: str | None,
                system: str | None = None, messages: tuple[dict, ...] = (),
                tools: Sequence[dict] | None = None) -> EngineCall:
    """The engine call of a validated body, mapped as this module's docstring says: its `Request`, built here once
    with the policy the body's validation built, and the query its `retrieval` runs on the worker. `question`: the
    last user message as sent (or the completion prompt); `cache_salt`: the request's (`request_salt`)."""
    documents = [doc if isinstance(doc, str) else (doc.text if doc.text is not None else doc.id or "")
                 for doc in body.documents or []]
    documents += body.chunk_ids or []
    options = body.cacheblend
    fusion = {"method": options.policy, "recompute_ratio": "auto" if options.auto_ratio else None,
              "calibrated_ratio": options.calibrated_ratio, "sampling": sampling, "cache_salt": cache_salt}
    if not documents and body.retrieval is None:
        return EngineCall(Request.of(prompt=messages or question, tools=tools, **fusion))
    retrieval = RetrievalQuery(body.retrieval.collection, body.retrieval.k, question) if body.retrieval else None
    last_turn, history = conversation(messages, question)
    template = PromptTemplate(system=system) if system else None
    return EngineCall(Request.of(tuple(documents), last_turn, history=history, template=template, **fusion),
                      retrieval)


def sampling_of(body: _Generation, default_max_tokens: int, grammar: Grammar | None = None) -> SamplingOptions:
    """How the body asks its answer to be decoded (`default_max_tokens` where it sets no maximum)."""
    return SamplingOptions(body.new_tokens(default_max_tokens), body.temperature, body.top_p, tuple(body.stop or ()),
                           body.seed, grammar)


def chat_call(body: ChatCompletionRequest, tokenizer, default_max_tokens: int, cache_salt: str | None,
              ) -> tuple[EngineCall, ChatPlan]:
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
        plan = plan_chat(body, ToolFormat.of(tokenizer) if whole else GENERIC)
    except (ValueError, ConfigError) as e:
        raise APIError(400, str(e), code="invalid_value") from e
    if plan.system_text:
        system = f"{system}\n\n{plan.system_text}" if system else plan.system_text
    call = engine_call(body, question, sampling_of(body, default_max_tokens, plan.grammar), cache_salt, system,
                       tuple(plan.messages), plan.tools)
    return call, plan


def completion_call(body: CompletionRequest, default_max_tokens: int, cache_salt: str | None) -> EngineCall:
    """A completion prompt → engine call (the prompt is the question); `cache_salt`: the request's."""
    return engine_call(body, body.prompt_text(), sampling_of(body, default_max_tokens), cache_salt)


__all__ = ["APIError", "api_error", "chat_call", "completion_call", "engine_call", "parse_json", "read_body",
           "request_salt", "validate_body", "validation_message"]
