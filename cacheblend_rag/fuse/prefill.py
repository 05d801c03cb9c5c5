"""One fused prefill, start to end: place cached KV (the policy), run the layer loop, read the logits, stats.

    placements = policy.place(cache, request)        which stored KV goes where (readers opened once)
    seq        = cache.sequence(layout, placements)  rows, cached / exact / reused masks, a per-layer loader
    selection  = policy.start(adapter, seq, placements)
    result     = run_layers(adapter, seq, selection) the one layer loop
    logits     = adapter.logits(last row)            → first token; TTFT ends here
    placements.close()                               readers released (a tier may promote what was read)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CacheFormatError, ConfigError
from ..ingest.chunks import Chunk, chunk_id, looks_like_chunk_id
from ..store import LayerReadError
from .chunk_cache import ChunkCache
from .loop import LoopResult, run_layers
from .placement import Placements
from .policy import FusionRequest, Policy
from .sequence import FusedSequence

logger = logging.getLogger(__name__)

# A stored layer that fails to read turns its entry into a hole and the request runs again; every entry of the
# request (each chunk, the prefix segment, a variant) may be bad at once, so allow one retry per entry.
_EXTRA_READ_ATTEMPTS = 3


SUMMARY_KEYS = ("method", "chunk_hits", "chunk_misses", "num_tokens", "num_reused", "num_recomputed", "fidelity",
                "num_prefix_rows", "num_chunk_rows", "recompute_ratio_effective", "ttft_s", "num_generated",
                "recompute_ratio", "links")
"""The stats the integrations copy into their responses' metadata (LangChain, LlamaIndex)."""


def stats_summary(stats: Mapping[str, Any], chunks: Sequence[str | Chunk] | None = None) -> dict[str, Any]:
    """A request's stats as the integrations report them: SUMMARY_KEYS, `recomputed_share`, and `chunk_ids` with
    `per_chunk` hit or miss: of the chunks the request named (texts, ids or Chunks, in order), else of those the
    engine found in its prompt."""
    info = {k: stats[k] for k in SUMMARY_KEYS if k in stats}
    info["recomputed_share"] = stats.get("recompute_ratio_effective", 0.0)
    hits = list(stats.get("chunk_hits", ()))
    if chunks is None:
        ids = hits + [cid for cid in stats.get("chunk_misses", ()) if cid not in hits]
    else:
        ids = [c.chunk_id if isinstance(c, Chunk) else (c if looks_like_chunk_id(c) else chunk_id(c)) for c in chunks]
    info.update(chunk_ids=ids, per_chunk={cid: ("hit" if cid in hits else "miss") for cid in ids})
    return info


