"""Shared Redis tier timings (`cacheblend-rag bench shared-tier`):

1. Cross-replica TTFT: engines a and b (each memory → one Redis; two engines on one model stand for two
   replicas); per question a prefills first (computing and storing the chunks), then b twice: its first prefill
   reads the chunks from Redis, its second from its own memory tier (promoted there). The ratio of b's TTFT on
   the Redis hit to the memory hit, at CacheBlend r.
2. A remote tier behind an emulated link: a paced loopback proxy (1 Gbit/s by default, its own process) in front of
   redis-server; one engine per codec (fp16, int8, cachegen) with Redis, through the proxy, as its only tier;
   TTFT per codec against recompute (full prefill), and the first-token KL of each against the full prefill.

Timings on a shared CPU are indicative; bytes and KL are not.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from .replicas import ProxyProcess, RedisServer

CODECS = ("fp16", "int8", "cachegen")
AUTO = "auto"  # the tier's own choice (RedisStore codec="auto": the link measured, choose_codec's pick)
REMOTE_ROWS = (*CODECS, AUTO)


def cross_replica(items: list[tuple[str, list[str]]], *, model: str, home: str | None, ratio: float = 0.15,
                  device: str = "cpu", dtype: str = "float32") -> dict:
    """b's TTFT on a Redis hit vs a memory hit (medians over the questions, the engine's prefill).

    Two engines stand for the two replicas (one model in memory; the replicas are separate processes in the fault
    runs and in tests/test_replicas.py): a computes each question's chunks into Redis; b (memory → the same Redis)
    answers twice, first reading the chunks from Redis, then from its memory tier, where the first read promoted
    them.
    """
    from cacheblend_rag.engine import CacheBlendEngine
    from cacheblend_rag.store import open_store

    base = CacheBlendEngine.from_pretrained(model, kv_store=None, device=device, dtype=dtype, home=home)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cacheblend-xreplica-") as tmp:
        redis_server = RedisServer(Path(tmp)).start()
        try:
            a = CacheBlendEngine(base.model, base.tokenizer, kv_store=open_store(["memory", redis_server.url]),
                                 home=home)
            b = CacheBlendEngine(base.model, base.tokenizer, kv_store=open_store(["memory", redis_server.url]),
                                 home=home)
            for i, (question, docs) in enumerate(items):
                cold = a.prefill(docs, question, recompute_ratio=ratio)  # computes; the holes go to Redis
                remote = b.prefill(docs, question, recompute_ratio=ratio)
                local = b.prefill(docs, question, recompute_ratio=ratio)
                for pre in (remote, local):
                    if pre.stats["chunk_misses"]:
                        raise RuntimeError(f"b missed chunks a had stored: {pre.stats['chunk_misses']}")
                if not remote.stats["kv_bytes_by_tier"].get("redis") or local.stats["kv_bytes_by_tier"].get("redis"):
                    raise RuntimeError(f"unexpected tiers: {remote.stats['kv_bytes_by_tier']}, "
                                       f"{local.stats['kv_bytes_by_tier']}")
                if i:  # the first question warms the engines up, untimed
                    rows.append({"cold_prefill_s": cold.stats["ttft_s"], "redis_prefill_s": remote.stats["ttft_s"],
                                 "memory_prefill_s": local.stats["ttft_s"],
                                 "redis_kv_mb": remote.stats["kv_bytes_by_tier"]["redis"] / 1e6})
        finally:
            redis_server.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"ratio": ratio, "questions": len(rows), "medians": med,
            "redis_vs_memory_prefill": med["redis_prefill_s"] / med["memory_prefill_s"], "rows": rows}


def remote_codecs(items: list[tuple[str, list[str]]], *, model: str, home: str | None, ratio: float = 0.15,
                  bits_per_s: float = 1e9, device: str = "cpu", dtype: str = "float32") -> dict:
    """TTFT per codec with Redis behind a paced link, against recompute; medians over the questions."""
    from cacheblend_rag.engine import CacheBlendEngine
    from cacheblend_rag.store.redis import RedisStore
    from .metrics import first_token_kl

    base = CacheBlendEngine.from_pretrained(model, kv_store=None, device=device, dtype=dtype, home=home)
    m, tok = base.model, base.tokenizer
    ttft: dict[str, list[float]] = {c: [] for c in REMOTE_ROWS}
    ttft["recompute (full prefill)"] = []
    kl: dict[str, list[float]] = {c: [] for c in REMOTE_ROWS}
    loaded: dict[str, list[int]] = {c: [] for c in REMOTE_ROWS}
    with tempfile.TemporaryDirectory(prefix="cacheblend-remote-") as tmp:
        redis_server = RedisServer(Path(tmp)).start()
        proxy = ProxyProcess(redis_server.port, bits_per_s)
        try:
            writers = {c: CacheBlendEngine(m, tok, kv_store=RedisStore.from_url(
                f"{redis_server.url}?prefix={c}&codec={c}"), home=home) for c in CODECS}
            readers = {c: CacheBlendEngine(m, tok, kv_store=RedisStore.from_url(
                f"redis://127.0.0.1:{proxy.port}/0?prefix={c}&codec={c}", socket_timeout=30.0), home=home)
                for c in CODECS}
            # codec=auto measures the link it is given and picks; it writes and reads through the proxy
            auto = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0?prefix=auto&codec=auto",
                                       socket_timeout=30.0)
            picked = auto.codec.name if auto.codec is not None else "fp16"
            writers[AUTO] = readers[AUTO] = CacheBlendEngine(m, tok, kv_store=auto, home=home)
            for i, (question, docs) in enumerate(items):
                for c in REMOTE_ROWS:
                    writers[c].ingest(docs, show_progress=False)
                full = base.prefill(docs, question, method="full_prefill")
                timed = i > 0  # the first question warms every engine up, untimed
                if timed:
                    ttft["recompute (full prefill)"].append(full.stats["ttft_s"])
                for c in REMOTE_ROWS:
                    pre = readers[c].prefill(docs, question, recompute_ratio=ratio)
                    if pre.stats["chunk_misses"]:
                        raise RuntimeError(f"{c}: chunks missed through the proxy: {pre.stats['chunk_misses']}")
                    if timed:
                        ttft[c].append(pre.stats["ttft_s"])
                        kl[c].append(first_token_kl(full.logits, pre.logits))
                        loaded[c].append(int(pre.stats["kv_bytes_loaded"]))
        finally:
            proxy.stop()
            redis_server.stop()
    out = {name: {"ttft_median_s": statistics.median(v)} for name, v in ttft.items()}
    for c in REMOTE_ROWS:
        out[c].update(kl_mean=statistics.fmean(kl[c]), kv_mb_per_request=statistics.fmean(loaded[c]) / 1e6,
                      link_s=statistics.fmean(loaded[c]) * 8 / bits_per_s)
    fastest = min((k for k in out if k != AUTO), key=lambda k: out[k]["ttft_median_s"])
    return {"ratio": ratio, "bits_per_s": bits_per_s, "questions": len(items) - 1, "by_method": out,
            "fastest": fastest, "auto_picked": picked, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def format_shared_tier(cross: dict | None, remote: dict | None) -> str:
    """The two markdown tables."""
    lines = []
    if cross:
        m = cross["medians"]
        lines += [f"Cross-replica TTFT at CacheBlend r={cross['ratio']} ({cross['questions']} questions, medians):", "",
                  "| on replica b | TTFT, engine prefill (s) |", "|---|---:|",
                  f"| chunks from Redis (computed on a; {m['redis_kv_mb']:.1f} MB read) | {m['redis_prefill_s']:.3f} |",
                  f"| chunks from b's memory tier | {m['memory_prefill_s']:.3f} |",
                  f"| Redis / memory | {cross['redis_vs_memory_prefill']:.2f}× |",
                  f"| (a, computing every chunk: cold) | {m['cold_prefill_s']:.3f} |", ""]
    if remote:
        lines += [f"Redis behind a {remote['bits_per_s'] / 1e9:g} Gbit/s paced link, CacheBlend r={remote['ratio']} "
                  f"({remote['questions']} questions, medians); fastest: **{remote['fastest']}**; codec=auto "
                  f"measured the link and picked **{remote['auto_picked']}**", "",
                  "| KV from | TTFT (s) | KV read per request (MB) | its time on the link (s) | first-token KL |",
                  "|---|---:|---:|---:|---:|"]
        for name, row in remote["by_method"].items():
            if "kl_mean" in row:
                lines.append(f"| Redis, {name} | {row['ttft_median_s']:.3f} | {row['kv_mb_per_request']:.2f} | "
                             f"{row['link_s']:.3f} | {row['kl_mean']:.4f} |")
            else:
                lines.append(f"| {name} | {row['ttft_median_s']:.3f} | 0 | 0 | 0 |")
    return "\n".join(lines)
