"""Prometheus metrics of one server, in their own registry (several apps in one process never collide)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


def tier_stats(stats: dict) -> dict[str, dict]:
    """Each tier's counters by tier name, from a store's `stats()` (a chain lists its tiers under "tiers")."""
    names = stats.get("tiers")
    if isinstance(names, list):
        return {name: stats[name] for name in names if isinstance(stats.get(name), dict)}
    return {str(stats.get("tier", "store")): stats}


class StoreCollector(Collector):
    """The KV store's own counters, read from its `stats()` at every scrape (a tier lacking a counter has none)."""

    _COUNTERS = (("errors", "cacheblend_kv_store_errors", "Calls to a KV tier that failed (down, timed out, refused)"),
                 ("outages", "cacheblend_kv_store_outages", "Times a KV tier became unavailable"),
                 ("failovers", "cacheblend_kv_store_failovers",
                  "Times a Redis Cluster tier's set of masters changed (a failover), as this process saw it"),
                 ("corrupt", "cacheblend_kv_store_corrupt", "Stored KV values that failed validation (then deleted)"),
                 ("skipped", "cacheblend_kv_store_skipped",
                  "Calls to an unavailable KV tier not tried (waiting before trying again)"),
                 ("hits", "cacheblend_kv_store_hits", "Entries found, by tier"),
                 ("misses", "cacheblend_kv_store_misses", "Entries not found, by tier"),
                 ("bytes_read", "cacheblend_kv_store_read_bytes", "Bytes of KV read from a tier"),
                 ("bytes_written", "cacheblend_kv_store_written_bytes", "Bytes of KV written to a tier"))

    def __init__(self, store_stats: Callable[[], dict]) -> None:
        self.store_stats = store_stats

    def collect(self) -> Iterator[Metric]:
        """One sample per tier and counter the tier reports."""
        try:
            tiers = tier_stats(self.store_stats())
        except Exception:  # noqa: BLE001 - a scrape must answer even if a store's stats fail
            logger.exception("could not read the KV store's stats")
            return
        for field, name, doc in self._COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, counts in tiers.items():
                if isinstance(counts.get(field), (int, float)):
                    family.add_metric([tier], counts[field])
            yield family
        available = GaugeMetricFamily("cacheblend_kv_store_available", "1 while a tier answers, 0 in an outage",
                                      labels=["tier"])
        for tier, counts in tiers.items():
            if isinstance(counts.get("available"), bool):
                available.add_metric([tier], 1.0 if counts["available"] else 0.0)
        yield available

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the tiers are known only at scrape time."""
        return iter(())


class OccupancyCollector(Collector):
    """What a store holds now, bytes and entries per tier, read from its `stats()` at every scrape: gauges named
    `<prefix>_bytes` and `<prefix>_entries` (a tier that does not count them has no sample)."""

    def __init__(self, prefix: str, what: str, store_stats: Callable[[], dict]) -> None:
        self.prefix, self.what, self.store_stats = prefix, what, store_stats

    def collect(self) -> Iterator[Metric]:
        """One sample per tier and gauge the tier reports."""
        try:
            tiers = tier_stats(self.store_stats())
        except Exception:  # noqa: BLE001 - a scrape must answer even if a store's stats fail
            logger.exception("could not read the stats of %s", self.what)
            return
        for field, doc in (("bytes", f"Bytes {self.what} holds now, by tier"),
                           ("entries", f"Entries {self.what} holds now, by tier")):
            family = GaugeMetricFamily(f"{self.prefix}_{field}", doc, labels=["tier"])
            for tier, counts in tiers.items():
                if isinstance(counts.get(field), int):
                    family.add_metric([tier], counts[field])
            yield family

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the tiers are known only at scrape time."""
        return iter(())


class CountCollector(Collector):
    """One counter read from a callback at every scrape (a count kept by the engine, not by the server)."""

    def __init__(self, name: str, doc: str, count: Callable[[], int]) -> None:
        self.name, self.doc, self.count = name, doc, count

    def collect(self) -> Iterator[Metric]:
        """The counter's one sample."""
        yield CounterMetricFamily(self.name, self.doc, value=self.count())

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the value is read at scrape time."""
        return iter(())


class ServerMetrics:
    """Counters, histograms and gauges of the server; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], int], batch_size: Callable[[], int],
                 store_stats: Callable[[], dict] | None = None,
                 grammar_compilations: Callable[[], int] | None = None,
                 prefix_store_stats: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("cacheblend_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("cacheblend_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("cacheblend_cached_prompt_tokens",
                                     "Prompt tokens whose KV came from the cache", registry=r)
        self.completion_tokens = Counter("cacheblend_completion_tokens", "Generated tokens", registry=r)
        self.kv_hits = Counter("cacheblend_kv_chunk_hits", "Chunks whose KV was found in the store", registry=r)
        self.kv_misses = Counter("cacheblend_kv_chunk_misses", "Chunks whose KV had to be computed", registry=r)
        self.ttft = Histogram("cacheblend_time_to_first_token_seconds",
                              "From the request's arrival to its first token (queueing included)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("cacheblend_prefill_seconds", "The engine's fused prefill (its TTFT)",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_per_token = Histogram("cacheblend_time_per_output_token_seconds",
                                          "Decode time per generated token after the first",
                                          buckets=_PER_TOKEN_BUCKETS, registry=r)
        self.latency = Histogram("cacheblend_request_latency_seconds", "From arrival to the last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("cacheblend_queue_depth", "Requests waiting for the engine", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.batch_size = Gauge("cacheblend_batch_size", "Sequences the engine is working on now", registry=r)
        self.batch_size.set_function(batch_size)
        # Python's cyclic GC: collections per generation, and the objects `serve` froze out of it at startup (the
        # model's and libraries'; a full collection over them held the GIL ~250 ms: serve/command.py)
        GCCollector(registry=r)
        self.gc_frozen = Gauge("cacheblend_gc_frozen_objects",
                               "Objects frozen out of Python's cyclic GC at startup (gc.freeze)", registry=r)
        self.gc_frozen.set_function(gc.get_freeze_count)
        if store_stats is not None:
            r.register(StoreCollector(store_stats))
            r.register(OccupancyCollector("cacheblend_kv_store", "the chunk KV store", store_stats))
        if prefix_store_stats is not None:  # finished requests' KV kept for the next turn (engine.prefix_store)
            r.register(OccupancyCollector("cacheblend_prefix_store", "the stored-prefix store", prefix_store_stats))
        if grammar_compilations is not None:
            r.register(CountCollector("cacheblend_grammar_compilations",
                                      "Grammars (schemas, tools) compiled; a grammar seen again is not compiled again",
                                      grammar_compilations))

    def observe_finished(self, usage: dict, stats: dict, ttft_s: float | None, latency_s: float) -> None:
        """Record one request that produced an answer."""
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])
        self.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])
        self.kv_hits.inc(len(stats.get("chunk_hits", ())))
        self.kv_misses.inc(len(stats.get("chunk_misses", ())))
        if "ttft_s" in stats:
            self.prefill.observe(stats["ttft_s"])
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.latency.observe(latency_s)
        decode_s = stats.get("timing", {}).get("decode_s")
        generated = stats.get("num_generated", 0)
        if decode_s is not None and generated > 1:
            self.decode_per_token.observe(decode_s / generated)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
