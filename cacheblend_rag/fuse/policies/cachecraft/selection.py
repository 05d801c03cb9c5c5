"""Cache-Craft's policy and selection: per chunk the cheapest variant and its budget, then per layer the budget's
rows, HKVD within budgets, the focused-chunk early stop, and the attention metadata of new variants.

Per chunk of a request, among its stored variants (the isolated ingestion precompute and any KV computed after
other chunks, `variants.py`), the variant with the lowest CFO (`equations.py`) is placed and the top
⌈CFO · |C|⌉ of its tokens are recomputed: by the variant's stored inter-attention ranking (eq. 14, no check
layer), by this engine's question-weighted HKVD at layer 1 within the chunk's budget (`token_choice="hkvd"`), or
by the question's attention over the stale KV in a probe pass of the uncached rows (`token_choice="relevance"`,
`hkvd.question_relevance`, as the `relevance` policy ranks rows; layers from a third of the depth down), from layer 0.
Per layer the question's attention to each chunk is accumulated; once the set of high-attention chunks
(Algorithm 1) is the same for `focus_window` layers, the other chunks' rows stop being recomputed (§3.2.2). Chunks
computed in full in context (holes, a budget of every token) are stored as new variants after the first token,
with their attention metadata; variants beyond a byte budget are evicted by usefulness (f_r += 1/CFO per use,
lowest first, §3.3).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import ClassVar, cast

import torch

from ....errors import ConfigError
from ....ingest.chunks import Chunk
from ....models.adapter import LlamaFamilyAdapter
from ....store import ChunkKV, KVStore, LayerReader
from ...guard import QualityGuard
from ...hkvd import hkvd_score, question_attention, question_relevance
from ...loop import LayerView, LoopResult
from ...placement import Placements
from ...policy import FusionRequest, Policy, RowSelection
from ...sequence import FusedSequence, Placement
from ..checks import check_guard_options
from .equations import (DEFAULT_ALPHA, cache_fix_overhead, calibrated_alpha, focused_chunks, order_penalty,
                        prefix_overlap)
from .variants import Variant, VariantStore, cci, token_digest, variant_kv_id

logger = logging.getLogger(__name__)

TOKEN_CHOICES = ("ranking", "hkvd", "relevance")
FIRST_USES = ("reuse", "full")
CHECK_LAYER = 1  # token_choice="hkvd": where deviations are measured (layer 0's K/V see no context)
# Variant metadata (inter/intra attention, ranking) from every third layer: the paper averages over layers, and
# measuring all 30 after the first token cost ≈ 3× the request's own prefill on a 2-core CPU.
METADATA_EVERY = 3


# ---- the policy -------------------------------------------------------------------------------

def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class CacheCraft(Policy):
    """Cache-Craft: variants of chunk caches, per-chunk budgets CFO = α·CCI·(1−β'), focused-chunk early stop."""

    alpha: float | None = None  # None: the calibrated α of this model (`cacheblend-rag calibrate`), else DEFAULT_ALPHA
    focus_window: int = 3  # w of Algorithm 1: layers the focused set must hold before the others stop
    # The first layer at which focus may stop chunks (None: a third of the model's depth). Algorithm 1 alone cut
    # at layer 2 (the earliest w = 3 allows) on every warm MuSiQue request measured, keeping only the last chunk.
    focus_min_layer: int | None = None
    # "ranking": the variant's stored ranking; "hkvd": question-weighted HKVD at layer 1; "relevance": the question's
    # attention over the stale KV (a probe pass of the uncached rows, as the `relevance` policy ranks rows)
    token_choice: str = "ranking"
    use_beta: bool = True  # ablation: False takes β' = 0 (every variant is out of context)
    use_focus: bool = True  # ablation: False never stops recomputing unfocused chunks
    use_cci: bool = True  # ablation: False recomputes random tokens at the same budgets
    first_use: str = "reuse"  # "full": a chunk with no in-context variant yet is computed in full (and stored)
    store_variants: bool = True  # store chunks computed in full in context as variants
    compute_last: bool = False  # the last chunk computed in full after the others (ingestion's neighbour variants)
    variant_budget_mb: float = 1024.0  # variants' bytes per namespace; beyond it the least useful are evicted
    guard: float | None = None  # quality guard threshold (fuse/guard.py), measured at the check layer
    guard_ratio: float | None = None  # a flagged request recomputes at least this share of each reused chunk
    name: ClassVar[str] = "cachecraft"

    def __post_init__(self) -> None:
        a = self.alpha
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a)
                              or a < 0):
            raise ConfigError(f"alpha must be a number ≥ 0 (or None for the calibrated value), got {a!r}")
        w = self.focus_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError(f"focus_window must be an integer ≥ 1, got {w!r}")
        m = self.focus_min_layer
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ConfigError(f"focus_min_layer must be an integer ≥ 0 (or None for a third of the depth), got {m!r}")
        if self.token_choice not in TOKEN_CHOICES:
            raise ConfigError(f"token_choice must be one of {TOKEN_CHOICES}, got {self.token_choice!r}")
        if self.first_use not in FIRST_USES:
            raise ConfigError(f"first_use must be one of {FIRST_USES}, got {self.first_use!r}")
        for name in ("use_beta", "use_focus", "use_cci", "store_variants", "compute_last"):
            _check_bool(name, getattr(self, name))
        b = self.variant_budget_mb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 0:
            raise ConfigError(f"variant_budget_mb must be a number ≥ 0, got {b!r}")
        check_guard_options(self.guard, self.guard_ratio)

    @classmethod
    def chunk_state(cls, store: KVStore) -> VariantStore:
        """Its variants, beside the store's chunk KV (`ChunkCache.policy_state` makes one per cache)."""
        return VariantStore.beside(store)

    @classmethod
    def neighbor_variants(cls) -> "CacheCraft":
        """What ingestion runs to store a chunk computed after its neighbours: the last chunk in full, no focus."""
        return cls(compute_last=True, use_focus=False)

    def resolved_alpha(self, cache) -> float:
        """α: as given, else calibrated for the cache's model, device and dtype, else DEFAULT_ALPHA."""
        if self.alpha is not None:
            return float(self.alpha)
        a = cache.adapter
        found = calibrated_alpha(cache.fingerprint, a.device.type, a.dtype)
        return DEFAULT_ALPHA if found is None else found

    def place(self, cache, request: FusionRequest) -> Placements:
        """The exact prefix, then per chunk the variant with the lowest CFO (missing chunks are holes)."""
        alpha = self.resolved_alpha(cache)
        variants = cast(VariantStore, cache.policy_state(self))  # this class's `chunk_state`
        ns = cache.namespace
        prefix = request.prefix_ids
        out = CraftPlacements([Placement(0, cache.exact_segment(prefix), exact=True)] if prefix else [])
        follows_lead_in = prefix == list(cache.lead_in_ids)
        ids = [c.chunk_id for c in request.chunks]
        token_ids = request.layout.token_ids
        plans: list[ChunkPlan] = []
        for i, (chunk, start) in enumerate(zip(request.chunks, request.layout.chunk_starts)):
            context = tuple(ids[:i])
            plan = ChunkPlan(i, chunk, int(start), context, token_digest(token_ids[:start]))
            plans.append(plan)
            try:
                self._choose(cache, variants, plan, alpha, first=(i == 0 and follows_lead_in and chunk.kv_start == 0),
                             last=(i == len(request.chunks) - 1))
            except BaseException:
                out.close()  # the readers opened so far
                raise
            if plan.reader is None:  # no readable variant, not even the isolated precompute: a hole
                out.misses.append(chunk.chunk_id)
                out.holes.append(chunk)
                continue
            out.hits.append(chunk.chunk_id)
            out.placements.append(Placement(plan.row_start, plan.reader, exact=plan.exact))
        out.plan = RequestPlan(alpha, ns, variants, plans)
        return out

    def _choose(self, cache, variants: VariantStore, plan: "ChunkPlan", alpha: float, first: bool,
                last: bool = False) -> None:
        """Score every variant of the chunk (eqs. 6–12) and open the cheapest whose KV is readable."""
        chunk, n = plan.chunk, plan.chunk.num_tokens
        stored = variants.lookup(cache.namespace, chunk.chunk_id)
        isolated = Variant.isolated(chunk.chunk_id, n)
        in_context = [v for v in stored if v.context]
        if in_context:  # the chunk's own context dependence, as measured when it was computed in context
            isolated.cci = sum(v.cci for v in in_context) / len(in_context)
            ranked = [v for v in in_context if v.ranking]
            if ranked:
                isolated.ranking = max(ranked, key=lambda v: v.f_r).ranking
        scored = []
        for v in [isolated, *stored]:
            beta = prefix_overlap(v.inter, v.context, plan.context) if self.use_beta else 0.0
            gamma = order_penalty(v.context, plan.context) if self.use_beta else 0.0
            beta_adj = beta * (1.0 - gamma)
            cfo = cache_fix_overhead(alpha, v.cci, beta_adj)
            if v.kv_id is None and first:
                cfo = 0.0  # the isolated precompute behind the very prefix it follows here is exact
            scored.append((cfo, v.kv_id is not None, v, beta, gamma, beta_adj))
        # Ties go to the isolated precompute: at equal cost, KV shaped by no context beats KV shaped by another.
        scored.sort(key=lambda s: (s[0], s[1]))
        for cfo, _, v, beta, gamma, beta_adj in scored:
            if v.kv_id is None:
                reader = cache.reader(chunk)
            else:
                reader = variants.reader(cache.namespace, v, chunk)
            if reader is None:
                continue
            if self.first_use == "full" and not in_context and not first and plan.context:
                cfo = 1.0  # first use in context: compute it in full once, so it is stored as a variant
            if self.compute_last and last and plan.context and v.lead_digest != plan.lead_digest:
                cfo = 1.0  # a variant after exactly these chunks is what was asked for (unless it is stored)
            plan.reader, plan.variant = reader, v
            plan.beta, plan.gamma, plan.beta_adj, plan.cfo = beta, gamma, beta_adj, cfo
            plan.exact = v.kv_id is None and first
            plan.budget = min(n, math.ceil(cfo * n - 1e-9))
            variants.touch(cache.namespace, v, cfo)
            return

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence, placed: Placements) -> "CraftSelection":
        """Rows of each chunk's budget (by ranking) from layer 0, or whole chunks up to the HKVD check layer."""
        request = placed.plan if isinstance(placed, CraftPlacements) else None
        by_reader = {id(p.reader): p for p in request.chunks if p.reader is not None} if request else {}
        in_seq = [p for p in seq.placements if id(p.kv) in by_reader and by_reader[id(p.kv)].reader is p.kv]
        if request is None or len(in_seq) != len(by_reader):
            raise RuntimeError("cachecraft.start() takes what its own place() returned for the same request")
        return CraftSelection(~seq.cached, 0, policy=self, request=request, adapter=adapter, seq=seq)


