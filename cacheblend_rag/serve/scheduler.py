"""The request queue and the engine's worker thread.

    event loop (HTTP)                         worker thread (engine)
    ─────────────────                         ──────────────────────
    submit(job) ──▶ [ bounded queue ] ──▶ run(job): prefill, decode ──▶ job.emit(Piece | Done | Failed)
       │ full: QueueFull (429)                   checks job.should_stop() between pieces
    await job.next_event() ◀──────────── loop.call_soon_threadsafe ◀──┘

The engine serves one request at a time (it holds a lock), so one worker runs jobs in arrival order; the event
loop only queues, waits and writes bytes, so /health, /metrics and 429s answer while a request runs. A job that
is cancelled (client gone, timeout) stops at its next piece; one cancelled while queued is skipped.

`BatchScheduler` (continuous batching) has the same `submit`/`depth`/`batch_size`/`stop` and the same job events,
so the routes do not change; its worker interleaves prefills and decode steps:

    loop:  room in the batch and a job waits? ─▶ prefill it (the engine's lock), it joins the batch
           drop every job that must stop (cancelled, timed out, client gone): its slot is free now
           one decode step for every active job ─▶ Piece per job; a finished one gets Done and leaves

One prefill at a time is fine on a CPU (a prefill uses every core); a long prefill pauses the running decodes
for its duration, which is what a single engine thread can do.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The bounded queue has no room: answer 429."""


class RequestTimeout(Exception):
    """The request ran past its deadline."""


class Cancelled(Exception):
    """The request was cancelled (its client went away, or the server is stopping)."""


@dataclass(frozen=True)
class Piece:
    """A piece of generated text."""

    text: str


@dataclass(frozen=True)
class Done:
    """The request finished: the engine's stats (num_tokens, num_generated, chunk hits, timing, ...)."""

    stats: dict
    finish_reason: str  # "stop" or "length"


@dataclass(frozen=True)
class Failed:
    """The request failed with `error`."""

    error: BaseException


Event = Piece | Done | Failed


@dataclass(eq=False)
class Job:
    """One request on its way through the worker; `call` is what the runner needs (the routes build it)."""

    call: Any
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() past which the job stops
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the worker took it
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Event) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    def cancel(self) -> None:
        """Ask the worker to stop this job at its next piece (or skip it if it has not started)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """Whether the job was cancelled."""
        return self._cancelled.is_set()

    def should_stop(self) -> BaseException | None:
        """Why the job must stop now, or None to go on."""
        if self._cancelled.is_set():
            return Cancelled("the request was cancelled")
        if time.monotonic() > self.deadline:
            return RequestTimeout("the request ran past the server's timeout")
        return None

    async def next_event(self, poll_s: float, is_gone: Callable[[], Any] | None = None) -> Event:
        """The next event; raises RequestTimeout at the deadline and Cancelled when `await is_gone()` says so."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout("the request ran past the server's timeout")
            try:
                return await asyncio.wait_for(self.events.get(), min(remaining, poll_s))
            except TimeoutError:
                if is_gone is not None and await is_gone():
                    raise Cancelled("the client disconnected") from None


_STOP = object()


class _JobQueue:
    """A bounded FIFO of jobs in which a cancelled job stops counting at once: it holds no slot and is not in the
    depth, so a client that left frees its place for the next one (it gets its Failed event as it leaves)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque = deque()
        self._cond = threading.Condition()

    def _drop_cancelled(self) -> None:
        """Under the condition's lock: take the cancelled jobs out, each told why."""
        kept: deque = deque()
        for item in self._items:
            if item is not _STOP and item.cancelled:
                item.emit(Failed(Cancelled("the request was cancelled while it waited")))
            else:
                kept.append(item)
        self._items = kept

    def put_nowait(self, job: "Job") -> None:
        """Queue a job; queue.Full when `maxsize` live jobs already wait."""
        with self._cond:
            self._drop_cancelled()
            if len(self._items) >= self.maxsize:
                raise queue.Full
            self._items.append(job)
            self._cond.notify()

    def put_stop(self) -> None:
        """Queue the worker's stop marker (never refused)."""
        with self._cond:
            self._items.append(_STOP)
            self._cond.notify()

    def get(self, block: bool = True):
        """The next job (or the stop marker); queue.Empty when none waits and `block` is False."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._items:
                    return self._items.popleft()
                if not block:
                    raise queue.Empty
                self._cond.wait()

    def qsize(self) -> int:
        """Live jobs waiting."""
        with self._cond:
            self._drop_cancelled()
            return sum(1 for item in self._items if item is not _STOP)


class _QueueWorker:
    """A bounded FIFO of jobs and the one worker thread that takes them (`_work`, per scheduler)."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be ≥ 1, got {max_queue}")
        self._queue = _JobQueue(max_queue)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="cacheblend-engine", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull when `max_queue` jobs already wait."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None

    def depth(self) -> int:
        """Live jobs waiting for the engine (not counting those it is working on, nor cancelled ones)."""
        return self._queue.qsize()

    def stop(self, timeout: float | None = None) -> None:
        """Let the worker finish the queued and running jobs, then end it."""
        if self._thread is None:
            return
        self._queue.put_stop()
        self._thread.join(timeout)
        self._thread = None

    def _work(self) -> None:
        raise NotImplementedError


