"""Loading benchmark (CacheBlend §5): TTFT with KV in memory vs on disk, with and without layer pipelining,
and recompute_ratio="auto" vs fixed ratios (`cacheblend-rag bench loading`).

The disk runs drop the OS page cache of every KV file before each request
(posix_fadvise DONTNEED), so each layer is read from the device, not from RAM.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from tqdm.auto import tqdm

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.loading.profile import drop_page_cache
from cacheblend_rag.store import DiskStore, MemoryStore
from .datasets import question_passages
from .metrics import first_token_kl

AUTO_COMPARED = (("auto", "auto"), ("0.15", 0.15), ("0.30", 0.30))  # (label, recompute_ratio)


def run(model, tokenizer, items: list[dict], kv_root: str | Path, *, num_chunks: int = 6,
        chunk_tokens: int | None = None, ratio: float = 0.15, lead_in: str = "prefix",
        home: str | os.PathLike[str] | None = None, show_progress: bool = True) -> dict:
    """TTFT per KV location at `ratio`, and "auto" vs fixed ratios, interleaved per question.

    Engines on the same model: one on a DiskStore at `kv_root` (ingests, and gives the full-prefill reference),
    one on a memory store, two on the disk store (pipelined, depth 2; on demand, depth 0). Returns medians,
    ratios to the memory tier, and the profiles the loading controller used.
    """
    root = Path(kv_root)
    # no stored prefixes: each engine must fuse the same prompts as the others, not reuse its own last request
    same = dict(lead_in=lead_in, home=home, prefix_reuse=False)
    base = CacheBlendEngine(model, tokenizer, kv_store=DiskStore(root), **same)
    engines = {
        "memory": CacheBlendEngine(model, tokenizer, kv_store=MemoryStore(None), **same),
        "disk, pipelined (depth 2)": CacheBlendEngine(model, tokenizer, kv_store=DiskStore(root), prefetch_depth=2,
                                                      **same),
        "disk, on demand (depth 0)": CacheBlendEngine(model, tokenizer, kv_store=DiskStore(root), prefetch_depth=0,
                                                      **same),
    }
    auto_engines = {"memory": engines["memory"], "disk": engines["disk, pipelined (depth 2)"]}
    for engine in auto_engines.values():
        engine.controller  # noqa: B018 (profiles measured or read now, not inside the first timed "auto" request)
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    waits: dict[str, list[float]] = {k: [] for k in engines}
    ratio_rows: dict[str, list[tuple[float, float, float]]] = {}
    for qi, item in enumerate(tqdm(items, desc="questions", unit="q", disable=not show_progress)):
        chunks = question_passages(item, num_chunks, chunk_tokens, tokenizer)
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
            for label, r in AUTO_COMPARED:
                if tier == "disk":
                    drop_page_cache(root.rglob("*.safetensors"))
                pre = engine.prefill(ids, question, recompute_ratio=r)
                ratio_rows.setdefault(f"{tier} {label}", []).append(
                    (pre.stats["ttft_s"], first_token_kl(full.logits, pre.logits), pre.stats["recompute_ratio"]))
    memory = statistics.median(ttft["memory"])
    tiers = {k: {"ttft_median_s": statistics.median(v), "vs_memory": statistics.median(v) / memory,
                 "kv_wait_median_s": statistics.median(waits[k])} for k, v in ttft.items()}
    ratios = {k: {"ttft_median_s": statistics.median(t for t, _, _ in v), "kl": statistics.fmean(x for _, x, _ in v),
                  "ratio_mean": statistics.fmean(r for _, _, r in v)} for k, v in ratio_rows.items()}
    controller = engines["disk, pipelined (depth 2)"].controller
    return {"ratio": ratio, "tiers": tiers, "ratios": ratios, "profile": dict(controller.compute.__dict__),
            "tier_profiles": {k: dict(v.__dict__) for k, v in controller.tiers.items()}}
