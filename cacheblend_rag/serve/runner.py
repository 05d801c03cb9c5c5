"""What the worker thread does with one call: add its retrieved passages to its request, run the engine, hand back
pieces and stats.

A call is built by the route (`calls.py`): the engine's `Request`, whole, and, for `retrieval`, the query that only
the worker runs (Chroma is opened and queried there, never on the event loop).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..decode.grammar import GrammarDecodeError
from ..errors import CollectionNotFoundError
from ..request import Request
from .scheduler import BatchScheduler, Done, Failed, Job, Piece, Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrievalQuery:
    """Passages to retrieve on the worker: the `k` chunks of the Chroma `collection` most similar to `query`."""

    collection: str
    k: int
    query: str  # the last user message as the client sent it (or the completion prompt)


@dataclass(frozen=True)
class EngineCall:
    """One API request on its way to the engine: its `Request`, built once by the route (policy, sampling, chunks,
    tools, salt: everything the engine reads), and what only the worker can add to it, the passages of `retrieval`."""

    request: Request
    retrieval: RetrievalQuery | None = None


class Retriever:
    """The server's Chroma collections, opened on first use (in the worker thread) and kept; only existing ones
    (a request never creates a collection, nor the database)."""

    def __init__(self, home: str | os.PathLike[str] | None, host: str | None = None, port: int | None = None) -> None:
        self.home, self.host, self.port = home, host, port
        self._stores: dict[str, object] = {}

    def query(self, collection: str, question: str, k: int) -> list[str]:
        """Texts of the `k` chunks most similar to the question, best first; CollectionNotFoundError (naming the
        collection only, never where the database is) when it does not exist."""
        store = self._stores.get(collection)
        if store is None:
            from ..retrieval.chroma import ChromaChunkStore

            try:
                store = ChromaChunkStore(self.home, collection, host=self.host, port=self.port, create=False)
            except CollectionNotFoundError as e:
                logger.info("retrieval from a missing collection: %s", e)
                raise CollectionNotFoundError(f"no collection {collection!r} on this server; fill it with "
                                              f"`cacheblend-rag ingest PATH --collection {collection}`") from None
            self._stores[collection] = store
        return [hit.text for hit in store.query(question, k)]


def retrieved_request(call: EngineCall, retriever: Retriever, stats: dict) -> Request:
    """The call's request with its retrieved passages after its own chunks (queried here, on the worker thread);
    `stats` gets `num_retrieved`."""
    if call.retrieval is None:
        return call.request
    retrieval = call.retrieval
    retrieved = retriever.query(retrieval.collection, retrieval.query, retrieval.k)
    stats["num_retrieved"] = len(retrieved)
    return replace(call.request, chunks=(*call.request.chunks, *retrieved))


def run_job(engine, retriever: Retriever, job: Job) -> None:
    """Run one job on the worker thread: emit its pieces, then Done (or Failed); stop early when asked to."""
    stats: dict = {}
    pieces = engine.stream_request(retrieved_request(job.call, retriever, stats), stats)
    stopped: BaseException | None = None
    try:
        for piece in pieces:
            stopped = job.should_stop()
            if stopped is not None:
                break
            job.emit(Piece(piece))
    finally:
        pieces.close()  # a stream closed early stops decoding
    if stopped is not None:
        logger.debug("request stopped early: %s", stopped)
        job.emit(Failed(stopped))
        return
    job.emit(Done(stats, stats["finish_reason"]))  # the engine's answer says how it ended: never recounted here


# ---- continuous batching: a request is started (prefill) once, then advanced one token per batched step ----------


@dataclass(eq=False)
class ActiveRequest:
    """A request in the running decode batch: its job, its decode sequence and its stats so far."""

    job: Job
    sequence: object  # decode.kv_decode.KVSequence
    stats: dict
    decode_started: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        """Whether its answer is complete (EOS, a stop string or max_tokens)."""
        return self.sequence.finished

    @property
    def first_piece(self) -> str:
        """The text of the first token, chosen from the prefill's logits before any decode step."""
        return self.sequence.first_piece

    def done(self) -> Done | Failed:
        """The Done event with the request's final stats; Failed when its grammar failed while decoding."""
        seq = self.sequence
        if seq.error is not None:
            return Failed(GrammarDecodeError(seq.error))
        self.stats["num_generated"] = len(seq.generated)
        self.stats["timing"] = dict(self.stats.get("timing", {}), decode_s=time.perf_counter() - self.decode_started)
        return Done(self.stats, seq.finish_reason)  # "stop" or "length", as the sequence's answer decided


def start_job(engine, retriever: Retriever, job: Job) -> ActiveRequest:
    """Prefill one job (on the worker thread, under the engine's lock): a request ready to join the batch."""
    stats: dict = {}
    seq, pre_stats = engine.start_request(retrieved_request(job.call, retriever, stats))
    stats.update(pre_stats.as_dict())
    return ActiveRequest(job, seq, stats)


def step_jobs(engine, active: Sequence[ActiveRequest]) -> list[str]:
    """One decode step for every active request; the text piece of each."""
    return engine.advance([a.sequence for a in active])


def make_scheduler(engine, retriever: Retriever, max_queue: int, max_batch: int = 8):
    """The continuous-batching scheduler on the engine's own decoder; one request at a time (HF generate) when
    the engine decodes with decoder="hf"."""
    if engine.decoder != "kv":
        return Scheduler(lambda job: run_job(engine, retriever, job), max_queue)
    return BatchScheduler(lambda job: start_job(engine, retriever, job), lambda active: step_jobs(engine, active),
                          max_queue, max_batch)
