"""Loading benchmark (CacheBlend §5): TTFT with KV in memory vs on disk, with and without layer pipelining,
and recompute_ratio="auto" vs fixed ratios.

    python -m cacheblend_rag.bench.loading_bench --limit 10

The disk runs drop the OS page cache of every KV file before each request
(posix_fadvise DONTNEED), so each layer is read from the device, not from RAM.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from ..engine import CacheBlendEngine
from ..loading.profile import drop_page_cache
from ..store import DiskStore, MemoryStore
from .engine_bench import DEFAULT_DATASET, load_dataset, machine, passages_of
from .metrics import first_token_kl


def run(model_name: str, dataset: str, limit: int, num_chunks: int, ratio: float, dtype: str) -> dict:
    """TTFT per configuration, interleaved per question; returns medians and ratios to the memory tier."""
    root = Path(tempfile.mkdtemp(prefix="cacheblend-loading-"))
    base = CacheBlendEngine.from_pretrained(model_name, kv_store=DiskStore(root), dtype=dtype, home=None)
    model, tokenizer = base.model, base.tokenizer
    engines = {
        "memory": CacheBlendEngine(model, tokenizer, kv_store=MemoryStore(None)),
        "disk, pipelined (depth 2)": CacheBlendEngine(model, tokenizer, kv_store=DiskStore(root), prefetch_depth=2),
        "disk, on demand (depth 0)": CacheBlendEngine(model, tokenizer, kv_store=DiskStore(root), prefetch_depth=0),
    }
    auto_engines = {"memory": engines["memory"], "disk": engines["disk, pipelined (depth 2)"]}
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    waits: dict[str, list[float]] = {k: [] for k in engines}
    ratio_rows: dict[str, list[tuple[float, float, float]]] = {}
    for qi, item in enumerate(tqdm(load_dataset(dataset, limit), desc="questions", unit="q")):
        chunks = passages_of(item, num_chunks)
        ids = base.ingest(chunks, show_progress=False)
        engines["memory"].ingest(chunks, show_progress=False)
        question = item["question"]
        full = base.prefill(ids, question, method="full_prefill")
        names = list(engines)
        for name in names[qi % len(names):] + names[: qi % len(names)]:
            engine = engines[name]
            if name.startswith("disk"):
                drop_page_cache(root.rglob("*.safetensors"))
            pre = engine.prefill(ids, question, recompute_ratio=ratio)
            ttft[name].append(pre.stats["ttft_s"])
            waits[name].append(pre.stats["timing"]["kv_wait_s"])
        for tier, engine in auto_engines.items():
            for label, r in ((f"{tier} auto", "auto"), (f"{tier} 0.15", 0.15), (f"{tier} 0.30", 0.30)):
                if tier == "disk":
                    drop_page_cache(root.rglob("*.safetensors"))
                pre = engine.prefill(ids, question, recompute_ratio=r)
                ratio_rows.setdefault(label, []).append(
                    (pre.stats["ttft_s"], first_token_kl(full.logits, pre.logits), pre.stats["recompute_ratio"]))
    memory = statistics.median(ttft["memory"])
    tiers = {k: {"ttft_median_s": statistics.median(v), "vs_memory": statistics.median(v) / memory,
                 "kv_wait_median_s": statistics.median(waits[k])} for k, v in ttft.items()}
    ratios = {k: {"ttft_median_s": statistics.median(t for t, _, _ in v), "kl": statistics.fmean(x for _, x, _ in v),
                  "ratio_mean": statistics.fmean(r for _, _, r in v)} for k, v in ratio_rows.items()}
    return {"tiers": tiers, "ratios": ratios, "profile": engines["memory"].controller.compute.__dict__,
            "tier_profiles": {k: v.__dict__ for k, v in engines["memory"].controller.tiers.items()}}


def main(argv: list[str] | None = None) -> None:
    """Command line entry."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dataset", nargs="?", default=str(DEFAULT_DATASET))
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    result = run(args.model, args.dataset, args.limit, args.chunks, args.ratio, args.dtype)
    print(f"\n{args.limit} questions × {args.chunks} passages, CacheBlend r={args.ratio}; {machine()}")
    print("| KV location | TTFT median (s) | × memory tier | loop waited for KV (median s) |\n|---|---|---|---|")
    for name, row in result["tiers"].items():
        print(f"| {name} | {row['ttft_median_s']:.3f} | {row['vs_memory']:.3f} | {row['kv_wait_median_s']:.4f} |")
    print("\n| ratio | TTFT median (s) | first-token KL vs full prefill | mean ratio used |\n|---|---|---|---|")
    for name, row in result["ratios"].items():
        print(f"| {name} | {row['ttft_median_s']:.3f} | {row['kl']:.4f} | {row['ratio_mean']:.3f} |")
    p, t = result["profile"], result["tier_profiles"]
    print(f"\nprofile: layer = {p['layer_fixed_s'] * 1e3:.2f} ms + {p['layer_per_row_s'] * 1e6:.2f} µs/row at "
          f"{p['num_tokens']} tokens; tiers: " + ", ".join(f"{k} {v['read_bytes_per_s'] / 1e9:.2f} GB/s" for k, v in t.items()))


if __name__ == "__main__":
    main()
