"""The one text and finish path of decoding: token ids → text pieces as each token arrives, cut at the first stop
string, and why the answer ended. `Answer` is what every decoder feeds (the kv decoder's sequences, HF generate
through `AnswerStreamer`), for generate, stream and the batched server steps alike; nobody cuts or decides the
finish reason again (gpt-fast's split: the cache holder and the sampler know nothing of text)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


CONTEXT_TOKENS = 6  # printed tokens decoded again before the new ones, so each token decodes as it does in its line


class IncrementalText:
    """Text of a growing list of token ids, handed out piece by piece as each token arrives (as the streamer
    does: only an incomplete UTF-8 sequence waits).

    Each push decodes a bounded window, not the answer so far: the tokens not yet wholly printed plus
    CONTEXT_TOKENS printed ones before them (so a token's leading space and the tokenizer's clean-up see the same
    neighbours as in the whole text), and hands out what the window's text adds past the printed part. Once all
    of the window's text is printed the window moves up to its end; decoding restarts after a newline, as the
    whole-line decode it replaces did. `ids_decoded` counts the token ids passed to `decode` (a bounded number
    per token, however long the answer: tests pin it)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []  # the window: the line's last ids, CONTEXT_TOKENS printed ones first
        self._base = 0  # the window's ids before this one are wholly printed
        self._printed = 0  # characters of the window's text already handed out
        self.ids_decoded = 0

    def _decode(self, ids: list[int]) -> str:
        self.ids_decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """The new printable text after `token_id`."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        stable = len(text.rstrip("\ufffd"))
        piece = text[self._printed:stable]
        self._printed = max(self._printed, stable)
        if text.endswith("\n"):
            self._ids, self._base, self._printed = [], 0, 0
        elif stable == len(text) and len(self._ids) - self._base >= CONTEXT_TOKENS:
            # all printed: the window keeps its last CONTEXT_TOKENS ids, their text counted as printed
            del self._ids[:-CONTEXT_TOKENS]
            self._base = CONTEXT_TOKENS
            self._printed = len(self._decode(self._ids))
        return piece


class StopFilter:
    """Cuts a stream of text pieces at the first stop string, holding back enough text to see one that spans
    pieces."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.buffer = ""
        self.found = False

    def push(self, piece: str, armed: bool = True) -> str:
        """Text that is safe to hand out now; sets `found` once a stop string appeared (the text ends before it).
        Unarmed (a constrained answer that cannot end yet), the piece and the held text pass unsearched: a stop
        string counts only where it begins after the answer could have ended."""
        if not self.stop:
            return piece
        if not armed:
            out, self.buffer = self.buffer + piece, ""
            return out
        self.buffer += piece
        cuts = [i for i in (self.buffer.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self.found = True
            out, self.buffer = self.buffer[:min(cuts)], ""
            return out
        if len(self.buffer) > self.hold:
            cut = len(self.buffer) - self.hold
            out, self.buffer = self.buffer[:cut], self.buffer[cut:]
            return out
        return ""

    def flush(self) -> str:
        """The held-back text, at the end of the answer."""
        out, self.buffer = self.buffer, ""
        return out


class Answer:
    """An answer as its tokens arrive: the text pieces to hand out (stop strings cut), then its text, token ids,
    `finish_reason` and whether its grammar completed — decided here once, for every decoder and every caller.

    finish_reason: "stop" (EOS, a stop string, a grammar that allows only ending, or decoding stopped early by its
    caller), "length" (max_new_tokens) or "error" (the grammar failed while decoding: `error` says why). `grammar`
    is the sequence's grammar state (`decode.grammar.GrammarState`, or None): the decoder masks with it, `accept`
    advances it. With `pieces=False` no text is decoded per token (stop strings are then not looked for); `text`
    decodes the whole answer once at the end.
    """

    def __init__(self, tokenizer, settings, eos_token_id: int | None, grammar=None, pieces: bool = True) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.eos = eos_token_id
        self.grammar = grammar
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the grammar failed while decoding (finish_reason "error")
        self._text = IncrementalText(tokenizer) if pieces and tokenizer is not None else None
        self._stop = StopFilter(settings.stop)
        self._out: list[str] = []  # the pieces handed out

    @property
    def finished(self) -> bool:
        """Whether the answer is complete."""
        return self.finish_reason is not None

    @property
    def grammar_satisfied(self) -> bool | None:
        """Whether the text so far completes the grammar (None without one): False after "length" means the
        constrained text was cut before it was complete."""
        return None if self.grammar is None else self.grammar.satisfied

    @property
    def text(self) -> str:
        """The answer's text: the pieces handed out when a stop string cut it, else its tokens decoded whole."""
        if self._stop.found:
            return "".join(self._out)
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def accept(self, token_id: int) -> str:
        """Record the next token; returns the text to hand out now (stop strings cut) and sets finish_reason.
        Tokens after the answer finished are ignored (a decoder that stops a step later)."""
        if self.finished:
            return ""
        self.token_ids.append(token_id)
        piece = ""
        # a stop string inside a constrained answer counts only from where the grammar could end (before this token)
        can_stop = self.grammar is None or self.grammar.satisfied
        if self.grammar is not None:
            self.grammar.consume(token_id)
            if self.grammar.error:  # failed at this token or at its mask (which then allowed only EOS)
                from .grammar import first_line

                self.error = (f"the {self.settings.grammar.kind} grammar failed while decoding, after "
                              f"{len(self.token_ids) - 1} tokens: {first_line(self.grammar.error)}; send a simpler "
                              "schema (a pattern or a recursion past the grammar engine's limits?)")
                logger.warning("%s", self.error)
                self.finish_reason = "error"
                return ""
        if token_id == self.eos:
            self.finish_reason = "stop"
        elif self._text is not None:
            piece = self._stop.push(self._text.push(token_id), armed=can_stop)
            if self._stop.found:
                self.finish_reason = "stop"
        if self.finish_reason is None and self.grammar is not None and self.grammar.stopped:
            self.finish_reason = "stop"  # the grammar allows only EOS now: end without a step to choose it
        if self.finish_reason is None and len(self.token_ids) >= self.settings.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and not self._stop.found:
            piece += self._stop.flush()
        if piece:
            self._out.append(piece)
        return piece

    def end(self) -> str:
        """Decoding ended before the answer finished (its caller stopped it, or HF generate stopped on its own
        stop strings a token apart): finish_reason "stop"; returns the held-back text to hand out."""
        if self.finished:
            return ""
        self.finish_reason = "stop"
        piece = self._stop.flush()
        if piece:
            self._out.append(piece)
        return piece
