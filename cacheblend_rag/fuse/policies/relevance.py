"""Query relevance: recompute the reused rows the question reads most, found by a probe pass over the stale KV.

Deviation-ranked recompute (CacheBlend's HKVD) chooses rows whose KV moved most; on look-alike documents and on an
agent's step after a tool (the question first, the pages after it) the rows that decide the answer are not those
(issue 39: even the true deviation, measured against a full
prefill, keeps no more answers at 15 %). This policy ranks by what the question reads instead, as ProphetKV (arXiv
2602.02579) does: a probe pass (`hkvd.question_relevance`) runs only the uncached rows (question, template) through
every layer over the stale KV (a few dozen rows: cheap), and the attention the trailing rows give each reused row,
summed over the deeper layers (each layer normalized over the reused rows), picks the `recompute_ratio` of reused
rows that are recomputed in every layer. No layer runs over every row, so at the same ratio it computes fewer rows
than CacheBlend. recompute_ratio=1 is full prefill, 0 is full reuse (no probe then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...errors import ConfigError
from ...models.adapter import LlamaFamilyAdapter
from .. import placement
from ..hkvd import question_relevance, reuse_budget, top_rows
from ..lookalike import LookalikeRows, lookalike_rows
from ..policy import Policy, RowSelection
from ..sequence import FusedSequence
from .checks import check_ratio


@dataclass(frozen=True)
class Relevance(placement.EveryChunk, Policy):
    """Recompute the `recompute_ratio` of reused rows the question attends to most over the stale KV (a probe pass
    of the uncached rows), in every layer; the rest keep their cached KV."""

    recompute_ratio: float = 0.15  # share of reused rows recomputed, in every layer
    from_layer: int | None = None  # the first layer whose attention counts (None: a third of the way down)
    lookalike: float | None = 0.2  # recompute in full the pages that look like an earlier one (as CacheBlend does)
    name: ClassVar[str] = "relevance"

    def __post_init__(self) -> None:
        check_ratio(self.recompute_ratio)
        if self.from_layer is not None and (isinstance(self.from_layer, bool) or not isinstance(self.from_layer, int)
                                            or self.from_layer < 0):
            raise ConfigError(f"from_layer must be an integer ≥ 0 (or None), got {self.from_layer!r}")
        if self.lookalike is not None:
            check_ratio(self.lookalike, "lookalike")

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence,
              placed: placement.Placements) -> RowSelection:
        """The uncached rows and the reused rows most relevant to the question (none: full reuse; all: full prefill)."""
        num_reused, budget = reuse_budget(seq, self.recompute_ratio)
        if budget == 0:
            return RowSelection(~seq.cached)
        if budget >= num_reused:
            return RowSelection(torch.ones_like(seq.cached))
        first = adapter.num_layers // 3 if self.from_layer is None else self.from_layer
        if first >= adapter.num_layers:
            raise ConfigError(f"from_layer {first} ≥ the model's {adapter.num_layers} layers")
        lookalike = lookalike_rows(seq, self.lookalike)
        if bool(lookalike[seq.reused].all()):  # every reused page is in a look-alike group: no probe, and every
            return LookalikeRows(~seq.exact, lookalike_rows=num_reused)  # row not exact already is recomputed
        score = question_relevance(adapter, seq, first)
        return LookalikeRows(~seq.cached | top_rows(score, seq, self.recompute_ratio) | lookalike,
                             lookalike_rows=int(lookalike.sum()))
