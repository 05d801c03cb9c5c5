"""The one layer loop. Every method (full prefill, prefix cache, full reuse, CacheBlend, ...) runs through it.

Per layer: project Q/K/V for the active rows, place the cached keys at their
positions (RoPE), overlay the fresh keys of the active rows, show the selection
one `LayerView` (fresh q/k/v, the cached K/V as loaded, the fused keys) so it can
narrow the active rows, then write the fresh values, attend causally and run the
MLP for the rows that stay. Rows that are not active keep their cached K/V in
that layer; rows with no cached KV are always active.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.profiler import record_function

from ..kernels import RowAttentionPlan
from ..models.adapter import LlamaFamilyAdapter
from .sequence import FusedSequence


@dataclass(frozen=True)
class LayerView:
    """What a selection sees of one layer, before the loop writes the fresh values over the cached ones."""

    layer: int
    rows: torch.Tensor  # (M,) rows active in this layer
    q: torch.Tensor  # (M, heads, d) their queries, after RoPE
    k: torch.Tensor  # (M, kv_heads, d) their fresh keys, before RoPE (as cached)
    v: torch.Tensor  # (M, kv_heads, d) their fresh values
    cached_k: torch.Tensor | None  # (N, kv_heads, d) cached keys before RoPE as loaded (zeros where uncached);
    cached_v: torch.Tensor | None  # None when every row is computed in this layer
    keys: torch.Tensor  # (N, kv_heads, d) the layer's fused keys after RoPE (fresh rows overlaid)
    scale: float  # the layer's softmax scale
    seq: FusedSequence  # which rows are cached, exact, reused, and their chunks


class Selection(Protocol):
    """One request's row plan: the rows active from layer 0, and which of them stay active layer by layer."""

    active: torch.Tensor  # (N,) bool
    full_layers: int  # leading layers computed over every non-exact row (0 if none)

    def keep(self, view: LayerView) -> torch.Tensor | None:
        """A bool mask over `view.rows` of those that stay active from this layer on, or None to keep all.

        Dropped rows still leave their fresh K/V in this layer; rows without cached KV are never dropped.
        """

    def report(self) -> dict:
        """After the loop: what the selection wants in the request's stats (e.g. {"guard": {...}}), or {}."""

    def after_request(self, result: "LoopResult") -> int:
        """After the first token: keep what the request computed (Cache-Craft stores its variants), or nothing;
        how many entries it kept (`Prefill.kept`)."""


