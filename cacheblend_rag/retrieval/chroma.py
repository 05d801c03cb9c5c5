"""The default vector store: Chroma, embedded (PersistentClient under the home) or a server (HttpClient).

Embeddings always come from the local all-MiniLM-L6-v2 and are passed explicitly: Chroma's default embedding
function downloads an ONNX model and fails offline. Records are keyed by chunk id and upserted, so ingesting
the same text twice leaves one record. Distances are cosine. Each record's metadata carries `source` (the
absolute path of the file it came from), so a changed or removed file's records can be found and deleted.

A server can require a token (`token=`, sent as `Authorization: Bearer ...` through chromadb's own
`TokenAuthClientProvider`) and https (`ssl=True`, verified against the system's CAs or `ca_bundle=`).
Chroma's own `chroma run` (the Rust server of chromadb 1.x) has no authentication: put it behind a proxy that
checks the token and terminates TLS, or run chromadb's Python server (`uvicorn chromadb.app:app`) with
`CHROMA_SERVER_AUTHN_PROVIDER=chromadb.auth.token_authn.TokenAuthenticationServerProvider` (docs/cli.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .. import settings
from ..errors import CollectionNotFoundError, ConfigError, MissingDependencyError, VectorStoreError
from ..ingest.embeddings import embed, embedding_model_path, load_embedder
from ..ingest.loaders import ChunkRecord

logger = logging.getLogger(__name__)

DEFAULT_COLLECTION = "cacheblend_chunks"
_UPSERT_BATCH = 256
_TOKEN_PROVIDER = "chromadb.auth.token_authn.TokenAuthClientProvider"
_CHROMA_DB_FILE = "chroma.sqlite3"  # what PersistentClient creates in its folder


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


def _is_auth_error(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in ("unauthorized", "forbidden", "authoriz", "authenticat", "401", "403"))


class ChromaChunkStore:
    """Chunks in a Chroma collection, keyed by chunk id.

    Embedded by default (`chromadb.PersistentClient` at `settings.chroma_dir(home)`, or `path`); with
    `host`/`port` it talks to a Chroma server instead (`token`, `ssl`, `ca_bundle` default to the
    `CACHEBLEND_RAG_CHROMA_*` environment variables). `create=False` opens an existing collection only and
    writes nothing: a missing collection (or embedded database) is a `CollectionNotFoundError` listing those that
    exist. `own_embeddings=False` opens a collection
    someone else made as it is, without our embedding function, for reading its documents (`warm_from_chroma`).
    """

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        collection: str = DEFAULT_COLLECTION,
        *,
        host: str | None = None,
        port: int | None = None,
        path: str | os.PathLike[str] | None = None,
        token: str | None = None,
        ssl: bool | None = None,
        ca_bundle: str | os.PathLike[str] | None = None,
        create: bool = True,
        own_embeddings: bool = True,
    ) -> None:
        try:
            import chromadb
            from chromadb.config import Settings
        except ImportError as e:
            raise MissingDependencyError("the Chroma store needs chromadb: pip install 'cacheblend-rag[retrieval]'") from e
        if not 3 <= len(collection) <= 512:
            raise ConfigError(f"Chroma collection names need 3 to 512 characters, got {collection!r}")
        if port is not None and not 0 < int(port) < 65536:
            raise ConfigError(f"a Chroma server port is 1 to 65535, got {port}")
        remote = host is not None or port is not None
        token = settings.chroma_token(token)
        ssl = settings.chroma_ssl(ssl)
        ca = settings.chroma_ca_bundle(ca_bundle)
        if not remote and (token or ssl or ca):
            raise ConfigError("a Chroma token, https or a CA bundle only apply to a server: give --host/--port too")
        if ca is not None and not os.path.isfile(ca):
            raise ConfigError(f"Chroma CA bundle {ca}: no such file")
        options: dict = {"anonymized_telemetry": False}
        if token:
            options.update(chroma_client_auth_provider=_TOKEN_PROVIDER, chroma_client_auth_credentials=token)
        if ca is not None:
            options["chroma_server_ssl_verify"] = ca
        client_settings = Settings(**options)
        self.collection_name = collection
        self._own_embeddings = own_embeddings
        # where, before anything can fail: every error below names it
        if remote:
            host = host or "localhost"
            self.location = f"{'https' if ssl else 'http'}://{host}:{port or 8000}"
        else:
            root = settings.chroma_dir(home) if path is None else os.fspath(path)
            self.location = str(root)
            if not create and not os.path.isfile(os.path.join(root, _CHROMA_DB_FILE)):
                # opening would create the database there: a read never writes
                raise CollectionNotFoundError(f"no Chroma database at {self.location}: no collection "
                                              f"{collection!r}; run `cacheblend-rag ingest PATH` with the same "
                                              "--home/--collection first")
        try:
            if remote:
                self.client = chromadb.HttpClient(host=host, port=int(port or 8000), ssl=ssl, settings=client_settings)
            else:
                os.makedirs(root, exist_ok=True)
                self.client = chromadb.PersistentClient(path=str(root), settings=client_settings)
            self.collection = self._open(create)
        except (VectorStoreError, ConfigError):
            raise
        except Exception as e:  # chromadb raises ValueError / httpx errors / its own classes: name the cause
            if not remote:
                raise VectorStoreError(f"cannot open the Chroma database at {self.location}: {e}") from e
            if _is_auth_error(e):
                hint = ("the token was refused; check --chroma-token / $" + settings.ENV_CHROMA_TOKEN) if token else \
                    ("the server requires a token: pass --chroma-token or set $" + settings.ENV_CHROMA_TOKEN)
                raise VectorStoreError(f"Chroma at {self.location} refused the request ({e}): {hint}") from e
            raise VectorStoreError(
                f"cannot reach Chroma at {self.location} ({type(e).__name__}: {e}); start it "
                f"(`chroma run --host {host} --port {port or 8000}`), check --host/--port"
                + ("" if ssl else ", or pass --chroma-ssl if it speaks https")
            ) from e
        logger.info("Chroma collection %r at %s", collection, self.location)

    def _open(self, create: bool):
        if create:
            return self.client.get_or_create_collection(
                name=self.collection_name,
                embedding_function=_embedding_function(),
                configuration={"hnsw": {"space": "cosine"}},
            )
        names = [c if isinstance(c, str) else c.name for c in self.client.list_collections()]
        if self.collection_name not in names:
            listed = ", ".join(repr(n) for n in sorted(names)) or "none"
            raise CollectionNotFoundError(
                f"no collection {self.collection_name!r} in Chroma at {self.location} (collections: {listed}); "
                "run `cacheblend-rag ingest PATH` with the same --home/--collection first"
            )
        # A collection made elsewhere keeps its own embedding function: we only read its documents.
        function = _embedding_function() if self._own_embeddings else None
        return self.client.get_collection(name=self.collection_name, embedding_function=function)

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
        """Embed and add the records not stored yet; returns the ids that were new.

        A record already stored keeps its embedding; its metadata (e.g. `source`) is updated when it differs,
        so a passage belongs to the file that was ingested last with it.
        """
        unique = list({r.chunk_id: r for r in records}.values())
        existing = self._metadatas([r.chunk_id for r in unique])
        changed = [r for r in unique if r.chunk_id in existing
                   and existing[r.chunk_id] != {**r.metadata, "chunk_id": r.chunk_id}]
        for start in range(0, len(changed), _UPSERT_BATCH):
            batch = changed[start:start + _UPSERT_BATCH]
            self.collection.update(ids=[r.chunk_id for r in batch],
                                   metadatas=[{**r.metadata, "chunk_id": r.chunk_id} for r in batch])
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

    def _metadatas(self, ids: Sequence[str]) -> dict[str, dict]:
        """Metadata of those of `ids` that are stored."""
        found: dict[str, dict] = {}
        for start in range(0, len(ids), _UPSERT_BATCH):
            res = self.collection.get(ids=list(ids[start:start + _UPSERT_BATCH]), include=["metadatas"])
            found.update({cid: dict(meta or {}) for cid, meta in zip(res["ids"], res["metadatas"])})
        return found

    def ids_for_source(self, source: str) -> set[str]:
        """Ids of the records whose `source` metadata is `source`."""
        return set(self.collection.get(where={"source": source}, include=[])["ids"])

    def sources(self) -> dict[str, set[str]]:
        """Every `source` in the collection with its record ids (one pass over the metadata, in pages)."""
        out: dict[str, set[str]] = {}
        total, page = self.count(), 1000
        for offset in range(0, total, page):
            res = self.collection.get(include=["metadatas"], limit=page, offset=offset)
            for cid, meta in zip(res["ids"], res["metadatas"]):
                out.setdefault(str((meta or {}).get("source", "")), set()).add(cid)
        return out

    def delete(self, ids: Sequence[str]) -> int:
        """Delete records by id; returns how many of them existed."""
        ids = list(dict.fromkeys(ids))
        if not ids:
            return 0
        present = self.existing_ids(ids)
        for start in range(0, len(ids), _UPSERT_BATCH):
            batch = [cid for cid in ids[start:start + _UPSERT_BATCH] if cid in present]
            if batch:
                self.collection.delete(ids=batch)
        return len(present)

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
