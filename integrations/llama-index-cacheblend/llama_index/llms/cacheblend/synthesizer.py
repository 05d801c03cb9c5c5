"""`CacheBlendSynthesizer` (each retrieved node one chunk of one fused prompt) and `as_query_engine`.

LlamaIndex's own synthesizers work too (`Settings.llm = CacheBlendLLM(...)`, `index.as_query_engine()`): the
engine finds the chunks in their prompts. This synthesizer passes the chunks explicitly, so a node whose text
a template would alter (metadata lines, COMPACT re-splitting) still hits.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.ingest.chunks import chunk_id, normalize_text  # noqa: F401 (chunk_id: example)
from cacheblend_rag.retrieval.prompt import render_prompt
from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.base.llms.types import CompletionResponseGen
from llama_index.core.llms import LLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, NodeWithScore
from llama_index.llms.cacheblend.base import CacheBlendLLM
from llama_index.llms.cacheblend.indexing import build_index, node_text  # noqa: F401 (build_index: example)
from llama_index.postprocessor.cacheblend.base import KVAwareNodePostprocessor

__all__ = ["CacheBlendSynthesizer", "as_query_engine"]


class CacheBlendSynthesizer(BaseSynthesizer):
    """All retrieved nodes in one fused prompt, each node's text one chunk (its id = the node's chunk id).

    With a `CacheBlendLLM` the chunks and the question go to the LLM as keywords; any other LLM gets the
    documented prompt string.

    Example:
        >>> from llama_index.core import Document
        >>> index = build_index([Document(text="Honeybees have five eyes.")], engine)
        >>> llm = CacheBlendLLM(engine=engine, max_new_tokens=4)
        >>> qe = RetrieverQueryEngine(retriever=index.as_retriever(), response_synthesizer=CacheBlendSynthesizer(llm=llm))
        >>> response = qe.query("How many eyes does a honeybee have?")
        >>> response.metadata["cacheblend"]["chunk_hits"] == [chunk_id("Honeybees have five eyes.")]
        True
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
        texts = [t for t in texts if normalize_text(t)]  # an empty node is no chunk
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
    llm: LLM | None = None,
    similarity_top_k: int = 6,
    streaming: bool = False,
    *,
    engine: CacheBlendEngine | None = None,
    reorder_cached_first: bool = False,
) -> RetrieverQueryEngine:
    """A RetrieverQueryEngine: top-k retrieval → KVAwareNodePostprocessor → CacheBlendSynthesizer → `llm`.

    `llm` defaults to `CacheBlendLLM(engine=engine)` when `engine` is given, else to `Settings.llm`; with
    neither it raises instead of loading a second model. Streaming and `aquery` work.
    """
    if llm is None:
        if engine is not None:
            llm = CacheBlendLLM(engine=engine)
        elif Settings._llm is not None:  # set by the user (reading `Settings.llm` would build the OpenAI default)
            llm = Settings.llm
        else:
            raise ConfigError("as_query_engine needs an LLM: pass llm= or engine=, or set "
                              "Settings.llm = CacheBlendLLM(engine=...)")
    kv_engine = engine or (llm.engine if isinstance(llm, CacheBlendLLM) else None)
    return RetrieverQueryEngine(
        retriever=index.as_retriever(similarity_top_k=similarity_top_k),
        response_synthesizer=CacheBlendSynthesizer(llm=llm, streaming=streaming),
        node_postprocessors=[KVAwareNodePostprocessor(engine=kv_engine, reorder_cached_first=reorder_cached_first)],
    )
