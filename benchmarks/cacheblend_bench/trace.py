"""The trace benchmark: chunks that recur with different companions (issue #15's workload).

For each of N questions, R requests, each a seeded random subset of k of the question's passages in random
order; the requests of all questions are shuffled together (seeded), so a passage comes back later behind
other passages. Two corpus modes:

    warm   every passage precomputed in isolation at ingestion (what CacheBlend assumes)
    cold   nothing precomputed: a store fills only from live requests (what Cache-Craft assumes)

Every method gets its own engine (one shared model) with a fresh store, and sees the whole trace in order;
per request the methods run in a rotating order so machine noise hits all alike. Each request's reference is
the full prefill of that very request (run once: it is the `full_prefill` method's own record). Any method of
the policy registry runs by name (`fuse.policies.POLICIES`), with options as in the main bench
('cacheblend@0.15/guard=0.05'). A method's own facts come from its stats: `stats["guard"]` (fuse/guard.py) and
`stats["cachecraft"]` (variants served) when the policy reports them.
"""

from __future__ import annotations

import logging
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.store import MemoryStore
from cacheblend_rag.fuse.policies import POLICIES, option_names
from .datasets import passages_of
from .methods import REFERENCE, MethodSpec
from .metrics import first_token_kl, rouge_l, token_f1

logger = logging.getLogger(__name__)

MODES = ("warm", "cold", "neighbors")  # neighbors: warm + Cache-Craft variants after each passage's nearest
DEFAULT_METHODS = "full_prefill,cacheblend@0.15,cacheblend@0.30,full_reuse"
GUARD_FLOOR = 0.3  # the guard twin of a method without a ratio (cachecraft): flagged chunks recompute ≥ this share
GUARD_SWEEP_QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9)  # estimate thresholds for the offline recall/precision sweep


# ---- the trace ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: a question and the passages it is asked over, in request order."""

    position: int  # its place in the trace
    question_index: int
    repeat: int  # which of the question's R requests (numbered in generation order)
    passages: tuple[int, ...]  # indices into the question's passages, in the order they are placed


def make_trace(passages_per_question: list[int], repeats: int, k: int, seed: int = 0) -> list[TraceRequest]:
    """R requests per question, each k of its passages drawn at random in random order; all interleaved (seeded)."""
    if repeats < 1 or k < 1:
        raise ValueError(f"repeats and k must be ≥ 1, got repeats={repeats}, k={k}")
    rng = random.Random(seed)
    drawn = [(q, r, tuple(rng.sample(range(n), min(k, n))))
             for q, n in enumerate(passages_per_question) for r in range(repeats)]
    rng.shuffle(drawn)
    return [TraceRequest(i, q, r, subset) for i, (q, r, subset) in enumerate(drawn)]


# ---- methods --------------------------------------------------------------------------------------


def _value(text: object) -> object:
    """An option given on the command line as text: a bool, an int or a float where it reads as one."""
    if not isinstance(text, str):
        return text
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_trace_methods(text: str) -> list[MethodSpec]:
    """Engine methods from '--methods' (any registered policy, options as '/key=value'); full prefill first."""
    specs = []
    for name in (m for m in text.split(",") if m.strip()):
        spec = MethodSpec.parse(name)
        if spec.is_chain:
            raise ValueError(f"--trace runs engine methods (the policy registry), not the chain {spec.method!r}")
        specs.append(replace(spec, options={k: _value(v) for k, v in spec.options.items()}))
    if REFERENCE not in [s.label for s in specs]:
        specs.insert(0, MethodSpec.parse(REFERENCE))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"methods given twice in {text!r}")
    return specs


def with_guard(specs: list[MethodSpec], threshold: float, escalate_to: float | None) -> list[MethodSpec]:
    """Each method that takes a guard computes it (flag only: the same rows), followed by a twin that escalates
    flagged requests to `escalate_to` (default: twice its ratio, at most 1)."""
    out = []
    for spec in specs:
        if "guard" not in option_names(POLICIES[spec.method]) or "guard" in spec.options:
            out.append(spec)
            continue
        out.append(replace(spec, options={**spec.options, "guard": threshold}))
        ratio = spec.ratio if spec.ratio is not None else getattr(POLICIES[spec.method](), "recompute_ratio", None)
        if escalate_to is not None:
            target = escalate_to
        else:  # twice the method's ratio; a method with per-chunk budgets (no ratio) raises each to a floor
            target = min(1.0, 2 * ratio) if ratio else GUARD_FLOOR
        out.append(replace(spec, label=f"{spec.label}/guard={threshold:g}/guard_ratio={target:g}",
                           options={**spec.options, "guard": threshold, "guard_ratio": target}))
    return out


