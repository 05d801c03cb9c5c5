"""Decode speed after a fused prompt: the engine's own decoder (decode.kv_decode) vs HF generate, same run.

For each prompt length, passages from the dataset are ingested until the fused prompt reaches it; CacheBlend
prefills it once, then both decoders run greedily from that prefill's KV (identical tokens are checked) and
ms/token is their decode time over the tokens they generated (setup, i.e. the cache copy, included). The
memory bound per token is (weight bytes + KV bytes read) / a read bandwidth measured here (a large torch.sum).
A batch row times one step of B sequences after the shortest prompt: per step and per generated token.
"""

from __future__ import annotations

import logging
import time

import torch

from cacheblend_rag.decode.generate import SamplingOptions, decode
from cacheblend_rag.decode.kv_decode import KVDecoder, kv_decode
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.kernels.decode_step import library as decode_kernel

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (512, 2048, 3700, 7000)
DEFAULT_BATCHES = (1, 4, 8)
QUESTION = "Which of these facts is the most surprising, and why?"


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a torch.sum streams from memory (best of `repeats`), a read bandwidth for the bound."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding (one row of it is read),
    the LM head counted once even when it is tied to the embedding."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (p is embed and p is not head):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(engine: CacheBlendEngine, num_keys: int) -> int:
    """Bytes of cached K and V one decode step reads over `num_keys` positions."""
    a = engine.adapter
    elem = torch.empty(0, dtype=a.dtype).element_size()
    return 2 * a.num_layers * num_keys * a.num_kv_heads * a.head_dim * elem


def _passages(items: list[dict]) -> list[str]:
    return [f"{c['title']}\n{c['text']}" for item in items for c in item["ctxs"]]


def _timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best, out


def run(engine: CacheBlendEngine, items: list[dict], *, lengths=DEFAULT_LENGTHS, new_tokens: int = 32,
        batches=DEFAULT_BATCHES, repeats: int = 2) -> dict:
    """Per prompt length: ms/token of both decoders, their tokens compared, and the memory bound."""
    passages = _passages(items)
    tokenizer = engine.tokenizer
    sizes = [len(tokenizer(p)["input_ids"]) for p in passages]
    bandwidth = read_bandwidth()
    weights = weight_bytes_per_token(engine.model)
    sampling = SamplingOptions(max_new_tokens=new_tokens)
    rows, first = [], None
    for target in lengths:
        chosen, total = [], 0
        for p, n in zip(passages, sizes):  # the first passages whose total is nearest the target length
            if total >= target or (chosen and abs(total + n - target) > abs(total - target)):
                break
            chosen.append(p)
            total += n
        if len(chosen) == len(passages) and total < 0.9 * target:
            logger.warning("the dataset has only %d passage tokens; skipping the %d-token prompt", total, target)
            continue
        engine.ingest(chosen, show_progress=False)
        pre = engine.prefill(chosen, QUESTION, store_holes=False)
        n = int(pre.token_ids.numel())
        if first is None:  # untimed: the first call of each path builds what later calls reuse (packed weights)
            warm = SamplingOptions(max_new_tokens=2)
            kv_decode(engine.adapter, tokenizer, pre.token_ids, pre.keys, pre.values, warm)
            decode(engine.model, tokenizer, pre.token_ids, pre.keys, pre.values, warm)
        kv_s, ours = _timed(lambda: kv_decode(engine.adapter, tokenizer, pre.token_ids, pre.keys, pre.values,
                                              sampling), repeats)
        hf_s, reference = _timed(lambda: decode(engine.model, tokenizer, pre.token_ids, pre.keys, pre.values,
                                                sampling), repeats)
        kv_bytes = kv_bytes_per_token(engine, n + new_tokens // 2)
        bound_ms = 1e3 * (weights + kv_bytes) / bandwidth
        kv_ms, hf_ms = 1e3 * kv_s / max(1, ours.numel()), 1e3 * hf_s / max(1, reference.numel())
        rows.append({"prompt_tokens": n, "new_tokens": int(ours.numel()), "kv_ms_per_token": kv_ms,
                     "hf_ms_per_token": hf_ms, "speedup": hf_ms / kv_ms, "bound_ms_per_token": bound_ms,
                     "kv_over_bound": kv_ms / bound_ms, "identical": ours.tolist() == reference.tolist()})
        if first is None:
            first = pre
    batch_rows = []
    if first is not None:
        decoder = KVDecoder(engine.adapter, tokenizer)
        for size in batches:
            seqs = [decoder.sequence(first.token_ids, first.keys, first.values, sampling, text=False)
                    for _ in range(size)]
            decoder.step(seqs)  # warm-up step (the recomputed last prompt token)
            steps = min(8, new_tokens - 1)
            started = time.perf_counter()
            for _ in range(steps):
                decoder.step(seqs)
            step_s = (time.perf_counter() - started) / steps
            batch_rows.append({"batch": size, "prompt_tokens": int(first.token_ids.numel()),
                               "ms_per_step": 1e3 * step_s, "ms_per_token": 1e3 * step_s / size,
                               "tokens_per_s": size / step_s})
    return {"rows": rows, "batches": batch_rows, "read_gb_per_s": bandwidth / 1e9, "weight_mb": weights / 1e6,
            "dtype": str(engine.adapter.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "attention": "C kernel" if decode_kernel() is not None else "torch ops"}


def format_table(result: dict) -> str:
    """Markdown tables of a `run` result."""
    lines = ["| prompt tokens | new tokens | kv decode ms/token | HF generate ms/token | speedup | memory bound "
             "ms/token | kv / bound | identical greedy tokens |", "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['prompt_tokens']} | {r['new_tokens']} | {r['kv_ms_per_token']:.1f} | "
                     f"{r['hf_ms_per_token']:.1f} | {r['speedup']:.2f}× | {r['bound_ms_per_token']:.1f} | "
                     f"{r['kv_over_bound']:.1f}× | {'yes' if r['identical'] else 'NO'} |")
    if result["batches"]:
        lines += ["", "| batch | prompt tokens | ms/step | ms/token | tokens/s |", "|---:|---:|---:|---:|---:|"]
        for b in result["batches"]:
            lines.append(f"| {b['batch']} | {b['prompt_tokens']} | {b['ms_per_step']:.1f} | {b['ms_per_token']:.1f} "
                         f"| {b['tokens_per_s']:.1f} |")
    lines.append(f"\nread bandwidth {result['read_gb_per_s']:.1f} GB/s (torch.sum of 1 GiB), weights read per token "
                 f"{result['weight_mb']:.0f} MB, {result['dtype']}, {result['threads']} threads, attention on "
                 f"{result.get('attention', 'torch ops')}")
    return "\n".join(lines)
