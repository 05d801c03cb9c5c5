"""LangChain integration (langchain-core only): a CacheBlend LLM, chunk-id retrievers, a prompt and LCEL chains.

How chunk ids reach the model through an ordinary LCEL chain::

    {"context": retriever, "question": RunnablePassthrough()} | CacheBlendPromptTemplate() | llm | StrOutputParser()

- `ChunkIdRetriever` (or `ChromaRetriever`) returns Documents whose `id` and `metadata["chunk_id"]` are the
  content-hash chunk id.
- `CacheBlendPromptTemplate` formats them into a `CacheBlendPromptValue`: a `StringPromptValue` whose text is
  the documented plain form (`cacheblend_rag.retrieval.prompt`) and which also carries the chunks and the question.
- `BaseLLM` turns every input into a string (`PromptValue.to_string()`) before `_generate`/`_stream`. The LLM
  therefore finds the chunks of each prompt, in order, from: an explicit `chunks=` keyword; the prompt value
  seen by `_convert_input` (remembered by its string); the string itself, parsed back and matched against the
  KV store by content hash; else the whole string is the question of a chunk-less prefill. Every path gives the
  same answer; the first two only skip parsing.

Which chunks hit the KV store and how much was recomputed is in each Generation's `generation_info` and in
`llm_output["requests"]`; `StatsCallbackHandler` collects them from any chain.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import CacheBlendEngine
from ..errors import ConfigError, MissingDependencyError
from ..fuse.layout import PromptTemplate
from ..fuse.policies import METHODS
from ..ingest.chunks import Chunk, chunk_id, looks_like_chunk_id, normalize_text
from ..models.loader import DEFAULT_MODEL
from ..retrieval.prompt import INSTRUCTION, parse_prompt, render_prompt

try:
    from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForLLMRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.language_models import BaseLLM, LanguageModelInput
    from langchain_core.messages import BaseMessage, HumanMessage
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.outputs import Generation, GenerationChunk, LLMResult
    from langchain_core.prompt_values import PromptValue, StringPromptValue
    from langchain_core.prompts import BasePromptTemplate
    from langchain_core.prompts import PromptTemplate as LCPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough
    from langchain_core.vectorstores import VectorStore
    from pydantic import ConfigDict, Field, PrivateAttr, field_validator
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        "the LangChain integration needs langchain-core: pip install 'cacheblend-rag[langchain]'"
    ) from e

__all__ = [
    "CacheBlendLLM", "CacheBlendPromptTemplate", "CacheBlendPromptValue", "ChromaRetriever", "ChunkIdRetriever",
    "StatsCallbackHandler", "create_map_reduce_chain", "create_map_rerank_chain", "create_stuff_chain",
    "document_chunk_id",
]

_STATS_KEYS = ("method", "chunk_hits", "chunk_misses", "num_tokens", "num_reused", "num_recomputed",
               "recompute_ratio_effective", "ttft_s", "num_generated", "recompute_ratio")


def document_chunk_id(doc: Document) -> str:
    """The content-hash chunk id of a Document (recomputed from its text, never trusted from metadata)."""
    return chunk_id(doc.page_content)


# ---- retrievers ---------------------------------------------------------------------------


class ChunkIdRetriever(BaseRetriever):
    """Wraps a retriever or vector store; its Documents carry the content-hash chunk id.

    `Document.id` and `metadata["chunk_id"]` are set to `cacheblend_rag.chunk_id(page_content)`; duplicates
    (same id) are dropped, keeping the first (best-ranked).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    base: Any
    """A retriever (any Runnable returning Documents) or a `VectorStore`."""
    k: int = 4
    """Top-k when `base` is a vector store (a retriever keeps its own k)."""

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        if isinstance(self.base, VectorStore):
            docs = self.base.similarity_search(query, k=self.k)
        elif isinstance(self.base, Runnable):
            docs = self.base.invoke(query, config={"callbacks": run_manager.get_child()})
        elif hasattr(self.base, "invoke"):
            docs = self.base.invoke(query)
        else:
            raise ConfigError(f"ChunkIdRetriever.base must be a retriever or a VectorStore, got {type(self.base).__name__}")
        return with_chunk_ids(docs)