# ---- the run --------------------------------------------------------------------------------------


@dataclass
class _Lane:
    """One method's engine (own store) over the shared model."""

    spec: MethodSpec
    engine: CacheBlendEngine
    records: list[dict] = field(default_factory=list)


def _store_bytes(stats: dict) -> int | None:
    """KV bytes a store holds, from its stats (a composite's tiers: its largest)."""
    if isinstance(stats.get("bytes"), int):
        return stats["bytes"]
    tiers = [v for v in stats.values() if isinstance(v, dict)]
    found = [b for b in (_store_bytes(t) for t in tiers) if b is not None]
    return max(found) if found else None


def variant_facts(report: object) -> dict | None:
    """From a policy's `stats["cachecraft"]`: chunks served and how many by a variant computed in context.

    Tolerant of the report's shape: a `variant_hits` count if given, else per-chunk entries (under "chunks")
    whose `variant` (the ids of the chunks before it) is non-empty.
    """
    if not isinstance(report, dict):
        return None
    if isinstance(report.get("variant_hits"), int):
        return {"variant_hits": report["variant_hits"], "chunks": report.get("num_chunks")}
    chunks = report.get("chunks")
    entries = list(chunks.values()) if isinstance(chunks, dict) else chunks if isinstance(chunks, list) else []
    entries = [e for e in entries if isinstance(e, dict)]
    if not entries:
        return None
    return {"variant_hits": sum(1 for e in entries if e.get("variant")), "chunks": len(entries)}


def _record(request: TraceRequest, spec: MethodSpec, gen, ref_gen) -> dict:
    stats = gen.stats
    guard = stats.get("guard")
    return {
        "position": request.position, "question_index": request.question_index, "repeat": request.repeat,
        "passages": list(request.passages), "method": spec.label, "ttft_s": gen.ttft_s,
        "answer": gen.text, "num_tokens": stats["num_tokens"], "num_reused": stats["num_reused"],
        "num_recomputed": stats["num_recomputed"], "num_hole_tokens": stats["num_hole_tokens"],
        "recompute_ratio_effective": stats["recompute_ratio_effective"],
        "chunk_hits": len(stats["chunk_hits"]), "chunk_misses": len(stats["chunk_misses"]),
        "kv_bytes_loaded": stats["kv_bytes_loaded"],
        "kl": max(0.0, first_token_kl(ref_gen.logits, gen.logits)),
        "first_token_match": int(gen.logits.argmax()) == int(ref_gen.logits.argmax()),
        "answer_match": gen.token_ids == ref_gen.token_ids,
        "agreement_f1": token_f1(gen.text, ref_gen.text), "agreement_rouge_l": rouge_l(gen.text, ref_gen.text),
        "guard": dict(guard) if isinstance(guard, dict) else None,
        "variants": variant_facts(stats.get("cachecraft")),
    }


