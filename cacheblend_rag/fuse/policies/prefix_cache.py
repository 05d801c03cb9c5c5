"""Prefix caching: reuse the exact KV of the system prefix and the first chunk, compute the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...models.adapter import LlamaFamilyAdapter
from .. import placement
from ..policy import FusionRequest, Policy, RowSelection
from ..sequence import FusedSequence


@dataclass(frozen=True)
class PrefixCache(Policy):
    """Reuse the KV of the exact prefix (system prefix + first chunk), compute the rest."""

    name: ClassVar[str] = "prefix_cache"
    reuses_chunks: ClassVar[bool] = False

    def place(self, cache, request: FusionRequest) -> placement.Placements:
        """The exact prefix and the first chunk as it follows it."""
        return placement.exact_prefix(cache, request)

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence,
              placed: placement.Placements) -> RowSelection:
        """Rows without cached KV."""
        return RowSelection(~seq.cached)
