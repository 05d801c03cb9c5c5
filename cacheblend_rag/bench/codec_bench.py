"""KV codecs on real KV: size, error, speed and first-token KL (`python -m cacheblend_rag.bench.codec_bench`).

Not a timed test: timings depend on the machine's load. The KL part stores each chunk's KV passed
through a codec (encode, decode to the engine's dtype) and compares a CacheBlend prefill over it
with a full prefill, as the loading benchmark does.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import torch

from ..store import KVKey
from ..store.base import ChunkKV
from ..store.codecs import MEASUREMENT_HEADER, decode_chunk, encode_chunk, get_codec, measure_codec
from .datasets import load_dataset, passages_of, resolve_dataset
from .metrics import first_token_kl

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
    ("cachegen", {"key_bits": "6,5,4", "value_bits": "5,4,3"}),
    ("cachegen", {"key_bits": "5,4,4", "value_bits": "5,4,4"}),  # LMCache-like: 32 bins shallow, 16 deeper
    ("cachegen", {"key_bits": "6,4,3", "value_bits": "5,3,3"}),
    ("cachegen", {"key_bits": "5,4,3", "value_bits": "4,3,3"}),
    ("cachegen", {"key_bits": "4,3,3", "value_bits": "4,3,3"}),
    ("cachegen", {"group_size": 10}),
    ("cachegen", {"group_size": 64}),
    ("cachegen", {"value_axis": "token"}),
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


def codec_kl(engine, items: list[dict], settings: list[tuple[str, dict[str, Any]]], *, num_chunks: int = 6,
             recompute_ratio: float = 0.15) -> dict[str, list[float]]:
    """Per setting, first-token KL(full prefill ‖ cacheblend over codec-round-tripped KV) per question."""
    out: dict[str, list[float]] = {}
    dtype = engine.adapter.dtype
    for item in items:
        texts = passages_of(item, num_chunks)
        ids = engine.ingest(texts, show_progress=False)
        keys = [KVKey(engine.namespace, cid) for cid in ids]
        originals = [engine.kv_store.get(k) for k in keys]
        full = engine.prefill(texts, item["question"], method="full_prefill")
        for name, params in [("none", {})] + settings:
            label = f"{name} {params}" if params else name
            for key, kv in zip(keys, originals):
                if name != "none":
                    codec = get_codec(name, **params)
                    kv = decode_chunk(codec, encode_chunk(codec, kv), kv, dtype).to(engine.adapter.device)
                engine.kv_store.put(key, kv)
            pre = engine.prefill(texts, item["question"], method="cacheblend", recompute_ratio=recompute_ratio)
            out.setdefault(label, []).append(max(0.0, first_token_kl(full.logits, pre.logits)))
        for key, kv in zip(keys, originals):
            engine.kv_store.put(key, kv)
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the size/error/speed table and, unless --no-kl, the KL table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--questions", type=int, default=2, help="questions whose passages give the KV to measure")
    parser.add_argument("--kl-questions", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--no-kl", action="store_true")
    args = parser.parse_args(argv)

    from ..engine import CacheBlendEngine

    path = resolve_dataset(None)
    if path is None:
        raise SystemExit("MuSiQue data not found; set $CACHEBLEND_RAG_MUSIQUE")
    engine = CacheBlendEngine.from_pretrained(args.model, None, device="cpu", dtype=args.dtype)
    items = load_dataset(path, max(args.questions, args.kl_questions))
    kvs = chunk_kvs(engine, [t for item in items[: args.questions] for t in passages_of(item, args.chunks)])
    print(f"{len(kvs)} chunks, {sum(kv.num_tokens for kv in kvs)} tokens, {args.dtype} "
          "(MB/s of fp16-equivalent KV; indicative)\n")
    print(MEASUREMENT_HEADER)
    for name, params in DEFAULT_SETTINGS:
        print(measure_codec(get_codec(name, **params), kvs).as_row(), flush=True)
    if args.no_kl:
        return
    kl = codec_kl(engine, items[: args.kl_questions], DEFAULT_SETTINGS, num_chunks=args.chunks)
    print(f"\nfirst-token KL vs full prefill, cacheblend@0.15, {args.kl_questions} questions × {args.chunks} passages")
    print("| KV passed through | mean KL | median KL | max KL |\n|---|---|---|---|")
    for label, values in kl.items():
        print(f"| {label} | {statistics.fmean(values):.4f} | {statistics.median(values):.4f} | {max(values):.4f} |")


if __name__ == "__main__":
    main()