def run(model, tokenizer, items: list[dict], specs: list[MethodSpec], *, mode: str = "warm", repeats: int = 3,
        k: int = 6, max_new_tokens: int = 16, seed: int = 0, lead_in: str = "prefix",
        show_progress: bool = True) -> dict:
    """Run the trace once in `mode` for every method; returns the trace, per-request records and a summary."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if REFERENCE not in [s.label for s in specs]:
        specs = [MethodSpec.parse(REFERENCE), *specs]
    passages = [passages_of(item, None) for item in items]
    trace = make_trace([len(p) for p in passages], repeats, k, seed)
    # Unbounded memory stores: the trace measures recompute, not capacity (warm lanes share the same tensors).
    lanes = [_Lane(s, CacheBlendEngine(model, tokenizer, MemoryStore(None), lead_in=lead_in, prefix_reuse=False))
             for s in specs]
    if mode in ("warm", "neighbors"):  # every passage precomputed in isolation, once, in every lane's store
        first = lanes[0].engine
        # only the passages the trace asks for: the rest would never be read (same results, less ingestion)
        texts = list(dict.fromkeys(passages[r.question_index][i] for r in trace for i in r.passages))
        ids = first.ingest(texts, show_progress=show_progress)
        for lane in lanes[1:]:
            for chunk_id in dict.fromkeys(ids):
                key = first.cache.key(chunk_id)
                lane.engine.kv_store.put(key, first.kv_store.get(key))
            lane.engine.ingest(texts, show_progress=False)  # registers the texts; the KV is stored already
    if mode == "neighbors":  # each passage also after its nearest passages of the same question (FusionRAG)
        for lane in lanes:
            if lane.spec.method != "cachecraft":
                continue
            for qi in sorted({r.question_index for r in trace}):
                used = {i for r in trace if r.question_index == qi for i in r.passages}
                lane.engine.ingest_variants([first.resolve_chunk(passages[qi][i]).chunk_id for i in sorted(used)],
                                            show_progress=False)
    torch.manual_seed(seed)
    bar = tqdm(total=len(trace) * len(lanes), desc=f"trace ({mode})", unit="run", disable=not show_progress)
    for request in trace:
        item = items[request.question_index]
        chunks = [passages[request.question_index][i] for i in request.passages]
        order = lanes[request.position % len(lanes):] + lanes[: request.position % len(lanes)]
        gens = {}
        for lane in order:
            bar.set_postfix_str(lane.spec.label, refresh=False)
            gens[lane.spec.label] = lane.engine.generate(chunks, item["question"], lane.spec.method, lane.spec.ratio,
                                                         max_new_tokens=max_new_tokens, seed=seed,
                                                         **lane.spec.options)
            bar.update()
        ref = gens[REFERENCE]
        for lane in lanes:
            lane.records.append(_record(request, lane.spec, gens[lane.spec.label], ref))
    bar.close()
    records = [r for lane in lanes for r in lane.records]
    store_bytes = {lane.spec.label: _store_bytes(lane.engine.kv_store.stats()) for lane in lanes}
    summary = summarize(records, [s.label for s in specs], store_bytes)
    guard = guard_detection(records, specs)
    return {"mode": mode, "trace": [vars(r) | {"passages": list(r.passages)} for r in trace], "records": records,
            "summary": summary, "guard": guard}


# ---- summary --------------------------------------------------------------------------------------


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def summarize(records: list[dict], labels: list[str], store_bytes: dict[str, int | None] | None = None) -> dict:
    """Per method: TTFT, speedup vs full prefill, recompute shares, KL, agreement, hits, variants, store bytes."""
    by = {label: [r for r in records if r["method"] == label] for label in labels}
    base = statistics.median(r["ttft_s"] for r in by[REFERENCE]) if by.get(REFERENCE) else None
    summary = {}
    for label, rows in by.items():
        if not rows:
            continue
        med = statistics.median(r["ttft_s"] for r in rows)
        reused = sum(r["num_reused"] for r in rows)
        variants = [r["variants"] for r in rows if r.get("variants")]
        summary[label] = {
            "n": len(rows), "ttft_median_s": med, "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in rows),
            "speedup": base / med if base and med else None,
            "recomputed_share": sum(r["num_recomputed"] for r in rows) / reused if reused else None,
            "recompute_ratio_effective": _mean(r["recompute_ratio_effective"] for r in rows),
            "hole_tokens_share": sum(r["num_hole_tokens"] for r in rows) / max(1, sum(r["num_tokens"] for r in rows)),
            "chunk_hit_rate": sum(r["chunk_hits"] for r in rows)
            / max(1, sum(r["chunk_hits"] + r["chunk_misses"] for r in rows)),
            "kl": _mean(r["kl"] for r in rows), "kl_p90": sorted(r["kl"] for r in rows)[int(0.9 * (len(rows) - 1))],
            "first_token_match": _mean(r["first_token_match"] for r in rows),
            "answer_match": _mean(r["answer_match"] for r in rows),
            "agreement_f1": _mean(r["agreement_f1"] for r in rows),
            "variant_hits": sum(v["variant_hits"] for v in variants) if variants else None,
            "store_bytes": (store_bytes or {}).get(label),
            "guard_flagged": _mean(r["guard"]["flagged"] for r in rows if r.get("guard")),
            "guard_escalated": _mean(r["guard"]["escalated"] for r in rows if r.get("guard")),
        }
    return summary


def _detection(rows: list[dict], flagged: list[bool], wrong: list[bool]) -> dict:
    hits = sum(f and w for f, w in zip(flagged, wrong))
    return {"mismatches": sum(wrong), "flagged": sum(flagged), "caught": hits,
            "recall": hits / sum(wrong) if any(wrong) else None,
            "precision": hits / sum(flagged) if any(flagged) else None,
            "flag_rate": sum(flagged) / len(rows) if rows else None}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties broken by order); None with fewer than 3 points or a constant side."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(_ranks(xs), _ranks(ys))


def guard_detection(records: list[dict], specs: list[MethodSpec]) -> dict:
    """Per method that ran a flag-only guard: recall and precision of its flag over first-token mismatches vs
    full prefill (and over differing greedy answers), a sweep over estimate thresholds, and its escalating
    twin's extra mean TTFT and quality."""
    out = {}
    for spec in specs:
        if "guard" not in spec.options or "guard_ratio" in spec.options:
            continue
        rows = [r for r in records if r["method"] == spec.label and r.get("guard")]
        measured = [r for r in rows if r["guard"]["estimate"] is not None]
        if not measured:
            continue
        wrong = [not r["first_token_match"] for r in measured]
        flagged = [bool(r["guard"]["flagged"]) for r in measured]
        estimates = sorted(r["guard"]["estimate"] for r in measured)
        sweep = []
        for q in GUARD_SWEEP_QUANTILES:
            t = estimates[min(len(estimates) - 1, int(q * len(estimates)))]
            sweep.append({"quantile": q, "threshold": t, **_detection(measured, [r["guard"]["estimate"] > t
                                                                                 for r in measured], wrong)})
        entry = {"threshold": spec.options["guard"], "requests": len(measured),
                 "first_token": _detection(measured, flagged, wrong),
                 "answer": _detection(measured, flagged, [not r["answer_match"] for r in measured]),
                 "estimate_median": statistics.median(estimates), "sweep": sweep, "escalation": None,
                 # how well the estimate orders requests by their real distance from full prefill
                 "estimate_kl_spearman": rank_correlation([r["guard"]["estimate"] for r in measured],
                                                          [r["kl"] for r in measured])}
        twin = next((s for s in specs if s.method == spec.method and s.ratio == spec.ratio and "guard_ratio" in s.options
                     and {k: v for k, v in s.options.items() if k != "guard_ratio"} == spec.options), None)
        if twin is not None:
            twin_rows = [r for r in records if r["method"] == twin.label]
            base_ttft = statistics.fmean(r["ttft_s"] for r in rows)
            twin_ttft = statistics.fmean(r["ttft_s"] for r in twin_rows)
            entry["escalation"] = {
                "method": twin.label, "escalate_to": twin.options["guard_ratio"],
                "escalated_share": _mean(r["guard"]["escalated"] for r in twin_rows),
                "ttft_mean_s": twin_ttft, "base_ttft_mean_s": base_ttft, "extra_ttft": twin_ttft / base_ttft - 1,
                "kl": _mean(r["kl"] for r in twin_rows), "base_kl": _mean(r["kl"] for r in rows),
                "first_token_match": _mean(r["first_token_match"] for r in twin_rows),
                "base_first_token_match": _mean(r["first_token_match"] for r in rows),
            }
        out[spec.label] = entry
    return out