@dataclass
class RequestStats(Mapping):
    """What one request did: rows reused and recomputed, chunk hits, bytes loaded, time per stage.

    Readable as a mapping (`stats["chunk_hits"]`) and as JSON-ready `as_dict()`; optional fields (None) are
    left out of both.
    """

    method: str
    num_tokens: int
    num_reused: int  # rows whose cached KV was approximate (chunks reused out of context)
    num_exact_cached: int  # rows whose cached KV was exact (a true prefix: stored prefix, segment, exact chunk)
    num_recomputed: int  # reused rows recomputed through the last layer
    num_hole_tokens: int  # rows of chunks that were not stored (computed in place)
    num_computed: int  # other uncached rows (template, question)
    recompute_ratio_effective: float  # share of reused rows computed, averaged over layers
    chunk_hits: list[str]  # chunks found and reused: from their own stored KV, or inside a stored prefix
    chunk_misses: list[str]
    rows_per_layer: list[int]
    attention_pairs_per_layer: list[int]  # query-key pairs each layer attended
    layer_s: list[float]  # seconds per layer, KV waits included
    ttft_s: float
    timing: dict[str, float]  # kv_load_s, kv_wait_s, check_s, layers_s (+ decode_s after decoding)
    kv_bytes_loaded: int  # stored bytes actually read
    kv_bytes_by_tier: dict[str, int]
    num_prefix_rows: int = 0  # leading rows from a stored prefix (an earlier request's KV; within num_exact_cached)
    num_chunk_rows: int = 0  # rows placed from stored chunk KV (after the stored prefix)
    recompute_ratio: float | None = None  # the ratio the policy ran at (the controller's with "auto")
    controller: dict | None = None  # the loading controller's decision, with recompute_ratio="auto"
    fidelity: dict | None = None  # the fidelity gate's decision the ratio came from (a request that named none)
    links: dict | None = None  # whether learned links ran ({"ran": bool, ...}), on an engine that has links
    num_generated: int | None = None  # after decoding
    # A policy's own report, one entry per name (e.g. "cachecraft", "guard"): from `Placements.report` and the
    # selection's optional `report()`; flattened into the top level of `as_dict()`.
    policy_report: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready dict (optional fields that are None left out, the policy's report at the top level)."""
        d = dataclasses.asdict(self)
        report = d.pop("policy_report")
        out = {k: v for k, v in d.items() if v is not None}
        out.update({k: v for k, v in report.items() if k not in out})
        return out

    def __getitem__(self, key: str) -> Any:
        if key != "policy_report" and key in _STATS_FIELDS:  # a field: no copy of the whole record
            value = getattr(self, key)
            if value is not None:
                return value
        elif key in self.policy_report:
            return self.policy_report[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


@dataclass
class Prefill:
    """A fused prefill: next-token logits after the prompt, the fused KV for decoding, and stats."""

    logits: torch.Tensor  # (vocab,) float32
    stats: RequestStats
    token_ids: torch.Tensor  # (N,)
    keys: list[torch.Tensor] = field(repr=False)  # per layer (N, kv_heads, d), after RoPE
    values: list[torch.Tensor] = field(repr=False)
    chunk_ids: list[str] = field(default_factory=list)
    unstored_holes: list[Chunk] = field(default_factory=list, repr=False)  # holes left to store (store_holes=False)
    # chunks to compute behind a recurring opening after the answer (store_holes=False: `store_pending`)
    unlearned: list[Chunk] = field(default_factory=list, repr=False)
    opening: list[int] = field(default_factory=list, repr=False)
    kept: int = 0  # entries the policy kept after the first token (Cache-Craft: variants stored; `after_request`)


_STATS_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestStats))

AutoRatio = Callable[[FusedSequence, Placements], Any]  # → a controller decision with .recompute_ratio, .as_dict()


@dataclass
class _Run:
    seq: FusedSequence
    result: LoopResult
    logits: torch.Tensor
    placed: Placements
    timing: dict[str, float]
    policy: Policy
    decision: Any = None
    selection_report: dict[str, Any] = field(default_factory=dict)
    selection: Any = None


def fused_prefill(cache: ChunkCache, policy: Policy, request: FusionRequest, *, store_holes: bool = True,
                  auto_ratio: AutoRatio | None = None) -> Prefill:
    """Fused prefill of `request` under `policy`; holes are stored after the logits unless `store_holes=False`.

    With `auto_ratio`, the policy's recompute_ratio is chosen per request from what was placed (the loading
    controller). A stored layer that fails to read mid-request drops that entry and the request runs again.
    """
    started = time.perf_counter()
    if auto_ratio is not None and policy.recompute_ratio is None:
        raise ConfigError(f'recompute_ratio="auto" needs a method with a recompute ratio, not {policy.name!r}')
    for _ in range(len(request.chunks) + _EXTRA_READ_ATTEMPTS):
        try:
            run = _run(cache, policy, request, auto_ratio)
            break
        except LayerReadError as e:
            logger.warning("%s; retrying with it as a hole", e)
            if e.key is not None:
                cache.delete(e.key)
    else:
        raise CacheFormatError("stored KV kept failing to read; giving up on this request")
    ttft = time.perf_counter() - started
    by_tier: dict[str, int] = {}
    for p in run.placed.placements:
        by_tier[p.kv.tier] = by_tier.get(p.kv.tier, 0) + p.kv.bytes_read
    run.placed.close()  # after the first token: promotion reads the layers the loop skipped
    kept = run.selection.after_request(run.result)  # e.g. Cache-Craft keeps its variants, after the first token
    stats = _stats(run, request.chunks, ttft, by_tier)
    out = Prefill(run.logits, stats, request.layout.token_ids, run.result.keys, run.result.values,
                  [c.chunk_id for c in request.chunks], run.placed.holes, run.placed.to_learn,
                  request.prefix_ids if run.placed.to_learn else [], kept)
    if store_holes:
        store_pending(cache, out)
    return out


def store_pending(cache: ChunkCache, prefill: Prefill) -> None:
    """Compute and store what a prefill left for after its logits: its holes, and the chunks to learn behind its
    opening (best effort: logged), so the next request hits."""
    take_pending(cache, prefill)()


