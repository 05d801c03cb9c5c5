"""One ingestion: files → chunks → Chroma (embeddings) + the engine's KV store, idempotent by chunk id.

Memory stays bounded whatever the corpus size: files are read one at a time and their chunks handled in
batches of `batch_chunks` (embed, upsert, compute KV, store, count the stored bytes, drop); the KV computed
lives on only in the store's memory tier, whose budget the caller sets (`open_store(path, memory_bytes=...)`,
the CLI's `--memory-budget`).

The corpus is kept current: each record's `source` is its file's absolute path; re-ingesting a file deletes
those of its records (and their KV) that it no longer produces, re-ingesting a folder also deletes the records of
its files that are gone, and `delete_sources` / `prune_sources` remove a file's records on request. A passage
found in several files belongs to the one ingested last with it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import CacheBlendError, KVWriteError
from .loaders import (
    DEFAULT_CHUNK_TOKENS,
    ChunkRecord,
    SkippedFile,
    iter_files,
    iter_loaded,
    source_key,
    split_texts,
)

logger = logging.getLogger(__name__)

DEFAULT_BATCH_CHUNKS = 32


@dataclass(frozen=True)
class IngestReport:
    """What an ingestion did (counts are exact: `new_kv` and `kv_bytes` are what the KV store holds now)."""

    files: int  # files read
    chunks: int  # chunks those files produced
    new_chunks: int  # new to the vector store or to the KV store
    new_kv: int  # chunks whose KV was computed and stored by this run
    tokens: int  # model tokens over all chunks
    kv_bytes: int  # bytes of KV stored by this run (on disk when the store has a disk tier)
    seconds: float
    chunk_ids: tuple[str, ...] = ()
    skipped: tuple[SkippedFile, ...] = ()  # files not ingested, with the reason
    kv_failed: tuple[str, ...] = ()  # chunk ids whose KV could not be stored
    removed_chunks: int = 0  # records of changed or removed files deleted from the vector store
    dropped_kv: int = 0  # KV entries of those records deleted from the KV store

    def as_dict(self) -> dict:
        """JSON-ready dict (without the id list)."""
        d = asdict(self)
        d.pop("chunk_ids")
        d["skipped"] = [{"path": s.path, "reason": s.reason} for s in self.skipped]
        d["kv_failed"] = len(self.kv_failed)
        return d

    def summary(self) -> str:
        """One line for people."""
        line = (f"{self.files} files, {self.chunks} chunks ({self.new_chunks} new, {self.new_kv} KV computed), "
                f"{self.tokens} tokens, {self.kv_bytes / 2**20:.1f} MiB of new KV, {self.seconds:.1f} s")
        if self.removed_chunks or self.dropped_kv:
            line += f"; {self.removed_chunks} stale chunks removed ({self.dropped_kv} KV dropped)"
        if self.skipped:
            line += f"; {len(self.skipped)} files skipped"
        if self.kv_failed:
            line += f"; KV of {len(self.kv_failed)} chunks NOT stored"
        return line


class IngestError(CacheBlendError):
    """An ingestion stopped (e.g. the KV store cannot write); `report` says exactly what was stored before."""

    def __init__(self, message: str, report: IngestReport) -> None:
        super().__init__(message)
        self.report = report




@dataclass
class _Run:
    engine: object
    store: object
    progress: tqdm
    records: list[ChunkRecord] = field(default_factory=list)
    ids: dict[str, None] = field(default_factory=dict)  # every chunk id produced, in order
    new_ids: set[str] = field(default_factory=set)
    new_kv: int = 0
    kv_bytes: int = 0
    tokens: int = 0
    kv_failed: list[str] = field(default_factory=list)

    def flush(self) -> None:
        """Embed and upsert the pending records, compute and store their missing KV, count what was stored."""
        batch, self.records = self.records, []
        if not batch:
            return
        engine = self.engine
        if self.store is not None:
            self.new_ids.update(self.store.upsert(batch))
        self.tokens += sum(len(engine.tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in batch)
        missing = [r for r in batch if not engine.has_kv(r.chunk_id)]
        error: BaseException | None = None
        if missing:
            try:
                engine.ingest([r.text for r in missing], show_progress=False)
            except (OSError, CacheBlendError) as e:
                error = e
        for r in missing:  # count what the store holds now, not what was computed
            size = engine.kv_nbytes(r.chunk_id)
            if size is None:
                self.kv_failed.append(r.chunk_id)
            else:
                self.new_kv += 1
                self.kv_bytes += size
                self.new_ids.add(r.chunk_id)
        self.progress.update(len(batch))
        if error is not None:
            raise error


def ingest_paths(
    paths: Iterable[str | os.PathLike[str]],
    engine,
    store=None,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    show_progress: bool = True,
    follow_symlinks: bool = False,
    batch_chunks: int = DEFAULT_BATCH_CHUNKS,
    sync_sources: bool = True,
) -> IngestReport:
    """Load, split (with the engine's tokenizer), upsert into `store` (a ChromaChunkStore or None) and precompute KV.

    Files that cannot be used are skipped and listed in the report; a KV store that cannot write stops the
    run with an `IngestError` carrying the report of what was stored. With `sync_sources` (and a store), the
    records a re-ingested file no longer produces, and those of files gone from a re-ingested folder, are
    deleted with their KV.
    """
    started = time.perf_counter()
    paths = [Path(p).expanduser() for p in paths]
    skipped: list[SkippedFile] = []
    files = iter_files(paths, follow_symlinks=follow_symlinks, skipped=skipped)
    run = _Run(engine, store, tqdm(desc="ingest", unit="chunk", disable=not show_progress))
    stale: set[str] = set()
    read_files: list[Path] = []
    sync = sync_sources and store is not None
    error: BaseException | None = None
    try:
        for f, texts in iter_loaded(files, skipped):
            if texts is None:
                if sync and skipped[-1].empty:  # the file says nothing now: its old chunks are stale
                    stale |= store.ids_for_source(source_key(f))
                continue
            records = split_texts(texts, engine.tokenizer, chunk_tokens=chunk_tokens)
            if not records:  # its text is only what the tokenizer drops ("\x16"): read, but nothing to ingest
                skipped.append(SkippedFile(str(f), "no text the model's tokenizer keeps (only control or "
                                                   "unprintable characters)", empty=True))
                if sync:
                    stale |= store.ids_for_source(source_key(f))
                continue
            read_files.append(f)
            if sync:
                stale |= store.ids_for_source(source_key(f)) - {r.chunk_id for r in records}
            for r in records:
                if r.chunk_id not in run.ids:
                    run.ids[r.chunk_id] = None
                    run.records.append(r)
            if len(run.records) >= batch_chunks:
                run.flush()
        run.flush()
    except (OSError, CacheBlendError) as e:
        error = e
    finally:
        run.progress.close()
    removed = dropped = 0
    if sync and error is None:
        seen = {source_key(f) for f in files}
        for root in (p for p in paths if p.is_dir()):
            prefix = source_key(root).rstrip(os.sep) + os.sep
            for source, ids in store.sources().items():
                if source.startswith(prefix) and source not in seen and not os.path.lexists(source):
                    stale |= ids
        stale -= run.ids.keys()  # a passage still produced by some file stays
        if stale:
            removed = store.delete(sorted(stale))
            dropped = engine.drop_kv(sorted(stale))
            logger.info("removed %d stale chunks (%d KV entries)", removed, dropped)
    report = IngestReport(
        len(read_files), len(run.ids), len(run.new_ids), run.new_kv, run.tokens, run.kv_bytes,
        time.perf_counter() - started, tuple(run.ids), tuple(skipped), tuple(run.kv_failed), removed, dropped,
    )
    if report.kv_failed:  # the store's own error says why when it raised one (disk full, read-only, Redis down)
        why = f": {error}" if isinstance(error, KVWriteError) else " (see the warnings above: disk full or read-only?)"
        raise IngestError(f"the KV of {len(report.kv_failed)} chunks could not be stored in {_kv_location(engine)}"
                          f"{why}; {report.summary()}", report) from error
    if error is not None:
        raise IngestError(f"ingest stopped: {error}; {report.summary()}", report) from error
    return report


def _kv_location(engine) -> str:
    folders = [str(path) for path in engine.kv_store.tiers().values() if path is not None]
    return ", ".join(folders) or "the KV store"


@dataclass(frozen=True)
class DeleteReport:
    """What a delete/prune removed."""

    sources: tuple[str, ...]  # the files whose records were removed
    removed_chunks: int
    dropped_kv: int

    def as_dict(self) -> dict:
        """JSON-ready dict."""
        return {"sources": list(self.sources), "removed_chunks": self.removed_chunks, "dropped_kv": self.dropped_kv}


def _delete(engine, store, by_source: dict[str, set[str]]) -> DeleteReport:
    ids = sorted(set().union(*by_source.values())) if by_source else []
    removed = store.delete(ids) if ids else 0
    dropped = engine.drop_kv(ids) if (ids and engine is not None) else 0
    return DeleteReport(tuple(sorted(by_source)), removed, dropped)


def delete_sources(paths: Sequence[str | os.PathLike[str]], engine, store) -> DeleteReport:
    """Remove the records (and KV, if `engine` is given) of these files, or of every file under these folders."""
    keys = [source_key(p) for p in paths]
    chosen: dict[str, set[str]] = {}
    for source, ids in store.sources().items():
        if any(source == k or source.startswith(k.rstrip(os.sep) + os.sep) for k in keys):
            chosen[source] = ids
    return _delete(engine, store, chosen)


def prune_sources(engine, store) -> DeleteReport:
    """Remove the records (and KV) of every source file that no longer exists."""
    gone = {s: ids for s, ids in store.sources().items() if s and os.path.isabs(s) and not os.path.lexists(s)}
    return _delete(engine, store, gone)
