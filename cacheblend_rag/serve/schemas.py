"""Request bodies of the OpenAI-compatible routes, with the RAG extensions, as pydantic models.

OpenAI fields this server does not use (`logprobs`, `presence_penalty`, `user`, ...) are accepted and ignored,
as other OpenAI-compatible servers do, so stock clients work unchanged; fields whose values it cannot honour
(`n > 1`, `best_of > 1`) are rejected with a 400. The RAG extensions (`documents`, `chunk_ids`, `retrieval`,
`cacheblend`) are strict: an unknown key or an out-of-range value is a 400 that names it.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ..decode.generate import SEED_MAX, SEED_MIN
from ..errors import ConfigError
from ..fuse.policies import DEFAULT_METHOD, POLICIES, make_policy, takes_ratio
from ..fuse.policy import Policy
from ..ingest.chunks import looks_like_chunk_id

MAX_STOP = 4  # as OpenAI
MAX_CACHE_SALT = 1024  # characters of a request's cache_salt (a secret or an id, not a document)
MAX_JSON_DEPTH = 64  # nesting (objects and arrays) of a tool's or response_format's schema, and of call arguments
SCHEMA_INT_BOUND = 2**63  # a schema's integers (bounds, consts, enums): the grammar engine's are signed 64-bit
# Chroma's own rule for collection names: 3-512 of [A-Za-z0-9._-], alphanumeric at both ends, no "..", not an IP
_COLLECTION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,510}[A-Za-z0-9]")


def _utf8(value: Any, where: str) -> None:
    """Refuse text that cannot be encoded (a lone surrogate, legal in JSON escapes): the tokenizer would fail."""
    texts = [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)] \
        if isinstance(value, list) else []
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} is not valid text ({e.reason} at position {e.start}); send UTF-8 text") \
                from None


def check_json(value: Any, where: str, *, schema: bool = False) -> None:
    """Refuse a JSON value nested deeper than MAX_JSON_DEPTH and, in a schema, a number the grammar engine cannot
    take (an integer outside ±2^63, a non-finite float): walked without recursion, so any depth is safe to check."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth == MAX_JSON_DEPTH:
                raise ValueError(f"{where}: more than {MAX_JSON_DEPTH} levels of nested objects and arrays")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
        elif schema and isinstance(item, int) and not isinstance(item, bool) \
                and not -SCHEMA_INT_BOUND <= item < SCHEMA_INT_BOUND:
            raise ValueError(f"{where}: an integer outside the signed 64-bit range (±2^63) the grammar engine takes")
        elif schema and isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{where}: a number that is not finite")