class Scheduler(_QueueWorker):
    """A bounded FIFO of jobs and one worker thread that runs them with `run(job)`, one at a time."""

    def __init__(self, run: Callable[[Job], None], max_queue: int) -> None:
        super().__init__(max_queue)
        self._run = run
        self._running = 0

    def batch_size(self) -> int:
        """Jobs the engine is working on now (0 or 1)."""
        return self._running

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            reason = job.should_stop()
            if reason is not None:  # cancelled or timed out while it waited
                job.emit(Failed(reason))
                continue
            job.started = time.monotonic()
            self._running = 1
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - every failure goes back to its request, the worker lives on
                job.emit(Failed(e))
            finally:
                self._running = 0


class Decoding(Protocol):
    """What `BatchScheduler` needs of a started request (runner.ActiveRequest)."""

    job: Job

    @property
    def finished(self) -> bool: ...

    @property
    def first_piece(self) -> str: ...  # text ready before the first step (the prefill chose its token)

    def done(self) -> Done | Failed: ...  # Failed: the answer ended in an error (a grammar that failed)


class BatchScheduler(_QueueWorker):
    """A bounded FIFO of jobs and one worker thread: a job is prefilled by `start(job)` and joins the running
    decode batch (at most `max_batch`); `step(active)` advances every active job by one token and returns each
    one's text piece."""

    def __init__(self, start: Callable[[Job], Decoding], step: Callable[[list], list[str]], max_queue: int,
                 max_batch: int = 8) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        super().__init__(max_queue)
        self._start, self._step = start, step
        self.max_batch = max_batch
        self._active: list[Decoding] = []

    def batch_size(self) -> int:
        """Jobs decoding now."""
        return len(self._active)

    def _admit(self, job: Job) -> None:
        reason = job.should_stop()
        if reason is not None:  # cancelled or timed out while it waited
            job.emit(Failed(reason))
            return
        job.started = time.monotonic()
        try:
            active = self._start(job)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to its request, the worker lives on
            job.emit(Failed(e))
            return
        if active.first_piece:  # out now: the first word does not wait for the batch's next step
            job.emit(Piece(active.first_piece))
        if active.finished:  # e.g. EOS or max_tokens=1 from the prefill's own token
            job.emit(active.done())
        else:
            self._active.append(active)

    def _work(self) -> None:
        stopping = False
        while True:
            if not stopping and len(self._active) < self.max_batch:
                try:  # an idle worker waits for work; a busy one only looks
                    job = self._queue.get(block=not self._active)
                except queue.Empty:
                    job = None
                if job is _STOP:
                    stopping = True
                elif job is not None:
                    self._admit(job)
            # a job that must stop frees its slot before the step (the batch shrinks before anyone hears of it)
            reasons = [a.job.should_stop() for a in self._active]
            stopped = [(a, r) for a, r in zip(self._active, reasons) if r is not None]
            running = self._active = [a for a, r in zip(self._active, reasons) if r is None]
            for active, reason in stopped:
                logger.debug("request stopped early: %s", reason)
                active.job.emit(Failed(reason))
            if not running:
                if stopping:
                    return
                continue
            try:
                pieces = self._step(running)
            except BaseException as e:  # noqa: BLE001 - a failed step fails the jobs in it, not the server
                logger.exception("a decode step failed")
                for active in running:
                    active.job.emit(Failed(e))
                self._active = []
                continue
            self._active = [a for a in running if not a.finished]
            for active, piece in zip(running, pieces):
                if piece:
                    active.job.emit(Piece(piece))
                if active.finished:
                    active.job.emit(active.done())