# ---- tables and plot ------------------------------------------------------------------------------


def _f(value, spec: str = ".3f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


TRACE_HEAD = ("| method | TTFT median (s) | speedup | reused recomputed | recompute_ratio_effective | hole tokens | "
              "chunk hits | KL mean | KL p90 | 1st-token match | greedy answer = full | agreement F1 | "
              "variant hits | store (MB) |")


def format_trace_table(summary: dict[str, dict]) -> str:
    """The per-method markdown table of one mode."""
    lines = [TRACE_HEAD, "|" + "---|" * TRACE_HEAD.count(" | ") + "---|"]
    for label, s in summary.items():
        mb = None if s["store_bytes"] is None else s["store_bytes"] / 1e6
        lines.append(
            f"| {label} | {s['ttft_median_s']:.3f} | {_f(s['speedup'], '.2f', '×')} | {_f(s['recomputed_share'])} | "
            f"{_f(s['recompute_ratio_effective'])} | {s['hole_tokens_share']:.2f} | {s['chunk_hit_rate']:.2f} | "
            f"{_f(s['kl'], '.4f')} | {_f(s['kl_p90'], '.4f')} | {_f(s['first_token_match'], '.2f')} | "
            f"{_f(s['answer_match'], '.2f')} | {_f(s['agreement_f1'])} | {_f(s['variant_hits'], 'd')} | "
            f"{_f(mb, '.1f')} |")
    return "\n".join(lines)


def format_guard_table(guard: dict[str, dict]) -> str:
    """The guard as a detector: recall/precision on first-token mismatches and the escalating twin's cost."""
    if not guard:
        return ""
    head = ("| method | threshold | flagged | 1st-token mismatches | recall | precision | answer recall | "
            "estimate~KL (Spearman) | escalate to | escalated | extra mean TTFT | KL → escalated | "
            "1st-token match → escalated |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for label, g in guard.items():
        d, a, e = g["first_token"], g["answer"], g["escalation"] or {}
        lines.append(
            f"| {label} | {g['threshold']:g} | {_f(d['flag_rate'], '.2f')} | {d['mismatches']}/{g['requests']} | "
            f"{_f(d['recall'], '.2f')} | {_f(d['precision'], '.2f')} | {_f(a['recall'], '.2f')} | "
            f"{_f(g.get('estimate_kl_spearman'), '+.2f')} | "
            f"{_f(e.get('escalate_to'), 'g')} | {_f(e.get('escalated_share'), '.2f')} | "
            f"{_f(None if not e else 100 * e['extra_ttft'], '+.1f', '%')} | "
            f"{_f(e.get('base_kl'), '.4f')} → {_f(e.get('kl'), '.4f')} | "
            f"{_f(e.get('base_first_token_match'), '.2f')} → {_f(e.get('first_token_match'), '.2f')} |")
    sweep_head = "| method | estimate > (quantile) | flagged | recall | precision |"
    lines += ["", "Offline sweep over the estimates (no escalation run):", "", sweep_head, "|---|---|---|---|---|"]
    for label, g in guard.items():
        for s in g["sweep"]:
            lines.append(f"| {label} | {s['threshold']:.4f} (q{s['quantile']:.1f}) | {_f(s['flag_rate'], '.2f')} | "
                         f"{_f(s['recall'], '.2f')} | {_f(s['precision'], '.2f')} |")
    return "\n".join(lines)


def plot_kl_vs_ttft(results: list[dict], path: str | Path) -> Path:
    """One point per method and mode: median TTFT on x, mean first-token KL vs full prefill on y."""
    from .report import _plt, _save

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.4, 4.6))
    markers = {"warm": "o", "cold": "s", "neighbors": "^"}
    colors = {"warm": "tab:blue", "cold": "tab:orange", "neighbors": "tab:green"}
    for result in results:
        for label, s in result["summary"].items():
            if label == REFERENCE or s["kl"] is None:
                continue
            ax.scatter(s["ttft_median_s"], s["kl"], marker=markers.get(result["mode"], "o"), s=40, zorder=3,
                       color=colors.get(result["mode"], "tab:gray"))
            ax.annotate(label, (s["ttft_median_s"], s["kl"]), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ref = result["summary"].get(REFERENCE)
        if ref:
            ax.axvline(ref["ttft_median_s"], color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("TTFT median (s)  [dotted: full prefill]")
    ax.set_ylabel("first-token KL(full ‖ method), mean")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.grid(alpha=0.3)
    ax.set_title("trace: quality vs TTFT (blue: warm corpus, orange: cold)", fontsize=10)
    return _save(plt, fig, path)


def format_trace_markdown(meta: dict, results: list[dict]) -> str:
    """trace.md: what ran, then per mode the method table and the guard table."""
    lines = [f"# Trace benchmark ({meta['questions']} questions × {meta['repeats']} requests, k={meta['k']})", "",
             f"- command: `{meta['command']}`", f"- model {meta['model']}, {meta['dtype']}, {meta['machine']}",
             f"- {meta['max_new_tokens']} new tokens per answer, seed {meta['seed']}; TTFT indicative", ""]
    for result in results:
        lines += [f"## {result['mode']} corpus", "", format_trace_table(result["summary"]), ""]
        guard = format_guard_table(result["guard"])
        if guard:
            lines += ["Guard:", "", guard, ""]
    lines += [NOTES]
    return "\n".join(lines)


NOTES = """\
- TTFT: prefill to the first token's logits; speedup: full prefill's median TTFT / the method's, same run.
- reused recomputed: Σ num_recomputed / Σ num_reused (reused rows recomputed through the last layer);
  recompute_ratio_effective: the engine's per-layer share, averaged over requests; hole tokens: share of prompt
  tokens in chunks missing from the store (computed in place); chunk hits: chunks found in the store.
- KL: KL(full ‖ method) of the first-token distribution vs the full prefill of the same request; greedy answer
  = full: the greedy answer tokens equal full prefill's; agreement F1: token F1 of the answers.
- variant hits: chunks served by a variant computed in context (stats["cachecraft"]); store: KV bytes held at
  the end of the trace.
- guard: recall = share of first-token mismatches the flag caught; precision = share of flags that were
  mismatches; extra mean TTFT: the escalating twin's mean TTFT over the flag-only run's."""


def write_trace_outputs(meta: dict, results: list[dict], out: str | Path) -> list[Path]:
    """trace.md, trace.json and trace_kl_vs_ttft.png under `out`."""
    import json

    from .report import _strict

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / "trace.md", out / "trace.json", out / "trace_kl_vs_ttft.png"
    md.write_text(format_trace_markdown(meta, results) + "\n")
    js.write_text(json.dumps(_strict({"meta": meta, "results": results}), indent=1, default=str))
    plot_kl_vs_ttft(results, png)
    return [md, js, png]