def with_chunk_ids(docs: Sequence[Document]) -> list[Document]:
    """Copies of `docs` with id and metadata["chunk_id"] set to the content hash; duplicates dropped."""
    out: list[Document] = []
    seen: set[str] = set()
    for doc in docs:
        cid = document_chunk_id(doc)
        if cid in seen:
            continue
        seen.add(cid)
        out.append(Document(page_content=doc.page_content, metadata={**doc.metadata, "chunk_id": cid}, id=cid))
    return out


class ChromaRetriever(BaseRetriever):
    """Top-k search over a `cacheblend_rag.retrieval.ChromaChunkStore` (embedded or server)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    store: Any
    """A `ChromaChunkStore`."""
    k: int = 6
    """How many chunks to return."""

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [
            Document(page_content=hit.text, metadata={**hit.metadata, "chunk_id": hit.chunk_id, "score": hit.score},
                     id=hit.chunk_id)
            for hit in self.store.query(query, self.k)
        ]


# ---- prompt -------------------------------------------------------------------------------


class CacheBlendPromptValue(StringPromptValue):
    """A string prompt that also carries its chunks (ids + texts) and its question.

    `text` is the documented plain form (`render_prompt`), so any LLM can take it; `CacheBlendLLM` uses the
    chunks directly.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    chunk_ids: list[str] = Field(default_factory=list)
    """Content-hash ids of the chunks, in prompt order."""
    chunk_texts: list[str] = Field(default_factory=list)
    """Normalized chunk texts, in prompt order."""
    question: str = ""
    """The question, as the engine puts it after the chunks."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """Not part of LangChain's serializable namespace."""
        return False

    def to_messages(self) -> list[BaseMessage]:
        """The string form as one human message (for chat models)."""
        return [HumanMessage(content=self.text)]


def _as_texts(context: Any) -> list[str]:
    if context is None:
        return []
    if isinstance(context, (str, Document)):
        context = [context]
    texts = []
    for item in context:
        text = item.page_content if isinstance(item, Document) else str(item)
        if normalize_text(text):
            texts.append(normalize_text(text))
    return texts


