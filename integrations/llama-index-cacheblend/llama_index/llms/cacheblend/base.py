"""`CacheBlendLLM`: a LlamaIndex LLM over a `CacheBlendEngine`, used the standard way (`Settings.llm`).

Every prompt — LlamaIndex's own text-QA / refine templates, chat messages of a chat engine — goes to
`engine.generate_prompt`, which reuses the cached KV of each stored chunk that appears in it verbatim.
The stats of each call are in the response's `additional_kwargs`, and a query's stats in its
`Response.metadata["cacheblend"]` (attached at the query's end by `QueryStatsHandler`, an instrumentation handler
that keeps each request's facts by span tree).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from cacheblend_rag import tools as generic_tools
from cacheblend_rag.tool_format import GENERIC, ToolFormat
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.fuse.prefill import stats_summary
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.policies import all_option_names, check_not_options
from cacheblend_rag.ingest.chunks import looks_like_chunk_id, normalize_text
from cacheblend_rag.models.loader import DEFAULT_MODEL
from cacheblend_rag.request import DEFAULT_METHOD, Request, call_keywords, default_policy
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.span import SimpleSpan, active_span_id
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.schema import MetadataMode
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

__all__ = ["CacheBlendLLM", "QueryStatsHandler"]

logger = logging.getLogger(__name__)

CALL_SETTINGS = ("method", "recompute_ratio", "max_tokens", "max_new_tokens", "temperature", "top_p", "seed",
                 "stop", "do_sample", "chunks", "question", "formatted", "grammar", "tools")


def _call_settings() -> set[str]:
    """Keyword arguments a call (or `generate_kwargs`) accepts: the settings and the policies' options."""
    return set(CALL_SETTINGS) | all_option_names()


MAX_RETRIEVED = 64  # retrieved texts kept per request (the latest last)


def query_stats(calls: Sequence[dict]) -> dict[str, Any]:
    """One query's stats from its LLM calls: one call's own dict (filled live when streaming), or a merge."""
    if len(calls) == 1:
        return calls[0]
    hits = [cid for c in calls for cid in c.get("chunk_hits", ())]
    misses = [cid for c in calls for cid in c.get("chunk_misses", ())]
    return {"calls": list(calls), "chunk_hits": list(dict.fromkeys(hits)),
            "chunk_misses": list(dict.fromkeys(misses)),
            "ttft_s": calls[0].get("ttft_s") if calls else None,
            "num_reused": sum(c.get("num_reused", 0) for c in calls),
            "num_recomputed": sum(c.get("num_recomputed", 0) for c in calls)}


@dataclass
class _Request:
    """What one request's span tree (a query, a chat turn: a root span and all it calls) holds for the
    CacheBlendLLM calls in it."""

    retrieved: list[str] = field(default_factory=list)
    """Texts of the nodes its retrievers returned, the latest last (at most `MAX_RETRIEVED`)."""
    queries: dict[str, list[dict]] = field(default_factory=dict)
    """Its queries in progress, by span: the stats of their LLM calls."""


