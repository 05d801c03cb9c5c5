"""`bench answers`: do right answers stay right? Answerable questions (NQ-style: the gold passage among retrieved
look-alikes; or MuSiQue-style), each arm side by side with full prefill on the same prompts, scored against gold.

    arm    = "full_prefill" | "method@ratio" | "method@ratio+links" | "default" (no ratio named: the gate's choice)
    record = per question and arm: the answer, right or not, first-token KL vs full prefill, TTFT

Per arm: accuracy against gold, the share of full prefill's right answers kept, token F1 with full prefill's answer,
mean first-token KL and the TTFT speed-up over full prefill (its summed TTFT over the arm's, the same questions).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from cacheblend_rag.gate import is_right  # the gate's own scoring: a normalized gold answer inside the reply

from .metrics import token_f1

REFERENCE = "full_prefill"


@dataclass(frozen=True)
class Arm:
    """One configuration to run: a method (or "default": the engine's, at the gate's ratio), a ratio, links."""

    label: str
    method: str | None  # None: the engine's default method, no ratio named (the fidelity gate decides)
    ratio: float | None = None
    links: bool | None = None  # None: the engine's default; False: off; True: on

    @classmethod
    def parse(cls, text: str) -> "Arm":
        """'relevance@0.15+links', 'full_reuse', 'full_reuse+links', 'relevance@0.3-links', 'default'."""
        from cacheblend_rag.fuse.policies import POLICIES

        label = text.strip()
        head, links = label, False
        if head.endswith("+links"):
            head, links = head[: -len("+links")], True
        elif head.endswith("-links"):
            head = head[: -len("-links")]
        if head == "default":
            return cls(label, None, None, None if not label.endswith("links") else links)
        method, _, ratio = head.partition("@")
        if method not in POLICIES:
            raise ValueError(f"--arms: unknown method {method!r} (one of {', '.join(POLICIES)}, or default)")
        try:
            return cls(label, method, float(ratio) if ratio else None, links)
        except ValueError:
            raise ValueError(f"--arms: {label!r}: the ratio after @ must be a number") from None


def run_answers(engine, examples, arms: list[Arm], *, max_new_tokens: int = 32, show_progress: bool = True) -> dict:
    """Every arm on every example (full prefill first, the reference), after one warm-up request."""
    from cacheblend_rag import Request
    from cacheblend_rag.fuse.fidelity import first_token_kl

    arms = [Arm.parse(REFERENCE)] + [a for a in arms if a.label != REFERENCE]
    for ex in tqdm(examples, desc="ingest", unit="question", disable=not show_progress):
        engine.ingest(list(ex.passages), show_progress=False)
    warm = examples[0]
    engine.generate_request(Request.of(list(warm.passages), warm.question, "full_prefill", max_new_tokens=2))
    records = []
    for i, ex in enumerate(tqdm(examples, desc="questions", unit="question", disable=not show_progress)):
        record = {"question": ex.question, "golds": list(ex.answers), "arms": {}}
        reference = None
        for arm in arms:
            kwargs = {} if arm.method is None else {"method": arm.method, "recompute_ratio": arm.ratio}
            request = Request.of(list(ex.passages), ex.question, max_new_tokens=max_new_tokens, links=arm.links,
                                 **kwargs)
            started = time.perf_counter()
            gen = engine.generate_request(request)
            wall = time.perf_counter() - started
            if reference is None:
                reference = gen
            stats = gen.stats
            record["arms"][arm.label] = {
                "answer": gen.text, "right": is_right(gen.text, ex.answers),
                "kl": first_token_kl(reference.logits, gen.logits), "ttft_s": gen.ttft_s, "wall_s": wall,
                "f1_full": token_f1(gen.text, reference.text), "method": stats["method"],
                "ratio": stats.get("recompute_ratio"), "links": bool((stats.get("links") or {}).get("ran")),
                "num_tokens": stats["num_tokens"], "recomputed": stats.get("recompute_ratio_effective", 0.0),
            }
        records.append(record)
    return {"records": records, "summary": summarize(records, [a.label for a in arms])}


def summarize(records: list[dict], labels: list[str]) -> list[dict]:
    """Per arm: accuracy, right answers kept, F1 with full prefill, mean KL, TTFT speed-up."""
    ref_right = [r["arms"][REFERENCE]["right"] for r in records]
    ref_ttft = sum(r["arms"][REFERENCE]["ttft_s"] for r in records)
    rows = []
    for label in labels:
        arms = [r["arms"][label] for r in records]
        kept = sum(1 for a, ok in zip(arms, ref_right) if ok and a["right"])
        rows.append({
            "arm": label, "n": len(arms), "accuracy": statistics.fmean(a["right"] for a in arms),
            "right": sum(a["right"] for a in arms), "kept": kept, "full_right": sum(ref_right),
            "kept_share": kept / sum(ref_right) if sum(ref_right) else 1.0,
            "f1_full": statistics.fmean(a["f1_full"] for a in arms),
            "mean_kl": statistics.fmean(a["kl"] for a in arms),
            "speedup": ref_ttft / sum(a["ttft_s"] for a in arms),
            "links_ran": sum(a["links"] for a in arms), "ratio": arms[0]["ratio"], "method": arms[0]["method"],
            "mean_tokens": statistics.fmean(a["num_tokens"] for a in arms),
        })
    return rows


def format_answers(rows: list[dict]) -> str:
    """The summary as a Markdown table."""
    lines = ["| arm | ran as | accuracy | kept right | F1 vs full | first-token KL | TTFT speed-up |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ran = f"{r['method']}@{r['ratio']}" if r["ratio"] is not None else r["method"]
        ran += " + links" if r["links_ran"] else ""
        lines.append(f"| {r['arm']} | {ran} | {r['accuracy']:.3f} ({r['right']}/{r['n']}) | "
                     f"{r['kept']}/{r['full_right']} ({r['kept_share']:.0%}) | {r['f1_full']:.3f} | "
                     f"{r['mean_kl']:.4f} | {r['speedup']:.2f}× |")
    return "\n".join(lines)
