"""Throughput under load: C client threads replay the questions against one engine.

The engine serves one request at a time (it holds a lock around prefill + decode), so this measures queueing:
queries per minute is bounded by the per-request service time, and the TTFT a client sees under load is its
wait in the queue plus the prefill. Both methods are measured on the same questions, one after the other.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from cacheblend_rag.engine import CacheBlendEngine
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


# ---- over HTTP: the real server, real clients ----------------------------------------------------------------


async def _http_requests(url: str, model: str, requests: list[tuple[list[str], str]], concurrency: int,
                         max_tokens: int, method: str, api_key: str = "bench") -> list[dict]:
    """Send every request (documents, question) from `concurrency` asyncio clients of the openai SDK, streaming;
    one record per request: ttft_s (first content piece), latency_s, status (200, 429 or the error)."""
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=3600)
    pending = list(enumerate(requests))
    records: list[dict] = []

    async def worker() -> None:
        while pending:
            i, (docs, question) = pending.pop(0)
            sent = time.perf_counter()
            record = {"request": i, "ttft_s": None, "status": 200, "tokens": 0}
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"documents": docs, "cacheblend": {"method": method}})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content and record["ttft_s"] is None:
                        record["ttft_s"] = time.perf_counter() - sent
                    if chunk.usage is not None:
                        record["tokens"] = chunk.usage.completion_tokens
            except openai.RateLimitError:
                record["status"] = 429
            except openai.APIError as e:  # counted as failed; the run goes on
                record["status"] = f"{type(e).__name__}: {e}"
            record["latency_s"] = time.perf_counter() - sent
            records.append(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return records


def summarize_http(records: list[dict], wall_s: float) -> dict:
    """Requests/min, p50/p95 TTFT and latency of the completed requests; failed and 429 counts."""
    ok = [r for r in records if r["status"] == 200]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    latency = [r["latency_s"] for r in ok]
    rejected = [r["latency_s"] for r in records if r["status"] == 429]
    return {
        "requests": len(records), "completed": len(ok), "rejected_429": len(rejected),
        "failed": len(records) - len(ok) - len(rejected), "wall_s": wall_s,
        "requests_per_min": 60.0 * len(ok) / wall_s if wall_s else None,
        "ttft_p50_s": percentile(ttft, 0.5) if ttft else None, "ttft_p95_s": percentile(ttft, 0.95) if ttft else None,
        "latency_p50_s": percentile(latency, 0.5) if latency else None,
        "latency_p95_s": percentile(latency, 0.95) if latency else None,
        "max_429_s": max(rejected) if rejected else None,
        "tokens": sum(r["tokens"] for r in ok),
    }


def run_http_load(url: str, model: str, requests: list[tuple[list[str], str]], *, concurrency: int,
                  max_tokens: int = 32, method: str = "cacheblend", api_key: str = "bench") -> dict:
    """Drive a running server: `summarize_http` of every request, plus the records."""
    import asyncio

    started = time.perf_counter()
    records = asyncio.run(_http_requests(url, model, requests, concurrency, max_tokens, method, api_key))
    return {**summarize_http(records, time.perf_counter() - started), "records": records}


def rss_peak_mb(pid: int) -> float | None:
    """Peak resident memory of a process (VmHWM), in MB; None where /proc has no such field."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _server(home, model: str, dtype: str, *args: str):
    """`cacheblend-rag serve` on a free loopback port: a context manager, healthy on entry, SIGTERM on exit."""
    from .replicas import Replica

    return Replica(Path(home), [], "--timeout", "3600", *args, model=model, dtype=dtype, device="auto", name="load")


