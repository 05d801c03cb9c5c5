"""What the worker thread does with one request: gather its chunks, run the engine, hand back pieces and stats.

`engine_request` is the one place an API request becomes the engine's `Request`:
- with `documents`, `chunk_ids` or `retrieval`: chunks, a question, a template and history —
  the chunks are those passages, the question the last user message (or the completion prompt), the turns before
  it the history (the chunks stay in the first user turn, so a follow-up starts with the previous turn's prompt
  and answer: a stored prefix), a system message the template's system text;
- otherwise the request's own prompt — the whole chat, rendered with the model's chat template, or the
  completion prompt as is — is the request's prompt, in which the engine reuses the KV of every ingested chunk whose
  text it carries (a client's own RAG prompt gets reuse without any extension field).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..decode.generate import SamplingOptions
from ..decode.grammar import GrammarDecodeError
from ..errors import CollectionNotFoundError, PromptTooLongError
from ..fuse.layout import PromptTemplate
from ..fuse.policies import DEFAULT_METHOD, make_policy
from ..fuse.policy import Policy
from ..ingest.chunks import Chunk, looks_like_chunk_id, make_chunk
from ..request import Request
from .scheduler import BatchScheduler, Done, Failed, Job, Piece, Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineCall:
    """One request as the engine needs it, validated by the routes."""

    question: str  # the last user message, or the completion prompt
    sampling: SamplingOptions
    system: str | None = None  # a chat's system message
    messages: tuple[dict, ...] = ()  # the whole chat as {"role", "content": text} (empty for a completion)
    documents: tuple[str | Chunk, ...] = ()  # passage texts (tokenized on admission) or chunk ids, in prompt order
    retrieval: tuple[str, int] | None = None  # (collection, k)
    # built once from the body's `cacheblend` field; a call that names none: the registry's default method
    policy: Policy = field(default_factory=lambda: make_policy(DEFAULT_METHOD))
    auto_ratio: bool = False  # recompute_ratio "auto": the loading controller chooses it
    calibrated_ratio: bool = True  # no ratio named: the model's calibrated one (the fidelity gate) applies
    tools: tuple[dict, ...] | None = None  # listed by the chat template (its own tool format; no documents)
    cache_salt: str | None = None  # the engine request's (`request_salt`): None shares with every unsalted call


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


def request_salt(key_namespace: str | None, cache_salt: str | None) -> str | None:
    """The engine's cache salt for a request: its API key's namespace combined with (not replaced by) the
    `cache_salt` it sent, unambiguously (no client salt can name another key's namespace); None for neither."""
    if key_namespace is None and cache_salt is None:
        return None
    return json.dumps([key_namespace, cache_salt], ensure_ascii=False)


def admit_documents(engine, call: EngineCall) -> EngineCall:
    """The call with its document texts tokenized (Chunks), for the engine's worker to skip that work; refused
    with PromptTooLongError when their tokens alone exceed the context window. Runs off the worker thread."""
    chunks: list[str | Chunk] = []
    for doc in call.documents:
        # a chunk id is looked up by the engine (cheap); a text is tokenized here, outside the engine's lock
        chunks.append(doc if isinstance(doc, Chunk) or looks_like_chunk_id(doc) else make_chunk(doc, engine.tokenizer))
    tokens = sum(c.num_tokens for c in chunks if isinstance(c, Chunk))
    if tokens > engine.context_window:
        raise PromptTooLongError(f"the documents have {tokens} tokens, more than the model's context window of "
                                 f"{engine.context_window} tokens; send fewer or shorter documents")
    return replace(call, documents=tuple(chunks))


def prompt_tokens(engine, call: EngineCall) -> int:
    """Tokens of the call's prompt as the engine will build it (system text, tools' and schema's instructions,
    turns, question and the tokenized documents; chunk ids and retrieved chunks not counted, so a lower bound for
    those): counted on admission, before any grammar compiles. Runs off the worker thread."""
    if not call.documents and call.retrieval is None:
        return engine.count_prompt_tokens(call.messages or call.question, call.tools)
    template = PromptTemplate(system=call.system) if call.system else engine.template
    question, history = conversation(call)
    prefix, separator, suffix = template.render(engine.tokenizer, question, history)
    chunks = [c for c in call.documents if isinstance(c, Chunk)]
    return len(prefix) + len(suffix) + sum(c.num_tokens for c in chunks) + len(separator) * max(len(chunks) - 1, 0)


def conversation(call: EngineCall) -> tuple[str, tuple[dict, ...]]:
    """(question, earlier turns) of a call on the documents path: the last user message of a chat (a tool's result
    is one) and the messages before it, system messages left to the template; a completion has no earlier turns."""
    turns = [m for m in call.messages if m["role"] not in ("system", "developer")]
    last = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=None)
    if last is None:
        return call.question, ()
    return turns[last]["content"], tuple(turns[:last])


def engine_request(call: EngineCall, retriever: Retriever, stats: dict) -> Request:
    """The engine's request for a call (its retrieval run here); `stats` gets `num_retrieved`."""
    if not call.documents and call.retrieval is None:
        prompt = call.messages if call.messages else call.question
        return Request.of(prompt=prompt, method=call.policy, recompute_ratio=_ratio(call), sampling=call.sampling,
                          tools=call.tools, cache_salt=call.cache_salt, calibrated_ratio=call.calibrated_ratio)
    chunks = list(call.documents)
    if call.retrieval is not None:
        collection, k = call.retrieval
        retrieved = retriever.query(collection, call.question, k)
        stats["num_retrieved"] = len(retrieved)
        chunks += retrieved
    template = PromptTemplate(system=call.system) if call.system else None
    question, history = conversation(call)
    return Request.of(tuple(chunks), question, method=call.policy, recompute_ratio=_ratio(call), history=history,
                      template=template, sampling=call.sampling, cache_salt=call.cache_salt,
                      calibrated_ratio=call.calibrated_ratio)


def _ratio(call: EngineCall) -> str | None:
    """`Request.of`'s `recompute_ratio` for a call whose policy is built: "auto" leaves it to the engine."""
    return "auto" if call.auto_ratio else None


def run_job(engine, retriever: Retriever, job: Job) -> None:
    """Run one job on the worker thread: emit its pieces, then Done (or Failed); stop early when asked to."""
    stats: dict = {}
    pieces = engine.stream_request(engine_request(job.call, retriever, stats), stats)
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
    seq, pre_stats = engine.start_request(engine_request(job.call, retriever, stats))
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
