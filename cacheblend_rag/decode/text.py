"""The one text path of decoding: token ids → text pieces as each token arrives, cut at the first stop string.
Generate, stream and the batched server steps all use these two (gpt-fast's split: the cache holder and the
sampler know nothing of text)."""

from __future__ import annotations


class IncrementalText:
    """Text of a growing list of token ids, handed out piece by piece as each token arrives (as the streamer
    does: only an incomplete UTF-8 sequence waits); decoding restarts after a newline so each call stays cheap."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._printed = 0

    def push(self, token_id: int) -> str:
        """The new printable text after `token_id`."""
        self._ids.append(token_id)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        stable = len(text.rstrip("\ufffd"))
        piece = text[self._printed:stable]
        self._printed = max(self._printed, stable)
        if text.endswith("\n"):
            self._ids, self._printed = [], 0
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