@dataclass
class LoopResult:
    """What the loop produced: the fused KV of every computed layer and the last rows' hidden states."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer, (N, kv_heads, d), after RoPE
    values: list[torch.Tensor] = field(default_factory=list)  # per layer, (N, kv_heads, d)
    rows: torch.Tensor | None = None  # (M,) rows active in the last computed layer (their K/V computed there)
    output_rows: torch.Tensor | None = None  # rows whose hidden states come out of it: `rows`, or their last few
    hidden: torch.Tensor | None = None  # (len(output_rows), hidden) their hidden states after it
    rows_per_layer: list[int] = field(default_factory=list)  # rows whose K/V each layer computed
    reused_rows_per_layer: list[int] = field(default_factory=list)  # of those, rows whose cached KV was approximate
    fresh_keys: list[torch.Tensor] = field(default_factory=list)  # per layer, pre-RoPE K of active rows (if recorded)
    fresh_values: list[torch.Tensor] = field(default_factory=list)
    layer_s: list[float] = field(default_factory=list)  # seconds each layer took
    pairs_per_layer: list[int] = field(default_factory=list)  # query-key pairs each layer's attention had to see


def run_layers(
    adapter: LlamaFamilyAdapter,
    seq: FusedSequence,
    selection: Selection,
    *,
    record_fresh: bool = False,
    num_output_rows: int | None = None,
    trainable: bool = False,
) -> LoopResult:
    """Run every layer over `seq` for the rows in `selection.active`, as the selection narrows them.

    With `num_output_rows` n, the last layer attends and runs its MLP for the last n active rows only: the
    other rows' K/V of that layer are all a decoding cache needs, and only the last rows' logits are read.
    `trainable`: outside inference mode, so a gradient flows back to the sequence's link embeddings (training
    links; the model's weights stay frozen); otherwise the loop runs under `torch.inference_mode()`.
    """
    with torch.inference_mode(not trainable):
        return _run_layers(adapter, seq, selection, record_fresh, num_output_rows)


def _run_layers(adapter: LlamaFamilyAdapter, seq: FusedSequence, selection: Selection, record_fresh: bool,
                num_output_rows: int | None) -> LoopResult:
    num_rows = seq.num_rows
    active = selection.active
    if bool((~seq.cached & ~active).any()):
        raise ValueError("rows without cached KV must be active")
    positions = torch.arange(num_rows, device=seq.token_ids.device)
    rope = adapter.rotary(positions)  # per layer (Gemma 3's local and global layers differ)
    rows = active.nonzero().squeeze(1)
    ids = seq.token_ids[rows]
    hidden = adapter.embed(ids) if seq.links is None else seq.links.embed(adapter.embed, ids)
    # Per row set (it changes only where the policy narrows it): the rows' cos/sin and attention plans.
    row_rope = rope.rows(rows)
    num_reused = int(seq.reused[rows].sum())  # counted when the rows change, not per layer: a GPU sync each
    plans: dict[int | None, RowAttentionPlan] = {}  # by sliding window
    result = LoopResult()
    for layer in range(adapter.num_layers):
        started = time.perf_counter()
        q, k, v = adapter.project_qkv(layer, hidden)
        if record_fresh:
            result.fresh_keys.append(k)
            result.fresh_values.append(v)
        result.rows_per_layer.append(int(rows.numel()))
        result.reused_rows_per_layer.append(num_reused)
        q = adapter.rope(layer, q, row_rope)
        k_rot = adapter.rope(layer, k, row_rope)
        all_fresh = rows.numel() == num_rows  # every row computed: nothing cached to place
        cached_k = cached_v = None
        if all_fresh:
            layer_k, layer_v = k_rot, v
        else:
            with record_function("fuse.place_cached_kv"):  # load, re-position (RoPE), overlay the fresh rows
                cached_k, cached_v = seq.cached_kv(layer)
                layer_k = adapter.rope(layer, cached_k, rope)
                layer_k[rows] = k_rot
        with record_function("fuse.select_rows"):
            keep = selection.keep(LayerView(layer, rows, q, k, v, cached_k, cached_v, layer_k,
                                            adapter.scaling(layer), seq))
        if not all_fresh:  # the selection has seen the cached V: the loaded buffer becomes the fused V
            layer_v = cached_v
            layer_v[rows] = v
        if keep is not None:  # the dropped rows' fresh K/V stay in this layer; they compute no further
            keep = keep | ~seq.cached[rows]  # rows without cached KV can never be dropped
            rows, hidden, q = rows[keep], hidden[keep], q[keep]
            row_rope = rope.rows(rows)
            num_reused = int(seq.reused[rows].sum())
            plans.clear()
        result.rows = rows
        if num_output_rows is not None and layer == adapter.num_layers - 1:
            rows, hidden, q = rows[-num_output_rows:], hidden[-num_output_rows:], q[-num_output_rows:]
            plans.clear()
        window = adapter.sliding_window(layer)
        plan = plans.get(window)
        if plan is None:
            with record_function("fuse.plan_attention"):
                plan = plans[window] = RowAttentionPlan(rows, num_rows, hidden.dtype, window)
        attn = plan.attend(q, layer_k, layer_v, scale=adapter.scaling(layer))
        result.pairs_per_layer.append(plan.num_pairs)
        hidden = adapter.finish_layer(layer, hidden, attn)
        result.keys.append(layer_k)
        result.values.append(layer_v)
        result.layer_s.append(time.perf_counter() - started)
    result.output_rows, result.hidden = rows, hidden
    return result