@dataclass
class ChunkPlan:
    """One chunk of a request: the variant chosen for it, its scores and its budget."""

    position: int
    chunk: Chunk
    row_start: int
    context: tuple[str, ...]  # ids of the chunks before it in this request
    lead_digest: str  # digest of every token before it
    reader: LayerReader | None = None  # None: a hole (computed in full)
    variant: Variant | None = None
    exact: bool = False
    beta: float = 0.0
    gamma: float = 0.0
    beta_adj: float = 0.0
    cfo: float = 1.0
    budget: int = 0  # tokens to recompute
    choice: str = "none"  # how its tokens were chosen: ranking, hkvd, relevance, random, head, all, none
    record: bool = False  # computed in full in context: stored as a variant after the request
    stored: bool = False

    @property
    def rows(self) -> slice:
        """Its rows in the fused sequence."""
        return slice(self.row_start, self.row_start + self.chunk.num_tokens)


@dataclass
class RequestPlan:
    """What place() decided for one request; start() receives it inside the placements."""

    alpha: float
    namespace: str
    variants: VariantStore
    chunks: list[ChunkPlan]


@dataclass
class CraftPlacements(Placements):
    """Cache-Craft's placements, carrying its per-chunk plan from place() to start() (by value, no side channel)."""

    plan: RequestPlan | None = None


