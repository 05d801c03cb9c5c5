"""`ChatCacheBlend`: a LangChain chat model over a `CacheBlendEngine`, with the model's own chat template.

Messages become `[{"role", "content"}]` and go to `engine.generate_prompt`, which renders them with the model's
chat template and reuses the cached KV of every stored chunk that appears in them verbatim — whatever system
prompt, template or separators the user's chain put around the chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import AliasChoices, ConfigDict, Field

from ._common import EngineFields, call_settings, check_call_kwargs, close_stream, stats_info, usage

__all__ = ["ChatCacheBlend", "to_chat_messages"]

_ROLES = {"system": "system", "human": "user", "ai": "assistant"}


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
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ConfigError(f"ChatCacheBlend takes text only; a {message.type} message has a {kind!r} block "
                              f"(images, audio, files and tool calls are not supported by this model)")
    return "".join(parts)


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as `[{"role", "content"}]` for the model's chat template (text only, no tools)."""
    out = []
    for message in messages:
        if isinstance(message, ChatMessage):
            role = message.role
        elif isinstance(message, (SystemMessage, HumanMessage, AIMessage)):
            role = _ROLES[message.type]
        else:
            raise ConfigError(f"ChatCacheBlend cannot take a {type(message).__name__}: the model has no tool "
                              f"calling; pass system, human and AI messages")
        if isinstance(message, AIMessage) and message.tool_calls:
            raise ConfigError("ChatCacheBlend cannot take an AIMessage with tool calls: the model has no tool calling")
        out.append({"role": role, "content": _text(message)})
    return out


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
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True, extra="forbid")

    max_tokens: int = Field(default=256, ge=1, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    """Most tokens to generate (alias `max_new_tokens`)."""
    streaming: bool = False
    """Whether `invoke` streams internally (callbacks see each token)."""

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
        """Prompt tokens of these messages as the model's chat template renders them."""
        if tools:
            raise ConfigError("ChatCacheBlend has no tool calling; count messages without tools")
        tokenizer = self.get_engine().tokenizer
        rendered = to_chat_messages(messages)
        if getattr(tokenizer, "chat_template", None):
            return len(tokenizer.apply_chat_template(rendered, tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"])
        return sum(len(self.get_token_ids(m["content"])) for m in rendered)

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        check_call_kwargs(type(self).__name__, kwargs)
        return call_settings(self, self.max_tokens, stop, kwargs)

    def _metadata(self, engine: CacheBlendEngine, stats: dict) -> dict[str, Any]:
        return {"model_name": engine.model_name, "model_provider": "cacheblend", "cacheblend": stats_info(stats)}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            chunks = list(self._stream(messages, stop=stop, run_manager=run_manager, **kwargs))
            message = chunks[0].message
            for chunk in chunks[1:]:
                message = message + chunk.message
            return ChatResult(generations=[ChatGeneration(message=AIMessage(
                content=message.content, usage_metadata=message.usage_metadata,
                response_metadata=message.response_metadata))])
        engine = self.get_engine()
        settings = self._settings(stop, kwargs)
        out = engine.generate_prompt(to_chat_messages(messages), **settings)
        message = AIMessage(content=out.text, usage_metadata=usage(out.stats),
                            response_metadata=self._metadata(engine, out.stats))
        return ChatResult(generations=[ChatGeneration(message=message)], llm_output={"model_name": engine.model_name})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        engine = self.get_engine()
        settings = self._settings(stop, kwargs)
        stats: dict = {}
        pieces = engine.stream_prompt(to_chat_messages(messages), stats=stats, **settings)
        try:
            for piece in pieces:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        finally:
            close_stream(pieces)  # a consumer that stops early ends the engine's stream (and its decoding) too
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage(stats), response_metadata=self._metadata(engine, stats),
            chunk_position="last"))
