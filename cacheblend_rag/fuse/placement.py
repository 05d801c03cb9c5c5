"""Where cached KV goes in a request: the three placements the built-in policies use.

    nothing        compute every row
    exact_prefix   the prefix's exact KV, and the first chunk exactly as it follows that prefix (computed once)
    every_chunk    the prefix's exact KV, and every stored chunk's own KV re-positioned; missing chunks are holes
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ingest.chunks import Chunk
from .chunk_cache import ChunkCache
from .policy import FusionRequest
from .sequence import Placement


@dataclass
class Placements:
    """The cached KV placed for one request, and what was found or missed (by chunk id)."""

    placements: list[Placement] = field(default_factory=list)
    hits: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)
    holes: list[Chunk] = field(default_factory=list)  # misses to compute in isolation and store after the request
    report: dict = field(default_factory=dict)  # the policy's own facts for the request's stats (e.g. variants used)

    def close(self) -> None:
        """End of the request: every reader releases its handle (tiers may promote what was read)."""
        for p in self.placements:
            p.kv.close()


def nothing(cache: ChunkCache, request: FusionRequest) -> Placements:
    """No cached KV: every chunk is computed in place."""
    return Placements(misses=[c.chunk_id for c in request.chunks])


def _prefix(cache: ChunkCache, prefix: list[int]) -> Placements:
    """The exact KV of the prefix (none for an empty one): cached by its token ids, so a repeated system
    prompt or template head is reused exactly."""
    return Placements([Placement(0, cache.exact_segment(prefix), exact=True)] if prefix else [])


def exact_prefix(cache: ChunkCache, request: FusionRequest) -> Placements:
    """The exact prefix and the first chunk as it follows it (computed and stored on a miss, then hit)."""
    prefix, chunks = request.prefix_ids, request.chunks
    out = _prefix(cache, prefix)
    exact_first = bool(chunks) and chunks[0].kv_start == 0  # a first token merged into the prefix: not exact
    if exact_first:
        first = chunks[0]
        reader = cache.reader(first, lead_in_ids=prefix)
        (out.hits if reader is not None else out.misses).append(first.chunk_id)
        if reader is None:
            reader = cache.compute_and_store(first, lead_in_ids=prefix, best_effort=True)
        out.placements.append(Placement(request.layout.chunk_starts[0], reader, exact=True))
    out.misses += [c.chunk_id for c in chunks[int(exact_first):]]
    return out


def every_chunk(cache: ChunkCache, request: FusionRequest) -> Placements:
    """The exact prefix and each stored chunk's KV (precomputed behind the lead-in); missing chunks are holes."""
    prefix = request.prefix_ids
    out = _prefix(cache, prefix)
    follows_lead_in = prefix == list(cache.lead_in_ids)
    for i, (chunk, start) in enumerate(zip(request.chunks, request.layout.chunk_starts)):
        reader = cache.reader(chunk)
        if reader is None:
            out.misses.append(chunk.chunk_id)
            out.holes.append(chunk)
            continue
        out.hits.append(chunk.chunk_id)
        # The first chunk after the very prefix it was precomputed behind is exact.
        out.placements.append(Placement(start, reader, exact=(i == 0 and follows_lead_in and chunk.kv_start == 0)))
    return out
