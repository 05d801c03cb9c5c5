"""Engine benchmark: TTFT and fidelity of every method on MuSiQue-style data, all in one run.

    python -m cacheblend_rag.bench.engine_bench --limit 20 --chunks 6      # engine methods only
    cacheblend-rag bench --limit 20 --chunks 6                               # + LangChain chains, HF pipeline

Methods are interleaved per question (the order rotates) so machine noise hits all alike; speedups are
ratios to full prefill measured in the same run. The passages' KV is ingested before anything is timed.
"""

from __future__ import annotations

import logging
import platform
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..engine import CacheBlendEngine
from .datasets import DEFAULT_DATASET, load_dataset, passages_of, question_passages  # noqa: F401 (re-exported)
from .metrics import best_f1, first_token_kl, rouge_l, token_f1

logger = logging.getLogger(__name__)

ENGINE_METHODS = ("full_prefill", "prefix_cache", "full_reuse", "cacheblend")
CHAIN_METHODS = ("stuff", "map_reduce", "map_rerank", "hf_pipeline")
DEFAULT_RATIOS = (0.05, 0.15, 0.30)
SWEEP_RATIOS = (0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 0.75, 1.0)
DEFAULT_METHODS = ("full_prefill", "prefix_cache", "full_reuse", "cacheblend@0.05", "cacheblend@0.15", "cacheblend@0.30")
REFERENCE = "full_prefill"
WARMUP_PASSAGE = "Warm-up\nThe Eiffel Tower is in Paris, the capital of France."
WARMUP_QUESTION = "Where is the Eiffel Tower?"


@dataclass(frozen=True)
class MethodSpec:
    """A method to run: an engine method or a chain, a ratio, and options."""

    label: str
    method: str
    ratio: float | None = None
    options: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """'cacheblend@0.15' → CacheBlend at 0.15; options follow as '/key=value' pairs.

        e.g. 'cacheblend@0.15/deviation=k/check_layers=1+2/candidate_factor=2/filter_layer=4' (tuples join with '+').
        Chains ('stuff', 'map_reduce', 'map_rerank') run CacheBlendLLM at cacheblend@0.15 unless told:
        'map_reduce@0.3', 'stuff/method=full_prefill'.
        """
        head, *opts = text.strip().split("/")
        name, _, ratio = head.partition("@")
        if name not in ENGINE_METHODS + CHAIN_METHODS:
            raise ValueError(f"unknown method {name!r}; expected one of {', '.join(ENGINE_METHODS + CHAIN_METHODS)}")
        return cls(text.strip(), name, float(ratio) if ratio else None, dict(_option(o) for o in opts))

    @property
    def is_chain(self) -> bool:
        """Whether this runs through a LangChain chain (TTFT = first streamed chunk)."""
        return self.method in CHAIN_METHODS

    @property
    def ratio_of_recompute(self) -> float | None:
        """Where the method sits on a recompute-ratio axis: full reuse 0, full prefill 1, CacheBlend its ratio."""
        return {"full_reuse": 0.0, "full_prefill": 1.0}.get(self.method, self.ratio if self.method == "cacheblend" else None)


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if key == "check_layers":
        return key, tuple(int(v) for v in value.split("+"))
    if key in ("chunk_head_tokens", "filter_layer"):
        return key, int(value)
    if key == "candidate_factor":
        return key, float(value)
    return key, value


def parse_methods(text: str | None, ratios: tuple[float, ...] = DEFAULT_RATIOS, *, sweep: bool = False,
                  hf_available: bool = False) -> list[MethodSpec]:
    """Method specs from '--methods'; a bare 'cacheblend' expands to one spec per ratio; full prefill first.

    With no text: every engine method, CacheBlend at each ratio, the chains, and hf_pipeline when available;
    with `sweep`: full prefill, full reuse and CacheBlend at each ratio (quality vs ratio).
    """
    if text:
        names = [m for m in text.split(",") if m.strip()]
    elif sweep:
        names = ["full_prefill", "full_reuse", "cacheblend"]
    else:
        names = ["full_prefill", "prefix_cache", "full_reuse", "cacheblend", "stuff", "map_reduce", "map_rerank"]
        names += ["hf_pipeline"] if hf_available else []
    specs: list[MethodSpec] = []
    for name in names:
        head, sep, rest = name.strip().partition("/")
        if head == "cacheblend":
            specs += [MethodSpec.parse(f"cacheblend@{_ratio_text(r)}{sep}{rest}") for r in ratios]
        else:
            specs.append(MethodSpec.parse(name))
    if REFERENCE not in [s.label for s in specs]:
        specs.insert(0, MethodSpec.parse(REFERENCE))
    labels = [s.label for s in specs]
    duplicates = {label for label in labels if labels.count(label) > 1}
    if duplicates:
        raise ValueError(f"methods given twice: {', '.join(sorted(duplicates))}")
    return specs