def run_serve_load(items: list[dict], *, model: str = "smollm2-135m", dtype: str = "auto", num_chunks: int = 6,
                   concurrency: int = 8, num_requests: int = 16, max_tokens: int = 32,
                   methods: tuple[str, ...] = ("cacheblend", "full_prefill"), overload_clients: int = 16,
                   overload_queue: int = 2) -> dict:
    """The server under load over HTTP: continuous batching (--max-batch 8) vs one request at a time
    (--max-batch 1), each method, same requests; then an overload run (more clients than the queue)."""
    import tempfile
    from pathlib import Path

    from cacheblend_rag import settings
    from .datasets import passages_of

    requests = [(passages_of(items[i % len(items)], num_chunks), items[i % len(items)]["question"])
                for i in range(num_requests)]
    out: dict = {"concurrency": concurrency, "requests": num_requests, "max_tokens": max_tokens, "runs": []}
    with tempfile.TemporaryDirectory(prefix="cacheblend-serve-load-") as tmp:
        home = Path(tmp)
        (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
        for label, args in (("batching (max-batch 8)", ("--max-batch", "8")),
                            ("one at a time (max-batch 1)", ("--max-batch", "1"))):
            with _server(home, model, dtype, *args, "--max-queue", str(num_requests)) as server:
                # warm-up: every request's passages stored (the KV tier is on disk under the shared home)
                run_http_load(server.url, model, requests, concurrency=concurrency, max_tokens=1)
                for method in methods:
                    result = run_http_load(server.url, model, requests, concurrency=concurrency,
                                           max_tokens=max_tokens, method=method)
                    out["runs"].append({"server": label, "method": method, **result})
                out.setdefault("rss_peak_mb", {})[label] = rss_peak_mb(server.proc.pid)
        with _server(home, model, dtype, "--max-batch", "2", "--max-queue", str(overload_queue)) as server:
            burst = [requests[i % len(requests)] for i in range(overload_clients)]
            result = run_http_load(server.url, model, burst, concurrency=overload_clients, max_tokens=8)
            out["overload"] = {"clients": overload_clients, "max_queue": overload_queue, "max_batch": 2, **result,
                               "rss_peak_mb": rss_peak_mb(server.proc.pid)}
    return out


def store_mb(url: str) -> dict[str, float]:
    """What the server's stores hold now, in MB, from /metrics: "prefixes" (finished requests' KV kept for the next
    turn) and "chunks" (the chunk KV store's memory tier)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = {"cacheblend_prefix_store_bytes": "prefixes", "cacheblend_kv_store_bytes": "chunks"}
    return {wanted[s.name]: s.value / 2**20 for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in wanted and s.labels.get("tier") == "memory"}


def run_serve_memory(items: list[dict], *, model: str = "smollm2-135m", dtype: str = "auto", num_chats: int = 200,
                     every: int = 25, num_chunks: int = 6, max_tokens: int = 8) -> dict:
    """`cacheblend-rag serve`'s RSS over `num_chats` distinct two-turn chats sent by the openai SDK (documents, a
    question, then a follow-up carrying the first answer): RSS and what its two stores hold (`store_mb`) every
    `every` chats, after one warm-up request."""
    import tempfile

    import openai

    from cacheblend_rag import settings
    from .conversation import distinct_chats
    from .datasets import passages_of
    from .faults import rss_bytes

    chats = distinct_chats(items, num_chats, num_chunks)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cacheblend-serve-memory-") as tmp:
        home = Path(tmp)
        (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
        with _server(home, model, dtype) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="bench", max_retries=0, timeout=3600)

            def sample(chats: int | str) -> dict:
                return {"chats": chats, "rss_mb": rss_bytes(server.proc.pid) / 2**20, **store_mb(server.url)}

            rows.append(sample(0))
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=2)
            rows.append(sample("warm-up"))
            for n, chat in enumerate(tqdm(chats, desc="conversations", unit="chat"), start=1):
                docs = passages_of(chat, num_chunks)
                messages = [{"role": "user", "content": chat["question"]}]
                first = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                       extra_body={"documents": docs})
                messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                             {"role": "user", "content": "Say it in one sentence."}]
                client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               extra_body={"documents": docs})
                if n % every == 0 or n == len(chats):
                    rows.append(sample(n))
            peak = rss_peak_mb(server.proc.pid)
    return {"chats": len(chats), "max_tokens": max_tokens, "num_chunks": num_chunks, "rows": rows,
            "rss_peak_mb": peak}


def format_serve_memory(result: dict) -> str:
    """The memory table of `run_serve_memory`."""
    def mb(value: float | None) -> str:
        return "–" if value is None else f"{value:.0f}"

    lines = ["| chats | server RSS MB | stored prefixes MB | chunk KV in memory MB |", "|---|---:|---:|---:|"]
    lines += [f"| {r['chats']} | {mb(r['rss_mb'])} | {mb(r.get('prefixes'))} | {mb(r.get('chunks'))} |"
              for r in result["rows"]]
    return "\n".join(lines + ["", f"server RSS peak {mb(result['rss_peak_mb'])} MB"])


def format_serve_load(result: dict) -> str:
    """Markdown tables of a `run_serve_load` result."""
    def f(x, unit="s"):
        return "–" if x is None else f"{x:.1f}{unit}" if unit else f"{x:.1f}"

    lines = ["| server | method | completed | failed | requests/min | TTFT p50 | TTFT p95 | latency p50 | latency p95 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['server']} | {r['method']} | {r['completed']}/{r['requests']} | {r['failed']} | "
                     f"{f(r['requests_per_min'], '')} | {f(r['ttft_p50_s'])} | {f(r['ttft_p95_s'])} | "
                     f"{f(r['latency_p50_s'])} | {f(r['latency_p95_s'])} |")
    o = result.get("overload")
    if o:
        lines += ["", f"overload: {o['clients']} clients at once, --max-queue {o['max_queue']} --max-batch "
                  f"{o['max_batch']}: {o['completed']} completed, {o['rejected_429']} got 429 (slowest 429 after "
                  f"{f(o['max_429_s'])}), {o['failed']} failed; server RSS peak {f(o['rss_peak_mb'], ' MB')}"]
    rss = result.get("rss_peak_mb") or {}
    if rss:
        lines.append("server RSS peak: " + ", ".join(f"{k} {f(v, ' MB')}" for k, v in rss.items()))
    return "\n".join(lines)