@dataclass
class _Attention:
    """Attention a chunk computed in full paid, summed over its rows and layers (mean over heads)."""

    to_segment: torch.Tensor  # (num chunks,) to each chunk of the request
    intra: float = 0.0  # to earlier tokens of its own
    per_token: torch.Tensor | None = None  # (n,) each token's attention to the chunks before it
    layers: int = 0
    layers_seen: set[int] = field(default_factory=set)


@dataclass
class CraftSelection(RowSelection):
    """One Cache-Craft request: per-chunk budgets, HKVD within budgets, focus, and attention for new variants."""

    policy: CacheCraft | None = None
    request: RequestPlan | None = None
    adapter: LlamaFamilyAdapter | None = None
    seq: FusedSequence | None = None
    dropped: torch.Tensor | None = None  # (N,) rows this selection stopped
    cumulative: list[float] = field(default_factory=list)  # per chunk: question attention so far (eq. 15)
    history: list[frozenset[int]] = field(default_factory=list)
    focused: frozenset[int] | None = None
    cutoff_layer: int | None = None
    attention: dict[int, _Attention] = field(default_factory=dict)  # chunk position → metadata being gathered
    queries: list[tuple] = field(default_factory=list)  # (layer, rows, q, scale) of those chunks' rows
    guard: QualityGuard | None = None
    report_: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        seq, policy = self.seq, self.policy
        active = ~seq.cached
        self.dropped = torch.zeros_like(seq.cached)
        self.hkvd: list[ChunkPlan] = []
        self.checked: list[ChunkPlan] = []  # chunks whose budget rows were chosen up front, checked by the guard
        num_chunks = len(self.request.chunks)
        by_relevance: list[ChunkPlan] = []  # chosen below, after one probe pass for all of them
        for p in self.request.chunks:
            n = p.chunk.num_tokens
            rows = torch.arange(p.row_start, p.row_start + n, device=seq.cached.device)
            if p.reader is None:
                p.choice, p.budget, p.cfo = "all", n, 1.0
            elif p.exact or p.budget == 0:
                p.choice = "none"
            elif p.budget >= n:
                p.choice = "all"
                active[rows] = True
            elif not policy.use_cci:  # the ablation: as many tokens, drawn at random (seeded by the chunk)
                p.choice = "random"
                g = torch.Generator().manual_seed(int(p.chunk.chunk_id[:8], 16))
                active[rows[torch.randperm(n, generator=g)[:p.budget].to(rows.device)]] = True
            elif policy.token_choice == "relevance":
                p.choice = "relevance"
                by_relevance.append(p)
            elif policy.token_choice == "ranking" and p.variant is not None and p.variant.ranking:
                p.choice = "ranking"
                active[rows[torch.tensor(p.variant.ranking[:p.budget], device=rows.device)]] = True
            elif self.adapter.num_layers > CHECK_LAYER + 1:  # no ranking stored (or asked for): HKVD at layer 1
                p.choice = "hkvd"
                active[rows] = True
                self.hkvd.append(p)
            else:  # too few layers for a check layer: the chunk's first tokens
                p.choice = "head"
                active[rows[: p.budget]] = True
            # Computed in full after other chunks: a new variant, unless it is one already.
            p.record = (policy.store_variants and p.choice == "all" and bool(p.context) and not p.exact
                        and (p.variant is None or p.variant.lead_digest != p.lead_digest))
            if p.record:
                self.attention[p.position] = _Attention(torch.zeros(num_chunks, dtype=torch.float64))
        if by_relevance:
            score = question_relevance(self.adapter, seq, self.adapter.num_layers // 3)
            for p in by_relevance:
                rows = torch.arange(p.row_start, p.row_start + p.chunk.num_tokens, device=score.device)
                active[rows[score[rows].topk(p.budget).indices]] = True
        self.planned = active.clone()  # rows the budgets keep (hkvd chunks: chosen at the check layer)
        if policy.guard is not None:
            self.guard = QualityGuard(policy.guard, policy.guard_ratio)
            partial = [p for p in self.request.chunks if p.choice in ("ranking", "relevance", "random", "head", "none")
                       and p.reader is not None and not p.exact]
            if not (partial or self.hkvd):  # every reused row recomputed (or none reused): nothing stays stale
                self.guard.settle(0.0)
            elif self.adapter.num_layers <= CHECK_LAYER + 1:  # no check layer to measure at: not estimated
                self.guard.settle(None)
            else:  # fresh and cached K/V of every reused row, once: all of them through the check layer
                active = active | seq.reused
                self.checked = partial
        self.active = active
        self.full_layers = CHECK_LAYER + 1 if self.hkvd or self.checked else 0
        self.cumulative = [0.0] * num_chunks

    # ---- per layer -------------------------------------------------------------------------

    def keep(self, view: LayerView) -> torch.Tensor | None:
        """Gather attention for new variants; choose HKVD rows at the check layer; stop unfocused chunks."""
        changed = False
        if self.attention:
            self._gather(view)
        if (self.hkvd or self.checked) and view.layer == CHECK_LAYER:
            if self.guard is not None:  # a settled guard never gets here: no hkvd or checked chunks then
                self.guard.observe(view)
            self._choose_hkvd(view)
            if self.guard is not None:
                self._guard(view)
            changed = True
        if self.policy.use_focus and self.cutoff_layer is None and len(self.request.chunks) >= 3:
            changed |= self._focus(view)
        if not changed:
            return None
        return ~self.dropped[view.rows]

    def _choose_hkvd(self, view: LayerView) -> None:
        if view.cached_k is None:  # every row computed here (no prefix, all chunks checked): no deviation to see
            score = question_attention(view)
        else:
            score = hkvd_score(view, "k", "attention")
        for p in self.hkvd:
            rows = torch.arange(p.rows.start, p.rows.stop, device=score.device)
            rows = rows[~self.dropped[rows]]
            top = rows[score[rows].topk(min(p.budget, rows.numel())).indices]
            drop = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
            drop[torch.isin(rows, top)] = False
            self.dropped[rows[drop]] = True

    def _guard(self, view: LayerView) -> None:
        """Estimate from the rows the budgets keep; a flagged request raises every partial budget to guard_ratio."""
        seq = view.seq
        for p in self.checked:  # their planned rows stay; the rest of their rows stop after this layer
            rows = torch.arange(p.rows.start, p.rows.stop, device=seq.cached.device)
            self.dropped[rows[~self.planned[rows]]] = True
        escalate_to = self.guard.decide(self.active & ~self.dropped, seq)  # active ⊇ planned
        if escalate_to is None:
            return
        score = question_attention(view) if view.cached_k is None else hkvd_score(view, "k", "attention")
        for p in [*self.checked, *self.hkvd]:
            n = p.chunk.num_tokens
            rows = torch.arange(p.rows.start, p.rows.stop, device=score.device)
            kept = int((~self.dropped[rows]).sum())
            extra = min(n, math.ceil(escalate_to * n - 1e-9)) - kept
            if extra <= 0:
                continue
            dropped = rows[self.dropped[rows]]
            self.dropped[dropped[score[dropped].topk(min(extra, dropped.numel())).indices]] = False
            p.budget = max(p.budget, kept + min(extra, dropped.numel()))

    def _focus_min_layer(self) -> int:
        m = self.policy.focus_min_layer
        return self.adapter.num_layers // 3 if m is None else m

    def _focus(self, view: LayerView) -> bool:
        """Algorithm 1: accumulate question→chunk attention; cut once the focused set held for w layers."""
        seq = view.seq
        attention = question_attention(view)
        seg = seq.segment_of_row
        in_chunk = seg >= 0
        per_chunk = torch.zeros(len(self.cumulative), dtype=torch.float64, device=attention.device)
        per_chunk.index_add_(0, seg[in_chunk], attention[in_chunk].double())
        self.cumulative = [c + float(x) for c, x in zip(self.cumulative, per_chunk.tolist())]
        self.history.append(frozenset(focused_chunks(self.cumulative)))
        w = self.policy.focus_window
        if len(self.history) < w or len(set(self.history[-w:])) != 1 or view.layer < self._focus_min_layer():
            return False
        self.focused, self.cutoff_layer = self.history[-1], view.layer
        unfocused = torch.zeros_like(seq.cached)
        for p in self.request.chunks:
            if p.position not in self.focused:
                unfocused[p.rows] = True
                if p.reader is not None and p.record:  # no longer computed in full: not a variant
                    p.record = False
                    self.attention.pop(p.position, None)
        self.dropped |= unfocused & seq.reused
        return True

    def _gather(self, view: LayerView) -> None:
        """Keep the queries of the rows of chunks computed in full; their attention is measured after TTFT."""
        if view.layer % METADATA_EVERY != METADATA_EVERY - 1:
            return
        recording = torch.zeros_like(view.seq.cached)
        for pos in self.attention:
            recording[self.request.chunks[pos].rows] = True
        pick = recording[view.rows]
        if bool(pick.any()):  # the loop never writes into q in place; the layer's keys are result.keys[layer]
            self.queries.append((view.layer, view.rows[pick], view.q[pick], view.scale))

    def _measure(self, result: LoopResult) -> None:
        """Attention of the kept queries (eqs. 3–4), per source chunk, mean over heads, summed over layers."""
        seq = self.seq
        seg = seq.segment_of_row
        num_chunks = len(self.cumulative)
        positions = torch.arange(seq.num_rows, device=seg.device)
        for layer, rows, q, scale in self.queries:
            keys = result.keys[layer].to(q.dtype)
            m, heads, d = q.shape
            kv_heads = keys.shape[1]
            for part in range(0, m, 256):  # bounded memory: (heads, 256, N) at a time
                r, qp = rows[part:part + 256], q[part:part + 256]
                hi = int(r.max()) + 1  # causal: no row of this part sees a key past its last row
                logits = torch.einsum("mkgd,nkd->kgmn", qp.view(r.numel(), kv_heads, heads // kv_heads, d),
                                      keys[:hi]).float() * scale  # the model's dtype for the matmul, fp32 softmax
                logits = logits.masked_fill(positions[None, :hi] > r[:, None], float("-inf"))
                probs = logits.softmax(-1).mean(dim=(0, 1))  # (m, hi)
                to_segment = torch.zeros(r.numel(), num_chunks + 1, dtype=probs.dtype, device=probs.device)
                to_segment.index_add_(1, seg[:hi] + 1, probs)  # column 0: prefix, separators, question
                own = seg[r]
                earlier = positions[None, :hi] < r[:, None]
                intra = (probs * ((seg[None, :hi] == own[:, None]) & earlier)).sum(1)
                for pos, acc in self.attention.items():
                    mine = own == pos
                    if not bool(mine.any()):
                        continue
                    acc.to_segment += to_segment[mine, 1:].sum(0).double().cpu()
                    acc.intra += float(intra[mine].sum())
                    token_inter = to_segment[mine, 1:pos + 1].sum(1).double().cpu()  # to the chunks before it
                    local = (r[mine] - self.request.chunks[pos].row_start).cpu()
                    if acc.per_token is None:
                        acc.per_token = torch.zeros(self.request.chunks[pos].chunk.num_tokens, dtype=torch.float64)
                    acc.per_token.index_add_(0, local, token_inter)
            for acc in self.attention.values():
                acc.layers_seen.add(layer)
        self.queries.clear()
        for acc in self.attention.values():
            acc.layers = len(acc.layers_seen)

    # ---- after the loop --------------------------------------------------------------------

    def after_request(self, result: LoopResult) -> int:
        """Store chunks computed in full in context as variants (KV un-rotated to pre-RoPE), then evict; how many
        were stored."""
        req = self.request
        stored = 0
        try:
            if self.attention and len(result.keys) == self.adapter.num_layers:
                self._measure(result)
            for pos, acc in self.attention.items():
                p = req.chunks[pos]
                if not p.record or acc.layers == 0 or len(result.keys) != self.adapter.num_layers:
                    continue
                kv = self._variant_kv(p, result)
                variant = self._variant_meta(p, acc)
                p.stored = req.variants.add(req.namespace, variant, kv)
                stored += p.stored
            evicted = req.variants.evict(req.namespace, int(self.policy.variant_budget_mb * 2**20)) if stored else []
        except Exception as e:  # noqa: BLE001 - storing variants never fails a request that has its answer
            logger.warning("cachecraft could not store variants (%s: %s)", type(e).__name__, e)
            evicted = []
        report = self.report_.setdefault("cachecraft", {})
        report["variants_stored"] = stored
        report["variants_evicted"] = len(evicted)
        for entry, p in zip(report.get("chunks", []), req.chunks):
            entry["stored_variant"] = p.stored
        return stored

    def _variant_kv(self, p: ChunkPlan, result: LoopResult) -> ChunkKV:
        adapter = self.adapter
        device = result.keys[0].device
        positions = torch.arange(p.rows.start, p.rows.stop, device=device)
        unrotate = adapter.rotary(positions).inverse()
        keys = tuple(adapter.rope(layer, k[p.rows], unrotate).cpu().clone()  # RoPE undone
                     for layer, k in enumerate(result.keys))
        values = tuple(v[p.rows].cpu().clone() for v in result.values)
        return ChunkKV(keys, values, p.chunk.token_ids.cpu(), positions_start=p.row_start)

    def _variant_meta(self, p: ChunkPlan, acc: _Attention) -> Variant:
        req, n = self.request, p.chunk.num_tokens
        inter: dict[str, float] = {}
        for j, other in enumerate(req.chunks[: p.position]):
            cid = other.chunk.chunk_id
            inter[cid] = inter.get(cid, 0.0) + float(acc.to_segment[j]) / acc.layers
        sizes = {q.chunk.chunk_id: q.chunk.num_tokens for q in req.chunks}
        intra = acc.intra / acc.layers
        ranking = torch.argsort(acc.per_token, descending=True, stable=True).tolist()
        return Variant(p.chunk.chunk_id, variant_kv_id(p.chunk.chunk_id, p.lead_digest), p.context, p.lead_digest,
                       n, inter, intra, cci(inter, intra, n, sizes), ranking)

    def report(self) -> dict:
        """stats["cachecraft"]: per chunk its variant, scores and budget; focused chunks; the cut-off layer."""
        req, seq = self.request, self.seq
        final = self.active & ~self.dropped
        chunks = []
        for p in req.chunks:
            v = p.variant
            chunks.append({
                "chunk_id": p.chunk.chunk_id, "position": p.position, "num_tokens": p.chunk.num_tokens,
                "variant": None if p.reader is None else list(v.context),
                "variant_kind": "hole" if p.reader is None else ("context" if v.kv_id else "isolated"),
                "variant_hit": p.reader is not None and v.kv_id is not None,
                "cci": None if v is None else v.cci, "beta": p.beta, "gamma": p.gamma, "beta_adjusted": p.beta_adj,
                "cfo": p.cfo, "budget": p.budget, "token_choice": p.choice,
                "recomputed": int((final[p.rows] & seq.reused[p.rows]).sum()),
                "stored_variant": p.stored,
            })
        self.report_["cachecraft"] = {
            "alpha": req.alpha, "focus_window": self.policy.focus_window, "token_choice": self.policy.token_choice,
            "chunks": chunks,
            "variant_hits": sum(c["variant_hit"] for c in chunks),
            "focused_chunks": None if self.focused is None else sorted(self.focused),
            "cutoff_layer": self.cutoff_layer,
            "variants_stored": 0, "variants_evicted": 0,
        }
        if self.guard is not None:
            self.report_.update(self.guard.report())
        return self.report_
