"""Look-alike pages: a later chunk that repeats an earlier chunk's phrasing with other content.

Reused KV loses answers among such pages (docs/benchmarks.md, "Which method for my documents"): a page
computed on its own is the KV of a *first* document, and placed second or third among pages written from the same
template (product pages, FAQ pages, forms) it pulls the question to its own facts — a neighbour's price. Pages that
merely repeat each other (overlapping windows of one article) or share nothing do not. So the risk is phrasing
shared *without* content shared, which token n-grams measure directly:

    score(page j) = |short n-grams of j seen in pages < j| / |short n-grams of j|
                  − |long n-grams of j seen in pages < j| / |long n-grams of j|

(3- and 8-grams of token ids). FAQ pages score 0.27–0.45; MuSiQue's retrieved passages 0.00–0.14, though they
repeat each other almost whole (their 3- and 8-gram shares are both ~0.95). A page above the threshold is
recomputed in full, and so is the earlier page it borrows most phrasing from: a group's first page left stale
loses the answers on the pages after it in an agent's step after a tool (the question before the pages: on the
FAQ tool frame, Qwen, N = 40, 20/40 right with the first page stale, 30/40 as full prefill with it recomputed;
docs/benchmarks.md). A page whose KV is exact already (after the very opening it was computed behind) is not
recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .policy import RowSelection
from .sequence import FusedSequence

SHORT, LONG = 3, 8


def _grams(ids: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def lookalike_scores(pages: list[list[int]]) -> list[float]:
    """Per page (token ids, in prompt order): phrasing shared with an earlier page minus content shared (0 for the
    first page and for pages too short to have a long n-gram)."""
    return _scores([_grams(ids, SHORT) for ids in pages], [_grams(ids, LONG) for ids in pages])


def _scores(shorts: list[set], longs: list[set]) -> list[float]:
    scores, seen_short, seen_long = [], set(), set()
    for short, long in zip(shorts, longs):
        if seen_short and long:
            scores.append(len(short & seen_short) / len(short) - len(long & seen_long) / len(long))
        else:
            scores.append(0.0)
        seen_short |= short
        seen_long |= long
    return scores


def lookalike_group(pages: list[list[int]], threshold: float) -> list[bool]:
    """Per page (token ids, in prompt order): whether it is in a look-alike group — its score above `threshold`,
    or the earlier page that such a page shares the most 3-grams with."""
    shorts = [_grams(ids, SHORT) for ids in pages]  # each page's n-grams made once, for the scores and the group
    flagged = [score > threshold for score in _scores(shorts, [_grams(ids, LONG) for ids in pages])]
    group = list(flagged)
    for j in (j for j, f in enumerate(flagged) if f):
        group[max(range(j), key=lambda i: len(shorts[j] & shorts[i]))] = True
    return group


def lookalike_rows(seq: FusedSequence, threshold: float | None) -> torch.Tensor:
    """(N,) bool: the reused rows of every chunk in a look-alike group (`lookalike_group`; None: none)."""
    rows = torch.zeros_like(seq.cached)
    segments = seq.segment_of_row
    chunk_ids = sorted(set(segments[segments >= 0].tolist()))  # every chunk, an exact first one included
    if threshold is None or len(chunk_ids) < 2:
        return rows
    ids = seq.token_ids
    pages = [ids[segments == c].tolist() for c in chunk_ids]
    for c, in_group in zip(chunk_ids, lookalike_group(pages, threshold)):
        if in_group:
            rows |= segments == c
    return rows & seq.reused


@dataclass
class LookalikeRows(RowSelection):
    """A selection that never narrows, reporting how many reused rows it recomputes as look-alike pages."""

    lookalike_rows: int = 0

    def report(self) -> dict:
        """{"lookalike_rows": n} when any page looked like an earlier one."""
        return {"lookalike_rows": self.lookalike_rows} if self.lookalike_rows else {}
