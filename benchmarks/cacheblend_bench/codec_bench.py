"""KV codecs on real KV: size, error, speed and first-token KL (`cacheblend-bench codecs`).

Not a timed test: timings depend on the machine's load. The KL part stores each chunk's KV passed
through a codec (encode, decode to the engine's dtype) and compares a CacheBlend prefill over it
with a full prefill, as the loading benchmark does.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cacheblend_rag.store import KVKey
from cacheblend_rag.store.base import ChunkKV
from cacheblend_rag.store.codecs import decode_chunk, encode_chunk, get_codec, layer_nbytes

from .codec_measure import GROUP_SPEED_HEADER, MEASUREMENT_HEADER, measure_codec
from .datasets import load_dataset, passages_of, resolve_dataset
from .metrics import first_token_kl, percentile, token_f1

logger = logging.getLogger(__name__)

# (name, params): the defaults, then a size-quality sweep over bits per layer group and anchor group size.
DEFAULT_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("fp16", {}),
    ("int8", {}),
    ("int8", {"key_axis": "channel", "value_axis": "token"}),
    ("int8", {"key_axis": "channel", "value_axis": "channel"}),
    ("cachegen", {}),
    ("cachegen", {"key_bits": "8,6,5", "value_bits": "6,5,4"}),
    ("cachegen", {"key_bits": "6,5,5", "value_bits": "6,5,4"}),
    ("cachegen", {"key_bits": "6,5,5", "value_bits": "5,4,4"}),
    ("cachegen", {"key_bits": "6,5,4", "value_bits": "5,4,3"}),
    ("cachegen", {"key_bits": "5,4,4", "value_bits": "5,4,4"}),
    # LMCache's scheme: per-token absmax, 32 bins (5 bits) for the shallow third of the keys, 16 (4 bits) deeper;
    # values 32 bins for the first 2 layers only (here: the shallow third), 16 after
    ("cachegen", {"key_bits": "5,4,4", "value_bits": "5,4,4", "key_axis": "token", "value_axis": "token"}),
    ("cachegen", {"value_axis": "token"}),
    ("cachegen", {"key_bits": "6,4,3", "value_bits": "5,3,3"}),
    ("cachegen", {"key_bits": "5,4,3", "value_bits": "4,3,3"}),
    ("cachegen", {"key_bits": "4,3,3", "value_bits": "4,3,3"}),
    ("cachegen", {"group_size": 10}),
    ("cachegen", {"group_size": 64}),
    # the default before issue 16's sweep (keys' error dominated the KL: 4-bit middle/deep keys)
    ("cachegen", {"key_bits": "6,4,4", "value_bits": "4,3,3"}),
    # half-bit widths near 5x (the default is 5.5,4.5,4.5 + 3.5,3,3): bits moved from the values to the keys
    ("cachegen", {"key_bits": "5,5,4", "value_bits": "4,3,3"}),
    ("cachegen", {"key_bits": "5.5,5,4", "value_bits": "3.5,3,3"}),
    ("cachegen", {"key_bits": "5,5,4.5", "value_bits": "3.5,3,3"}),
    ("cachegen", {"key_bits": "5.5,5,4.5", "value_bits": "3.5,3,2.5"}),
    ("cachegen", {"key_bits": "5,5,5", "value_bits": "3.5,3,2.5"}),
    ("cachegen", {"key_bits": "5.5,5,5", "value_bits": "3.5,2.5,2.5"}),
]


def chunk_kvs(engine, texts: list[str]) -> list[ChunkKV]:
    """The stored KV of each text, ingesting it first (in the engine's dtype, on CPU)."""
    ids = engine.ingest(texts, show_progress=False)
    out = []
    for cid in ids:
        kv = engine.kv_store.get(KVKey(engine.namespace, cid))
        if kv is None:
            raise RuntimeError(f"chunk {cid} was ingested but its KV is not in the store (is the budget too small?)")
        out.append(kv.to("cpu"))
    return out


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """'cachegen:key_bits=6,5,5;value_bits=5,4,4' -> ('cachegen', {'key_bits': '6,5,5', 'value_bits': '5,4,4'})."""
    name, _, rest = text.partition(":")
    params = dict(item.split("=", 1) for item in rest.split(";") if item)
    get_codec(name, **params)  # fail early on a bad setting
    return name, params


def setting_label(name: str, params: dict[str, Any]) -> str:
    """A short label: 'cachegen K6,5,5 V5,4,4 g0 ch/ch'."""
    if not params:
        return name
    return f"{name} " + " ".join(f"{k}={v}" for k, v in params.items())


@dataclass
class _RoundTrip:
    kv: ChunkKV
    nbytes: int
    num_tokens: int


def _round_trip(codec, kv: ChunkKV, dtype: torch.dtype, *, with_bytes: bool) -> _RoundTrip:
    """`kv` through `codec` (encode, decode to `dtype`) and its stored bytes; without bytes, a codec's lossless-free
    `reconstruct_layer` (cachegen's quantization without the range coder, bit-identical) is used when it has one."""
    reconstruct = getattr(codec, "reconstruct_layer", None)
    if with_bytes or reconstruct is None:
        layers = encode_chunk(codec, kv)
        return _RoundTrip(decode_chunk(codec, layers, kv, dtype), sum(layer_nbytes(t) for t in layers), kv.num_tokens)
    pairs = [reconstruct(k, v, i, kv.num_layers, dtype) for i, (k, v) in enumerate(zip(kv.keys, kv.values))]
    out = ChunkKV(tuple(k for k, _ in pairs), tuple(v for _, v in pairs), kv.token_ids, kv.positions_start)
    return _RoundTrip(out, 0, kv.num_tokens)


def codec_quality(engine, items: list[dict], settings: list[tuple[str, dict[str, Any]]], *, num_chunks: int = 6,
                  recompute_ratio: float = 0.15, max_new_tokens: int = 32,
                  on_question=None, with_bytes: bool = True,
                  reuse_dir: str | Path | None = None, code_segments: bool = True) -> dict[str, dict[str, list[float]]]:
    """Per setting and question: first-token KL(full prefill ‖ cacheblend over codec-round-tripped KV), greedy
    answer agreement (token F1 with the full prefill's answer), first-token match, stored bytes per token, and
    "kl_none": KL(cacheblend over the uncoded KV ‖ cacheblend over the coded KV), the codec's own distortion
    (KL vs full prefill moves up or down by ±0.03 per question under tiny KV changes; this one does not).

    "none" is the engine's own KV (no store round trip); put ("fp16", {}) in `settings` for the baseline store.
    With `reuse_dir`, each question's chunk KV and full-prefill answer are kept there and read back by later runs
    (the chunks' prefill and the full prefill dominate a question's cost; a setting costs one CacheBlend pass).
    With `code_segments` (the default since issue 30), the exact segments in the store (the lead-in every chunk is
    computed behind, whose first row is the attention sink) go through the codec too, as in a store built with
    `kv_codec=`; before, only the chunks did, which hid the sink's error. (Chunks are still computed behind the exact
    lead-in: a coded store computes them behind its decoded one.)
    """
    out: dict[str, dict[str, list[float]]] = {}
    dtype = engine.adapter.dtype
    for item in items:
        texts = passages_of(item, num_chunks)
        keys, originals, full = _question_state(engine, item, texts, max_new_tokens, reuse_dir)
        if code_segments:  # the lead-in segment(s) the store holds, coded like the chunks
            segs = [k for k in engine.kv_store.keys() if k.chunk_id.startswith("seg-")]
            if not segs:  # the first request computes and stores the lead-in
                engine.prefill(texts, item["question"], method="cacheblend", recompute_ratio=recompute_ratio)
                segs = [k for k in engine.kv_store.keys() if k.chunk_id.startswith("seg-")]
            keys, originals = keys + segs, originals + [engine.kv_store.get(k) for k in segs]
        uncoded = None
        for name, params in [("none", {})] + settings:
            nbytes = tokens = 0
            for key, kv in zip(keys, originals):
                if name != "none":
                    codec = get_codec(name, **params)
                    kv = _round_trip(codec, kv, dtype, with_bytes=with_bytes)
                    nbytes += kv.nbytes if with_bytes else 0
                    tokens += kv.num_tokens
                    kv = kv.kv.to(engine.adapter.device)
                engine.kv_store.put(key, kv)
            gen = engine.generate(texts, item["question"], method="cacheblend", recompute_ratio=recompute_ratio,
                                  max_new_tokens=max_new_tokens)
            if code_segments and name != "none" and not gen.stats.chunk_hits:
                raise RuntimeError("codec bench: the coded KV was not used (no chunk hits)")
            uncoded = gen if uncoded is None else uncoded  # "none" runs first
            rec = out.setdefault(setting_label(name, params), {"kl": [], "agreement": [], "match": [], "bpt": [],
                                                               "kl_none": [], "question": [], "text": []})
            rec["kl"].append(max(0.0, first_token_kl(full.logits, gen.logits)))
            rec["kl_none"].append(max(0.0, first_token_kl(uncoded.logits, gen.logits)))
            rec["agreement"].append(token_f1(gen.text, full.text))
            rec["match"].append(float(int(gen.logits.argmax()) == int(full.logits.argmax())))
            rec["bpt"].append(nbytes / tokens if tokens and nbytes else float("nan"))
            rec["question"].append(float(item.get("_index", -1)))
            rec["text"].append(gen.text)
        for key, kv in zip(keys, originals):
            engine.kv_store.put(key, kv)
        if on_question is not None:  # e.g. print the table so far: a long run still leaves figures if stopped
            on_question(len(next(iter(out.values()))["kl"]), out)
    return out


@dataclass
class _Answer:
    text: str
    logits: torch.Tensor


def _question_state(engine, item: dict, texts: list[str], max_new_tokens: int, reuse_dir: str | Path | None):
    """(store keys, chunk KVs, full-prefill answer) of one question: computed, or read from `reuse_dir`."""
    from cacheblend_rag.ingest.chunks import make_chunk

    path = None
    if reuse_dir is not None:
        tag = f"{item.get('_index', item['question'][:20])}-{len(texts)}-{engine.adapter.dtype}-{max_new_tokens}"
        path = Path(reuse_dir) / f"q{''.join(c if c.isalnum() or c in '-_' else '_' for c in tag)}.pt"
        if path.is_file():
            saved = torch.load(path, weights_only=False)
            keys = [KVKey(engine.namespace, make_chunk(t, engine.tokenizer).chunk_id) for t in texts]
            for key, kv in zip(keys, saved["kvs"]):
                engine.kv_store.put(key, kv.to(engine.adapter.device))
            return keys, saved["kvs"], _Answer(saved["text"], saved["logits"])
    ids = engine.ingest(texts, show_progress=False)
    keys = [KVKey(engine.namespace, cid) for cid in ids]
    originals = [engine.kv_store.get(k) for k in keys]
    full = engine.generate(texts, item["question"], method="full_prefill", max_new_tokens=max_new_tokens)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"kvs": [kv.to("cpu") for kv in originals], "text": full.text, "logits": full.logits.cpu()}, path)
    return keys, originals, _Answer(full.text, full.logits)


