"""`warm_from_vectorstore`: precompute the KV of the documents a LangChain vector store already holds.

The user's vector store stays as it is (nothing is re-embedded or rewritten); each stored document's KV is
computed once, so when a retriever over that store puts the document into any prompt, `ChatCacheBlend` /
`CacheBlendLLM` reuse it from the first question on.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.warm import WarmReport, warm_texts
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore, VectorStoreRetriever

__all__ = ["iter_vectorstore_documents", "warm_from_vectorstore"]

PAGE = 256  # documents read per request


def _pages_by_offset(vectorstore: VectorStore) -> bool:
    """Whether the store lists its records by `get(limit=, offset=, include=)` (langchain-chroma's `Chroma`)."""
    get = getattr(vectorstore, "get", None)
    if get is None:
        return False
    try:
        params = inspect.signature(get).parameters
    except (TypeError, ValueError):
        return False
    return {"limit", "offset", "include"} <= set(params)


def iter_vectorstore_documents(vectorstore: VectorStore | VectorStoreRetriever,
                               ids: Iterable[str] | None = None) -> Iterator[tuple[str, str]]:
    """`(id, text)` of the documents of a vector store: these `ids` (through `get_by_ids`, which every
    LangChain vector store may implement), else all of them where the store can list them (`InMemoryVectorStore`,
    langchain-chroma's `Chroma`)."""
    if isinstance(vectorstore, VectorStoreRetriever):
        vectorstore = vectorstore.vectorstore
    if _pages_by_offset(vectorstore):  # its own listing: also reads records stored without metadata
        ids = None if ids is None else list(ids)
        offset = 0
        while True:
            if ids is None:
                res = vectorstore.get(limit=PAGE, offset=offset, include=["documents"])
            else:
                res = vectorstore.get(ids=ids[offset:offset + PAGE], include=["documents"])
            yield from zip(res["ids"], res["documents"])
            offset += PAGE
            if (ids is None and len(res["ids"]) < PAGE) or (ids is not None and offset >= len(ids)):
                return
    elif ids is not None:
        ids = list(ids)
        for start in range(0, len(ids), PAGE):
            for doc in vectorstore.get_by_ids(ids[start:start + PAGE]):
                yield str(doc.id), doc.page_content
    elif isinstance(vectorstore, InMemoryVectorStore):
        for doc_id, record in list(vectorstore.store.items()):
            yield str(doc_id), record["text"]
    else:
        raise ConfigError(f"{type(vectorstore).__name__} has no way to list all its documents; pass ids= (read "
                          "with get_by_ids), or warm the texts yourself with engine.ingest(texts)")


def warm_from_vectorstore(engine: Any, vectorstore: VectorStore | VectorStoreRetriever, *,
                          ids: Iterable[str] | None = None, show_progress: bool = False) -> WarmReport:
    """Precompute the KV of the documents of a LangChain vector store (all, or these `ids`); `engine` is a
    `CacheBlendEngine` or a `ChatCacheBlend` / `CacheBlendLLM` (whose engine is used). Documents that cannot be
    warmed (empty, too short to be matched, longer than the context window) are listed in `report.skipped`.

    Example:
        >>> from langchain_core.vectorstores import InMemoryVectorStore
        >>> store = InMemoryVectorStore(embeddings)
        >>> _ = store.add_texts(["Drones are male bees; they have no sting."])
        >>> report = warm_from_vectorstore(engine, store)
        >>> report.chunks, engine.has_kv(report.chunk_ids[0])
        (1, True)
    """
    if not isinstance(engine, CacheBlendEngine):
        get_engine = getattr(engine, "get_engine", None)
        if get_engine is None:
            raise ConfigError(f"engine must be a CacheBlendEngine, ChatCacheBlend or CacheBlendLLM, got "
                              f"{type(engine).__name__}")
        engine = get_engine()
    return warm_texts(engine, iter_vectorstore_documents(vectorstore, ids), show_progress=show_progress)
