"""What a request may cost the server before it reaches the engine: the API key checked from the headers alone,
a capped body read within a deadline, request headers due within a deadline, and a prompt too big for the context
window refused from its character count.

    connection ─▶ headers within --header-timeout (HeaderDeadline) ─▶ key? else 401, body unread (RequestGuard)
               ─▶ body ≤ --max-body-bytes (413) within --body-timeout (408) ─▶ routes ─▶ size checks ─▶ queue

A refusal sent before the body was read closes the connection (`Connection: close`): what the client still sends
is never read.
"""

from __future__ import annotations

import asyncio
import email.message
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from ..errors import PromptTooLongError
from ..ingest.chunks import looks_like_chunk_id, normalize_text
from ..request import Request

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Refusal = Callable[[int, str, str, dict[str, str]], Any]  # (status, message, code, headers) → an ASGI response


class _BodyTooLarge(Exception):
    pass


class _BodyTooSlow(Exception):
    pass


class _ClientGone(Exception):
    pass


def matching_key(headers: Iterable[tuple[bytes, bytes]], api_keys: Iterable[str]) -> str | None:
    """The key of `api_keys` the raw headers carry as `Authorization: Bearer <key>`, or None: each key compared in
    constant time, and all of them, so the time says nothing about which one (or how many) came close."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            sent = token.strip().encode()
            found = None
            for key in api_keys:
                if hmac.compare_digest(sent, key.encode()):
                    found = key
            return found if scheme.lower() == "bearer" else None
    return None


def key_namespace(api_key: str) -> str:
    """The cache namespace of an API key's requests: a digest of the key (the same on every replica, and not the
    key itself, which is never stored in a cache entry's name)."""
    return hashlib.sha256(b"cacheblend-rag api key\0" + api_key.encode()).hexdigest()[:32]


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses a malformed one before the app sees it
    return None


