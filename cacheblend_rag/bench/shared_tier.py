"""Shared Redis tier timings (`cacheblend-rag bench --shared-tier`):

1. Cross-replica TTFT: replicas a and b (memory → one Redis); per question a answers first (computing and storing
   the chunks), then b twice: its first answer reads the chunks from Redis, its second from its own memory tier
   (promoted there). The ratio of b's TTFT on the Redis hit to the memory hit, at CacheBlend r.
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

from .faults import ask
from .replicas import ProxyProcess, RedisServer, Replica

CODECS = ("fp16", "int8", "cachegen")


def cross_replica(items: list[tuple[str, list[str]]], *, model: str, home: str | None, ratio: float = 0.15,
                  max_tokens: int = 1) -> dict:
    """b's TTFT on a Redis hit vs a memory hit (medians over the questions; the engine's prefill and the request's
    time to first token)."""
    from .. import settings
    from ..models.loader import model_folder

    model_folder(model, home)
    extra = {"cacheblend": {"method": "cacheblend", "recompute_ratio": ratio}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="cacheblend-xreplica-") as tmp:
        redis_server = RedisServer(Path(tmp)).start()
        replicas = []
        try:
            for name in ("a", "b"):
                rhome = Path(tmp) / f"home-{name}"
                rhome.mkdir()
                (rhome / "models").symlink_to(settings.models_dir(home), target_is_directory=True)
                replicas.append(Replica(rhome, ["memory", redis_server.url], model=model, name=name))
            a, b = (r.wait_ready() for r in replicas)
            warm_q, warm_docs = items[0]  # untimed: first-request costs (threads, allocator) on both replicas
            for replica in (a, b, b):
                ask(replica.url, warm_q, warm_docs, max_tokens, model, extra=extra)
            for question, docs in items[1:]:
                cold = ask(a.url, question, docs, max_tokens, model, extra=extra)["usage"]["cacheblend"]
                remote = ask(b.url, question, docs, max_tokens, model, extra=extra)["usage"]["cacheblend"]
                local = ask(b.url, question, docs, max_tokens, model, extra=extra)["usage"]["cacheblend"]
                if remote["chunk_misses"] or local["chunk_misses"]:
                    raise RuntimeError(f"b missed chunks a had stored: {remote['miss_ids']} / {local['miss_ids']}")
                rows.append({"cold_prefill_s": cold["prefill_s"], "redis_prefill_s": remote["prefill_s"],
                             "memory_prefill_s": local["prefill_s"], "redis_ttft_s": remote["ttft_s"],
                             "memory_ttft_s": local["ttft_s"], "chunks": remote["chunk_hits"]})
        finally:
            for replica in replicas:
                replica.kill9()
            redis_server.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "chunks"}
    return {"ratio": ratio, "questions": len(rows), "medians": med,
            "redis_vs_memory_prefill": med["redis_prefill_s"] / med["memory_prefill_s"],
            "redis_vs_memory_ttft": med["redis_ttft_s"] / med["memory_ttft_s"], "rows": rows}


def remote_codecs(items: list[tuple[str, list[str]]], *, model: str, home: str | None, ratio: float = 0.15,
                  bits_per_s: float = 1e9, device: str = "cpu", dtype: str = "float32") -> dict:
    """TTFT per codec with Redis behind a paced link, against recompute; medians over the questions."""
    from ..engine import CacheBlendEngine
    from ..store.redis import RedisStore
    from .metrics import first_token_kl

    base = CacheBlendEngine.from_pretrained(model, kv_store=None, device=device, dtype=dtype, home=home)
    m, tok = base.model, base.tokenizer
    ttft: dict[str, list[float]] = {c: [] for c in CODECS}
    ttft["recompute (full prefill)"] = []
    kl: dict[str, list[float]] = {c: [] for c in CODECS}
    loaded: dict[str, list[int]] = {c: [] for c in CODECS}
    with tempfile.TemporaryDirectory(prefix="cacheblend-remote-") as tmp:
        redis_server = RedisServer(Path(tmp)).start()
        proxy = ProxyProcess(redis_server.port, bits_per_s)
        try:
            writers = {c: CacheBlendEngine(m, tok, kv_store=RedisStore.from_url(
                f"{redis_server.url}?prefix={c}&codec={c}"), home=home) for c in CODECS}
            readers = {c: CacheBlendEngine(m, tok, kv_store=RedisStore.from_url(
                f"redis://127.0.0.1:{proxy.port}/0?prefix={c}&codec={c}", socket_timeout=30.0), home=home)
                for c in CODECS}
            for i, (question, docs) in enumerate(items):
                ids = None
                for c in CODECS:
                    ids = writers[c].ingest(docs, show_progress=False)
                full = base.prefill(ids, question, method="full_prefill")
                timed = i > 0  # the first question warms every engine up, untimed
                if timed:
                    ttft["recompute (full prefill)"].append(full.stats["ttft_s"])
                for c in CODECS:
                    pre = readers[c].prefill(ids, question, recompute_ratio=ratio)
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
    for c in CODECS:
        out[c].update(kl_mean=statistics.fmean(kl[c]), kv_mb_per_request=statistics.fmean(loaded[c]) / 1e6,
                      link_s=statistics.fmean(loaded[c]) * 8 / bits_per_s)
    fastest = min(out, key=lambda k: out[k]["ttft_median_s"])
    return {"ratio": ratio, "bits_per_s": bits_per_s, "questions": len(items) - 1, "by_method": out,
            "fastest": fastest, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def format_shared_tier(cross: dict | None, remote: dict | None) -> str:
    """The two markdown tables."""
    lines = []
    if cross:
        m = cross["medians"]
        lines += [f"Cross-replica TTFT at CacheBlend r={cross['ratio']} ({cross['questions']} questions, medians):", "",
                  "| on replica b | engine prefill (s) | request TTFT (s) |", "|---|---:|---:|",
                  f"| chunks from Redis (computed on a) | {m['redis_prefill_s']:.3f} | {m['redis_ttft_s']:.3f} |",
                  f"| chunks from b's memory tier | {m['memory_prefill_s']:.3f} | {m['memory_ttft_s']:.3f} |",
                  f"| Redis / memory | {cross['redis_vs_memory_prefill']:.2f}× | {cross['redis_vs_memory_ttft']:.2f}× |",
                  f"| (a, computing every chunk: cold) | {m['cold_prefill_s']:.3f} | — |", ""]
    if remote:
        lines += [f"Redis behind a {remote['bits_per_s'] / 1e9:g} Gbit/s paced link, CacheBlend r={remote['ratio']} "
                  f"({remote['questions']} questions, medians); fastest: **{remote['fastest']}**", "",
                  "| KV from | TTFT (s) | KV read per request (MB) | its time on the link (s) | first-token KL |",
                  "|---|---:|---:|---:|---:|"]
        for name, row in remote["by_method"].items():
            if "kl_mean" in row:
                lines.append(f"| Redis, {name} | {row['ttft_median_s']:.3f} | {row['kv_mb_per_request']:.2f} | "
                             f"{row['link_s']:.3f} | {row['kl_mean']:.4f} |")
            else:
                lines.append(f"| {name} | {row['ttft_median_s']:.3f} | 0 | 0 | 0 |")
    return "\n".join(lines)
