"""Retrieval and ingestion: loaders and token-aware splitting, the local embedder, Chroma, the passage prompt format.

Data flow: files → `load_paths` → `split_texts` (chunks of ~512 model tokens) → `ChromaChunkStore.upsert`
(embeddings) + `CacheBlendEngine.ingest` (KV) — all keyed by the content-hash chunk id. `ingest_paths` does it all;
`warm_from_chroma` / `warm_texts` precompute the KV of documents a vector store already holds (no re-embedding).
Heavy imports (chromadb, sentence-transformers, langchain-text-splitters) happen inside the functions that need them.
"""

from .loaders import ChunkRecord, LoadResult, SkippedFile, SourceText, load_paths, load_paths_report, split_texts
from .pipeline import DeleteReport, IngestError, IngestReport, delete_sources, ingest_paths, prune_sources
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
    "ANSWER_HEADER", "CHUNK_SEPARATOR", "PASSAGE_HEADER", "QUESTION_HEADER", "ChunkRecord", "DeleteReport",
    "IngestError", "IngestReport", "LoadResult", "ParsedPrompt", "SkippedFile", "SourceText", "delete_sources",
    "ingest_paths", "load_paths", "load_paths_report", "parse_prompt", "prune_sources", "render_prompt",
    "split_texts", "SkippedDocument", "WarmReport", "iter_chroma_documents", "open_chroma_collection",
    "warm_from_chroma", "warm_texts",
]


def __getattr__(name: str):  # chromadb is imported only when the Chroma store is asked for
    if name in ("ChromaChunkStore", "RetrievedChunk", "DEFAULT_COLLECTION"):
        from . import chroma

        return getattr(chroma, name)
    if name in ("load_embedder", "embedding_model_path"):
        from . import embeddings

        return getattr(embeddings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
