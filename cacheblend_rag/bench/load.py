"""Throughput under load: C client threads replay the questions against one engine.

The engine serves one request at a time (it holds a lock around prefill + decode), so this measures queueing:
queries per minute is bounded by the per-request service time, and the TTFT a client sees under load is its
wait in the queue plus the prefill. Both methods are measured on the same questions, one after the other.
"""

from __future__ import annotations

import statistics
import threading
import time

from tqdm.auto import tqdm

from ..engine import CacheBlendEngine
from .methods import MethodSpec
from .metrics import percentile


def run_load(engine: CacheBlendEngine, questions: list[tuple[list[str], str]], specs: list[MethodSpec], *,
             concurrency: int, max_new_tokens: int = 32, seed: int = 0, show_progress: bool = True) -> dict:
    """Per method: C threads, each replaying every question (from a different start); qpm and TTFT under load.

    `questions` are (chunk ids, question) pairs whose KV is already ingested. A client's TTFT is the time from
    sending its request to the first token's logits: its latency minus the decode time the engine reports.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be ≥ 1, got {concurrency}")
    out: dict[str, dict] = {}
    total = len(questions) * concurrency
    for spec in specs:
        if spec.is_chain:
            raise ValueError(f"throughput is measured on engine methods, not {spec.label!r}")
        rows: list[dict] = []
        lock = threading.Lock()
        bar = tqdm(total=total, desc=f"load {spec.label} ×{concurrency}", unit="q", disable=not show_progress,
                   leave=False)

        def client(c: int, spec: MethodSpec = spec, rows: list = rows, lock=lock, bar=bar) -> None:
            n = len(questions)
            for k in range(n):
                ids, question = questions[(c + k) % n]
                sent = time.perf_counter()
                gen = engine.generate(ids, question, spec.method, spec.ratio, max_new_tokens=max_new_tokens,
                                      seed=seed, **spec.options)
                latency = time.perf_counter() - sent
                with lock:
                    rows.append({"client": c, "latency_s": latency, "service_ttft_s": gen.ttft_s,
                                 "ttft_s": latency - gen.stats["timing"]["decode_s"],
                                 "chunk_misses": len(gen.stats["chunk_misses"])})
                    bar.update()

        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        bar.close()
        ttft = [r["ttft_s"] for r in rows]
        out[spec.label] = {
            "concurrency": concurrency, "requests": len(rows), "wall_s": wall,
            "queries_per_min": 60.0 * len(rows) / wall if wall else None,
            "ttft_median_s": statistics.median(ttft), "ttft_p90_s": percentile(ttft, 0.9),
            "service_ttft_median_s": statistics.median(r["service_ttft_s"] for r in rows),
            "latency_median_s": statistics.median(r["latency_s"] for r in rows),
            # a request that missed KV recomputed those chunks: the store could not hold the working set
            "requests_with_misses": sum(1 for r in rows if r["chunk_misses"]) if spec.method != "full_prefill" else 0,
            "records": rows,
        }
    return out
