"""`ChatCacheBlend`: a LangChain chat model over a `CacheBlendEngine`, with the model's own chat template.

Messages become `[{"role", "content"}]` and go to `engine.generate_prompt`, which renders them with the model's
chat template and reuses the cached KV of every stored chunk that appears in them verbatim — whatever system
prompt, template or separators the user's chain put around the chunks.

Tool calling and structured output run on the engine's constrained decoding (`SamplingOptions.grammar`): bound
tools use the chat template's own tool format where it has one (`ToolFormat.of`: the template lists the tools
and renders calls and `tool` results itself; the grammar forces its call syntax), else `cacheblend_rag.tools`'
generic format (a call is `<tool_call>{"name", "arguments"}</tool_call>`, a tool's result a `<tool_response>` user
message), and `response_format` a JSON schema the answer must match.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import Any, Literal

from cacheblend_rag import tools as generic_tools
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.prefill import stats_summary
from cacheblend_rag.request import Request
from cacheblend_rag.tool_format import GENERIC, ToolFormat
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr

from ._common import EngineFields, call_settings, check_call_kwargs, close_stream, learn_retrieved, usage

__all__ = ["ChatCacheBlend", "StructuredOutputError", "to_chat_messages"]

logger = logging.getLogger(__name__)

TOOL_KWARGS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "strict")
"""Per-call keyword arguments of tool calling and structured output (set by `bind_tools` / `with_structured_output`)."""


class StructuredOutputError(OutputParserException):
    """The constrained answer was cut by max_tokens before it was complete (it would not parse).

    Example:
        >>> from pydantic import BaseModel
        >>> class Age(BaseModel):
        ...     age: int
        >>> try:
        ...     ChatCacheBlend(engine=engine, max_tokens=2).with_structured_output(Age).invoke("Bob is 42.")
        ... except StructuredOutputError as e:
        ...     print("cut: raise max_tokens")
        cut: raise max_tokens
    """

_ROLES = MappingProxyType({"system": "system", "human": "user", "ai": "assistant"})


_CALL_BLOCKS = ("tool_call", "tool_use", "tool_call_chunk", "function_call")  # an AIMessage's calls, as blocks


def _text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(message, AIMessage) and isinstance(block, dict) and block.get("type") in _CALL_BLOCKS:
            continue  # rendered from message.tool_calls
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ConfigError(f"ChatCacheBlend takes text only; a {message.type} message has a {kind!r} block "
                              f"(images, audio, files and tool calls are not supported by this model)")
    return "".join(parts)


def to_chat_messages(messages: Sequence[BaseMessage], fmt: ToolFormat = GENERIC) -> list[dict[str, Any]]:
    """LangChain messages as `[{"role", "content"}]` for the model's chat template: an AIMessage's tool calls and
    a ToolMessage's result in the tool format `fmt` (`ToolFormat.of(tokenizer)`: the template's own `tool_calls`
    and `tool` messages, or the generic format's text), results verbatim."""
    return fmt.chat_messages(_shaped(messages))


def _shaped(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages in OpenAI's shape (an AIMessage's `tool_calls: [{"id", "name", "arguments"}]`, a
    ToolMessage as `{"role": "tool", "content", "tool_call_id"}`), before a tool format renders them."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, ToolMessage):
            out.append({"role": "tool", "content": _text(message), "tool_call_id": message.tool_call_id})
            continue
        if isinstance(message, ChatMessage):
            role = message.role
        elif isinstance(message, (SystemMessage, HumanMessage, AIMessage)):
            role = _ROLES[message.type]
        else:
            raise ConfigError(f"ChatCacheBlend cannot take a {type(message).__name__}; pass system, human, AI "
                              f"and tool messages")
        out.append({"role": role, "content": _text(message)})
        if isinstance(message, AIMessage) and message.tool_calls:
            out[-1]["tool_calls"] = [{"id": c.get("id"), "name": c["name"], "arguments": c["args"]}
                                     for c in message.tool_calls]
    return out


def _check_complete(message: BaseMessage) -> BaseMessage:
    """The message, or StructuredOutputError when its constrained answer was cut by max_tokens."""
    if isinstance(message, AIMessage) and message.response_metadata.get("grammar_satisfied") is False:
        raise StructuredOutputError(
            "the structured answer was cut at max_tokens before it was complete; raise max_tokens",
            llm_output=str(message.content))
    return message


