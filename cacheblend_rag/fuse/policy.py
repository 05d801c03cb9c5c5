"""What a policy is: where its cached KV comes from (`place`) and which rows each layer computes (`start`).

    policy.place(cache, request) -> Placements      which cached KV goes where; hits, misses, holes to store
    policy.start(adapter, seq, placed) -> Selection  per request: rows active at layer 0, `keep(view)` per layer
                                                     (`placed` is what `place` returned: its plan, by value)
    Policy.chunk_state(store) -> object | None       optional: per-chunk state the method keeps beside the chunk KV
                                                     (Cache-Craft's variants), one per cache: `cache.policy_state(p)`

The one layer loop (`fuse.loop.run_layers`) drives the selection; no policy runs a loop of its own.
A new policy is one module in `fuse/policies/` plus one line in its registry, its per-chunk state included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..ingest.chunks import Chunk
from .layout import Layout
from .loop import LayerView, LoopResult, Selection

if TYPE_CHECKING:  # typing only: the cache imports the loop, not the policies
    from .links import Links
    from ..models.adapter import LlamaFamilyAdapter
    from ..store import KVStore
    from .chunk_cache import ChunkCache
    from .placement import Placements
    from .sequence import FusedSequence


@dataclass(frozen=True)
class FusionRequest:
    """One request's chunks and where its layout put them."""

    chunks: list[Chunk]
    layout: Layout
    # its opening (the text before the first chunk, not the lead-in) came in an earlier request too: an app's own
    # template, whose chunks' KV is worth computing behind it (counted once per request, `ChunkCache.opening_recurs`)
    opening_recurs: bool = False
    # learned links whose placeholder rows the layout carries after its last chunk (fuse/links), or None
    links: "Links | None" = None

    @property
    def prefix_ids(self) -> list[int]:
        """Token ids before the first chunk (the system prefix)."""
        return self.layout.token_ids[: self.layout.prefix_len].tolist()


class Policy(ABC):
    """A token-selection method: a frozen dataclass of hyper-parameters that subclasses this.

    What the prefill may ask of any policy is declared here, with its default, so nothing probes for it.
    """

    name: ClassVar[str]
    # The share of reused rows the method recomputes, if it has one (CacheBlend's is a dataclass field that
    # overrides this). None: no ratio, and recompute_ratio="auto" is refused for the method.
    recompute_ratio: float | None = None
    # Whether the method places chunk KV computed out of context (what learned links correct); full prefill and
    # the exact prefix cache do not, so links never run under them.
    reuses_chunks: ClassVar[bool] = True

    @abstractmethod
    def place(self, cache: "ChunkCache", request: FusionRequest) -> "Placements":
        """The cached KV this method reuses, and the chunks it found or missed."""

    @abstractmethod
    def start(self, adapter: "LlamaFamilyAdapter", seq: "FusedSequence", placed: "Placements") -> Selection:
        """This request's selection (active rows at layer 0, narrowed layer by layer), from what `place` returned."""

    @classmethod
    def chunk_state(cls, store: "KVStore") -> object | None:
        """The state this method keeps per chunk beside `store`'s chunk KV, shared by every request on a cache (e.g.
        Cache-Craft's variants). `ChunkCache.policy_state(policy)` makes it on first use, once per cache and method
        name; the method reads it there in `place`. None (the default): the method keeps none."""
        return None


@dataclass
class RowSelection:
    """A selection that never narrows: the rows in `active` go through every layer."""

    active: torch.Tensor  # (N,) bool
    full_layers: int = 0

    def keep(self, view: LayerView) -> torch.Tensor | None:
        """Keep every active row."""
        return None

    def report(self) -> dict:
        """Nothing to add to the stats."""
        return {}

    def after_request(self, result: LoopResult) -> int:
        """Nothing to keep."""
        return 0
