"""Retrieval: the Chroma chunk store, warming the KV of what a vector store already holds, the passage prompt format.

Files are loaded, split and ingested by `cacheblend_rag.ingest` (`ingest_paths`), which fills a `ChromaChunkStore`
(embeddings) and the engine's KV store, keyed by the content-hash chunk id; `warm_from_chroma` / `warm_texts`
precompute the KV of documents a vector store already holds (no re-embedding). chromadb is imported only when the
Chroma store is asked for.
"""

from .warm import (
    SkippedDocument,
    WarmReport,
    iter_chroma_documents,
    open_chroma_collection,
    warm_from_chroma,
    warm_texts,
)
from .prompt import (
    ANSWER_HEADER,
    CHUNK_SEPARATOR,
    PASSAGE_HEADER,
    QUESTION_HEADER,
    ParsedPrompt,
    parse_prompt,
    render_prompt,
)

__all__ = [
    "ANSWER_HEADER", "CHUNK_SEPARATOR", "PASSAGE_HEADER", "QUESTION_HEADER", "ParsedPrompt", "SkippedDocument",
    "WarmReport", "iter_chroma_documents", "open_chroma_collection", "parse_prompt", "render_prompt",
    "warm_from_chroma", "warm_texts",
]


def __getattr__(name: str):  # chromadb is imported only when the Chroma store is asked for
    if name in ("ChromaChunkStore", "RetrievedChunk", "DEFAULT_COLLECTION"):
        from . import chroma

        return getattr(chroma, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
