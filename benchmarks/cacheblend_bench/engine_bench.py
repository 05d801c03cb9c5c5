"""The benchmark's runner: TTFT and fidelity of every method on MuSiQue-style data, all in one run.

Methods are interleaved per question (the order rotates) so machine noise hits all alike; speedups are
ratios to full prefill measured in the same run. The passages' KV is ingested before anything is timed.
"""

from __future__ import annotations

import logging
import random
import statistics
import time

import torch
from tqdm.auto import tqdm

from cacheblend_rag.engine import CacheBlendEngine
from .datasets import question_passages
from .methods import REFERENCE, MethodSpec
from .metrics import best_f1, first_token_kl, percentile, rouge_l, token_f1

logger = logging.getLogger(__name__)

WARMUP_PASSAGE = "Warm-up\nThe Eiffel Tower is in Paris, the capital of France."
WARMUP_QUESTION = "Where is the Eiffel Tower?"


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
