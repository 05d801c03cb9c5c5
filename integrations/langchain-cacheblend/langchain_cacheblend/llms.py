"""`CacheBlendLLM`: a LangChain LLM (string in, string out) over a `CacheBlendEngine`.

Where it finds the chunks of a prompt, in order: an explicit `chunks=` keyword; the chunks a
`CacheBlendPromptValue`'s string form carries (`PromptText`: LangChain hands the LLM `value.to_string()`);
otherwise the prompt string goes to `engine.generate_prompt`, which finds every stored chunk that appears in it
verbatim — so a user's own `PromptTemplate` gets the reuse too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.fuse.prefill import stats_summary
from cacheblend_rag.ingest.chunks import Chunk
from cacheblend_rag.request import Request
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import AliasChoices, ConfigDict, Field

from ._common import EngineFields, call_settings, check_call_kwargs, learn_retrieved
from ._common import close_stream as _close
from .prompts import PromptText

__all__ = ["CacheBlendLLM"]


@dataclass(frozen=True)
class _CallInput:
    chunks: list[str | Chunk] | None  # None: the engine finds the stored chunks in the prompt itself
    question: str
    source: str  # kwarg | prompt_value | prompt


class CacheBlendLLM(EngineFields, BaseLLM):
    """A LangChain LLM over a `CacheBlendEngine`: any prompt's stored chunks are answered from their cached KV.

    Drop-in for `HuggingFacePipeline`: keep your own `PromptTemplate`; chunks that appear in the prompt verbatim
    reuse their KV. `CacheBlendLLM(model=..., kv_store=...)` builds its engine on first use.

    Example:
        >>> from langchain_core.prompts import PromptTemplate
        >>> llm = CacheBlendLLM(engine=engine, max_new_tokens=8)
        >>> chain = PromptTemplate.from_template("Context: {context}\\nQuestion: {question}\\nAnswer:") | llm
        >>> isinstance(chain.invoke({"context": "Bees have five eyes.", "question": "How many eyes?"}), str)
        True
        >>> isinstance(llm.invoke("Say hi.", max_tokens=2, recompute_ratio=0.3), str)  # per-call settings
        True
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True, extra="forbid")

    max_new_tokens: int = Field(default=64, ge=1, validation_alias=AliasChoices("max_new_tokens", "max_tokens"))
    """Most tokens to generate (alias `max_tokens`)."""
    chat_template: bool = True
    """Send a prompt to an instruct model inside its chat template, as one user turn (as LlamaIndex's
    `HuggingFaceLLM` does): bare text makes such a model answer poorly or not at all. False sends the text as is;
    a model without a chat template always gets it as is."""

    @property
    def _llm_type(self) -> str:
        return "cacheblend"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self._identifying_fields(), "max_new_tokens": self.max_new_tokens,
                "chat_template": self.chat_template}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(ls_provider="cacheblend", ls_model_name=kwargs.get("model") or self.model_name,
                      ls_max_tokens=kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens)),
                      ls_temperature=kwargs.get("temperature", self.temperature))
        return params

    def _request(self, prompt: str, kwargs: dict[str, Any]) -> _CallInput:
        if kwargs.get("chunks") is not None:
            question = kwargs.get("question")
            return _CallInput(list(kwargs["chunks"]), question if question is not None else prompt, "kwarg")
        if isinstance(prompt, PromptText):  # a CacheBlendPromptValue's string form: its chunks travel on it
            return _CallInput(list(prompt.chunk_texts), prompt.question, "prompt_value")
        return _CallInput(None, prompt, "prompt")

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        check_call_kwargs(type(self).__name__, kwargs, extra=("chunks", "question"))
        return call_settings(self, self.max_new_tokens, stop, kwargs)

    @staticmethod
    def _info(stats: dict, request: _CallInput) -> dict[str, Any]:
        info = stats_summary(stats, request.chunks)  # the chunks it was given, or those found in the prompt
        info["chunks_from"] = request.source
        return info

    def _prompt(self, engine: CacheBlendEngine, text: str) -> str | list[dict[str, str]]:
        """The prompt as the model gets it: one user turn of its chat template, or the text as is."""
        if self.chat_template and engine.has_chat_template:
            return [{"role": "user", "content": text}]
        return text

    def _engine_request(self, engine: CacheBlendEngine, request: _CallInput, settings: dict[str, Any]) -> Request:
        """The engine's request: the given chunks and question, or the prompt in which the engine finds them."""
        if request.chunks is None:
            return Request.of(prompt=self._prompt(engine, request.question), **settings)
        return Request.of(request.chunks, request.question, **settings)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        engine = self.get_engine()
        settings = self._settings(stop, kwargs)
        generations, infos = [], []
        for prompt in prompts:
            request = self._request(prompt, kwargs)
            out = engine.generate_request(self._engine_request(engine, request, settings))
            info = self._info(out.stats, request)
            infos.append(info)
            generations.append([Generation(text=out.text, generation_info=info)])
            learn_retrieved(self, run_manager, prompt)
        return LLMResult(generations=generations, llm_output={"model_name": engine.model_name, "requests": infos})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine = self.get_engine()
        settings = self._settings(stop, kwargs)
        request = self._request(prompt, kwargs)
        stats: dict = {}
        pieces = engine.stream_request(self._engine_request(engine, request, settings), stats)
        try:
            for piece in pieces:
                chunk = GenerationChunk(text=piece)
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        finally:
            _close(pieces)  # a consumer that stops early ends the engine's stream (and its decoding) too
        learn_retrieved(self, run_manager, prompt)
        yield GenerationChunk(text="", generation_info=self._info(stats, request))