class CacheBlendPromptTemplate(BasePromptTemplate):
    """Formats `context` (Documents or strings) and `question` into a `CacheBlendPromptValue`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    input_variables: list[str] = Field(default_factory=lambda: ["context", "question"])
    """The inputs: retrieved chunks and the question."""
    context_key: str = "context"
    """Input holding the chunks (list of Documents or strings)."""
    question_key: str = "question"
    """Input holding the question."""
    question_template: str = "{question}"
    """How the question is put after the chunks (e.g. to ask for a score); `{question}` is replaced."""
    instruction: str = INSTRUCTION
    """First line of the string form (ignored by CacheBlendLLM, which uses the engine's template)."""

    @property
    def _prompt_type(self) -> str:
        return "cacheblend"

    def format_prompt(self, **kwargs: Any) -> CacheBlendPromptValue:
        """The prompt value for these inputs."""
        kwargs = self._merge_partial_and_user_variables(**kwargs)
        texts = _as_texts(kwargs.get(self.context_key))
        question = self.question_template.format(question=kwargs.get(self.question_key, ""))
        return CacheBlendPromptValue(
            text=render_prompt(texts, question, instruction=self.instruction),
            chunk_ids=[chunk_id(t) for t in texts], chunk_texts=texts, question=question,
        )

    def format(self, **kwargs: Any) -> str:
        """The string form."""
        return self.format_prompt(**kwargs).to_string()


# ---- the LLM ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    chunks: list[str | Chunk]
    question: str
    template: PromptTemplate | None
    source: str  # kwarg | prompt_value | parsed | plain


class _RecentPrompts:
    """Prompt values seen by `_convert_input`, by their string, for the `_generate` that follows (bounded)."""

    def __init__(self, size: int = 256) -> None:
        self._items: OrderedDict[str, CacheBlendPromptValue] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def put(self, value: CacheBlendPromptValue) -> None:
        with self._lock:
            self._items[value.text] = value
            self._items.move_to_end(value.text)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def get(self, text: str) -> CacheBlendPromptValue | None:
        with self._lock:
            return self._items.get(text)


class CacheBlendLLM(BaseLLM):
    """A LangChain LLM over a `CacheBlendEngine`: answers from the retrieved chunks' cached KV.

    Example:
        ```python
        llm = CacheBlendLLM(model="smollm2-135m", kv_store="~/.cache/cacheblend-rag/kv", max_new_tokens=32)
        chain = create_stuff_chain(ChunkIdRetriever(base=retriever), llm)
        chain.invoke("Who wrote ...?")
        llm.invoke("What is 2+2?", recompute_ratio=0.3)  # any setting can be overridden per call
        ```
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    engine: Any = Field(default=None, exclude=True)
    """A ready `CacheBlendEngine`; when None one is built on first use from `model`, `kv_store` and `home`."""
    model: str = DEFAULT_MODEL
    """Packaged model alias or local model folder (used only when `engine` is None)."""
    kv_store: str | None = None
    """KV store folder for a lazily built engine (None: in memory)."""
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
    max_new_tokens: int = 64
    """Most tokens to generate."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (with temperature > 0)."""
    seed: int | None = None
    """Sampling seed."""
    stop: list[str] | None = None
    """Stop strings used when a call passes none (generation ends before the first one)."""

    _recent: _RecentPrompts = PrivateAttr(default_factory=_RecentPrompts)
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

    @classmethod
    def from_model_id(cls, model: str = DEFAULT_MODEL, kv_store: str | None = None, **kwargs: Any) -> "CacheBlendLLM":
        """Load the model now (instead of on first use) and wrap it."""
        llm = cls(model=model, kv_store=kv_store, **kwargs)
        llm.get_engine()
        return llm

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
    def _llm_type(self) -> str:
        return "cacheblend"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "method": self.method, "recompute_ratio": self.recompute_ratio,
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (the default would fetch GPT-2 from a hub)."""
        return self.get_engine().tokenizer(text, add_special_tokens=False)["input_ids"]

    # -- keeping the prompt value: every BaseLLM entry point converts its input here first --

    def _convert_input(self, model_input: LanguageModelInput) -> PromptValue:
        value = super()._convert_input(model_input)
        if isinstance(value, CacheBlendPromptValue):
            self._recent.put(value)
        return value

    def _request(self, prompt: str, kwargs: dict[str, Any]) -> _Request:
        engine = self.get_engine()
        plain = PromptTemplate(system=engine.template.system, question="{question}", separator=engine.template.separator)
        if kwargs.get("chunks") is not None:
            question = kwargs.get("question")
            if question is None:
                parsed = parse_prompt(prompt)
                question = parsed.question if parsed else prompt
            return _Request(list(kwargs["chunks"]), question, None, "kwarg")
        value = self._recent.get(prompt)
        if value is not None:
            return _Request(list(value.chunk_texts), value.question, None, "prompt_value")
        parsed = parse_prompt(prompt, is_known=engine.knows)
        if parsed is not None:
            return _Request(list(parsed.chunk_texts), parsed.question, None, "parsed")
        return _Request([], prompt, plain, "plain")

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        method = kwargs.get("method", self.method)
        if method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        return dict(
            method=method,
            recompute_ratio=kwargs.get("recompute_ratio", self.recompute_ratio),
            max_new_tokens=kwargs.get("max_new_tokens", self.max_new_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            seed=kwargs.get("seed", self.seed),
            stop=stop if stop is not None else self.stop,
        )

    @staticmethod
    def _info(stats: dict, request: _Request) -> dict[str, Any]:
        info = {k: stats[k] for k in _STATS_KEYS if k in stats}
        ids = [c.chunk_id if isinstance(c, Chunk) else (c if looks_like_chunk_id(c) else chunk_id(c))
               for c in request.chunks]
        hits = set(stats.get("chunk_hits", ()))
        info.update(chunk_ids=ids, chunks_from=request.source,
                    per_chunk={cid: ("hit" if cid in hits else "miss") for cid in ids})
        return info

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
            out = engine.generate(request.chunks, request.question, template=request.template, **settings)
            info = self._info(out.stats, request)
            infos.append(info)
            generations.append([Generation(text=out.text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model": self.model, "requests": infos})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine = self.get_engine()
        request = self._request(prompt, kwargs)
        stats: dict = {}
        for piece in engine.stream(request.chunks, request.question, template=request.template, stats=stats,
                                   **self._settings(stop, kwargs)):
            chunk = GenerationChunk(text=piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._info(stats, request))


class StatsCallbackHandler(BaseCallbackHandler):
    """Collects the `generation_info` of every CacheBlendLLM generation in a run (pass it in `callbacks`)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.retrieved: list[list[str]] = []
        """Chunk ids of each retriever run, in the order runs ended (a wrapper ends after what it wraps)."""
        self._lock = threading.Lock()

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        """Record the chunk ids a retriever returned."""
        with self._lock:
            self.retrieved.append([d.metadata.get("chunk_id") or document_chunk_id(d) for d in documents])

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        """Record each generation's stats."""
        with self._lock:
            for gens in response.generations:
                for gen in gens:
                    if gen.generation_info and "chunk_ids" in gen.generation_info:
                        self.requests.append(gen.generation_info)

    @property
    def last(self) -> dict[str, Any] | None:
        """Stats of the latest generation."""
        return self.requests[-1] if self.requests else None


# ---- chains -------------------------------------------------------------------------------


def create_stuff_chain(retriever: Runnable, llm: Runnable, prompt: BasePromptTemplate | None = None) -> Runnable:
    """question → answer: all retrieved chunks in one fused prompt (the CacheBlend path)."""
    chain = {"context": retriever, "question": RunnablePassthrough()} | (prompt or CacheBlendPromptTemplate()) \
        | llm | StrOutputParser()
    return chain.with_config(run_name="cacheblend_stuff_chain")


_REDUCE_PROMPT = LCPromptTemplate.from_template(
    "Partial answers to the question, each from one passage:\n{answers}\n\n"
    "Question: {question}\nGive the single best final answer in a few words.\nAnswer:"
)


def _fan_out(inputs: dict) -> list[dict]:
    return [{"context": [doc], "question": inputs["question"]} for doc in inputs["context"]]


def _format_answers(answers: Sequence[str]) -> str:
    return "\n".join(f"{i}. {a.strip() or '(no answer)'}" for i, a in enumerate(answers, 1))


def create_map_reduce_chain(retriever: Runnable, llm: Runnable, reduce_prompt: BasePromptTemplate | None = None) -> Runnable:
    """question → answer: an answer per chunk (each prompt one cached chunk), then one reduce call over them."""
    map_chain = CacheBlendPromptTemplate() | llm | StrOutputParser()
    answers = RunnableLambda(_fan_out) | map_chain.map()

    def reduce_inputs(inputs: dict) -> dict:
        return {"answers": _format_answers(inputs["answers"]), "question": inputs["question"]}

    chain = (RunnableParallel(context=retriever, question=RunnablePassthrough())
             | RunnablePassthrough.assign(answers=answers)
             | RunnableLambda(reduce_inputs) | (reduce_prompt or _REDUCE_PROMPT) | llm | StrOutputParser())
    return chain.with_config(run_name="cacheblend_map_reduce_chain")


RERANK_QUESTION = "{question}\nAfter the answer, write 'Score:' and how sure you are, from 0 to 100."
_SCORE_RE = re.compile(r"score\s*[:=]?\s*(\d{1,3})", re.IGNORECASE)


def parse_scored_answer(text: str) -> tuple[str, int]:
    """(answer, score) from "answer ... Score: N"; a missing score counts as 0."""
    m = _SCORE_RE.search(text)
    if not m:
        return text.strip(), 0
    return text[: m.start()].strip().rstrip(".,;-(").strip(), min(int(m.group(1)), 100)


def create_map_rerank_chain(retriever: Runnable, llm: Runnable) -> Runnable:
    """question → answer: an answer with a 0–100 confidence per chunk; the best score wins.

    Ties (and answers without a parseable score, which count as 0) go to the better-ranked chunk.
    """
    map_chain = CacheBlendPromptTemplate(question_template=RERANK_QUESTION) | llm | StrOutputParser()
    answers = RunnableLambda(_fan_out) | map_chain.map()

    def pick(inputs: dict) -> str:
        scored = [parse_scored_answer(a) for a in inputs["answers"]]
        scored = [(ans, score, -i) for i, (ans, score) in enumerate(scored) if ans]
        return max(scored, key=lambda t: (t[1], t[2]))[0] if scored else ""

    chain = (RunnableParallel(context=retriever, question=RunnablePassthrough())
             | RunnablePassthrough.assign(answers=answers) | RunnableLambda(pick))
    return chain.with_config(run_name="cacheblend_map_rerank_chain")
