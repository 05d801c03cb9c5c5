"""Ingestion: files → texts → chunks (`loaders`), chunk identity and tokenization (`chunks`), the text index that
finds stored chunks inside any prompt (`index`), the local embedder (`embeddings`), and the corpus upkeep that fills
the engine's KV store and a Chroma collection together (`corpus.ingest_paths`, `delete_sources`, `prune_sources`).

Data flow: files → `load_paths` → `split_texts` (chunks of ~512 model tokens) → `ChromaChunkStore.upsert`
(embeddings) + `CacheBlendEngine.ingest` (KV), all keyed by the content-hash chunk id. Heavy imports
(sentence-transformers, langchain-text-splitters, chromadb) happen inside the functions that need them.
"""

from .corpus import DeleteReport, IngestError, IngestReport, delete_sources, ingest_paths, prune_sources
from .loaders import ChunkRecord, LoadResult, SkippedFile, SourceText, load_paths, load_paths_report, split_texts

__all__ = [
    "ChunkRecord", "DeleteReport", "IngestError", "IngestReport", "LoadResult", "SkippedFile", "SourceText",
    "delete_sources", "ingest_paths", "load_paths", "load_paths_report", "prune_sources", "split_texts",
]