def _ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}"


# ---- the run ------------------------------------------------------------------------------------


def _engine_record(gen, spec: MethodSpec) -> dict:
    stats = gen.stats
    return {
        "kind": "engine", "ttft_kind": "prefill", "ttft_s": gen.ttft_s,
        "latency_s": gen.ttft_s + stats["timing"]["decode_s"], "answer": gen.text,
        # At ratio 1 every row is active, and the engine's per-layer count then includes the exact (prefix,
        # first chunk) rows too, above 1; every reused row was recomputed, which is 1.
        "recompute_ratio_effective": stats["recompute_ratio_effective"],
        "kv_bytes_loaded": stats.get("kv_bytes_loaded"), "num_tokens": stats["num_tokens"],
        "num_generated": stats.get("num_generated"), "llm_calls": 1, "timing": stats["timing"],
        "chunk_hits": len(stats["chunk_hits"]), "chunk_misses": len(stats["chunk_misses"]),
    }


def run(engine: CacheBlendEngine, items: list[dict], specs: list[MethodSpec], *, num_chunks: int = 6,
        max_new_tokens: int = 32, show_progress: bool = True, chunk_tokens: int | None = None, seed: int = 0,
        warmup: bool = True) -> dict:
    """Run every method on every question; returns per-question records, a per-method summary, ingestion.

    Per question: ingest the passages (timed separately), warm the engine, then run every method in an order
    that rotates with the question; agreement is measured against that question's full-prefill answer.
    """
    if REFERENCE not in [s.label for s in specs]:
        specs = [MethodSpec.parse(REFERENCE), *specs]
    chains = None
    if any(s.is_chain for s in specs):
        from .chains import ChainRunner

        chains = ChainRunner(engine, max_new_tokens=max_new_tokens, seed=seed)
    random.seed(seed)
    torch.manual_seed(seed)

    def one(spec: MethodSpec, chunks: list[str], ids: list[str], question: str) -> tuple[dict, object]:
        if spec.is_chain:
            out = chains.run(spec, chunks, question)
            return out, None
        gen = engine.generate(ids, question, spec.method, spec.ratio, max_new_tokens=max_new_tokens, seed=seed,
                              **spec.options)
        return _engine_record(gen, spec), gen.logits

    questions = []
    ingest_s, ingest_tokens, ingest_chunks = 0.0, 0, 0
    for item in items:
        chunks = question_passages(item, num_chunks, chunk_tokens, engine.tokenizer)
        started = time.perf_counter()
        ids = engine.ingest(chunks, show_progress=False)
        ingest_s += time.perf_counter() - started
        ingest_tokens += sum(engine.resolve_chunk(i).num_tokens for i in ids)
        ingest_chunks += len(ids)
        questions.append((chunks, ids))

    # Engine methods are warm once ingestion has run the layer loop (and per question, below). Chains pay
    # first-call costs (LangChain setup, the HF pipeline's first generate): one untimed run on a tiny passage.
    chain_specs = [s for s in specs if s.is_chain]
    if warmup and chain_specs:
        for spec in tqdm(chain_specs, desc="warm-up", unit="chain", disable=not show_progress, leave=False):
            chains.run(spec, [WARMUP_PASSAGE], WARMUP_QUESTION)

    records: list[dict] = []
    bar = tqdm(total=len(items) * len(specs), desc="benchmark", unit="run", disable=not show_progress)
    for qi, (item, (chunks, ids)) in enumerate(zip(items, questions)):
        question, answers = item["question"], item.get("answers") or [item.get("answer", "")]
        engine.prefill(ids, question, method="full_reuse")  # stored KV warm, untimed
        if engine.lead_in != "prefix" and any(s.method == "prefix_cache" for s in specs):
            engine.prefill(ids, question, method="prefix_cache")  # its exact first chunk, computed once
        order = specs[qi % len(specs):] + specs[: qi % len(specs)]
        outputs: dict[str, tuple[dict, object]] = {}
        for spec in order:
            bar.set_postfix_str(spec.label, refresh=False)
            outputs[spec.label] = one(spec, chunks, ids, question)
            bar.update()
        ref, ref_logits = outputs[REFERENCE]
        for spec in specs:  # records in the spec order; the run order is in "run_position"
            rec, logits = outputs[spec.label]
            records.append({
                "question_index": qi, "method": spec.label, "run_position": order.index(spec),
                "question": question, "gold": answers, **rec,
                "f1": best_f1(rec["answer"], answers),
                "agreement_f1": token_f1(rec["answer"], ref["answer"]),
                "agreement_rouge_l": rouge_l(rec["answer"], ref["answer"]),
                "first_token_match": None if logits is None else int(logits.argmax()) == int(ref_logits.argmax()),
                "kl": None if logits is None else max(0.0, first_token_kl(ref_logits, logits)),
            })
    bar.close()
    summary = summarize(records, [s.label for s in specs])
    for spec in specs:
        if spec.label in summary:
            summary[spec.label]["ratio"] = spec.ratio_of_recompute
    return {"records": records, "summary": summary,
            "ingest": {"seconds": ingest_s, "tokens": ingest_tokens, "chunks": ingest_chunks,
                       "tokens_per_s": ingest_tokens / ingest_s if ingest_s else None}}


