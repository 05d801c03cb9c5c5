"""Admission: what a call must pass before it takes a queue slot, and the queue itself.

    call ─▶ documents counted ─▶ characters bounded (no tokenizing) ─▶ documents tokenized, prompt tokens counted
         ─▶ grammar size ─▶ grammar compiled (threads of its own, --grammar-timeout) ─▶ queue (429 + Retry-After)

Tokenizing runs on a thread of its own, never on the event loop nor on the engine's worker, so what cannot fit the
context window is refused before it costs the engine anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from dataclasses import replace

from ..decode.grammar import Grammar
from ..errors import PromptTooLongError
from ..ingest.chunks import Chunk, looks_like_chunk_id, make_chunk
from ..request import Request
from .calls import APIError
from .config import ServeConfig
from .limits import check_fits, max_token_chars
from .runner import EngineCall
from .scheduler import Job, QueueFull

logger = logging.getLogger(__name__)

GRAMMAR_WORKERS = 2  # threads compiling grammars: a schema bomb holds at most these, never the default pool


def tokenized(engine, request: Request) -> Request:
    """The request with its chunk texts tokenized (Chunks), for the engine's worker to skip that work; refused
    with PromptTooLongError when their tokens alone exceed the context window. Runs off the worker thread."""
    if not request.chunks:
        return request
    chunks: list[str | Chunk] = []
    for chunk in request.chunks:
        # a chunk id is looked up by the engine (cheap); a text is tokenized here, outside the engine's lock
        is_text = not (isinstance(chunk, Chunk) or looks_like_chunk_id(chunk))
        chunks.append(make_chunk(chunk, engine.tokenizer) if is_text else chunk)
    tokens = sum(c.num_tokens for c in chunks if isinstance(c, Chunk))
    if tokens > engine.context_window:
        raise PromptTooLongError(f"the documents have {tokens} tokens, more than the model's context window of "
                                 f"{engine.context_window} tokens; send fewer or shorter documents")
    return replace(request, chunks=tuple(chunks))


def prompt_tokens(engine, request: Request) -> int:
    """Tokens of the request's prompt as the engine will build it (system text, tools' and schema's instructions,
    turns, question and the tokenized chunks; chunk ids and retrieved chunks not counted, so a lower bound for
    those): counted on admission, before any grammar compiles. Runs off the worker thread."""
    if request.prompt is not None:
        return engine.count_prompt_tokens(request.prompt, request.tools)
    template = request.template or engine.template
    prefix, separator, suffix = template.render(engine.tokenizer, request.question, request.history)
    chunks = [c for c in request.chunks if isinstance(c, Chunk)]
    return len(prefix) + len(suffix) + sum(c.num_tokens for c in chunks) + len(separator) * max(len(chunks) - 1, 0)


class Admission:
    """The checks a call passes on its way to the queue, the grammar threads they compile on, and the queue's
    Retry-After (the mean latency of the requests answered so far)."""

    def __init__(self, engine, scheduler, config: ServeConfig) -> None:
        self.engine, self.scheduler, self.config = engine, scheduler, config
        self.chars_per_token = max_token_chars(engine.tokenizer)  # bounds a prompt's tokens from its length
        # grammars compile here, apart from the default pool that admits every request: plain requests never
        # wait behind a schema; the engine's compiler keeps what compiled, so the worker does not compile again
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_WORKERS, "cacheblend-grammar")
        self._mean_latency_s: float | None = None

    def check_grammar_size(self, grammar: Grammar) -> None:
        """A 400 for a grammar over --max-grammar-bytes: checked first, before its text is tokenized (a schema bomb's
        tokenizing alone took the CPU from every other request: `bench faults --fault-scenarios schema_bomb`)."""
        self.check_grammar_bytes(grammar.kind, len(grammar.source.encode()))

    def check_grammar_bytes(self, kind: str, size: int, at_least: bool = False) -> None:
        """A 400 for a grammar of `size` bytes (`at_least`: a lower bound, from the parsed JSON) over the limit."""
        if size > self.config.max_grammar_bytes:
            raise APIError(400, f"the request's {kind} grammar (its schema or tools) has {'at least ' * at_least}"
                           f"{size} bytes, more than this server's limit of {self.config.max_grammar_bytes} "
                           "(--max-grammar-bytes)", code="grammar_too_large")

    def admitted(self, call: EngineCall) -> EngineCall:
        """The call, checked for size and its documents tokenized: what cannot fit is refused here, before its
        grammar compiles, before it takes a queue slot or the engine's worker (which tokenized it before)."""
        request = call.request
        if len(request.chunks) > self.config.max_documents:
            raise APIError(400, f"{len(request.chunks)} documents and chunk ids; this server takes at most "
                           f"{self.config.max_documents} per request", code="too_many_documents")
        context_window = int(self.engine.context_window)
        check_fits(request, context_window, self.chars_per_token)
        request = tokenized(self.engine, request)
        tokens = prompt_tokens(self.engine, request)  # the schema's and tools' instructions included
        max_new_tokens = request.sampling.max_new_tokens
        if tokens + max_new_tokens > context_window:
            raise PromptTooLongError(f"the prompt has {tokens} tokens (system text, tools and schema included) + "
                                     f"max_tokens={max_new_tokens}, more than the model's context "
                                     f"window of {context_window} tokens; send a shorter prompt, schema or tools")
        return replace(call, request=request)

    async def compile(self, grammar: Grammar) -> None:
        """Compile the call's grammar on the grammar threads within the time limit: a 400 otherwise."""
        compiled = asyncio.wrap_future(self.grammar_pool.submit(self.engine.grammars.compile, grammar))
        try:
            await asyncio.wait_for(compiled, self.config.grammar_timeout_s)
        except TimeoutError:
            logger.warning("a %s grammar of %d bytes did not compile within %g s", grammar.kind,
                           len(grammar.source.encode()), self.config.grammar_timeout_s)
            raise APIError(400, f"the request's {grammar.kind} grammar did not compile within "
                           f"{self.config.grammar_timeout_s:g} s (--grammar-timeout); send a simpler schema or fewer "
                           "tools", code="grammar_too_complex") from None

    async def admit(self, call: EngineCall) -> EngineCall:
        """`admitted` on a thread of its own (neither the event loop nor the engine's worker tokenizes), then its
        grammar compiled (GrammarError, a 400, for one that does not compile or fails at its first token)."""
        grammar = call.request.sampling.grammar
        if grammar is not None:
            self.check_grammar_size(grammar)
        call = await asyncio.to_thread(self.admitted, call)
        if grammar is not None:
            await self.compile(grammar)
        return call

    def retry_after(self) -> str:
        """Seconds a client refused for a full queue should wait: the mean latency times the queue ahead of it."""
        mean = self._mean_latency_s or 1.0
        return str(max(1, math.ceil(mean * (self.scheduler.depth() + 1))))

    def submit(self, call: EngineCall) -> Job:
        """Queue the call as a job due within --timeout; a 429 with Retry-After when the queue is full."""
        job = Job(call, asyncio.get_running_loop(), deadline=time.monotonic() + self.config.timeout_s)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({e}); retry later", "rate_limit_error", "queue_full",
                           headers={"Retry-After": self.retry_after()}) from e
        return job

    def observe_latency(self, latency_s: float) -> None:
        """Fold an answered request's latency into the mean that Retry-After is computed from."""
        mean = self._mean_latency_s
        self._mean_latency_s = latency_s if mean is None else 0.8 * mean + 0.2 * latency_s

    def shutdown(self) -> None:
        """Stop the grammar threads, dropping compiles not started."""
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GRAMMAR_WORKERS", "Admission", "prompt_tokens", "tokenized"]
