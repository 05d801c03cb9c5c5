"""Retrievers whose Documents carry the content-hash chunk id (`Document.id == metadata["chunk_id"]`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.ingest.chunks import chunk_id
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable
from langchain_core.vectorstores import VectorStore
from pydantic import ConfigDict, Field

__all__ = ["ChromaRetriever", "ChunkIdRetriever", "document_chunk_id", "with_chunk_ids"]

DEFAULT_K = 4


def document_chunk_id(doc: Document) -> str:
    """The content-hash chunk id of a Document (recomputed from its text, never trusted from metadata)."""
    return chunk_id(doc.page_content)


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


def _as_documents(items: Any) -> list[Document]:
    """What a base returned, as Documents: a plain string is a passage; anything else is refused by name."""
    out = []
    for item in [items] if isinstance(items, (str, Document)) else items:
        if isinstance(item, str):
            out.append(Document(page_content=item))
        elif isinstance(item, Document):
            out.append(item)
        else:
            raise ConfigError(f"ChunkIdRetriever.base returned a {type(item).__name__}; it must return Documents "
                              "(or strings)")
    return out


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"k must be a positive int, got {k!r}")
    return k


class ChunkIdRetriever(BaseRetriever):
    """Wraps a retriever or vector store; its Documents carry the content-hash chunk id, at most `k` of them.

    `Document.id` and `metadata["chunk_id"]` are set to `cacheblend_rag.chunk_id(page_content)`; duplicates
    (same id) are dropped, keeping the first (best-ranked). A per-call `k` (`retriever.invoke(q, k=2)`) wins
    over the field; either is passed on to the base when it takes one (a vector store, a `VectorStoreRetriever`).

    Example:
        >>> from langchain_core.vectorstores import InMemoryVectorStore
        >>> store = InMemoryVectorStore(embeddings)
        >>> _ = store.add_texts(["Bees have five eyes.", "Queens are fed royal jelly.", "Wax comes from glands."])
        >>> retriever = ChunkIdRetriever(base=store.as_retriever(), k=2)
        >>> docs = retriever.invoke("How many eyes does a bee have?")
        >>> len(docs), docs[0].id == docs[0].metadata["chunk_id"]
        (2, True)
        >>> len(retriever.invoke("bee eyes", k=1))
        1
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    base: Any
    """A retriever (any Runnable returning Documents) or a `VectorStore`."""
    k: int | None = Field(default=None)
    """Most Documents returned (None: a vector store gives 4, a retriever its own number)."""

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        unknown = sorted(set(kwargs) - {"k"})
        if unknown:
            raise ConfigError(f"ChunkIdRetriever got unknown keyword argument(s) {', '.join(unknown)}; it accepts k")
        k = kwargs.get("k", self.k)
        if k is not None:
            k = _check_k(k)
        if isinstance(self.base, VectorStore):
            docs = self.base.similarity_search(query, k=k or DEFAULT_K)
        elif isinstance(self.base, BaseRetriever):
            takes_k = k is not None and self.base._expects_other_args  # e.g. VectorStoreRetriever(search_kwargs)
            docs = self.base.invoke(query, config={"callbacks": run_manager.get_child()}, **({"k": k} if takes_k else {}))
        elif isinstance(self.base, Runnable):
            docs = self.base.invoke(query, config={"callbacks": run_manager.get_child()})
        elif hasattr(self.base, "invoke"):
            docs = self.base.invoke(query)
        else:
            raise ConfigError(f"ChunkIdRetriever.base must be a retriever or a VectorStore, got {type(self.base).__name__}")
        docs = with_chunk_ids(_as_documents(docs))
        return docs[:k] if k is not None else docs


class ChromaRetriever(BaseRetriever):
    """Top-k search over a `cacheblend_rag.retrieval.ChromaChunkStore` (embedded or server); `k` per call too.

    Example:
        >>> from cacheblend_rag.ingest import ingest_paths
        >>> from cacheblend_rag.retrieval.chroma import ChromaChunkStore
        >>> store = ChromaChunkStore(home, "chroma_retriever_example")  # Chroma under a package home
        >>> _ = ingest_paths([data_dir], engine, store, show_progress=False)  # embeddings + KV, idempotent
        >>> docs = ChromaRetriever(store=store, k=3).invoke("How many eyes does a honeybee have?", k=2)
        >>> len(docs), docs[0].id == docs[0].metadata["chunk_id"]
        (2, True)
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    store: Any
    """A `ChromaChunkStore`."""
    k: int = 6
    """How many chunks to return."""

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        unknown = sorted(set(kwargs) - {"k"})
        if unknown:
            raise ConfigError(f"ChromaRetriever got unknown keyword argument(s) {', '.join(unknown)}; it accepts k")
        return [
            Document(page_content=hit.text, metadata={**hit.metadata, "chunk_id": hit.chunk_id, "score": hit.score},
                     id=hit.chunk_id)
            for hit in self.store.query(query, _check_k(kwargs.get("k", self.k)))
        ]
