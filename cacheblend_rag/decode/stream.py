"""Streaming: decode on a worker thread, yield the answer's text pieces (stop strings already cut by its `Answer`);
stop decoding when the consumer stops iterating (the worker is told to stop and joined, so no thread outlives the
stream)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import Any

from .text import Answer

_END = object()  # the worker's last item: the answer (and its stats) are final


def answer_streamer(answer: Answer, on_piece: Callable[[str], None] | None = None,
                    cancel: threading.Event | None = None):
    """A streamer for HF generate that feeds each new token to `answer` (the prompt skipped), hands its pieces to
    `on_piece` and sets `cancel` once the answer finished (generate then stops at the next step)."""
    from transformers.generation.streamers import BaseStreamer

    class AnswerStreamer(BaseStreamer):
        def __init__(self) -> None:
            self.prompt = True

        def put(self, value) -> None:
            if value.dim() > 1:
                if value.shape[0] > 1:
                    raise ValueError("streaming supports batch size 1")
                value = value[0]
            if self.prompt:
                self.prompt = False
                return
            for token_id in value.tolist():
                piece = answer.accept(token_id)
                if piece and on_piece is not None:
                    on_piece(piece)
            if answer.finished and cancel is not None:
                cancel.set()

        def end(self) -> None:
            piece = answer.end()
            if piece and on_piece is not None:
                on_piece(piece)

    return AnswerStreamer()


def stream_decode(open_prefill: Callable[[], AbstractContextManager[Any]],
                  decode_prefill: Callable[[Any, Callable[[str], None], threading.Event], Answer],
                  stats: dict | None = None) -> Generator[str, None, None]:
    """Yield the text pieces of the answer to the prefill that `open_prefill()` enters (on the worker thread).

    `decode_prefill(pre, emit, cancel)` decodes after the prefill `pre` (the engine's chosen decoder), handing each
    text piece to `emit` and stopping once `cancel` is set; it returns the finished `Answer`. `stats`, if given,
    gets the prefill's stats as soon as the first piece can arrive, then `num_generated`, `timing.decode_s`,
    `finish_reason` and `grammar_satisfied` (the answer's own). Closing the generator early (a `break`, a
    disconnected client) stops decoding at the next token and waits for the worker.
    """
    items: queue.Queue[Any] = queue.Queue()  # unbounded: the worker never waits on us
    cancel = threading.Event()

    def work() -> None:  # prefill and decode on one thread, holding the model's lock throughout
        try:
            with open_prefill() as pre:
                if stats is not None:  # readable as soon as the first piece arrives
                    stats.update(pre.stats.as_dict())
                if cancel.is_set():
                    return
                started = time.perf_counter()
                answer = decode_prefill(pre, items.put, cancel)
                if stats is not None:
                    stats["num_generated"] = len(answer.token_ids)
                    stats["timing"] = dict(pre.stats["timing"], decode_s=time.perf_counter() - started)
                    stats["finish_reason"], stats["grammar_satisfied"] = answer.finish_reason, answer.grammar_satisfied
                items.put(_END)  # the consumer may finish while the holes are stored
        except BaseException as e:  # surfaced to the consumer below
            items.put(e)
        finally:
            items.put(_END)

    worker = threading.Thread(target=work, daemon=True, name="cacheblend-decode")
    worker.start()
    try:
        while (item := items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancel.set()  # a consumer that stopped early: decoding stops at the next token
        worker.join()
