"""`ChatCacheBlend`: a LangChain chat model over a `CacheBlendEngine`, with the model's own chat template.

Messages become `[{"role", "content"}]` and go to `engine.generate_prompt`, which renders them with the model's
chat template and reuses the cached KV of every stored chunk that appears in them verbatim — whatever system
prompt, template or separators the user's chain put around the chunks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.policies import METHODS
from cacheblend_rag.models.loader import DEFAULT_MODEL
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
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ._common import call_settings, check_call_kwargs, close_stream, expand_path, stats_info, usage

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


class ChatCacheBlend(BaseChatModel):
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

    engine: Any = Field(default=None, exclude=True)
    """A ready `CacheBlendEngine`; when None one is built on first use from `model`, `kv_store` and `home`."""
    model: str = DEFAULT_MODEL
    """Packaged model alias or local model folder; with `engine`, the engine's own model name replaces it."""
    kv_store: str | None = None
    """KV store folder for a lazily built engine (None: in memory; `~` is expanded)."""
    home: str | None = None
    """Package home for a lazily built engine (converted models); None: $CACHEBLEND_RAG_HOME or the default."""
    device: str = "auto"
    """Device of a lazily built engine."""
    dtype: str = "auto"
    """Dtype of a lazily built engine."""
    method: str = "cacheblend"
    """Prefill method: full_prefill, prefix_cache, full_reuse or cacheblend."""
    recompute_ratio: float = 0.15
    """Share of reused chunk tokens recomputed per layer (cacheblend only)."""
    max_tokens: int = Field(default=256, ge=1, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    """Most tokens to generate (alias `max_new_tokens`)."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (with temperature > 0)."""
    seed: int | None = None
    """Sampling seed."""
    stop: list[str] | None = None
    """Stop strings used when a call passes none (generation ends before the first one)."""
    streaming: bool = False
    """Whether `invoke` streams internally (callbacks see each token)."""

    _build_lock: Any = PrivateAttr(default_factory=threading.Lock)

    @field_validator("method")
    @classmethod
    def _check_method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {value!r}")
        return value

    @field_validator("recompute_ratio")
    @classmethod
    def _check_ratio(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"recompute_ratio must be within [0, 1], got {value}")
        return value

    @model_validator(mode="after")
    def _name_from_engine(self) -> "ChatCacheBlend":
        if self.engine is not None:
            self.model = self.engine.model_name  # what the engine really holds, never a default alias
        self.kv_store = expand_path(self.kv_store)
        return self

    @classmethod
    def from_model_id(cls, model: str = DEFAULT_MODEL, kv_store: str | None = None, **kwargs: Any) -> "ChatCacheBlend":
        """Load the model now (instead of on first use) and wrap it."""
        chat = cls(model=model, kv_store=kv_store, **kwargs)
        chat.get_engine()
        return chat

    def get_engine(self) -> CacheBlendEngine:
        """The engine, built on first use when none was given."""
        if self.engine is None:
            with self._build_lock:
                if self.engine is None:
                    self.engine = CacheBlendEngine.from_pretrained(
                        self.model, kv_store=self.kv_store, device=self.device, dtype=self.dtype, home=self.home
                    )
        return self.engine

    @property
    def model_name(self) -> str:
        """The engine's model name (the `model` field until a lazily built engine exists)."""
        return self.engine.model_name if self.engine is not None else self.model

    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.get_engine().model_name, "method": self.method,
                "recompute_ratio": self.recompute_ratio, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

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

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (the default would fetch GPT-2 from a hub)."""
        return self.get_engine().tokenizer(text, add_special_tokens=False)["input_ids"]

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
