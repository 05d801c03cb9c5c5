"""One ingestion: files → chunks → Chroma (embeddings) + the engine's KV store, idempotent by chunk id."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from .loaders import DEFAULT_CHUNK_TOKENS, load_paths, split_texts


@dataclass(frozen=True)
class IngestReport:
    """What an ingestion did."""

    files: int
    chunks: int
    new_chunks: int  # new to the vector store or to the KV store
    new_kv: int  # chunks whose KV was computed by this run
    tokens: int  # model tokens over all chunks
    kv_bytes: int  # bytes of KV computed by this run
    seconds: float
    chunk_ids: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        """JSON-ready dict (without the id list)."""
        d = asdict(self)
        d.pop("chunk_ids")
        return d

    def summary(self) -> str:
        """One line for people."""
        return (f"{self.files} files, {self.chunks} chunks ({self.new_chunks} new, {self.new_kv} KV computed), "
                f"{self.tokens} tokens, {self.kv_bytes / 2**20:.1f} MiB of new KV, {self.seconds:.1f} s")


def ingest_paths(
    paths: Iterable[str | os.PathLike[str]],
    engine,
    store=None,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    show_progress: bool = True,
) -> IngestReport:
    """Load, split (with the engine's tokenizer), upsert into `store` (a ChromaChunkStore or None) and precompute KV."""
    started = time.perf_counter()
    files, texts = load_paths(paths)
    records = split_texts(texts, engine.tokenizer, chunk_tokens=chunk_tokens)
    ids = [r.chunk_id for r in records]
    new_vectors = set(store.upsert(records, show_progress=show_progress)) if store is not None else set()
    missing_kv = [r for r in records if not engine.has_kv(r.chunk_id)]
    engine.ingest([r.text for r in missing_kv], show_progress=show_progress)
    kv_bytes = 0
    for r in missing_kv:
        kv = engine.cache.store.get(engine.cache.key(r.chunk_id))
        kv_bytes += kv.nbytes if kv is not None else 0
    tokens = sum(len(engine.tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in records)
    new = new_vectors | {r.chunk_id for r in missing_kv}
    return IngestReport(len(files), len(records), len(new), len(missing_kv), tokens, kv_bytes,
                        time.perf_counter() - started, tuple(ids))
