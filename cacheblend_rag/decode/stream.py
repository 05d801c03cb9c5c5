"""Streaming: decode on a worker thread, yield text pieces, cut at stop strings; stop decoding when the consumer
stops iterating (the worker is told to stop and joined, so no thread outlives the stream)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from .generate import SamplingOptions
from .text import IncrementalText, StopFilter


def token_streamer(tokenizer):
    """A TextIteratorStreamer that hands out text as each token is decoded (`IncrementalText`), not only at word
    boundaries: the first word of an answer arrives one decode step sooner."""
    from transformers import TextIteratorStreamer

    class TokenStreamer(TextIteratorStreamer):
        def put(self, value) -> None:
            if value.dim() > 1:
                if value.shape[0] > 1:
                    raise ValueError("streaming supports batch size 1")
                value = value[0]
            if self.skip_prompt and self.next_tokens_are_prompt:
                self.next_tokens_are_prompt = False
                return
            for token_id in value.tolist():
                self.on_finalized_text(self.text.push(token_id))

    streamer = TokenStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    streamer.text = IncrementalText(tokenizer)
    return streamer


def stream_decode(open_prefill: Callable[[], AbstractContextManager[Any]], tokenizer, sampling: SamplingOptions,
                  decode_prefill: Callable[[Any, Any, threading.Event], Any], stats: dict | None = None,
                  ) -> Generator[str, None, None]:
    """Yield the text pieces of the answer to the prefill that `open_prefill()` enters (on the worker thread).

    `decode_prefill(pre, streamer, cancel)` decodes after the prefill `pre` (the engine's chosen decoder), putting
    tokens to `streamer` and stopping once `cancel` is set; it returns the new token ids. `stats`, if given, gets
    the prefill's stats as soon as the first piece can arrive, then `num_generated` and `timing.decode_s`.
    Closing the generator early (a `break`, a disconnected client) stops decoding at the next token and waits for
    the worker.
    """
    streamer = token_streamer(tokenizer)
    errors: queue.Queue[BaseException] = queue.Queue()
    cancel = threading.Event()
    decoded = threading.Event()  # set once the stats are final (or an error is queued)

    def work() -> None:  # prefill and decode on one thread, holding the model's lock throughout
        try:
            with open_prefill() as pre:
                if stats is not None:  # readable as soon as the first piece arrives
                    stats.update(pre.stats.as_dict())
                if cancel.is_set():
                    streamer.end()
                    return
                started = time.perf_counter()
                new_ids = decode_prefill(pre, streamer, cancel)
                if stats is not None:
                    stats["num_generated"] = int(new_ids.numel())
                    stats["timing"] = dict(pre.stats["timing"], decode_s=time.perf_counter() - started)
                decoded.set()  # the consumer may finish while the holes are stored
        except BaseException as e:  # surfaced to the consumer below
            errors.put(e)
            streamer.end()
        finally:
            decoded.set()

    worker = threading.Thread(target=work, daemon=True, name="cacheblend-decode")
    worker.start()
    try:
        yield from stop_filtered(streamer, sampling.stop)
        cancel.set()  # a stop string may end the text before decoding ends
        decoded.wait()  # the streamer ends before decode returns: wait for the final stats (and any error)
        if not errors.empty():
            raise errors.get()
    finally:
        cancel.set()  # a consumer that stopped early: decoding stops at the next token
        worker.join()  # the streamer's queue is unbounded: the worker never waits on us


def stop_filtered(pieces: Iterable[str], stop: tuple[str, ...]) -> Iterator[str]:
    """Pass text pieces through `StopFilter`: cut at the first stop string, even one that spans pieces."""
    cut = StopFilter(stop)
    for piece in pieces:
        out = cut.push(piece)
        if out:
            yield out
        if cut.found:
            return
    rest = cut.flush()
    if rest:
        yield rest