def _calls_repr(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as `{"name", "args"}` (for a log line and `response_metadata["repeated_call"]`)."""
    return [{"name": c["name"], "args": c["args"]} for c in calls]


def _log_repeat(calls: Sequence[dict[str, Any]]) -> None:
    logger.info("tool_choice 'auto': the answer repeats calls whose results the conversation holds (%s); answering "
                "again with tool_choice 'none'", _calls_repr(calls))


def _tool_call(call: generic_tools.ToolCall) -> dict[str, Any]:
    """A LangChain ToolCall dict."""
    return {"name": call.name, "args": call.arguments, "id": call.id, "type": "tool_call"}


class ChatCacheBlend(EngineFields, BaseChatModel):
    """A LangChain chat model over a `CacheBlendEngine`: retrieved chunks in the messages reuse their cached KV.

    Drop-in for `ChatHuggingFace`: keep your own `ChatPromptTemplate` (system prompt included). Stats of each
    answer are in `AIMessage.response_metadata["cacheblend"]` (chunk_hits, chunk_misses, recomputed_share,
    ttft_s, ...) and token counts in `usage_metadata` (`input_token_details["cache_read"]`: prompt tokens whose
    KV came from the store). `ChatCacheBlend(model=NAME, kv_store=PATH)` builds its engine on first use.

    Example:
        >>> from langchain_core.messages import HumanMessage, SystemMessage
        >>> chat = ChatCacheBlend(engine=engine, max_tokens=8)
        >>> reply = chat.invoke([SystemMessage("Answer briefly."), HumanMessage("Bees have five eyes. How many eyes?")])
        >>> reply.usage_metadata["output_tokens"] <= 8, "chunk_hits" in reply.response_metadata["cacheblend"]
        (True, True)
        >>> pieces = [chunk.content for chunk in chat.stream("Say hi.", max_tokens=3)]
        >>> from pydantic import BaseModel
        >>> class Person(BaseModel):
        ...     name: str
        ...     age: int
        >>> ChatCacheBlend(engine=engine, max_tokens=32).with_structured_output(Person).invoke("Alice is 30.")
        Person(name='Alice', age=30)
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True, extra="forbid")

    max_tokens: int = Field(default=256, ge=1, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    """Most tokens to generate (alias `max_new_tokens`)."""
    streaming: bool = False
    """Whether `invoke` streams internally (callbacks see each token)."""
    timeout: float | None = Field(default=None, gt=0)
    """Per-request deadline in seconds (None: none): decoding stops and TimeoutError is raised once it passes;
    checked between tokens, so a prefill already running finishes first."""
    max_retries: int | None = Field(default=None, ge=0)
    """Accepted for code written for hosted chat models; a no-op: a local model has no transient network errors
    to retry."""
    api_key: SecretStr | None = None
    """Accepted for code written for hosted chat models and ignored: a local model needs no key."""

    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self._identifying_fields(), "max_tokens": self.max_tokens}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params: dict[str, Any] = {
            "ls_provider": "cacheblend", "ls_model_type": "chat",
            "ls_model_name": kwargs.get("model") or self.model_name,
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens)),
        }
        stop = stop if stop is not None else self.stop
        if stop:
            params["ls_stop"] = stop
        return params

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Prompt tokens of these messages as the model's chat template renders them (with `tools`: listed as
        `bind_tools` lists them, by the template or in the generic format's system text)."""
        tokenizer = self.get_engine().tokenizer
        fmt = ToolFormat.of(tokenizer)
        turn = generic_tools.tool_turn(to_chat_messages(messages, fmt),
                                       [convert_to_openai_tool(t) for t in tools or ()], fmt=fmt)
        rendered = turn.messages
        if getattr(tokenizer, "chat_template", None):
            return len(tokenizer.apply_chat_template(rendered, tools=turn.tools, tokenize=True,
                                                     add_generation_prompt=True, return_dict=True)["input_ids"])
        return sum(len(self.get_token_ids(m["content"])) for m in rendered)

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        check_call_kwargs(type(self).__name__, kwargs, extra=TOOL_KWARGS)
        settings = call_settings(self, self.max_tokens, stop, {k: v for k, v in kwargs.items() if k not in TOOL_KWARGS})
        if kwargs.get("response_format") is not None:
            if kwargs.get("tools"):
                raise ConfigError("pass tools or response_format, not both (use with_structured_output or bind_tools)")
            settings["grammar"] = generic_tools.response_grammar(kwargs["response_format"])
        return settings

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any],
                 answer: bool = False
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], generic_tools.ToolTurn, ToolFormat]:
        """(chat messages, engine settings, the tool turn, the tool format) of one call: with tools, they are
        listed (by the chat template in its own format, else in the generic format's system text) and the grammar
        forces a call or a plain answer as `tool_choice` says. `answer`: the plain answer after an "auto" answer
        that only repeated answered calls (`cacheblend_rag.tools.answer_turn`)."""
        settings = self._settings(stop, kwargs)
        fmt = ToolFormat.of(self.get_engine().tokenizer)
        shaped = _shaped(messages)
        chat = fmt.chat_messages(shaped)
        schema = ((kwargs.get("response_format") or {}).get("json_schema") or {}).get("schema")
        if schema is not None:
            chat = generic_tools.with_system_text(chat, generic_tools.schema_prompt(schema))
        # bind_tools(..., parallel_tool_calls=True) lets an answer hold several calls
        turn = generic_tools.chat_turn(shaped, kwargs.get("tools") or [], kwargs.get("tool_choice"),
                                       bool(kwargs.get("parallel_tool_calls")), fmt, answer, chat)
        settings.update(turn.request_settings())
        return turn.messages, settings, turn, fmt

    def _metadata(self, engine: CacheBlendEngine, stats: dict) -> dict[str, Any]:
        meta = {"model_name": engine.model_name, "model_provider": "cacheblend", "cacheblend": stats_summary(stats)}
        if "finish_reason" in stats:
            meta["finish_reason"] = stats["finish_reason"]
        if stats.get("grammar_satisfied") is not None:
            meta["grammar_satisfied"] = stats["grammar_satisfied"]
        return meta

    def _message(self, text: str, stats: dict, engine: CacheBlendEngine, functions: list[dict[str, Any]],
                 fmt: ToolFormat) -> AIMessage:
        """The answer as an AIMessage: a well-formed call to a bound tool becomes `tool_calls`."""
        content, calls = generic_tools.parse_tool_calls(text, functions, fmt) if functions else (text, [])
        return AIMessage(content=content, tool_calls=[_tool_call(c) for c in calls], usage_metadata=usage(stats),
                         response_metadata=self._metadata(engine, stats))

    def _pieces(self, engine: CacheBlendEngine, chat: list[dict[str, str]], settings: dict[str, Any],
                stats: dict) -> Iterator[str]:
        """The answer's text pieces; past `timeout` the stream is closed (decoding stops) and TimeoutError raised."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        pieces = engine.stream_request(Request.of(prompt=chat, **settings), stats)
        try:
            for piece in pieces:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"ChatCacheBlend exceeded timeout={self.timeout}s; raise timeout or lower "
                                       f"max_tokens")
                yield piece
        finally:
            close_stream(pieces)  # a consumer that stops early ends the engine's stream (and its decoding) too

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._generate_turn(messages, stop, run_manager, kwargs)

    def _generate_turn(self, messages: list[BaseMessage], stop: list[str] | None,
                       run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any], answer: bool = False
                       ) -> ChatResult:
        engine = self.get_engine()
        chat, settings, turn, fmt = self._request(messages, stop, kwargs, answer)
        functions = turn.functions
        if self.streaming or self.timeout is not None:  # the stream path is the one that can stop at a deadline
            stats: dict = {}
            text = ""
            for piece in self._pieces(engine, chat, settings, stats):
                text += piece
                if run_manager and self.streaming:
                    run_manager.on_llm_new_token(piece, chunk=ChatGenerationChunk(message=AIMessageChunk(content=piece)))
            message = self._message(text.strip(), stats, engine, functions, fmt)
        else:
            out = engine.generate_request(Request.of(prompt=chat, **settings))
            stats = {**out.stats.as_dict(), "finish_reason": out.finish_reason,
                     "grammar_satisfied": out.grammar_satisfied}
            message = self._message(out.text, stats, engine, functions, fmt)
        learn_retrieved(self, run_manager, "\n".join(m["content"] for m in chat))
        if turn.repeats([generic_tools.ToolCall(c["name"], c["args"]) for c in message.tool_calls]):
            # the same call again after its result: an agent would loop on it; answer from the result instead
            _log_repeat(message.tool_calls)
            result = self._generate_turn(messages, stop, run_manager, kwargs, answer=True)
            result.generations[0].message.response_metadata["repeated_call"] = _calls_repr(message.tool_calls)
            return result
        return ChatResult(generations=[ChatGeneration(message=message)], llm_output={"model_name": engine.model_name})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        return self._stream_turn(messages, stop, run_manager, kwargs)

    def _stream_turn(self, messages: list[BaseMessage], stop: list[str] | None,
                     run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any], answer: bool = False
                     ) -> Iterator[ChatGenerationChunk]:
        engine = self.get_engine()
        chat, settings, turn, fmt = self._request(messages, stop, kwargs, answer)
        functions = turn.functions
        stats: dict = {}
        held = ""  # with tools: text that may still become a call is held back until the answer ends
        started = False  # the held text begins a call for good: no need to look at it again each piece
        sent = False
        for piece in self._pieces(engine, chat, settings, stats):
            if functions and (started or generic_tools.may_be_call(held + piece, fmt)):
                held += piece
                started = started or generic_tools.call_started(held, fmt)
                continue
            piece, held, sent = held + piece, "", True
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        content, calls = generic_tools.parse_tool_calls(held, functions, fmt) if held else ("", [])
        if not sent and turn.repeats(calls):  # the same call again after its result (see _generate)
            learn_retrieved(self, run_manager, "\n".join(m["content"] for m in chat))
            _log_repeat([{"name": c.name, "args": c.arguments} for c in calls])
            yield from self._stream_turn(messages, stop, run_manager, kwargs, answer=True)
            return
        chunks = [{"name": c.name, "args": json.dumps(c.arguments), "id": c.id, "index": i, "type": "tool_call_chunk"}
                  for i, c in enumerate(calls)]
        if content or chunks:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=content.strip() if calls else content,
                                                               tool_call_chunks=chunks))
            if run_manager:
                run_manager.on_llm_new_token(content, chunk=chunk)
            yield chunk
        learn_retrieved(self, run_manager, "\n".join(m["content"] for m in chat))
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage(stats), response_metadata=self._metadata(engine, stats),
            chunk_position="last"))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (functions, BaseTools, pydantic / TypedDict classes, OpenAI tool dicts): answers become
        `AIMessage.tool_calls` to them. `tool_choice`: "auto" (default: a call or a plain answer), "any" /
        "required" / True (a call), a tool's name (a call to it), "none" (no call). One call per answer."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            generic_tools.normalize_choice(tool_choice, [t["function"]["name"] for t in formatted])  # fail here
        self._warm_grammars()
        return self.bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def _warm_grammars(self) -> None:
        """Start the grammar compiler's one-time set-up on a background thread (`GrammarCompiler.warm_up`), so a
        first tool call made a while after binding does not pay it (0.5 s on SmolLM2, 1.9 s on Qwen2.5-Coder-0.5B).
        Only an engine already built: binding never loads a model."""
        if self.engine is not None:
            self.engine.grammars.warm_up()

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A runnable answering with an instance of `schema` (a pydantic class; else a dict): pydantic, TypedDict,
        JSON schema or OpenAI tool dict. The answer is constrained to the schema, so it always parses unless
        max_tokens cuts it (StructuredOutputError). `method`: "json_schema" (default: the answer is the JSON),
        "function_calling" (a forced call to a tool shaped like the schema) or "json_mode" (a JSON object: held to
        the schema when one is given, with no system line about it; describe the fields in your prompt). `strict` is accepted for compatibility: the schema is always enforced."""
        if kwargs:
            raise ValueError(f"with_structured_output got unknown keyword argument(s) {', '.join(sorted(kwargs))}")
        if schema is None and method != "json_mode":
            raise ValueError(f"schema must be given for method={method!r}")
        self._warm_grammars()
        pydantic_schema = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"ls_structured_output_format": {"kwargs": {"method": method, "strict": strict},
                                                 "schema": convert_to_json_schema(schema) if schema else None}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **trace)
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic_schema
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if method == "json_mode" and schema is None:
                response_format: dict[str, Any] = {"type": "json_object"}
            elif method == "json_mode":  # any JSON object, as OpenAI's; here also held to the schema it will be
                tool = convert_to_openai_tool(schema)["function"]  # parsed with (no system line: the prompt asks)
                response_format = {"type": "json_object", "schema": tool.get("parameters") or {"type": "object"}}
            else:
                tool = convert_to_openai_tool(schema)["function"]
                response_format = {"type": "json_schema", "json_schema": {
                    "name": tool["name"], "schema": tool.get("parameters") or {"type": "object"}, "strict": True}}
            llm = self.bind(response_format=response_format, **trace)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic_schema else JsonOutputParser()
        else:
            raise ValueError(f"method must be json_schema, function_calling or json_mode, got {method!r}")
        checked = RunnableLambda(_check_complete) | parser
        if include_raw:
            parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | checked, parsing_error=lambda _: None)
            fallback = RunnablePassthrough.assign(parsed=lambda _: None)
            return RunnableMap(raw=llm) | parse.with_fallbacks([fallback], exception_key="parsing_error")
        return llm | checked
