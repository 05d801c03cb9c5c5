"""Engine benchmark: TTFT and fidelity of every method on MuSiQue-style data, all in one run.

    python -m cacheblend_rag.bench.engine_bench --limit 20 --chunks 6

Methods are interleaved per question (the order rotates) so machine noise hits all
alike; speedups are ratios to full prefill measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..engine import CacheBlendEngine
from .metrics import best_f1, first_token_kl, token_f1

DEFAULT_DATASET = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "musique_dev.json"
DEFAULT_METHODS = ("full_prefill", "prefix_cache", "full_reuse", "cacheblend@0.05", "cacheblend@0.15", "cacheblend@0.30")


@dataclass(frozen=True)
class MethodSpec:
    """A method to run: an engine method name, a ratio, and CacheBlend options."""

    label: str
    method: str
    ratio: float | None = None
    options: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "MethodSpec":
        """'cacheblend@0.15' → CacheBlend at 0.15; options follow as '/key=value' pairs.

        e.g. 'cacheblend@0.15/deviation=k/check_layers=1+2/schedule=4:0.1' (tuples join with '+').
        """
        head, *opts = text.split("/")
        name, _, ratio = head.partition("@")
        return cls(text, name, float(ratio) if ratio else None, dict(_option(o) for o in opts))


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if key == "schedule":
        return key, tuple((int(layer), float(r)) for layer, r in (p.split(":") for p in value.split("+")))
    if key == "check_layers":
        return key, tuple(int(v) for v in value.split("+"))
    if key == "chunk_head_tokens":
        return key, int(value)
    return key, value


def load_dataset(path: str | Path, limit: int | None) -> list[dict]:
    """MuSiQue-style JSON: [{ctxs: [{title, text}], question, answers}]."""
    items = json.loads(Path(path).read_text())
    return items[:limit] if limit else items


def passages_of(item: dict, num_chunks: int) -> list[str]:
    """The first passages of a question, as 'title\\ntext' chunks."""
    return [f"{c['title']}\n{c['text']}" for c in item["ctxs"][:num_chunks]]


def run(engine: CacheBlendEngine, items: list[dict], specs: list[MethodSpec], *, num_chunks: int = 6,
        max_new_tokens: int = 32, show_progress: bool = True) -> dict:
    """Run every method on every question; returns per-question records and a per-method summary."""
    reference = MethodSpec("full_prefill", "full_prefill")
    records: list[dict] = []
    ingest_s, ingest_tokens = 0.0, 0
    bar = tqdm(items, desc="questions", unit="q", disable=not show_progress)
    for qi, item in enumerate(bar):
        chunks = passages_of(item, num_chunks)
        started = time.perf_counter()
        ids = engine.ingest(chunks, show_progress=False)
        ingest_s += time.perf_counter() - started
        ingest_tokens += sum(engine.resolve_chunk(i).num_tokens for i in ids)
        question, answers = item["question"], item.get("answers") or [item.get("answer", "")]
        engine.prefill(ids, question, method="full_reuse")  # warm caches and allocator, untimed
        ref = engine.generate(ids, question, method="full_prefill", max_new_tokens=max_new_tokens)
        order = specs[qi % len(specs):] + specs[: qi % len(specs)]
        for spec in order:
            gen = ref if spec == reference else engine.generate(
                ids, question, spec.method, spec.ratio, max_new_tokens=max_new_tokens, **spec.options)
            records.append({
                "question_index": qi, "method": spec.label, "ttft_s": gen.ttft_s,
                "latency_s": gen.ttft_s + gen.stats["timing"]["decode_s"],
                "answer": gen.text, "gold": answers, "f1": best_f1(gen.text, answers),
                "agreement_f1": token_f1(gen.text, ref.text),
                "first_token_match": int(gen.logits.argmax()) == int(ref.logits.argmax()),
                "kl": max(0.0, first_token_kl(ref.logits, gen.logits)),
                "recompute_ratio_effective": gen.stats["recompute_ratio_effective"],
                "num_tokens": gen.stats["num_tokens"], "timing": gen.stats["timing"],
            })
    summary = summarize(records, [s.label for s in specs])
    return {"records": records, "summary": summary,
            "ingest": {"seconds": ingest_s, "tokens": ingest_tokens,
                       "tokens_per_s": ingest_tokens / ingest_s if ingest_s else None}}


def summarize(records: list[dict], labels: list[str]) -> dict[str, dict]:
    """Per method: TTFT median/p90, speedup vs full prefill, gold F1, agreement, first-token match, KL."""
    by = {label: [r for r in records if r["method"] == label] for label in labels}
    base = statistics.median(r["ttft_s"] for r in by["full_prefill"]) if by.get("full_prefill") else None
    summary = {}
    for label, rows in by.items():
        if not rows:
            continue
        ttft = sorted(r["ttft_s"] for r in rows)
        med = statistics.median(ttft)
        summary[label] = {
            "n": len(rows), "ttft_median_s": med, "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "latency_median_s": statistics.median(r["latency_s"] for r in rows),
            "speedup": base / med if base else None,
            "f1": statistics.fmean(r["f1"] for r in rows),
            "agreement_f1": statistics.fmean(r["agreement_f1"] for r in rows),
            "first_token_match": statistics.fmean(float(r["first_token_match"]) for r in rows),
            "kl": statistics.fmean(r["kl"] for r in rows),
            "recompute_ratio_effective": statistics.fmean(r["recompute_ratio_effective"] for r in rows),
        }
    return summary


def format_table(summary: dict[str, dict]) -> str:
    """A markdown table of the summary."""
    head = "| method | TTFT median (s) | p90 (s) | speedup | gold F1 | agreement F1 | 1st-token match | KL | recomputed |"
    lines = [head, "|" + "---|" * 9]
    for label, s in summary.items():
        speed = f"{s['speedup']:.2f}×" if s["speedup"] else "–"
        lines.append(f"| {label} | {s['ttft_median_s']:.3f} | {s['ttft_p90_s']:.3f} | {speed} | {s['f1']:.3f} | "
                     f"{s['agreement_f1']:.3f} | {s['first_token_match']:.2f} | {s['kl']:.3f} | "
                     f"{s['recompute_ratio_effective']:.3f} |")
    return "\n".join(lines)


def machine() -> str:
    """One line about where this ran."""
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> None:
    """Command line entry."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dataset", nargs="?", default=str(DEFAULT_DATASET))
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lead-in", default="prefix", choices=("prefix", "bos", "none"))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="write results.json here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    engine = CacheBlendEngine.from_pretrained(args.model, dtype=args.dtype, lead_in=args.lead_in)
    specs = [MethodSpec.parse(m) for m in args.methods.split(",")]
    if "full_prefill" not in [s.label for s in specs]:
        specs.insert(0, MethodSpec.parse("full_prefill"))
    result = run(engine, load_dataset(args.dataset, args.limit), specs, num_chunks=args.chunks,
                 max_new_tokens=args.max_new_tokens)
    print(f"\n{args.limit} questions × {args.chunks} passages, {engine.adapter.dtype}, lead-in {args.lead_in}; {machine()}")
    print(f"ingestion: {result['ingest']['tokens']} tokens in {result['ingest']['seconds']:.1f} s "
          f"({result['ingest']['tokens_per_s']:.0f} tokens/s)")
    print(format_table(result["summary"]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
