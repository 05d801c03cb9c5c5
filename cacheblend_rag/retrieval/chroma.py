"""The default vector store: Chroma, embedded (PersistentClient under the home) or a server (HttpClient).

Embeddings always come from the local all-MiniLM-L6-v2 and are passed explicitly: Chroma's default embedding
function downloads an ONNX model and fails offline. Records are keyed by chunk id and upserted, so ingesting
the same text twice leaves one record. Distances are cosine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .. import settings
from ..errors import ConfigError, MissingDependencyError
from .embeddings import embed, embedding_model_path, load_embedder
from .loaders import ChunkRecord

logger = logging.getLogger(__name__)

DEFAULT_COLLECTION = "cacheblend_chunks"
_UPSERT_BATCH = 256


@dataclass(frozen=True)
class RetrievedChunk:
    """One search hit: the chunk, its metadata and its cosine similarity to the query."""

    chunk_id: str
    text: str
    metadata: dict
    score: float


def _embedding_function():
    """Chroma's sentence-transformers function on the local folder, sharing our loaded model.

    Chroma records the function's name and config (the model path) with the collection, so the same
    function is passed every time the collection is opened.
    """
    from chromadb.utils.embedding_functions import SentenceTransformerEmbeddingFunction

    path = str(embedding_model_path())
    SentenceTransformerEmbeddingFunction.models.setdefault(path, load_embedder())
    return SentenceTransformerEmbeddingFunction(model_name=path, device="cpu", normalize_embeddings=True,
                                                local_files_only=True)


class ChromaChunkStore:
    """Chunks in a Chroma collection, keyed by chunk id.

    Embedded by default (`chromadb.PersistentClient` at `settings.chroma_dir(home)`, or `path`); with
    `host`/`port` it talks to a Chroma server (`chroma run --path DIR --host H --port P`) instead.
    """

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        collection: str = DEFAULT_COLLECTION,
        *,
        host: str | None = None,
        port: int | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        try:
            import chromadb
            from chromadb.config import Settings
        except ImportError as e:
            raise MissingDependencyError("the Chroma store needs chromadb: pip install 'cacheblend-rag[retrieval]'") from e
        if not 3 <= len(collection) <= 512:
            raise ConfigError(f"Chroma collection names need 3 to 512 characters, got {collection!r}")
        client_settings = Settings(anonymized_telemetry=False)
        if host is not None or port is not None:
            self.location = f"http://{host or 'localhost'}:{port or 8000}"
            self.client = chromadb.HttpClient(host=host or "localhost", port=int(port or 8000), settings=client_settings)
        else:
            root = settings.chroma_dir(home) if path is None else os.fspath(path)
            os.makedirs(root, exist_ok=True)
            self.location = str(root)
            self.client = chromadb.PersistentClient(path=str(root), settings=client_settings)
        self.collection_name = collection
        self.collection = self.client.get_or_create_collection(
            name=collection,
            embedding_function=_embedding_function(),
            configuration={"hnsw": {"space": "cosine"}},
        )
        logger.info("Chroma collection %r at %s", collection, self.location)

    def count(self) -> int:
        """Number of stored chunks."""
        return self.collection.count()

    def existing_ids(self, ids: Sequence[str]) -> set[str]:
        """Which of `ids` are already stored."""
        found: set[str] = set()
        for start in range(0, len(ids), _UPSERT_BATCH):
            found.update(self.collection.get(ids=list(ids[start:start + _UPSERT_BATCH]), include=[])["ids"])
        return found

    def upsert(self, records: Sequence[ChunkRecord], *, show_progress: bool = False) -> list[str]:
        """Embed and upsert the records not stored yet; returns the ids that were new."""
        unique = list({r.chunk_id: r for r in records}.values())
        existing = self.existing_ids([r.chunk_id for r in unique])
        new = [r for r in unique if r.chunk_id not in existing]
        if not new:
            return []
        vectors = embed([r.text for r in new], show_progress=show_progress)
        for start in range(0, len(new), _UPSERT_BATCH):
            batch = new[start:start + _UPSERT_BATCH]
            self.collection.upsert(
                ids=[r.chunk_id for r in batch],
                documents=[r.text for r in batch],
                embeddings=vectors[start:start + _UPSERT_BATCH],
                metadatas=[{**r.metadata, "chunk_id": r.chunk_id} for r in batch],
            )
        return [r.chunk_id for r in new]

    def query(self, text: str, k: int = 6) -> list[RetrievedChunk]:
        """The `k` chunks most similar to `text`, best first."""
        if k < 1:
            raise ConfigError(f"k must be ≥ 1, got {k}")
        n = self.count()
        if n == 0:
            return []
        res = self.collection.query(query_embeddings=embed([text]), n_results=min(k, n),
                                    include=["documents", "metadatas", "distances"])
        return [
            RetrievedChunk(cid, doc, dict(meta or {}), 1.0 - float(dist))
            for cid, doc, meta, dist in zip(res["ids"][0], res["documents"][0], res["metadatas"][0], res["distances"][0])
        ]