class QueryStatsHandler(BaseEventHandler, BaseSpanHandler[SimpleSpan]):
    """What each request's span tree holds for the CacheBlendLLM calls in it: the stats of a query's calls, put
    into its `Response.metadata["cacheblend"]`, and the texts its retrievers returned, which the LLM learns when
    its prompt carries them (`learn_retrieved`).

    LlamaIndex's own instrumentation carries the request: the handler listens to the root dispatcher's spans
    (where each one sits in its tree) and events (a query's start and end, a retriever's nodes), and keeps the
    facts by tree; the LLM finds its own tree from its call's span (`active_span_id`). Registered once on the root
    dispatcher, as event and span handler, when the first CacheBlendLLM is built. A span's place is kept after it
    ends (a stream read after its query, a chat engine's writer thread still find their tree), so both maps are
    bounded (`MAX_SPANS`, `MAX_REQUESTS`: the least recently used go) and locked.

    Example:
        >>> handler = install_query_stats_handler()
        >>> handler is install_query_stats_handler(), isinstance(handler, QueryStatsHandler)
        (True, True)
    """

    MAX_SPANS: ClassVar[int] = 16384
    MAX_REQUESTS: ClassVar[int] = 256
    _parents: OrderedDict[str, str | None] = PrivateAttr(default_factory=OrderedDict)
    _requests: OrderedDict[str, _Request] = PrivateAttr(default_factory=OrderedDict)  # by root span
    _facts_lock: Any = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        """Registry name."""
        return "CacheBlendQueryStatsHandler"

    def new_span(self, id_: str, bound_args: Any, instance: Any = None, parent_span_id: str | None = None,
                 tags: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Note where the span sits (no span object is kept: the base class's `open_spans` stays empty)."""
        with self._facts_lock:
            self._parents[id_] = parent_span_id
            while len(self._parents) > self.MAX_SPANS:
                self._parents.popitem(last=False)

    def prepare_to_exit_span(self, id_: str, bound_args: Any, instance: Any = None, result: Any = None,
                             **kwargs: Any) -> None:
        """Nothing: the span's place is kept for what its tree still runs after it (see the class)."""

    def prepare_to_drop_span(self, id_: str, bound_args: Any, instance: Any = None,
                             err: BaseException | None = None, **kwargs: Any) -> None:
        """Nothing, as at a span's end."""

    def _chain(self, span_id: str | None) -> list[str]:
        """The span and those above it, innermost first (the lock held)."""
        chain: list[str] = []
        while span_id is not None and len(chain) < self.MAX_SPANS:
            chain.append(span_id)
            if span_id in self._parents:
                self._parents.move_to_end(span_id)  # a tree in use is the last to be forgotten
            span_id = self._parents.get(span_id)
        return chain

    def _request(self, span_id: str | None, create: bool = False) -> tuple[list[str], _Request | None]:
        """(the span's chain, its tree's facts: made with `create`), the lock held."""
        chain = self._chain(span_id)
        if not chain:
            return chain, None
        request = self._requests.get(chain[-1])
        if request is None and create:
            request = self._requests[chain[-1]] = _Request()
            while len(self._requests) > self.MAX_REQUESTS:
                self._requests.popitem(last=False)
        if request is not None:
            self._requests.move_to_end(chain[-1])
        return chain, request

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        """Open a record at a query's start; attach it at its end; note what a retriever returned."""
        if isinstance(event, RetrievalEndEvent):
            texts = [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in event.nodes or ()]
            with self._facts_lock:
                _, request = self._request(event.span_id, create=True)
                if request is not None:
                    request.retrieved = [*request.retrieved, *(t for t in texts if t.strip())][-MAX_RETRIEVED:]
        elif isinstance(event, QueryStartEvent) and event.span_id is not None:
            with self._facts_lock:
                _, request = self._request(event.span_id, create=True)
                if request is not None:
                    request.queries[event.span_id] = []
        elif isinstance(event, QueryEndEvent) and event.span_id is not None:
            self._end_query(event.span_id, event.response)

    def _end_query(self, span_id: str, response: Any) -> None:
        """Put the query's stats into its response; a lazy stream's, as it is read."""
        with self._facts_lock:
            _, request = self._request(span_id)
            calls = None if request is None else request.queries.get(span_id)
            gen = getattr(response, "response_gen", None)
            lazy = calls == [] and gen is not None and hasattr(response, "metadata")
            if request is not None and not lazy:
                request.queries.pop(span_id, None)
        if calls is None or not hasattr(response, "metadata"):
            return
        if lazy:  # a lazy stream: the LLM is called when the consumer reads it, inside the query's span again
            live: dict = {}
            read = self._aread if hasattr(gen, "__aiter__") else self._read
            response.response_gen = read(gen, span_id, calls, live)
            stats = live
        elif calls:
            stats = query_stats(calls)
        else:
            return
        if response.metadata is None:
            response.metadata = {}
        response.metadata["cacheblend"] = stats

    def _read(self, gen: Iterator[Any], span_id: str, calls: list[dict], live: dict) -> Iterator[Any]:
        """`gen`, each item read inside the query's span (its LLM calls are the query's), `live` kept filled."""
        it = iter(gen)
        try:
            while (item := _next_in(span_id, it)) is not _END:
                yield _fill(live, calls, item)
        finally:
            self._close_query(span_id, live, calls)

    async def _aread(self, gen: AsyncIterator[Any], span_id: str, calls: list[dict], live: dict
                     ) -> AsyncIterator[Any]:
        """The async form of `_read`."""
        it = gen.__aiter__()
        try:
            while (item := await _anext_in(span_id, it)) is not _END:
                yield _fill(live, calls, item)
        finally:
            self._close_query(span_id, live, calls)

    def _close_query(self, span_id: str, live: dict, calls: list[dict]) -> None:
        """A lazy stream ended: its stats are final and its query is closed."""
        _fill(live, calls)
        with self._facts_lock:
            _, request = self._request(span_id)
            if request is not None:
                request.queries.pop(span_id, None)

    def record(self, stats: dict, span_id: str | None) -> None:
        """Count an LLM call's stats toward the innermost query in progress in the call's span tree, if any."""
        with self._facts_lock:
            chain, request = self._request(span_id)
            if request is not None:
                query = next((s for s in chain if s in request.queries), None)
                if query is not None:
                    request.queries[query].append(stats)

    def retrieved(self, span_id: str | None) -> list[str]:
        """Texts the retrievers of this span's tree returned, in order, without repeats."""
        with self._facts_lock:
            _, request = self._request(span_id)
            return list(dict.fromkeys(request.retrieved)) if request is not None else []


_END = object()  # the end of a stream


@contextmanager
def _in_span(span_id: str) -> Iterator[None]:
    """Run inside the span `span_id`: what an LLM call starts meanwhile sits in that span's tree."""
    token = active_span_id.set(span_id)
    try:
        yield
    finally:
        active_span_id.reset(token)


def _next_in(span_id: str, it: Iterator[Any]) -> Any:
    with _in_span(span_id):
        return next(it, _END)


async def _anext_in(span_id: str, it: AsyncIterator[Any]) -> Any:
    with _in_span(span_id):
        return await anext(it, _END)


def _fill(live: dict, calls: list[dict], item: Any = None) -> Any:
    """Copy the stats of `calls` into `live`, then hand back `item`."""
    if calls:
        live.update(query_stats(calls))
    return item


_install_lock = threading.Lock()  # registration only: the handler (and what it keeps) is the dispatcher's


def install_query_stats_handler() -> QueryStatsHandler:
    """The handler on LlamaIndex's root dispatcher, registered there once (as event and span handler): the
    dispatcher holds it (no module global), so it is registered again if the dispatcher's handlers were cleared."""
    dispatcher = get_dispatcher()
    with _install_lock:
        handler = next((h for h in dispatcher.event_handlers if isinstance(h, QueryStatsHandler)), None)
        if handler is None:
            handler = QueryStatsHandler()
            dispatcher.add_event_handler(handler)
            dispatcher.add_span_handler(handler)
    return handler


_ROLES = MappingProxyType({MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant",
                           MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
                           MessageRole.DEVELOPER: "system"})


def to_chat_messages(messages: Sequence[ChatMessage], fmt: ToolFormat = GENERIC) -> list[dict[str, Any]]:
    """LlamaIndex chat messages as `[{"role", "content"}]` for the model's chat template: an assistant message's
    tool calls (`additional_kwargs["tool_calls"]`) and a tool message's result in the tool format `fmt`
    (`ToolFormat.of(tokenizer)`: the template's own `tool_calls` and `tool` messages, or the generic format's
    text), results verbatim, so stored chunks inside a tool's output are found."""
    return fmt.chat_messages(_shaped(messages))


def _shaped(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex chat messages in OpenAI's shape (an assistant message's `tool_calls: [{"id", "name",
    "arguments"}]`, a tool message as `{"role": "tool", "content", "tool_call_id"}`), before a tool format renders
    them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == MessageRole.TOOL:
            out.append({"role": "tool", "content": m.content or "",
                        "tool_call_id": m.additional_kwargs.get("tool_call_id")})
            continue
        role = _ROLES.get(m.role)
        if role is None:
            raise ConfigError(f"CacheBlendLLM cannot take a {m.role.value!r} message (system, user, assistant and "
                              f"tool messages only)")
        out.append({"role": role, "content": m.content or ""})
        calls = m.additional_kwargs.get("tool_calls")
        if calls:
            out[-1]["tool_calls"] = [{"id": c.get("id"), "name": c["name"], "arguments": c["arguments"]} for c in calls]
    return out


def _log_repeat(calls: Sequence[generic_tools.ToolCall]) -> None:
    logger.info("tool_choice 'auto': the answer repeats calls whose results the conversation holds (%s); answering "
                "again as plain text from the results", [(c.name, c.arguments) for c in calls])


def _call_kwargs(call: generic_tools.ToolCall) -> dict[str, Any]:
    """A parsed call as kept in a response's `additional_kwargs["tool_calls"]`."""
    return {"id": call.id, "name": call.name, "arguments": call.arguments}


class CacheBlendLLM(CustomLLM, FunctionCallingLLM):
    """A LlamaIndex LLM over a `CacheBlendEngine`; arguments mirror `HuggingFaceLLM`'s main ones.

    Set it as `Settings.llm` and use `index.as_query_engine()` / `as_chat_engine()` as usual: chunks that appear
    verbatim in the prompts reuse their KV. `complete(prompt, chunks=[...], question=...)` answers from those
    chunks explicitly. `context_window` and `model_name` are the engine's model's own. It is a function-calling
    LLM (`FunctionAgent`, `predict_and_call`, `structured_predict`, `as_structured_llm`): `chat(messages,
    tools=[...], tool_choice=...)` constrains decoding to a well-formed call in the chat template's own tool format
    (`ToolFormat.of`), else the generic one.

    Example:
        >>> llm = CacheBlendLLM(engine=engine, max_new_tokens=8)
        >>> llm.metadata.context_window == engine.context_window, llm.metadata.model_name == engine.model_name
        (True, True)
        >>> response = llm.complete("Bees have five eyes. How many eyes does a bee have?")
        >>> sorted(k for k in response.additional_kwargs if k.startswith("chunk_"))
        ['chunk_hits', 'chunk_ids', 'chunk_misses']
    """

    # a misspelt field (recompute_rato=0.9) is an error, never a silently kept default
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(default=DEFAULT_MODEL, description="Packaged model alias, local model folder or "
                            "Hugging Face hub id (org/name, read from the HF cache); with `engine=`, the engine's "
                            "own model name.")
    revision: str | None = Field(default=None, description="Branch, tag or commit of a hub id (None: main).")
    trust_remote_code: bool = Field(default=False, description="Run a hub repo's own modelling code (off: it is "
                                    "code from the repo's authors).")
    tokenizer_name: str | None = Field(default=None, description="Ignored: the model folder's tokenizer is used.")
    context_window: int | None = Field(default=None, gt=0, description="Context window (None: the model's own).")
    max_new_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    generate_kwargs: dict = Field(default_factory=dict, description="temperature, top_p, seed, stop, do_sample.")
    device_map: str = Field(default="auto", description="Device of a lazily built engine ('auto', 'cpu', 'cuda').")
    model_kwargs: dict = Field(default_factory=dict, description="Only 'dtype' / 'torch_dtype' is used.")
    kv_store: str | None = Field(default=None, description="KV store folder of a lazily built engine (~ expanded).")
    home: str | None = Field(default=None, description="Package home of a lazily built engine.")
    method: str = Field(default=DEFAULT_METHOD, description="Prefill method, any of the policy registry's: "
                        "relevance (the default), cacheblend, cachecraft, full_reuse, prefix_cache, full_prefill.")
    recompute_ratio: float | None = Field(default=None, description="Recomputed share of reused tokens; None: the "
                                          "model's calibrated ratio (the fidelity gate), else the method's default.")
    policy_options: dict = Field(default_factory=dict, description="The method's own options, for any policy of "
                                 "the registry (e.g. {'check_layers': (1, 2)} for cacheblend, {'alpha': 0.5} for "
                                 "cachecraft); checked by the policy.")
    learn_retrieved: bool = Field(default=True, description="Ingest retrieved passages a prompt carried after "
                                  "the answer (background), so the next query that retrieves them is a hit.")

    _engine: CacheBlendEngine | None = PrivateAttr(default=None)
    _build_lock: Any = PrivateAttr(default_factory=threading.Lock)
    _last: dict = PrivateAttr(default_factory=dict)

    def __init__(self, engine: CacheBlendEngine | None = None, **kwargs: Any) -> None:
        if engine is not None and not isinstance(engine, CacheBlendEngine):
            raise TypeError(f"engine must be a CacheBlendEngine (or None to build one from model_name), got "
                            f"{type(engine).__name__}")
        if "max_tokens" in kwargs:
            kwargs.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
        check_not_options(type(self).__name__, kwargs, type(self).model_fields)  # `lookalike=0`: where it goes
        super().__init__(**kwargs)
        default_policy(self.method, self.recompute_ratio, self.policy_options)  # the one check of them all
        unknown = sorted(set(self.generate_kwargs) - _call_settings())
        if unknown:
            raise ConfigError(f"generate_kwargs has unknown key(s) {', '.join(unknown)}; accepted: "
                              f"{', '.join(CALL_SETTINGS)}")
        if self.kv_store is not None:
            import os

            self.kv_store = os.path.expanduser(self.kv_store)
        self._engine = engine
        if engine is not None:
            self.model_name = engine.model_name  # what the engine really holds, never a default alias
        install_query_stats_handler()

    @classmethod
    def class_name(cls) -> str:
        """Registry name."""
        return "CacheBlendLLM"

    @property
    def engine(self) -> CacheBlendEngine:
        """The engine, built on first use when none was given."""
        if self._engine is None:
            with self._build_lock:
                if self._engine is None:
                    dtype = self.model_kwargs.get("dtype", self.model_kwargs.get("torch_dtype", "auto"))
                    self._engine = CacheBlendEngine.from_pretrained(
                        self.model_name, kv_store=self.kv_store, device=self.device_map, dtype=dtype, home=self.home,
                        revision=self.revision, trust_remote_code=self.trust_remote_code)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        """Context window, output budget and name, from the engine's model."""
        engine = self.engine
        return LLMMetadata(context_window=self.context_window or engine.context_window,
                           num_output=self.max_new_tokens, model_name=engine.model_name, is_chat_model=True,
                           is_function_calling_model=True)

    @property
    def last_stats(self) -> dict:
        """Stats of the latest call (live while it streams)."""
        return self._last

    def _settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(kwargs) - _call_settings())
        if unknown:
            raise ConfigError(f"CacheBlendLLM got unknown keyword argument(s) {', '.join(unknown)}; accepted: "
                              f"{', '.join(sorted(_call_settings()))}")
        gen = {**self.generate_kwargs, **kwargs}
        # Hugging Face's do_sample (defined here, so checked here): False is greedy whatever the temperature, True
        # without a temperature samples at 1; the temperature itself is Request.of's to check
        do_sample, temperature = gen.get("do_sample"), gen.get("temperature")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ConfigError(f"do_sample must be True or False, got {type(do_sample).__name__}")
        if do_sample is False:
            temperature = 0.0
        elif temperature is None:
            temperature = 1.0 if do_sample else 0.0
        return call_keywords(
            gen, method=self.method, recompute_ratio=self.recompute_ratio, policy_options=self.policy_options,
            max_new_tokens=self.max_new_tokens, temperature=temperature,
            top_p=gen.get("top_p", 1.0), seed=gen.get("seed"), stop=gen.get("stop"), grammar=gen.get("grammar"),
            tools=gen.get("tools"),
        )

    def _request(self, prompt: str | list[dict[str, str]], kwargs: dict[str, Any]) -> tuple[list[str] | None, Request]:
        """(the chunks the call named, or None, and the engine's request): with `chunks=`, those chunks and the
        `question=` (else the prompt); without, the prompt in which the engine finds the stored chunks itself."""
        kwargs = dict(kwargs)
        chunks = kwargs.pop("chunks", None)
        question = kwargs.pop("question", None)
        kwargs.pop("formatted", None)
        if isinstance(chunks, str):  # one chunk, never its characters
            chunks = [chunks]
        if chunks is not None:
            if not isinstance(chunks, Sequence) or not all(isinstance(c, str) for c in chunks):
                raise ConfigError(f"chunks must be a string or a list of strings (texts or chunk ids), got "
                                  f"{type(chunks).__name__}")
            chunks = [c for c in chunks if looks_like_chunk_id(c) or normalize_text(c)]  # empty chunks skipped
            return chunks, Request.of(chunks, question if question is not None else str(prompt),
                                      **self._settings(kwargs))
        return None, Request.of(prompt=prompt, **self._settings(kwargs))

    def _generate(self, prompt: str | list[dict[str, str]], kwargs: dict[str, Any]):
        chunks, request = self._request(prompt, kwargs)
        span_id = active_span_id.get()  # this call's span: its tree is the request (query, chat turn) it serves
        out = self.engine.generate_request(request)
        info = stats_summary(out.stats, chunks)
        self._last = info
        handler = install_query_stats_handler()
        handler.record(info, span_id)
        self._learn(prompt, handler, span_id)
        return out, info

    def _learn(self, prompt: str | list[dict[str, str]], handler: QueryStatsHandler, span_id: str | None) -> None:
        """Queue the passages this call's request retrieved that its prompt carried for ingest after the answer
        (`engine.learn`): with `learn_retrieved`, the next query that retrieves them reuses their KV, no warm step
        or postprocessor."""
        if not self.learn_retrieved:
            return
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        seen = [t for t in handler.retrieved(span_id) if t in text]
        if seen:
            self.engine.learn(seen)

    def _stream(self, prompt: str | list[dict[str, str]], kwargs: dict[str, Any]):
        chunks, request = self._request(prompt, kwargs)
        stats: dict = {}
        info: dict = {}
        self._last = info
        span_id = active_span_id.get()  # as in `_generate`, taken when called: the stream may be read elsewhere
        handler = install_query_stats_handler()
        handler.record(info, span_id)

        def pieces():
            it = self.engine.stream_request(request, stats)
            try:
                for piece in it:
                    info.update(stats_summary(stats, chunks))  # prefill stats are there from the first piece
                    yield piece
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()  # a consumer that stops early ends the engine's stream (and its decoding) too
            info.update(stats_summary(stats, chunks))
            self._learn(prompt, handler, span_id)

        return pieces(), info

    def _completion_prompt(self, prompt: str, formatted: bool) -> str | list[dict[str, str]]:
        """What a completion sends the model: as `HuggingFaceLLM` does, `completion_to_prompt` when the user set
        one, else an instruct model's chat template around it (one user turn after `system_prompt`, if any);
        `formatted=True` or a model without a chat template gets the text as is."""
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt)
        if not self.engine.has_chat_template:
            return prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer `prompt` (stored chunks in it reuse their KV), or `question=` over `chunks=`."""
        out, info = self._generate(self._completion_prompt(prompt, formatted), kwargs)
        if not out.text:
            logger.warning("the model answered a %d-token prompt with no text (%d tokens generated, all special or "
                           "whitespace)", info.get("num_tokens", 0), len(out.token_ids))
        return CompletionResponse(text=out.text, additional_kwargs=info)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream the answer: each response has the new `delta` and the cumulative `text`."""
        pieces, info = self._stream(self._completion_prompt(prompt, formatted), kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece, additional_kwargs=info)

        return gen()

    def _tool_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], answer: bool = False
                      ) -> tuple[list[dict[str, Any]], dict[str, Any], generic_tools.ToolTurn, ToolFormat]:
        """(chat messages, call kwargs, the tool turn, the tool format): with `tools`, they are listed (by the
        chat template in its own format, else in the generic format's system text) and the grammar forces a call
        or a plain answer as `tool_choice` says (`parallel_tool_calls`: one or more calls). `answer`: the plain
        answer after an "auto" answer that only repeated answered calls (`cacheblend_rag.tools.answer_turn`)."""
        kwargs = dict(kwargs)
        tools, choice = kwargs.pop("tools", None), kwargs.pop("tool_choice", None)
        parallel = bool(kwargs.pop("parallel_tool_calls", False))
        fmt = ToolFormat.of(self.engine.tokenizer)
        turn = generic_tools.chat_turn(_shaped(messages), tools or [], choice, parallel, fmt, answer)
        kwargs.update(turn.request_settings())
        return turn.messages, kwargs, turn, fmt

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer chat messages with the model's chat template (stored chunks in them reuse their KV); with
        `tools=` (OpenAI tool dicts), a call to one of them lands in `message.additional_kwargs["tool_calls"]`.
        Under "auto", an answer that only repeats calls whose results the messages hold is answered again as
        plain text from those results (`cacheblend_rag.tools.ToolTurn.repeats`)."""
        return self._chat(messages, kwargs)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], answer: bool = False) -> ChatResponse:
        chat, call_kwargs, turn, fmt = self._tool_request(messages, kwargs, answer)
        functions = turn.functions
        out, info = self._generate(chat, call_kwargs)
        content, calls = generic_tools.parse_tool_calls(out.text, functions, fmt) if functions else (out.text, [])
        if turn.repeats(calls):
            _log_repeat(calls)
            response = self._chat(messages, kwargs, answer=True)
            response.additional_kwargs["repeated_call"] = [_call_kwargs(c) for c in calls]
            return response
        extra = {"tool_calls": [_call_kwargs(c) for c in calls]} if calls else {}
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=content.strip() if calls
                                                else content, additional_kwargs=extra), additional_kwargs=info)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Stream a chat answer: each response has the new `delta` and the cumulative message; with `tools=`,
        text that may become a call is held back and the last response carries the call."""
        return self._stream_chat(messages, kwargs)

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], answer: bool = False
                     ) -> ChatResponseGen:
        chat, call_kwargs, turn, fmt = self._tool_request(messages, kwargs, answer)
        functions = turn.functions
        pieces, info = self._stream(chat, call_kwargs)

        def gen() -> ChatResponseGen:
            text, held = "", ""
            started = False  # the held text begins a call for good: no need to look at it again each piece
            for piece in pieces:
                if functions and not text and (started or generic_tools.may_be_call(held + piece, fmt)):
                    held += piece
                    started = started or generic_tools.call_started(held, fmt)
                    continue
                piece, held = held + piece, ""
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece,
                                   additional_kwargs=info)
            if held:
                content, calls = generic_tools.parse_tool_calls(held, functions, fmt)
                if not text and turn.repeats(calls):  # the same call again after its result (see `chat`)
                    _log_repeat(calls)
                    yield from self._stream_chat(messages, kwargs, answer=True)
                    return
                extra = {"tool_calls": [_call_kwargs(c) for c in calls]} if calls else {}
                content = content.strip() if calls else content
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text + content,
                                                       additional_kwargs=extra), delta=content,
                                   additional_kwargs=info)

        return gen()

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The `chat` kwargs of a tool-calling turn: the history, the user's message, the tools as OpenAI specs;
        `tool_required` forces a call, else `tool_choice` (default "auto"); `allow_parallel_tool_calls`: one or
        more calls per answer (else one)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(user_msg if isinstance(user_msg, ChatMessage)
                            else ChatMessage(role=MessageRole.USER, content=user_msg))
        specs = [tool.metadata.to_openai_tool() for tool in tools]
        return {"messages": messages, "tools": specs, "tool_choice": "required" if tool_required
                else (tool_choice or "auto"), "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The response's tool calls as ToolSelections (a ValueError without one, unless told not to)."""
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call in the response, got text: {response.message.content!r}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]
