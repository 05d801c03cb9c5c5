"""Full reuse: every chunk's own KV as is (re-positioned); only what is not cached is computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...models.adapter import LlamaFamilyAdapter
from .. import placement
from ..policy import Policy, RowSelection
from ..sequence import FusedSequence


@dataclass(frozen=True)
class FullReuse(placement.EveryChunk, Policy):
    """Reuse every chunk's KV as is (re-positioned); compute only what is not cached."""

    name: ClassVar[str] = "full_reuse"

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence,
              placed: placement.Placements) -> RowSelection:
        """Rows without cached KV."""
        return RowSelection(~seq.cached)