def _engine_over(engine, store):
    """An engine on the same model whose KV lives in `store` (a throwaway, for one measurement)."""
    return type(engine)(engine.model, engine.tokenizer, kv_store=store, lead_in=engine.lead_in,
                        template=engine.template)


def make_trace(items: list[dict], num_requests: int, k: int, num_chunks: int = 6,
               seed: int = 0) -> list[tuple[list[str], str]]:
    """`num_requests` seeded requests: a random question of `items`, with a random k-subset of its passages."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        item = rng.choice(items)
        passages = passages_of(item, num_chunks)
        out.append((rng.sample(passages, min(k, len(passages))), item["question"]))
    return out


def trace_loop(engine, trace: list[tuple[list[str], str]], codecs: list[str], *, budget_fraction: float = 0.25,
               recompute_ratio: float = 0.15) -> dict[str, dict[str, float]]:
    """Per codec: a memory tier whose byte budget holds `budget_fraction` of the trace's distinct chunks in fp16,
    the trace replayed through cacheblend; chunk hit rate, median and mean TTFT, entries held at the end."""
    from cacheblend_rag.store import MemoryStore

    distinct = sorted({t for texts, _ in trace for t in texts})
    tokens = sum(len(engine.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in distinct)
    a = engine.adapter
    fp16_per_token = 2 * 2 * a.num_layers * a.num_kv_heads * a.head_dim
    budget = int(budget_fraction * tokens * fp16_per_token)
    out: dict[str, dict[str, float]] = {}
    for name in codecs:
        store = MemoryStore(budget, codec=name)
        eng = _engine_over(engine, store)
        ttfts, hits, total = [], 0, 0
        for texts, question in trace:
            pre = eng.prefill(texts, question, method="cacheblend", recompute_ratio=recompute_ratio)
            ttfts.append(pre.stats["ttft_s"])
            hits += len(pre.stats["chunk_hits"])
            total += len(texts)
        st = store.stats()
        out[name] = {"hit_rate": hits / total, "ttft_median_s": statistics.median(ttfts),
                     "ttft_mean_s": statistics.fmean(ttfts), "entries": st["entries"], "distinct": len(distinct),
                     "budget_mb": budget / 1e6}
        logger.info("trace %s: %s", name, out[name])
    return out


def bandwidth_loop(engine, items: list[dict], codecs: list[str], bandwidths: list[float | None], *,
                   num_chunks: int = 6, recompute_ratio: float = 0.15,
                   disk_root: str | Path | None = None) -> dict[str, dict[str, float]]:
    """Median TTFT of cacheblend over a remote tier at each bandwidth (bytes/s; None: in-process memory) per codec,
    every chunk a hit; with `disk_root`, also from a disk tier whose page cache is dropped before each request; and
    of recomputing everything (full prefill) for reference. Per tier, "load share" is the median of the loop's KV
    reading and decoding time over the rest of its layer time (what the issue's "≤ 10% of the layer" means)."""
    from cacheblend_rag.store import DiskStore, MemoryStore
    from cacheblend_rag.store.probe import drop_page_cache
    from cacheblend_rag.store.throttled import ThrottledStore

    out: dict[str, dict[str, float]] = {}
    plain = MemoryStore(None)
    filler = _engine_over(engine, plain)  # computes every chunk's KV once; each codec's tier gets a coded copy
    for item in items:
        filler.ingest(passages_of(item, num_chunks), show_progress=False)
        filler.prefill(passages_of(item, num_chunks), item["question"], method="full_reuse")  # the lead-in too
    for name in codecs:
        base = MemoryStore(None, codec=name)
        for key in plain.keys():
            base.put(key, plain.get(key))
        tiers: list[tuple[str, Any, Path | None]] = [
            (_bw_label(bw), base if bw is None else ThrottledStore(base, bw), None) for bw in bandwidths]
        if disk_root is not None:
            folder = Path(disk_root) / name
            disk = DiskStore(folder, codec=name)
            for key in plain.keys():
                disk.put(key, plain.get(key))
            tiers.append(("disk, cold", disk, folder))
        for label, store, folder in tiers:
            eng = _engine_over(engine, store)
            ttfts, loaded, shares = [], [], []
            for item in items:
                if folder is not None:  # layers come from the device, not from RAM
                    drop_page_cache(p for p in folder.rglob("*") if p.is_file())
                pre = eng.prefill(passages_of(item, num_chunks), item["question"], method="cacheblend",
                                  recompute_ratio=recompute_ratio)
                if pre.stats["chunk_misses"]:
                    raise RuntimeError(f"bandwidth bench: unexpected misses {pre.stats['chunk_misses']}")
                timing = pre.stats["timing"]
                ttfts.append(pre.stats["ttft_s"])
                loaded.append(pre.stats["kv_bytes_loaded"])
                shares.append(timing["kv_load_s"] / max(timing["layers_s"] - timing["kv_load_s"], 1e-9))
            out.setdefault(name, {})[label] = statistics.median(ttfts)
            out[name][f"load share, {label}"] = statistics.median(shares)
            out[name]["MB loaded"] = statistics.fmean(loaded) / 1e6
            logger.info("bandwidth %s %s: %.3f s, load share %.3f", name, label, statistics.median(ttfts),
                        statistics.median(shares))
    eng = _engine_over(engine, plain)
    full = [eng.prefill(passages_of(item, num_chunks), item["question"], method="full_prefill").stats["ttft_s"]
            for item in items]
    labels = [_bw_label(bw) for bw in bandwidths] + (["disk, cold"] if disk_root is not None else [])
    out["recompute (full prefill)"] = {label: statistics.median(full) for label in labels}
    out["recompute (full prefill)"]["MB loaded"] = 0.0
    return out


def _bw_label(bw: float | None) -> str:
    if bw is None:
        return "memory"
    return f"{bw * 8 / 1e9:g} Gbit/s" if bw * 8 >= 1e9 else f"{bw * 8 / 1e6:g} Mbit/s"


QUALITY_HEADER = ("| KV passed through | B/token | vs fp16 | mean KL | Δ KL vs fp16 store | KL vs uncoded | "
                  "agreement F1 | Δ agreement | first-token match |\n|---|---|---|---|---|---|---|---|---|")


def quality_rows(results: dict[str, dict[str, list[float]]], baseline: str = "fp16") -> list[str]:
    """Markdown rows of codec_quality's results, deltas against the `baseline` setting."""
    base = results.get(baseline)
    base_kl = statistics.fmean(base["kl"]) if base else float("nan")
    base_ag = statistics.fmean(base["agreement"]) if base else float("nan")
    base_bpt = statistics.fmean(base["bpt"]) if base else float("nan")
    rows = []
    for label, r in results.items():
        kl, ag, bpt = statistics.fmean(r["kl"]), statistics.fmean(r["agreement"]), statistics.fmean(r["bpt"])
        ratio = f"{base_bpt / bpt:.2f}×" if bpt == bpt else "—"
        kl_none = statistics.fmean(r["kl_none"]) if r.get("kl_none") else float("nan")  # older JSON lacks it
        rows.append(f"| {label} | {bpt:,.0f} | {ratio} | {kl:.4f} | {kl - base_kl:+.4f} | {kl_none:.4f} | "
                    f"{ag:.3f} | {ag - base_ag:+.3f} | {statistics.fmean(r['match']):.2f} |")
    return rows


# The dev set split in two (issue 30): a default is chosen on one half and confirmed on the other.
HALVES = {"choose": (0, 25), "report": (25, 50)}

TAIL_HEADER = ("| KV passed through | vs fp16 | Δ KL mean | median | p90 | max (question) | KL vs uncoded p90 | "
               "agreement F1 | Δ agreement | F1 vs fp16 store's answer |\n|---|---|---|---|---|---|---|---|---|---|")


def tail_stats(results: dict[str, dict[str, list]], baseline: str = "fp16") -> dict[str, dict[str, float]]:
    """Per setting: the distribution over questions of ΔKL (its first-token KL minus the `baseline` store's on the
    same question): mean, median, p90 (nearest rank), max and the question it came from; the p90 of KL vs uncoded
    (the codec's own distortion: ΔKL moves by ±0.05 on a question whose CacheBlend KL is high under any small KV
    change, this does not); mean agreement F1 with the full prefill and its Δ against the baseline's; mean F1 of its
    answer against the baseline store's answer."""
    base = results[baseline]
    out = {}
    for label, r in results.items():
        deltas = [kl - b for kl, b in zip(r["kl"], base["kl"])]
        worst = max(range(len(deltas)), key=deltas.__getitem__)
        questions = r.get("question") or [float("nan")] * len(deltas)
        texts, base_texts = r.get("text"), base.get("text")
        vs_base = (statistics.fmean(token_f1(t, b) for t, b in zip(texts, base_texts))
                   if texts and base_texts else float("nan"))
        bpt, base_bpt = statistics.fmean(r["bpt"]), statistics.fmean(base["bpt"])
        none_p90 = percentile(r["kl_none"], 0.9) if r.get("kl_none") else float("nan")  # older JSON lacks it
        out[label] = {"none_p90": none_p90, "ratio": base_bpt / bpt if bpt == bpt else float("nan"), "mean": statistics.fmean(deltas),
                      "median": statistics.median(deltas), "p90": percentile(deltas, 0.9), "max": deltas[worst],
                      "worst_question": questions[worst], "agreement": statistics.fmean(r["agreement"]),
                      "d_agreement": statistics.fmean(r["agreement"]) - statistics.fmean(base["agreement"]),
                      "f1_vs_base": vs_base}
    return out


def tail_rows(results: dict[str, dict[str, list]], baseline: str = "fp16") -> list[str]:
    """Markdown rows of tail_stats (see TAIL_HEADER)."""
    rows = []
    for label, t in tail_stats(results, baseline).items():
        ratio = f"{t['ratio']:.2f}×" if t["ratio"] == t["ratio"] else "—"
        rows.append(f"| {label} | {ratio} | {t['mean']:+.4f} | {t['median']:+.4f} | {t['p90']:+.4f} | "
                    f"{t['max']:+.4f} (q{t['worst_question']:.0f}) | {t['none_p90']:.4f} | {t['agreement']:.3f} | "
                    f"{t['d_agreement']:+.3f} | {t['f1_vs_base']:.3f} |")
    return rows


def _mixed(original: ChunkKV, coded: ChunkKV, *, k_layers=(), v_layers=(), exact_rows: int = 0) -> ChunkKV:
    """`original` with the coded keys of `k_layers` and coded values of `v_layers` (the rest exact); the first
    `exact_rows` rows of every coded layer are put back exact."""
    def pick(orig: torch.Tensor, cod: torch.Tensor, coded_here: bool) -> torch.Tensor:
        if not coded_here:
            return orig
        if exact_rows:
            cod = cod.clone()
            cod[:exact_rows] = orig[:exact_rows].to(cod.dtype)
        return cod
    keys = tuple(pick(o, c, i in k_layers) for i, (o, c) in enumerate(zip(original.keys, coded.keys)))
    values = tuple(pick(o, c, i in v_layers) for i, (o, c) in enumerate(zip(original.values, coded.values)))
    return ChunkKV(keys, values, original.token_ids, original.positions_start)


def diagnose(engine, item: dict, setting: tuple[str, dict[str, Any]], *, num_chunks: int = 6,
             recompute_ratio: float = 0.15, per_layer: bool = False, max_new_tokens: int = 32,
             reuse_dir: str | Path | None = None) -> dict[str, tuple[float, float]]:
    """Where one question's KL increase under a codec comes from: per part, (first-token KL(full prefill ‖
    cacheblend) with only that part of the KV coded (the rest exact, in the engine's dtype) minus the KL with nothing
    coded; KL(cacheblend over exact KV ‖ cacheblend with the part coded), the codec's own distortion, which does
    not move by ±0.03 under tiny KV changes as the first does).

    Parts: everything; keys only; values only; keys / values of each layer third; each chunk position alone;
    everything but the first 1 / 4 rows of each chunk (attention-sink-like tokens); with `per_layer`, the keys /
    values of each single layer.
    """
    dtype = engine.adapter.dtype
    texts = passages_of(item, num_chunks)
    keys, originals, answer = _question_state(engine, item, texts, max_new_tokens, reuse_dir)
    segs = [k for k in engine.kv_store.keys() if k.chunk_id.startswith("seg-")]
    if not segs:
        engine.prefill(texts, item["question"], method="cacheblend", recompute_ratio=recompute_ratio)
        segs = [k for k in engine.kv_store.keys() if k.chunk_id.startswith("seg-")]
    num_chunks_coded = len(keys)
    keys, originals = keys + segs, originals + [engine.kv_store.get(k) for k in segs]
    full = answer.logits
    codec = get_codec(*setting[:1], **setting[1])
    coded = [_round_trip(codec, kv, dtype, with_bytes=False).kv for kv in originals]
    num_layers = originals[0].num_layers
    everything = set(range(num_layers))

    def logits(kvs: list[ChunkKV]) -> torch.Tensor:
        for key, kv in zip(keys, kvs):
            engine.kv_store.put(key, kv.to(engine.adapter.device))
        return engine.prefill(texts, item["question"], method="cacheblend", recompute_ratio=recompute_ratio).logits

    uncoded = logits(originals)
    base = first_token_kl(full, uncoded)
    parts: dict[str, list[ChunkKV]] = {
        "all": coded,
        "K only": [_mixed(o, c, k_layers=everything) for o, c in zip(originals, coded)],
        "V only": [_mixed(o, c, v_layers=everything) for o, c in zip(originals, coded)],
        "all but first row of each chunk": [_mixed(o, c, k_layers=everything, v_layers=everything, exact_rows=1)
                                            for o, c in zip(originals, coded)],
        "all but first 4 rows of each chunk": [_mixed(o, c, k_layers=everything, v_layers=everything, exact_rows=4)
                                               for o, c in zip(originals, coded)],
    }
    for g, name in enumerate(("0-1/3", "1/3-2/3", "2/3-1")):
        band = {i for i in range(num_layers) if min(i * 3 // num_layers, 2) == g}
        parts[f"K layers {name}"] = [_mixed(o, c, k_layers=band) for o, c in zip(originals, coded)]
        parts[f"V layers {name}"] = [_mixed(o, c, v_layers=band) for o, c in zip(originals, coded)]
    parts["lead-in only"] = [c if i >= num_chunks_coded else o for i, (o, c) in enumerate(zip(originals, coded))]
    parts["lead-in only, its first row exact"] = [
        _mixed(o, c, k_layers=everything, v_layers=everything, exact_rows=1) if i >= num_chunks_coded else o
        for i, (o, c) in enumerate(zip(originals, coded))]
    parts["chunks only"] = [c if i < num_chunks_coded else o for i, (o, c) in enumerate(zip(originals, coded))]
    for j in range(num_chunks_coded):
        parts[f"chunk {j} only"] = [c if i == j else o for i, (o, c) in enumerate(zip(originals, coded))]
    if per_layer:
        for layer in range(num_layers):
            parts[f"K layer {layer}"] = [_mixed(o, c, k_layers={layer}) for o, c in zip(originals, coded)]
            parts[f"V layer {layer}"] = [_mixed(o, c, v_layers={layer}) for o, c in zip(originals, coded)]
    out = {"kl (nothing coded)": (base, 0.0)}
    for label, kvs in parts.items():
        coded_logits = logits(kvs)
        out[label] = (first_token_kl(full, coded_logits) - base, first_token_kl(uncoded, coded_logits))
    for key, kv in zip(keys, originals):
        engine.kv_store.put(key, kv)
    return out


def print_combined(paths: list[str]) -> None:
    """One quality table from the per-question results of several runs (same settings, disjoint questions)."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    # Only settings every run has: a Δ against the fp16 store must compare the same questions.
    shared = [label for label in runs[0] if all(label in run for run in runs[1:])]
    left_out = sorted({label for run in runs for label in run} - set(shared))
    merged: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for label in shared:
            dst = merged.setdefault(label, {})
            for metric, values in run[label].items():
                dst.setdefault(metric, []).extend(values)
    n = len(next(iter(merged.values()))["kl"])
    print(f"{n} questions from {len(paths)} runs" + (f" (left out, not in every run: {', '.join(left_out)})"
                                                     if left_out else ""))
    print(QUALITY_HEADER)
    print("\n".join(quality_rows(merged)))
    if "fp16" in merged:
        print(f"\nper question, vs the fp16 store\n{TAIL_HEADER}\n" + "\n".join(tail_rows(merged)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The codec bench's options, on its parser (`cacheblend-rag codec-bench`, `cacheblend-bench codecs`)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--questions", type=int, default=2, help="questions whose passages give the KV to measure")
    parser.add_argument("--kl-questions", type=int, default=20, help="questions for the quality table")
    parser.add_argument("--skip-questions", type=int, default=0, help="start the quality table after this many")
    parser.add_argument("--half", choices=sorted(HALVES), default=None,
                        help="the quality table over one half of the dev set: 'choose' (questions 0-24, where "
                             "defaults are picked) or 'report' (25-49, held back to confirm them); overrides "
                             "--skip-questions/--kl-questions")
    parser.add_argument("--diagnose", type=int, nargs="+", metavar="Q", default=None,
                        help="for these question indices, the first-token KL increase with only parts of the KV "
                             "coded by the first --setting (layers, K/V, chunk position, first rows); then exit")
    parser.add_argument("--diagnose-layers", action="store_true", help="--diagnose each single layer's K and V too")
    parser.add_argument("--reuse", metavar="DIR", default=None,
                        help="keep each question's chunk KV and full-prefill answer in DIR and reuse them in later "
                             "runs (same model, dtype, chunks and --max-new-tokens)")
    parser.add_argument("--exact-lead-in", action="store_true",
                        help="code only the chunks, leaving the stored lead-in segment exact (the bench before issue "
                             "30; a store built with kv_codec= codes the lead-in too)")
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--setting", action="append", metavar="NAME[:K=V;K=V]", type=parse_setting,
                        help="a codec setting (repeatable); default: the built-in sweep")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--trace", type=int, default=0, metavar="R",
                        help="replay R seeded requests over --kl-questions questions through a memory tier holding "
                             "1/4 of the distinct chunks in fp16, per codec (hit rate, TTFT); skips the quality table")
    parser.add_argument("--trace-k", type=int, default=4, help="passages per trace request")
    parser.add_argument("--bandwidth", action="store_true",
                        help="TTFT per codec over a simulated remote tier at 1 Gbit/s and 100 Mbit/s vs recompute "
                             "(--kl-questions questions); skips the quality table")
    parser.add_argument("--disk-dir", default=None,
                        help="folder for --bandwidth's disk tier (default: the system's temp folder; pick a real disk)")
    parser.add_argument("--no-bytes", action="store_true",
                        help="quality table without bytes per token: skips cachegen's (lossless) range coding")
    parser.add_argument("--json", metavar="PATH", help="also write the quality results per question as JSON (after "
                        "every question)")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="print one quality table from --json files of runs over disjoint questions, and exit")
    parser.add_argument("--no-sizes", action="store_true", help="skip the size/error/speed table")
    parser.add_argument("--no-quality", "--no-kl", action="store_true", help="skip the quality table")


def run(args: argparse.Namespace) -> None:
    """Print the size/error/speed table and, unless --no-quality, the quality table (KL, agreement)."""
    if args.combine:
        print_combined(args.combine)
        return
    settings = args.setting or DEFAULT_SETTINGS
    if args.half:
        args.skip_questions, end = HALVES[args.half]
        args.kl_questions = end - args.skip_questions
    if args.threads:
        torch.set_num_threads(args.threads)

    from cacheblend_rag.engine import CacheBlendEngine

    path = resolve_dataset(None)
    if path is None:
        raise SystemExit("MuSiQue data not found; set $CACHEBLEND_RAG_MUSIQUE")
    engine = CacheBlendEngine.from_pretrained(args.model, None, device="cpu", dtype=args.dtype,
                                              prefix_reuse=False)
    items = load_dataset(path, max(args.questions, args.skip_questions + args.kl_questions,
                                   1 + max(args.diagnose or [0])))
    for i, item in enumerate(items):
        item["_index"] = i
    if args.diagnose:
        for q in args.diagnose:
            parts = diagnose(engine, items[q], settings[0], num_chunks=args.chunks, per_layer=args.diagnose_layers,
                             max_new_tokens=args.max_new_tokens, reuse_dir=args.reuse)
            print(f"\nquestion {q}, {setting_label(*settings[0])}, {args.dtype}: KL increase with only this part "
                  "coded\n| part | Δ KL vs full prefill | KL vs uncoded |\n|---|---|---|")
            print("\n".join(f"| {k} | {d:+.4f} | {u:.4f} |" for k, (d, u) in parts.items()), flush=True)
        return
    if not args.no_sizes:
        kvs = chunk_kvs(engine, [t for item in items[: args.questions] for t in passages_of(item, args.chunks)])
        print(f"{len(kvs)} chunks, {sum(kv.num_tokens for kv in kvs)} tokens, {args.dtype} "
              "(MB/s of fp16-equivalent KV; indicative)\n")
        print(MEASUREMENT_HEADER)
        measured = []
        for name, params in settings:
            measured.append(measure_codec(get_codec(name, **params), kvs, setting_label(name, params)))
            print(measured[-1].as_row(), flush=True)
        print(f"\nper layer group (indicative)\n{GROUP_SPEED_HEADER}")
        print("\n".join(m.group_speed_row() for m in measured), flush=True)
    codec_names = [name for name, _ in settings] if args.setting else ["fp16", "int8", "cachegen"]
    if args.trace:
        trace = make_trace(items[: args.kl_questions], args.trace, args.trace_k, args.chunks)
        rows = trace_loop(engine, trace, codec_names)
        first = next(iter(rows.values()))
        print(f"\nmemory tier of {first['budget_mb']:.1f} MB (1/4 of {first['distinct']} distinct chunks in fp16), "
              f"{args.trace} requests of {args.trace_k} passages over {args.kl_questions} questions, cacheblend@0.15, "
              f"{args.dtype} (TTFT indicative)")
        print("| memory codec | chunk hit rate | median TTFT (s) | mean TTFT (s) | entries held |\n|---|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['hit_rate']:.2f} | {r['ttft_median_s']:.3f} | {r['ttft_mean_s']:.3f} | "
                  f"{r['entries']} |", flush=True)
    if args.bandwidth:
        bws = [None, 1e9 / 8, 1e8 / 8]
        with tempfile.TemporaryDirectory(prefix="codec-disk-", dir=args.disk_dir) as disk_root:
            rows = bandwidth_loop(engine, items[: args.kl_questions], codec_names, bws, num_chunks=args.chunks,
                                  disk_root=disk_root)
        labels = [_bw_label(b) for b in bws] + ["disk, cold"]
        print(f"\nmedian TTFT (s) of cacheblend@0.15, every chunk on the tier, {args.kl_questions} questions × "
              f"{args.chunks} passages, {args.dtype} (indicative; disk: page cache dropped before each request)")
        print("| KV | MB read per request | " + " | ".join(labels) + " |\n|---|---|" + "---|" * len(labels))
        for name, r in rows.items():
            print(f"| {name} | {r['MB loaded']:.1f} | " + " | ".join(f"{r[lb]:.3f}" for lb in labels) + " |",
                  flush=True)
        print("\nthe loop's KV reading and decoding time over the rest of its layer time (median per request)")
        shared = ["memory", "disk, cold"]
        print("| KV | " + " | ".join(shared) + " |\n|---|" + "---|" * len(shared))
        for name, r in rows.items():
            if f"load share, {shared[0]}" in r:
                print(f"| {name} | " + " | ".join(f"{r[f'load share, {lb}']:.1%}" for lb in shared) + " |")
    if args.no_quality or args.trace or args.bandwidth:
        return
    chosen = items[args.skip_questions: args.skip_questions + args.kl_questions]
    def progress(done: int, results: dict) -> None:
        print(f"[{done} of {len(chosen)} questions]", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results))
        if done % 5 == 0 and done < len(chosen):
            print(f"\n(after {done} questions)\n{QUALITY_HEADER}\n" + "\n".join(quality_rows(results)), flush=True)

    results = codec_quality(engine, chosen, settings, num_chunks=args.chunks, max_new_tokens=args.max_new_tokens,
                            on_question=progress, with_bytes=not args.no_bytes, reuse_dir=args.reuse,
                            code_segments=not args.exact_lead_in)
    print(f"\nvs full prefill, cacheblend@0.15, {len(chosen)} questions × {args.chunks} passages, {args.dtype}, "
          f"greedy {args.max_new_tokens} tokens")
    print(QUALITY_HEADER)
    print("\n".join(quality_rows(results)), flush=True)
    if "fp16" in results:
        print(f"\nper question, vs the fp16 store ({args.dtype})\n{TAIL_HEADER}\n" + "\n".join(tail_rows(results)),
              flush=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m cacheblend_bench.codec_bench`: the same as `cacheblend-bench codecs`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
