"""Full reuse: every chunk's own KV as is (re-positioned); only what is not cached is computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...models.adapter import LlamaFamilyAdapter
from .. import placement
from ..policy import FusionRequest, Policy, RowSelection
from ..sequence import FusedSequence


@dataclass(frozen=True)
class FullReuse(Policy):
    """Reuse every chunk's KV as is (re-positioned); compute only what is not cached."""

    name: ClassVar[str] = "full_reuse"

    def place(self, cache, request: FusionRequest) -> placement.Placements:
        """The exact prefix and every stored chunk."""
        return placement.every_chunk(cache, request)

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence,
              placed: placement.Placements) -> RowSelection:
        """Rows without cached KV."""
        return RowSelection(~seq.cached)