def _compilable_schema(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A field validator: a JSON schema the grammar engine can compile (`check_json`)."""
    check_json(value, "the schema", schema=True)
    return value


class _Body(BaseModel):
    """A part of a request body: its text fields must be encodable text."""

    @field_validator("*")
    @classmethod
    def _encodable(cls, value: Any, info) -> Any:
        _utf8(value, info.field_name)
        return value


class Document(_Body):
    """A passage given inline: its text, with an optional client-side id (echoed in the stats)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    """The client's label for the passage; with no `text`, a stored chunk id."""
    text: str | None = None
    """The passage; its KV is computed once and reused by later requests that send the same text."""

    @model_validator(mode="after")
    def _text_or_id(self) -> "Document":
        if self.text is None and self.id is None:
            raise ValueError("a document needs `text` (or the `id` of a stored chunk)")
        if self.text is None and not looks_like_chunk_id(self.id or ""):
            raise ValueError(f"document id {self.id!r} is not a chunk id; send its `text` as well")
        if self.text is not None and not self.text.strip():
            raise ValueError("a document's text must not be empty")
        return self


class Retrieval(_Body):
    """Retrieve passages from the server's Chroma collection with the question (the last user message)."""

    model_config = ConfigDict(extra="forbid")

    collection: str = Field(default="cacheblend_chunks", min_length=3, max_length=512)
    """Chroma collection filled by `cacheblend-rag ingest --collection NAME` with the same home."""
    k: int = Field(default=6, ge=1, le=64)
    """How many chunks to retrieve."""

    @field_validator("collection")
    @classmethod
    def _chroma_name(cls, value: str) -> str:
        if not _COLLECTION_NAME.fullmatch(value) or ".." in value or _is_ip(value):
            raise ValueError(f"{value!r} is not a collection name: 3 to 512 letters, digits, '.', '_' or '-', "
                             "starting and ending with a letter or digit, no '..'")
        return value


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class CacheBlendOptions(_Body):
    """How the prompt's chunks are fused: the engine's method and that method's own options, whichever policy of
    the registry it is (`fuse.policies.POLICIES`): e.g. {"method": "cacheblend", "recompute_ratio": 0.3,
    "check_layers": [1, 2]} or {"method": "cachecraft", "alpha": 0.5, "guard": 0.1}. An option the method does not
    take, or a value it refuses, is a 400 naming it (the policy's own check, as every surface runs it). The policy
    is built once, when the body is validated, and kept (`policy`): the request runs that one."""

    model_config = ConfigDict(extra="allow")  # the method's options: checked by the policy itself, below
    _policy: Policy = PrivateAttr()  # set by the validator below

    method: str = DEFAULT_METHOD
    """Any method of the policy registry (`fuse.policies.POLICIES`), one registered by a plugin included."""
    recompute_ratio: float | Literal["auto"] | None = None
    """Share of reused tokens recomputed, within [0, 1], or "auto" (the loading controller)."""

    @field_validator("method")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown method {value!r}; use one of {', '.join(POLICIES)}")
        return value

    @model_validator(mode="after")
    def _the_policy_takes_them(self) -> "CacheBlendOptions":
        if self.auto_ratio and not takes_ratio(POLICIES[self.method]):
            raise ValueError(f'recompute_ratio "auto" needs a method with a recompute ratio, not {self.method!r}')
        try:  # `recompute_ratio="auto"` leaves the ratio to the engine
            self._policy = make_policy(self.method, None if self.auto_ratio else self.recompute_ratio,
                                       **self.policy_options())
        except (ConfigError, TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def auto_ratio(self) -> bool:
        """Whether the loading controller chooses the recompute ratio."""
        return self.recompute_ratio == "auto"

    @property
    def calibrated_ratio(self) -> bool:
        """Whether the body named no ratio for a method that has one: the model's calibrated ratio applies."""
        return self.recompute_ratio is None and takes_ratio(POLICIES[self.method])

    @property
    def policy(self) -> Policy:
        """The method's policy with these options, built when they were validated."""
        return self._policy

    def policy_options(self) -> dict[str, Any]:
        """The method's options that were set, as the engine takes them (lists as tuples)."""
        return {name: tuple(value) if isinstance(value, list) else value
                for name, value in (self.model_extra or {}).items() if value is not None}


class StreamOptions(_Body):
    """OpenAI's `stream_options`."""

    include_usage: bool = False


class _Generation(_Body):
    """Fields shared by both routes: sampling, streaming and the RAG extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(default=1, json_schema_extra={"enum": [1]})  # the schema says what the validator below takes
    stream: bool = False
    stream_options: StreamOptions | None = None

    documents: list[str | Document] | None = None
    """Passages whose KV is cached and fused: texts or `{"id", "text"}` objects."""
    chunk_ids: list[str] | None = None
    """Ids of chunks already stored (by `cacheblend-rag ingest` or an earlier request)."""
    retrieval: Retrieval | None = None
    """Retrieve passages from the server's Chroma collection."""
    cacheblend: CacheBlendOptions = Field(default_factory=CacheBlendOptions)
    """The fusion method and its options."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    """As vLLM's: requests with different salts never reuse each other's cached prompts (stored prefixes,
    segments, documents they sent), so none can tell from its usage or timing what another sent; within the API
    key's own namespace, with which it combines."""

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        return [s for s in stops if s] or None

    @field_validator("chunk_ids")
    @classmethod
    def _chunk_id_shape(cls, value: list[str] | None) -> list[str] | None:
        for cid in value or []:
            if not looks_like_chunk_id(cid):
                raise ValueError(f"{cid!r} is not a chunk id; pass passage texts in `documents` instead")
        return value

    @field_validator("documents")
    @classmethod
    def _no_empty_texts(cls, value: list[str | Document] | None) -> list[str | Document] | None:
        for doc in value or []:
            if isinstance(doc, str) and not doc.strip():
                raise ValueError("a document's text must not be empty")
        return value

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    """One part of a message's content; only text parts are understood."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(_Body):
    """The function an assistant message called: its name and its arguments as JSON text."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _not_too_deep(cls, value: str) -> str:
        try:
            check_json(json.loads(value), "the call's arguments")
        except RecursionError:
            raise ValueError(f"the call's arguments: more than {MAX_JSON_DEPTH} levels of nested objects and arrays") \
                from None
        except json.JSONDecodeError:
            pass  # said when the chat is rendered, naming the call
        return value


class MessageToolCall(_Body):
    """One tool call of an earlier assistant message (`message.tool_calls[i]` sent back)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One chat message: an assistant's may carry `tool_calls` (content null), a tool's result is `role: "tool"`
    with `tool_call_id`."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (text parts joined); other parts are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"only text content parts are supported, got {part.type!r}")
        return "".join(part.text or "" for part in self.content)


class FunctionSpec(_Body):
    """A tool's function: its name, what it does, and the JSON schema of its arguments."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule for names
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; the arguments' schema is always enforced

    _compilable = field_validator("parameters")(_compilable_schema)


class Tool(_Body):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class JSONSchemaFormat(_Body):
    """`response_format.json_schema`: the schema the answer must match."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced

    _compilable = field_validator("schema_")(_compilable_schema)


class ResponseFormat(_Body):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid for a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('response_format {"type": "json_schema"} needs json_schema.schema: '
                             '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}')
        return self

    def as_dict(self) -> dict[str, Any]:
        """The format as `cacheblend_rag.tools.response_schema` takes it."""
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_,
                                  "strict": self.json_schema.strict}
        return out


class ChatCompletionRequest(_Generation):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # true: one or more calls per answer; else one (docs/serve.md)
    response_format: ResponseFormat | None = None

    def new_tokens(self, default: int) -> int:
        """The most tokens to generate."""
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Generation):
    """`POST /v1/completions`."""

    prompt: str | list[str]
    best_of: int | None = Field(default=None, json_schema_extra={"enum": [1, None]})
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"exactly one prompt is supported, got {len(value)}")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {value}")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    def prompt_text(self) -> str:
        """The one prompt."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def new_tokens(self, default: int) -> int:
        """The most tokens to generate (OpenAI's legacy default is 16)."""
        return self.max_tokens or default


def openapi_body(model: type[BaseModel], served: tuple[str, ...]) -> dict[str, Any]:
    """The route's `requestBody` for the app's OpenAPI document (`app.openapi()`): the routes read their bodies
    themselves (`app._Server.read`), so FastAPI cannot describe them; the model's JSON schema with its definitions
    written in place, so it stands alone inside the document (Schemathesis fuzzes the server from it), and the
    names of the model the server serves (`served`) as the only values of `model`."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    schema["properties"]["model"] = {**schema["properties"]["model"], "enum": list(served)}

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline({**definitions[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items()
                                                                                if k != "$ref"}})
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