# ---- summary and table ---------------------------------------------------------------------------


def _mean(values) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    vals = [float(v) for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: list[dict], labels: list[str]) -> dict[str, dict]:
    """Per method: TTFT median/p90, latency, speedup vs full prefill, gold F1, agreement, match, KL, recompute.

    Metrics a method cannot give (KL and first-token match of chains) are None.
    """
    by = {label: [r for r in records if r["method"] == label] for label in labels}
    base = statistics.median(r["ttft_s"] for r in by[REFERENCE]) if by.get(REFERENCE) else None
    summary = {}
    for label, rows in by.items():
        if not rows:
            continue
        ttft = [r["ttft_s"] for r in rows]
        med = statistics.median(ttft)
        summary[label] = {
            "n": len(rows), "kind": rows[0].get("kind", "engine"), "ttft_kind": rows[0].get("ttft_kind", "prefill"),
            "ttft_median_s": med, "ttft_p90_s": percentile(ttft, 0.9),
            "latency_median_s": statistics.median(r["latency_s"] for r in rows),
            "speedup": base / med if base and med else None,
            "f1": statistics.fmean(r["f1"] for r in rows),
            "agreement_f1": statistics.fmean(r["agreement_f1"] for r in rows),
            "agreement_rouge_l": _mean(r.get("agreement_rouge_l") for r in rows),
            "first_token_match": _mean(r.get("first_token_match") for r in rows),
            "kl": _mean(r.get("kl") for r in rows),
            "recompute_ratio_effective": _mean(r.get("recompute_ratio_effective") for r in rows),
            "kv_bytes_loaded": _mean(r.get("kv_bytes_loaded") for r in rows),
            "llm_calls": _mean(r.get("llm_calls") for r in rows),
        }
    return summary


def _fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


TABLE_HEAD = ("| method | TTFT median (s) | p90 (s) | latency (s) | speedup | gold F1 | agreement F1 | ROUGE-L | "
              "1st-token match | KL | recomputed | KV loaded (MB) |")


def format_table(summary: dict[str, dict]) -> str:
    """A markdown table of the summary; '–' where a metric is unavailable. Chain TTFTs are marked with '*'."""
    lines = [TABLE_HEAD, "|" + "---|" * TABLE_HEAD.count(" | ") + "---|"]
    for label, s in summary.items():
        star = "*" if s.get("ttft_kind", "prefill") != "prefill" else ""
        kv = s.get("kv_bytes_loaded")
        lines.append(
            f"| {label} | {s['ttft_median_s']:.3f}{star} | {s['ttft_p90_s']:.3f} | "
            f"{_fmt(s.get('latency_median_s'))} | {_fmt(s.get('speedup'), '.2f', '×')} | {s['f1']:.3f} | "
            f"{s['agreement_f1']:.3f} | {_fmt(s.get('agreement_rouge_l'))} | {_fmt(s.get('first_token_match'), '.2f')} | "
            f"{_fmt(s.get('kl'))} | {_fmt(s.get('recompute_ratio_effective'))} | "
            f"{_fmt(None if kv is None else kv / 1e6, '.1f')} |")
    return "\n".join(lines)


def machine() -> str:
    """One line about where this ran."""
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    """Command line entry: the `cacheblend-rag bench` command with engine methods as the default."""
    from .command import main as command_main

    return command_main(argv, default_engine_only=True, prog="python -m cacheblend_rag.bench.engine_bench")


if __name__ == "__main__":
    raise SystemExit(main())
