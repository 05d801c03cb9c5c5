"""Full prefill: every row, every layer; the reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...models.adapter import LlamaFamilyAdapter
from .. import placement
from ..policy import FusionRequest, Policy, RowSelection
from ..sequence import FusedSequence


@dataclass(frozen=True)
class FullPrefill(Policy):
    """Every row, every layer: the reference."""

    name: ClassVar[str] = "full_prefill"
    reuses_chunks: ClassVar[bool] = False

    def place(self, cache, request: FusionRequest) -> placement.Placements:
        """Nothing from the cache."""
        return placement.nothing(cache, request)

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence,
              placed: placement.Placements) -> RowSelection:
        """All rows."""
        return RowSelection(torch.ones_like(seq.cached))
