"""Which rows must be recomputed to give full prefill's first token back: row classes side by side, per model.

For MuSiQue questions with their first passages (each cut to `--passage-tokens` so a 1.5B model iterates in
seconds), every arm reuses the passages' stored KV and recomputes one set of rows; first-token KL against the
model's own full prefill of the same prompt, and whether the top token is the same, are reported per arm:

    default             the default method at the model's own ratio (the fidelity gate's decision)
    full_reuse          nothing recomputed
    cacheblend@R        CacheBlend's deviation ranking (the package's policy)
    relevance@R         the question's attention over the stale KV (the package's default)
    heads@k             each reused passage's first k tokens (EPIC's LegoLink: the attention-sink rows)
    tails@k             each reused passage's last k tokens (the boundaries)
    passage@j           passage j recomputed whole, the others reused
    cross@R             oracle: the rows that, in full prefill, attend most to the passages before them (what a
                        stale row lacks); the top R of reused rows, attention summed over layers
    question@R          oracle: the rows the question attends to most in full prefill (relevance's target)
    layers@L            every row computed in layers 0..L, the reused rows stale from layer L+1 on (which layers'
                        staleness costs the most)
    ape@T               full reuse, the stale rows' keys at attention temperature T (APE's temperature: logits ÷ T)
    ape_relevance@T     relevance@0.15's rows recomputed, the other reused rows' keys at temperature T

    python benchmarks/fidelity_diagnosis.py --model qwen2.5-coder-1.5b --questions 0:6 --passage-tokens 128 \
        --arms full_reuse,cacheblend@0.15,relevance@0.15,heads@8,cross@0.15,question@0.15 --out diag.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.datasets import load_dataset, passages_of, resolve_dataset
from cacheblend_rag.fuse import placement
from cacheblend_rag.fuse.fidelity import first_token_kl
from cacheblend_rag.fuse.hkvd import chunk_heads
from cacheblend_rag.fuse.loop import LayerView, run_layers
from cacheblend_rag.fuse.policy import Policy, RowSelection
from cacheblend_rag.fuse.sequence import FusedSequence

RowChoice = Callable[[FusedSequence], torch.Tensor]  # → (N,) bool: reused rows to recompute


@dataclass(frozen=True)
class ChosenRows(placement.EveryChunk, Policy):
    """Every stored chunk placed; the rows `choose` returns (and every uncached row) recomputed in every layer."""

    choose: RowChoice = field(default=lambda seq: torch.zeros_like(seq.cached))
    temperature: float = 1.0  # attention temperature on the keys of the reused rows not recomputed
    through_layer: int | None = None  # every row computed through this layer (then only `choose`'s: none here)
    name: ClassVar[str] = "chosen_rows"

    def start(self, adapter, seq: FusedSequence, placed) -> RowSelection:
        """The uncached rows and the chosen reused ones."""
        active = ~seq.cached | (self.choose(seq) & seq.reused)
        if self.through_layer is not None:
            return _FirstLayers(~seq.exact, self.through_layer + 1, last=self.through_layer)
        if self.temperature == 1.0:
            return RowSelection(active)
        return _Tempered(active, stale=seq.reused & ~active, key_scale=1.0 / self.temperature)


@dataclass
class _FirstLayers(RowSelection):
    """Every non-exact row through layer `last`, then only the uncached ones."""

    last: int = 0

    def keep(self, view: LayerView) -> torch.Tensor | None:
        """Drop the reused rows after layer `last`."""
        return ~view.seq.cached[view.rows] if view.layer == self.last else None


@dataclass
class _Tempered(RowSelection):
    """Scales the stale rows' fused keys in place before each layer attends: q·k/T for every query."""

    stale: torch.Tensor | None = None
    key_scale: float = 1.0

    def keep(self, view: LayerView) -> None:
        """Temper this layer's stale keys; keep every row."""
        view.keys[self.stale] *= self.key_scale


