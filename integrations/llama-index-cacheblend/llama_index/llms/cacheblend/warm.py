"""`warm_from_index`: precompute the KV of the nodes a LlamaIndex index (or vector store) already holds.

The user's index stays as it is (nothing is re-embedded); each node's text — its content without metadata, the
part a synthesizer's prompt carries verbatim — gets its KV once, so `Settings.llm = CacheBlendLLM(...)` and
`index.as_query_engine()` reuse it from the first query on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.warm import WarmReport, warm_texts
from llama_index.core import Settings
from llama_index.core.indices.base import BaseIndex
from llama_index.core.schema import BaseNode
from llama_index.core.vector_stores.types import BasePydanticVectorStore

from llama_index.llms.cacheblend.base import CacheBlendLLM
from llama_index.llms.cacheblend.indexing import node_text

__all__ = ["iter_index_nodes", "warm_from_index"]


def iter_index_nodes(index: BaseIndex | BasePydanticVectorStore) -> Iterator[BaseNode]:
    """The nodes of an index: its docstore's, else (a vector store that keeps the text, e.g. `ChromaVectorStore`)
    the vector store's own `get_nodes`."""
    store = index if isinstance(index, BasePydanticVectorStore) else None
    if store is None:
        docs = index.docstore.docs
        if docs:
            yield from docs.values()
            return
        store = getattr(index, "vector_store", None)
    if store is None or not getattr(store, "stores_text", False):
        raise ConfigError(f"{type(index).__name__} keeps no node texts to warm (an empty docstore and no vector "
                          "store that stores text); warm the texts with engine.ingest(texts)")
    try:
        yield from store.get_nodes(None)
    except NotImplementedError as e:
        raise ConfigError(f"{type(store).__name__} cannot list its nodes (get_nodes); build the index with "
                          "store_nodes_override=True, or warm the texts with engine.ingest(texts)") from e


def warm_from_index(index: BaseIndex | BasePydanticVectorStore, engine: Any = None, *,
                    show_progress: bool = False) -> WarmReport:
    """Precompute the KV of every node of a LlamaIndex index or vector store. `engine`: a `CacheBlendEngine` or
    a `CacheBlendLLM`; None: that of `Settings.llm`. Nodes that cannot be warmed are in `report.skipped`.

    Example:
        >>> from llama_index.core import VectorStoreIndex
        >>> from llama_index.core.schema import TextNode
        >>> from llama_index.llms.cacheblend import LocalEmbedding
        >>> index = VectorStoreIndex([TextNode(text="Workers live about six weeks in summer.")],
        ...                          embed_model=LocalEmbedding())
        >>> report = warm_from_index(index, engine)
        >>> report.chunks, engine.has_kv(report.chunk_ids[0])
        (1, True)
    """
    if engine is None:
        engine = Settings._llm  # not `Settings.llm`: that would resolve (and fail on) the OpenAI default
        if not isinstance(engine, CacheBlendLLM):
            raise ConfigError("warm_from_index needs engine= (a CacheBlendEngine or CacheBlendLLM), or "
                              "Settings.llm set to a CacheBlendLLM")
    if isinstance(engine, CacheBlendLLM):
        engine = engine.engine
    if not isinstance(engine, CacheBlendEngine):
        raise ConfigError(f"engine must be a CacheBlendEngine or CacheBlendLLM, got {type(engine).__name__}")
    documents = ((node.node_id, node_text(node)) for node in iter_index_nodes(index))
    return warm_texts(engine, documents, show_progress=show_progress)
