"""Warm the KV store from texts a vector store already holds: no loading, splitting or re-embedding.

A user who already has a corpus in Chroma (or in any LangChain vector store / LlamaIndex index) keeps it as it
is; `warm_texts` precomputes the KV of each stored document so that the engine's prompt matcher reuses it when a
retriever puts that document into a prompt. `warm_from_chroma` reads a Chroma collection page by page (ids and
documents only, never its embeddings or its embedding function). The partner packages add
`warm_from_vectorstore` (LangChain) and `warm_from_index` (LlamaIndex) over the same `warm_texts`.

Documents that cannot be warmed are listed, never fatal: empty ones, ones too short to be matched inside a prompt
(`MIN_CHUNK_CHARS`) and ones longer than fits the model's context window behind the lead-in (re-split them).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from ..errors import VectorStoreError
from ..ingest.chunks import chunk_id, normalize_text
from ..ingest.index import MIN_CHUNK_CHARS

logger = logging.getLogger(__name__)

CHROMA_PAGE = 256  # documents read from Chroma per request


@dataclass(frozen=True)
class SkippedDocument:
    """A stored document whose KV was not computed, and why."""

    doc_id: str
    reason: str


@dataclass(frozen=True)
class WarmReport:
    """What a warm-up did: documents read, distinct chunks, KV computed now or already stored, what was skipped."""

    documents: int  # documents read from the vector store
    chunks: int  # distinct chunk texts among them (by content hash)
    new_kv: int  # chunks whose KV was computed and stored by this run
    already_stored: int  # chunks whose KV was stored before
    kv_bytes: int  # bytes of KV stored by this run
    seconds: float
    chunk_ids: tuple[str, ...] = ()
    skipped: tuple[SkippedDocument, ...] = ()

    def as_dict(self) -> dict:
        """JSON-ready dict (without the id list)."""
        d = asdict(self)
        d.pop("chunk_ids")
        d["skipped"] = [{"id": s.doc_id, "reason": s.reason} for s in self.skipped]
        return d

    def summary(self) -> str:
        """One line for people."""
        line = (f"{self.documents} documents, {self.chunks} chunks ({self.new_kv} KV computed, "
                f"{self.already_stored} already stored), {self.kv_bytes / 2**20:.1f} MiB of new KV, {self.seconds:.1f} s")
        if self.skipped:
            line += f"; {len(self.skipped)} documents skipped"
        return line


def warm_texts(engine, documents: Iterable[tuple[str, str]], *, show_progress: bool = False) -> WarmReport:
    """Precompute the KV of each `(doc_id, text)` not stored yet; returns what was computed, stored and skipped.

    `doc_id` is the vector store's own id (only used to name skipped documents); the KV is keyed by the text's
    chunk id, like every chunk the engine ingests.
    """
    started = time.perf_counter()
    room = engine.context_window - len(engine.lead_in_ids)
    seen: dict[str, None] = {}
    skipped: list[SkippedDocument] = []
    new_kv = already = kv_bytes = read = 0
    progress = tqdm(desc="warm KV", unit="doc", disable=not show_progress)
    try:
        for doc_id, text in documents:
            read += 1
            progress.update(1)
            norm = normalize_text(text) if isinstance(text, str) else ""
            if not norm:
                skipped.append(SkippedDocument(str(doc_id), "empty (no text stored with it)"))
                continue
            if len(norm) < MIN_CHUNK_CHARS:
                skipped.append(SkippedDocument(str(doc_id), f"shorter than {MIN_CHUNK_CHARS} characters: never "
                                                            "matched inside a prompt"))
                continue
            cid = chunk_id(norm)
            if cid in seen:
                continue
            if engine.has_kv(cid):
                seen[cid] = None
                already += 1
                continue
            num_tokens = len(engine.tokenizer(norm, add_special_tokens=False)["input_ids"])
            if num_tokens > room:
                skipped.append(SkippedDocument(str(doc_id), f"{num_tokens} tokens, more than the {room} that fit the "
                                                            "model's context window: re-split the collection"))
                continue
            engine.ingest([norm], show_progress=False)
            seen[cid] = None
            size = engine.kv_nbytes(cid)
            if size is not None:  # an in-memory-only store reports no size; the KV is there all the same
                kv_bytes += size
            new_kv += 1
    finally:
        progress.close()
    report = WarmReport(read, len(seen), new_kv, already, kv_bytes, time.perf_counter() - started, tuple(seen),
                        tuple(skipped))
    logger.info("warmed the KV of %s", report.summary())
    return report


def iter_chroma_documents(collection, page: int = CHROMA_PAGE) -> Iterator[tuple[str, str]]:
    """`(id, document)` of every record of a chromadb collection, in pages (no embeddings are read)."""
    total = collection.count()
    for offset in range(0, total, page):
        res = collection.get(include=["documents"], limit=page, offset=offset)
        yield from zip(res["ids"], res["documents"] or [None] * len(res["ids"]))


def open_chroma_collection(
    collection: str,
    *,
    path: str | os.PathLike[str] | None = None,
    home: str | os.PathLike[str] | None = None,
    host: str | None = None,
    port: int | None = None,
    token: str | None = None,
    ssl: bool | None = None,
    ca_bundle: str | os.PathLike[str] | None = None,
):
    """An existing, non-empty Chroma collection (a local `path`, the package's own under `home`, or a server),
    opened as it is — whatever embedding function it was made with — for reading its documents."""
    from .chroma import ChromaChunkStore

    store = ChromaChunkStore(home, collection, host=host, port=port, path=path, token=token, ssl=ssl,
                             ca_bundle=ca_bundle, create=False, own_embeddings=False)
    if store.count() == 0:
        raise VectorStoreError(f"Chroma collection {collection!r} at {store.location} is empty: nothing to warm")
    return store


def warm_from_chroma(engine, collection: str, *, show_progress: bool = False, **client) -> WarmReport:
    """Precompute the KV of every document of an existing Chroma collection; `client`: `open_chroma_collection`'s
    keywords (`path=`, or `host=`/`port=` with `token=`, `ssl=`, `ca_bundle=`). The collection is only read."""
    store = open_chroma_collection(collection, **client)
    return warm_texts(engine, iter_chroma_documents(store.collection), show_progress=show_progress)
