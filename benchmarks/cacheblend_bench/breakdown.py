"""Where the prefill time goes: per-layer times, rows and attention pairs, and op shares, per method.

    cacheblend-rag bench breakdown --limit 3 --dtype bfloat16 --methods full_prefill,full_reuse,cacheblend@0.15

Prefill only (no decoding). On CUDA the op shares are device time, but the per-layer times are host
time between launches (the loop does not synchronise per layer), so read them as approximate there.
Per question: ingest, warm every method once, then `repeats` timed rounds in
rotating order (per-layer times from the loop's own timer), then one round under `torch.profiler` for the
op shares: attention (SDPA kernels), matmuls (mm/addmm/bmm) and everything else, and for the loop's labelled
regions (placing the cached KV: load + RoPE re-positioning; the policy's row selection; attention plans).
What the request spends outside the layer loop (tokenising, placing chunks, the logits) is TTFT minus the
layers' time. A method's layers fall into: layer 0, the layers until its row set settles (CacheBlend's
check and filter layers), the deep layers (median of one), and the last layer (only the final row
attends there).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from cacheblend_rag.engine import CacheBlendEngine
from .datasets import question_passages
from .methods import REFERENCE, MethodSpec

ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_int_mm")


# the loop's labelled regions (torch.profiler.record_function), reported inclusive of the ops inside them
REGIONS = {"fuse.place_cached_kv": "place_cached_kv_s", "fuse.select_rows": "select_rows_s",
           "fuse.plan_attention": "plan_attention_s"}


def _op_shares(prof, on_cuda: bool) -> dict[str, float]:
    """Seconds of self time in attention kernels, matmuls and everything else, and in the loop's regions."""
    shares = {"attention_s": 0.0, "matmul_s": 0.0, "other_s": 0.0, **{key: 0.0 for key in REGIONS.values()}}
    for event in prof.key_averages():
        if event.key in REGIONS:  # host time of the whole region; its ops are counted below by kind
            shares[REGIONS[event.key]] += event.cpu_time_total / 1e6
            continue
        if getattr(event, "device_type", DeviceType.CPU) != DeviceType.CPU:
            continue  # a GPU kernel's own row: the op that launched it already counts its device time
        us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if any(op in event.key for op in ATTENTION_OPS):
            shares["attention_s"] += us / 1e6
        elif event.key in MATMUL_OPS:
            shares["matmul_s"] += us / 1e6
        else:
            shares["other_s"] += us / 1e6
    return shares


def _layer_groups(layer_s: list[float], rows: list[int]) -> dict[str, float]:
    """Layer 0, the layers until the row set settles, a deep layer (median) and the last layer, in seconds.

    The deep layers are those between layer 0 and the last that have the rows of the one before the last;
    a model of fewer than 3 layers has none (NaN).
    """
    last = len(layer_s) - 1
    if last < 2:
        return {"layer0_s": layer_s[0], "until_settled_s": 0.0, "deep_layer_s": float("nan"),
                "num_deep_layers": 0, "last_layer_s": layer_s[last]}
    settled = last - 1
    while settled > 1 and rows[settled - 1] == rows[last - 1]:
        settled -= 1
    return {"layer0_s": layer_s[0], "until_settled_s": sum(layer_s[1:settled]),
            "deep_layer_s": statistics.median(layer_s[settled:last]), "num_deep_layers": last - settled,
            "last_layer_s": layer_s[last]}


def run(engine: CacheBlendEngine, items: list[dict], specs: list[MethodSpec], *, num_chunks: int = 6,
        chunk_tokens: int | None = None, repeats: int = 2, show_progress: bool = True) -> dict:
    """Time and profile every engine method's prefill on every question; per method: medians of the timed
    rounds, and op shares averaged over the profiled ones."""
    specs = [s for s in specs if not s.is_chain]
    if not items or not specs or repeats < 1:
        raise ValueError("a breakdown needs questions, at least one engine method and repeats ≥ 1")
    on_cuda = engine.adapter.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    runs: dict[str, list[dict]] = defaultdict(list)
    ops: dict[str, dict[str, float]] = {s.label: defaultdict(float) for s in specs}
    bar = tqdm(total=len(items) * len(specs) * (repeats + 2), desc="breakdown", disable=not show_progress)
    for q, item in enumerate(items):
        ids = engine.ingest(question_passages(item, num_chunks, chunk_tokens, engine.tokenizer), show_progress=False)
        question = item["question"]

        def prefill(spec: MethodSpec):
            return engine.prefill(ids, question, spec.method, spec.ratio, **spec.options)

        for spec in specs:  # warm: stored KV read once, exact first chunk computed once
            prefill(spec)
            bar.update()
        for r in range(repeats):
            shift = (q * repeats + r) % len(specs)
            for spec in specs[shift:] + specs[:shift]:
                stats = prefill(spec).stats
                runs[spec.label].append({"ttft_s": stats["ttft_s"], "layer_s": stats["layer_s"],
                                         "outside_s": stats["ttft_s"] - sum(stats["layer_s"]),
                                         "rows": stats["rows_per_layer"], "num_tokens": stats["num_tokens"],
                                         "pairs": stats["attention_pairs_per_layer"]})
                bar.update()
        for spec in specs:
            with profile(activities=activities) as prof:
                prefill(spec)
            for key, seconds in _op_shares(prof, on_cuda).items():
                ops[spec.label][key] += seconds / len(items)
            bar.update()
    bar.close()

    summary = {}
    for spec in specs:
        records = runs[spec.label]
        num_layers = len(records[0]["layer_s"])
        layer_s = [statistics.median(r["layer_s"][i] for r in records) for i in range(num_layers)]
        rows, n = records[0]["rows"], records[0]["num_tokens"]  # the first question's, for the shares below
        deep = max(0, num_layers - 2)  # the layer before the last: the deep row set, where there is one
        summary[spec.label] = {
            "ttft_s": statistics.median(r["ttft_s"] for r in records),
            "outside_layers_s": statistics.median(r["outside_s"] for r in records),
            "layer_s": layer_s, **_layer_groups(layer_s, rows),
            "deep_rows_share": statistics.median(r["rows"][deep] / r["num_tokens"] for r in records),
            "deep_pairs_share": statistics.median(r["pairs"][deep] / (r["num_tokens"] * (r["num_tokens"] + 1) / 2)
                                                  for r in records),
            "rows_per_layer": rows, "num_tokens": n, **dict(ops[spec.label]),
        }
    if REFERENCE in summary:
        for s in summary.values():
            s["speedup"] = summary[REFERENCE]["ttft_s"] / s["ttft_s"]
    return summary