async def read_body(receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole request body, at most `limit` bytes, all of it within `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    parts: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _BodyTooSlow
        try:
            message = await asyncio.wait_for(receive(), remaining)
        except TimeoutError:
            raise _BodyTooSlow from None
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise _BodyTooLarge
        parts.append(body)
        if not message.get("more_body", False):
            return b"".join(parts)


class RequestGuard:
    """ASGI middleware in front of the routes: the API key is checked from the headers (401 without reading the
    body), then the body is read whole, at most `max_body_bytes` (413) and within `body_timeout_s` (408), and
    handed to the app. `open_paths` need no key; a path in `path_keys` needs one of its own keys instead of the API
    keys (/metrics under --metrics-key). The routes read the key's cache namespace as `request.state.key_namespace`
    (None without keys, or on an open path or a path with keys of its own)."""

    def __init__(self, app, *, api_keys: tuple[str, ...], open_paths: frozenset[str], max_body_bytes: int,
                 body_timeout_s: float, refuse: Refusal,
                 path_keys: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self.app, self.api_keys, self.open_paths = app, api_keys, open_paths
        self.path_keys = dict(path_keys or {})
        self.max_body_bytes, self.body_timeout_s, self.refuse = max_body_bytes, body_timeout_s, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        close = {"Connection": "close"}  # the body is left unread: the connection cannot carry another request
        own_keys = self.path_keys.get(scope["path"])
        if own_keys is not None:  # the operator's path: its own key, never a client's (which names no namespace here)
            if matching_key(headers, own_keys) is None:
                response = self.refuse(401, f"{scope['path']} needs the operator's key (--metrics-key), not a "
                                       "client's: send `Authorization: Bearer <that key>`", "invalid_api_key",
                                       {**close, "WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
            key = None
        else:
            key = matching_key(headers, self.api_keys) if self.api_keys and scope["path"] not in self.open_paths \
                else None
            if self.api_keys and scope["path"] not in self.open_paths and key is None:
                response = self.refuse(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                                       "invalid_api_key", {**close, "WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        # the request's own state (Starlette's `request.state`): set for every request, so a route never probes it
        scope.setdefault("state", {})["key_namespace"] = key_namespace(key) if key is not None else None
        declared = _content_length(headers)
        if declared is not None and declared > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        try:
            body = await read_body(receive, self.max_body_bytes, self.body_timeout_s)
        except _BodyTooLarge:
            return await self._too_large(scope, receive, send)
        except _BodyTooSlow:
            response = self.refuse(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                   "request_timeout", close)
            return await response(scope, receive, send)
        except _ClientGone:
            return None  # nobody to answer
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: http.disconnect, which the routes watch for

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = self.refuse(413, f"the request body is larger than this server's limit of {self.max_body_bytes} "
                               "bytes (--max-body-bytes)", "request_too_large", {"Connection": "close"})
        await response(scope, receive, send)


def header_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not complete `timeout_s`
    after it opened (or after its previous response): uvicorn itself times out only idle keep-alive connections,
    and only after a first response, so a client sending its headers a byte at a time would hold a socket forever.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._disarm_once_started()

        def on_response_complete(self) -> None:
            self._arm()  # the next request's headers are due within the deadline too
            super().on_response_complete()
            self._disarm_once_started()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _disarm_once_started(self) -> None:
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._disarm()

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


def json_content(content_type: str | None) -> bool:
    """Whether a body of this Content-Type is read as JSON, as FastAPI reads it (strict: `application/json` or
    `application/*+json`; a body without a Content-Type is not JSON)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _json_size(value: Any) -> int:
    """Bytes of `value` written as the grammar writes a schema (`json.dumps`, ASCII); 0 when it cannot be written."""
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return 0


def grammar_floor(body: Any) -> tuple[str, int] | None:
    """(grammar kind, a lower bound of its bytes) of the grammar a chat request's parsed JSON body asks for, from
    the raw JSON alone: before the body is validated and before its grammar is built (validating a 368 KB schema,
    closing its objects and writing it out twice took ~25 ms of CPU a request; its `json.dumps` alone is ~2 ms).
    A grammar writes each schema it holds with `json.dumps` after adding keys only (`tools.closed`), so a schema's
    own `json.dumps` is never longer than its part of the grammar: the response format's schema when there are no
    tools, every tool's parameters under `tool_choice` "auto" or "required" (and the response format's schema
    beside them under "auto"), the response format's schema alone under "none". None where it cannot tell (a named
    tool): the request's own check of the built grammar decides."""
    if not isinstance(body, dict):
        return None
    response_format, schema = body.get("response_format"), None
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema" \
            and isinstance(response_format.get("json_schema"), dict):
        schema = response_format["json_schema"].get("schema")
    schema_bytes = _json_size(schema) if isinstance(schema, dict) else 0
    tools = body.get("tools")
    if not tools:
        return ("json_schema", schema_bytes) if schema_bytes else None
    choice = body.get("tool_choice")
    if choice == "none":  # plain text, or the response format's schema alone
        return ("json_schema", schema_bytes) if schema_bytes else None
    if not isinstance(tools, list) or choice not in (None, "auto", "required"):
        return None
    size = schema_bytes if choice in (None, "auto") else 0
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        if isinstance(parameters, dict):
            size += _json_size(parameters)
    return "lark", size


def max_token_chars(tokenizer) -> int:
    """The most characters one token of this tokenizer can stand for (its longest vocabulary entry; a byte-level
    entry is at least as long as the text it encodes): a text of N characters has at least N / this tokens."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def prompt_chars(request: Request, normalize: Callable[[str], str] = str) -> int:
    """Characters of the text the engine will tokenize for this request, each text as `normalize` leaves it (chunk
    ids not counted)."""
    if request.prompt is not None:  # the whole chat, or the completion prompt
        prompt = request.prompt
        return len(normalize(prompt)) if isinstance(prompt, str) else sum(len(normalize(m["content"])) for m in prompt)
    chunks = sum(len(normalize(c)) for c in request.chunks if isinstance(c, str) and not looks_like_chunk_id(c))
    turns = sum(len(normalize(m["content"])) for m in request.history)  # a chat's earlier turns beside the chunks
    system = request.template.system if request.template is not None else None
    return chunks + turns + len(normalize(request.question)) + len(normalize(system or ""))


def check_fits(request: Request, context_window: int, chars_per_token: int) -> None:
    """PromptTooLongError when the request's text has more characters than the context window could hold even if every
    token were the longest one: refused without tokenizing."""
    bound = context_window * chars_per_token
    if prompt_chars(request) <= bound:
        return
    chars = prompt_chars(request, normalize_text)  # the engine strips whitespace first: count what it keeps
    if chars > bound:
        raise PromptTooLongError(f"the prompt's {chars} characters cannot fit the model's context window of "
                                 f"{context_window} tokens (at most {chars_per_token} characters a token); send "
                                 "fewer or shorter documents")
