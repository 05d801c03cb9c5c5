"""Where cached KV goes in a request: the three placements the built-in policies use.

    nothing        compute every row
    exact_prefix   the prefix's exact KV, and the first chunk exactly as it follows that prefix (computed once)
    every_chunk    the prefix's exact KV, and every stored chunk's own KV re-positioned; missing chunks are holes

"The prefix's exact KV" is, when one is stored, the longest stored prefix of the request's tokens (an earlier
request's KV, prompt and answer: `ChunkCache.stored_prefix`), placed at row 0 as is; the chunks after it are
placed as the policy places chunks, and a chunk it cuts keeps its rows after it. Else it is the text before the
first chunk, cached as an exact segment.

    rows     0 .............. P ........................................ N-1
             [ stored prefix ][ chunk j (part) ][ text ][ chunk k ][ question ]
             exact, as stored  placed by the policy, or computed
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
    prefix_rows: int = 0  # leading rows placed from a stored prefix (an earlier request's KV)
    # chunks placed from KV behind the lead-in in a prompt of a recurring opening (every chunk of a plain string's,
    # the first of a chat's): computed behind that opening (the request's prefix) after the answer, as holes are
    # stored, so the next such prompt places them from there
    to_learn: list[Chunk] = field(default_factory=list)

    def close(self) -> None:
        """End of the request: every reader releases its handle (tiers may promote what was read)."""
        for p in self.placements:
            p.kv.close()


def nothing(cache: ChunkCache, request: FusionRequest) -> Placements:
    """No cached KV: every chunk is computed in place."""
    return Placements(misses=[c.chunk_id for c in request.chunks])


def _prefix(cache: ChunkCache, request: FusionRequest) -> tuple[Placements, list[tuple[int, Chunk]]]:
    """The exact KV the request starts with, and (row, chunk) of the chunks after it.

    The longest stored prefix of the request's tokens (chunks it covers are hits, not placed again; one it cuts
    keeps its rows after it), unless it ends before the first chunk and the text before that chunk is a stored
    exact segment or the lead-in; then that segment's exact KV (none for an empty one): cached by its token ids,
    so a repeated system prompt or template head is reused exactly.
    """
    rest = list(zip(request.layout.chunk_starts, request.chunks))
    prefix = request.prefix_ids
    stored = cache.stored_prefix(request.layout.token_ids)
    if stored is not None and stored.num_tokens <= request.layout.prefix_len and (
            prefix == list(cache.lead_in_ids) or cache.has_segment(prefix)):
        stored.close()  # no further than the text before the first chunk, whose exact segment is stored (or is
        stored = None   # the lead-in, behind which the first chunk stays exact): the segment places more
    if stored is None:
        return Placements([Placement(0, cache.exact_segment(prefix), exact=True)] if prefix else []), rest
    # A stored prefix short of the first chunk (an agent's previous step, before the tool result that brought the
    # chunks): its rows are placed, the text after it up to the first chunk is computed in the layer loop
    end = stored.num_tokens
    after, covered = [], []
    for row, chunk in rest:
        if row + chunk.num_tokens <= end:  # found in the prompt and reused, inside the prefix's KV
            covered.append(chunk.chunk_id)
            continue
        if row < end:  # cut by the prefix: its rows from `end` on
            chunk = chunk.whole.part(chunk.kv_start + end - row, chunk.kv_start + chunk.num_tokens)
            row = end
        after.append((row, chunk))
    return Placements([Placement(0, stored, exact=True)], hits=covered, prefix_rows=end), after


def exact_prefix(cache: ChunkCache, request: FusionRequest) -> Placements:
    """The exact prefix and the first chunk as it follows it (computed and stored on a miss, then hit); after a
    stored prefix, the chunks are computed."""
    out, chunks = _prefix(cache, request)
    exact_first = bool(chunks) and not out.prefix_rows and chunks[0][1].kv_start == 0  # a merged first token: not
    if exact_first:
        start, first = chunks[0]
        prefix = request.prefix_ids
        reader = cache.reader(first, lead_in_ids=prefix)
        (out.hits if reader is not None else out.misses).append(first.chunk_id)
        if reader is None:
            reader = cache.compute_and_store(first, lead_in_ids=prefix, best_effort=True)
        out.placements.append(Placement(start, reader, exact=True))
    out.misses += [c.chunk_id for _, c in chunks[int(exact_first):]]
    return out


def every_chunk(cache: ChunkCache, request: FusionRequest) -> Placements:
    """The exact prefix and each stored chunk's KV (precomputed behind the lead-in); missing chunks are holes."""
    out, chunks = _prefix(cache, request)
    opening = request.prefix_ids
    follows_lead_in = not out.prefix_rows and opening == list(cache.lead_in_ids)
    own_opening = not out.prefix_rows and not follows_lead_in and bool(opening)
    # A prompt that begins unlike the lead-in (a plain string) places all its chunks' KV computed behind its own
    # opening where that is stored: string-frame KL 0.115 → 0.077. Any other opening of its own (a chat template
    # with the user's system message) places only its first chunk from there, which is then exact: computing the
    # rest behind it cost KL (0.064 → 0.078), an exact first chunk is recomputed nowhere (docs/benchmarks.md)
    foreign = own_opening and cache.foreign_opening(opening)
    learn = own_opening and request.opening_recurs
    for i, (start, chunk) in enumerate(chunks):
        first = i == 0 and chunk.kv_start == 0  # a first chunk whose first token merged with the opening's is not
        behind_opening = foreign or (own_opening and first)
        own = cache.reader(chunk, lead_in_ids=opening) if behind_opening else None
        reader = own if own is not None else cache.reader(chunk)
        if reader is None:
            out.misses.append(chunk.chunk_id)
            out.holes.append(chunk)
            continue
        out.hits.append(chunk.chunk_id)
        if learn and behind_opening and own is None:
            out.to_learn.append(chunk)
        # The first chunk after the very prefix it was precomputed behind is exact.
        out.placements.append(Placement(start, reader, exact=first and (follows_lead_in or own is not None)))
    return out


class EveryChunk:
    """A policy's `place` that puts the exact prefix and every stored chunk (`every_chunk`): full reuse, CacheBlend
    and relevance differ only in the rows they recompute over it."""

    def place(self, cache: ChunkCache, request: FusionRequest) -> Placements:
        """The exact prefix and every stored chunk."""
        return every_chunk(cache, request)