@dataclass
class _FullAttention(RowSelection):
    """Records, in a full prefill, each row's attention to earlier passages and the question's attention to it."""

    segment: torch.Tensor | None = None  # (N,) passage index or -1
    question_rows: int = 0
    cross: torch.Tensor | None = None  # (N,) summed over layers
    read: torch.Tensor | None = None  # (N,)

    def keep(self, view: LayerView) -> None:
        """Accumulate this layer's attention (mean over heads); keep every row."""
        q, keys = view.q.float(), view.keys.float()
        n, kv_heads, d = keys.shape
        groups = q.shape[1] // kv_heads
        probs = torch.zeros(n, n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for g in range(kv_heads):  # per KV head, to bound memory
            logits = torch.einsum("shd,nd->hsn", q[:, g * groups:(g + 1) * groups], keys[:, g]) * view.scale
            probs += logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(0)
        probs /= q.shape[1]
        seg = self.segment
        earlier = (seg[None, :] >= 0) & (seg[None, :] < seg[:, None])  # key in a passage before the row's own
        cross = (probs * earlier).sum(-1)
        read = probs[-self.question_rows:].mean(0)
        self.cross = cross if self.cross is None else self.cross + cross
        self.read = read if self.read is None else self.read + read / read.mean().clamp_min(1e-12)


def top_reused(score: torch.Tensor, seq: FusedSequence, ratio: float) -> torch.Tensor:
    """(N,) bool: the top `ratio` of reused rows by `score`."""
    score = score.masked_fill(~seq.reused, float("-inf"))
    chosen = torch.zeros_like(seq.cached)
    chosen[score.topk(round(ratio * int(seq.reused.sum()))).indices] = True
    return chosen


def passage_tails(seq: FusedSequence, k: int) -> torch.Tensor:
    """(N,) bool: the last k rows of each passage."""
    seg = seq.segment_of_row
    tails = torch.zeros_like(seq.cached)
    for p in seg.unique().tolist():
        if p >= 0:
            rows = (seg == p).nonzero().squeeze(1)
            tails[rows[-k:]] = True
    return tails


def cut(text: str, tokenizer, num_tokens: int | None) -> str:
    """The first `num_tokens` tokens of `text` (whole words), or all of it."""
    if not num_tokens:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= num_tokens else tokenizer.decode(ids[:num_tokens]).rsplit(" ", 1)[0]


def run(engine: CacheBlendEngine, items: list[dict], arms: list[str], num_chunks: int, passage_tokens: int | None,
        ) -> list[dict]:
    """Per question: full prefill, then every arm; KL and top-1 agreement per arm."""
    records = []
    for qi, item in items:
        passages = [cut(p, engine.tokenizer, passage_tokens) for p in passages_of(item, num_chunks)]
        ids = engine.ingest(passages, show_progress=False)
        question = item["question"]
        started = time.perf_counter()
        ref = engine.prefill(ids, question, "full_prefill")
        full_s = time.perf_counter() - started
        oracle = None
        record = {"question": qi, "num_tokens": ref.stats["num_tokens"], "full_prefill_s": full_s,
                  "top": engine.tokenizer.decode([int(ref.logits.argmax())]), "arms": {}}
        for arm in arms:
            name, _, arg = arm.partition("@")
            if name in ("cross", "question") and oracle is None:
                oracle = full_attention(engine, ids, question)
            if name == "default":
                started = time.perf_counter()
                out = engine.prefill(ids, question)
            elif name in ("full_reuse", "cacheblend", "relevance", "cachecraft"):
                started = time.perf_counter()
                out = engine.prefill(ids, question, name, float(arg) if arg else None)
            elif name == "layers":
                started = time.perf_counter()
                out = engine.prefill(ids, question, ChosenRows(through_layer=int(arg)))
            elif name in ("ape", "ape_relevance"):
                choose = relevant_rows(engine, 0.15) if name == "ape_relevance" else chooser("heads", "0", None)
                started = time.perf_counter()
                out = engine.prefill(ids, question, ChosenRows(choose, temperature=float(arg)))
            else:
                choose = chooser(name, arg, oracle)
                started = time.perf_counter()
                out = engine.prefill(ids, question, ChosenRows(choose))
            seconds = time.perf_counter() - started
            record["arms"][arm] = {
                "kl": first_token_kl(ref.logits, out.logits),
                "same_top": int(out.logits.argmax()) == int(ref.logits.argmax()),
                "top": engine.tokenizer.decode([int(out.logits.argmax())]),
                "recomputed": out.stats["num_recomputed"], "reused": out.stats["num_reused"],
                "ratio": out.stats.get("recompute_ratio"),
                "speedup": full_s / seconds,
            }
        records.append(record)
        print(json.dumps({"q": qi, "n": record["num_tokens"], "top": record["top"],
                          **{a: round(r["kl"], 4) for a, r in record["arms"].items()}}), file=sys.stderr)
    return records


def full_attention(engine: CacheBlendEngine, ids: list[str], question: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross, read) from a full prefill of the request: what each row reads of earlier passages, what the question
    reads of each row."""
    from cacheblend_rag import Request

    request = engine.fusion_of(Request.of(ids, question, "full_prefill"))
    layout = request.layout
    seq = FusedSequence(layout.token_ids, layout.segment_of_row, [], engine.adapter.num_layers,
                        engine.adapter.num_kv_heads, engine.adapter.head_dim, engine.adapter.dtype)
    suffix = int((layout.segment_of_row == -1).flip(0).int().cumprod(0).sum())
    recorder = _FullAttention(torch.ones_like(seq.cached), segment=layout.segment_of_row, question_rows=suffix)
    run_layers(engine.adapter, seq, recorder, num_output_rows=1)
    return recorder.cross, recorder.read


def relevant_rows(engine: CacheBlendEngine, ratio: float) -> RowChoice:
    """The rows relevance@ratio recomputes (its probe pass over the stale KV)."""
    from cacheblend_rag.fuse.hkvd import question_relevance, top_rows

    adapter = engine.adapter
    return lambda seq: top_rows(question_relevance(adapter, seq, adapter.num_layers // 3), seq, ratio)


def chooser(name: str, arg: str, oracle) -> RowChoice:
    """The row set an oracle or structural arm recomputes."""
    if name == "heads":
        return lambda seq: chunk_heads(seq, int(arg))
    if name == "tails":
        return lambda seq: passage_tails(seq, int(arg))
    if name == "passage":
        return lambda seq: seq.segment_of_row == int(arg)
    if name == "cross":
        return lambda seq: top_reused(oracle[0], seq, float(arg))
    if name == "question":
        return lambda seq: top_reused(oracle[1], seq, float(arg))
    raise SystemExit(f"unknown arm {name!r}")


def summary(records: list[dict], arms: list[str]) -> list[dict]:
    """Per arm: mean and median KL, top-1 agreement, share recomputed, speedup."""
    rows = []
    for arm in arms:
        rs = [r["arms"][arm] for r in records]
        rows.append({"arm": arm, "mean_kl": statistics.fmean(r["kl"] for r in rs),
                     "median_kl": statistics.median(r["kl"] for r in rs),
                     "same_top": sum(r["same_top"] for r in rs) / len(rs),
                     "recomputed": statistics.fmean(r["recomputed"] / max(1, r["reused"]) for r in rs),
                     "speedup": statistics.fmean(r["speedup"] for r in rs)})
    return rows


def main() -> None:
    """Parse, load, run, print the table, write the records."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=None)
    p.add_argument("--questions", default="0:6", help="a slice of the data set, start:stop")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--passage-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--arms", default="full_reuse,cacheblend@0.15,relevance@0.15,heads@8,tails@8,cross@0.15,"
                                    "question@0.15")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start, stop = (int(x) for x in args.questions.split(":"))
    items = list(enumerate(load_dataset(resolve_dataset(args.data), None)))[start:stop]
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=None, dtype=args.dtype, device="cpu")
    arms = [a for a in args.arms.split(",") if a]
    records = run(engine, items, arms, args.chunks, args.passage_tokens)
    print(f"{args.model}, questions {args.questions}, {args.chunks} passages × ≤{args.passage_tokens} tokens, "
          f"{args.dtype}")
    print(f"{'arm':<22}{'mean KL':>9}{'median':>9}{'same top':>10}{'recomp':>8}{'speedup':>9}")
    for row in summary(records, arms):
        print(f"{row['arm']:<22}{row['mean_kl']:>9.4f}{row['median_kl']:>9.4f}{row['same_top']:>10.2f}"
              f"{row['recomputed']:>8.2f}{row['speedup']:>9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "records": records, "summary": summary(records, arms)}, f, indent=1)


if __name__ == "__main__":
    main()