def take_pending(cache: ChunkCache, prefill: Prefill) -> Callable[[], None]:
    """What a prefill left to store, taken from it as one call to run later (it holds the chunks, not the KV)."""
    holes, unlearned, opening = prefill.unstored_holes, prefill.unlearned, prefill.opening
    prefill.unstored_holes, prefill.unlearned = [], []

    def store() -> None:
        store_chunks(cache, holes)
        store_chunks(cache, unlearned, opening)

    return store


def store_chunks(cache: ChunkCache, chunks: list[Chunk], lead_in_ids: Sequence[int] | None = None) -> None:
    """Compute and store the KV of chunks that were holes (or missed behind a prompt's opening), so the next
    request hits (best effort: logged)."""
    for chunk in chunks:  # behind its look-alike neighbour too, where it was ingested so (not a first document)
        cache.compute_and_store(chunk, lead_in_ids, behind=cache.neighbor(chunk.chunk_id), best_effort=True)


def _run(cache: ChunkCache, policy: Policy, request: FusionRequest, auto_ratio: AutoRatio | None) -> _Run:
    adapter, layout = cache.adapter, request.layout
    load_started = time.perf_counter()
    placed = policy.place(cache, request)
    try:
        seq = cache.sequence(layout.token_ids, layout.segment_of_row, placed.placements, request.links)
        kv_open_s = time.perf_counter() - load_started
        decision = None
        if auto_ratio is not None:  # match the recompute of a layer to the load of the next
            decision = auto_ratio(seq, placed)
            policy = dataclasses.replace(policy, recompute_ratio=decision.recompute_ratio)
        try:
            layers_started = time.perf_counter()
            selection = policy.start(adapter, seq, placed)
            result = run_layers(adapter, seq, selection, num_output_rows=1)
            if result.output_rows is None or int(result.output_rows[-1]) != seq.num_rows - 1:
                raise RuntimeError("the last prompt row was not computed; a policy dropped it")
            logits = adapter.logits(result.hidden[-1:])[0].float()
            layers_s = time.perf_counter() - layers_started
        finally:
            seq.close()
    except BaseException:
        placed.close()
        raise
    check_s = sum(result.layer_s[:selection.full_layers])  # the layers every row went through
    timing = {"kv_load_s": kv_open_s + seq.loader.load_s, "kv_wait_s": seq.loader.wait_s,
              "check_s": check_s, "layers_s": layers_s - check_s}
    return _Run(seq, result, logits, placed, timing, policy, decision, dict(selection.report()), selection)


def _stats(run: _Run, chunks: list[Chunk], ttft: float, by_tier: dict[str, int]) -> RequestStats:
    seq, result, placed = run.seq, run.result, run.placed
    reused = seq.reused
    num_reused = int(reused.sum())
    num_uncached = int((~seq.cached).sum())
    misses = set(placed.misses)
    hole_rows = sum(c.num_tokens for c in chunks if c.chunk_id in misses)
    recomputed = result.reused_rows_per_layer
    ratio = run.policy.recompute_ratio
    after = placed.prefix_rows
    chunk_rows = int((seq.cached[after:] & (seq.segment_of_row[after:] >= 0)).sum())
    return RequestStats(
        method=run.policy.name,
        num_tokens=seq.num_rows,
        num_reused=num_reused,
        num_exact_cached=int(seq.exact.sum()),
        num_recomputed=int(reused[result.rows].sum()),
        num_hole_tokens=hole_rows,
        num_computed=num_uncached - hole_rows,
        recompute_ratio_effective=(sum(recomputed) / (len(recomputed) * num_reused)) if num_reused else 0.0,
        chunk_hits=list(placed.hits),
        chunk_misses=list(placed.misses),
        rows_per_layer=result.rows_per_layer,
        attention_pairs_per_layer=result.pairs_per_layer,
        layer_s=result.layer_s,
        ttft_s=ttft,
        timing=run.timing,
        kv_bytes_loaded=sum(by_tier.values()),
        kv_bytes_by_tier=by_tier,
        num_prefix_rows=after,
        num_chunk_rows=chunk_rows,
        recompute_ratio=ratio,
        controller=run.decision.as_dict() if run.decision is not None else None,
        policy_report={**placed.report, **run.selection_report},
    )
