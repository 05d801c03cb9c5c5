"""TTFT on a CUDA GPU at real model shapes: full prefill, CacheBlend and full reuse, beside one plain HF forward.

Random weights of a real architecture's shape stand in for checkpoints that cannot be carried to the GPU machine:
time depends on the shape, not the weights' values, so the speedups hold; the KL and answers do not (this
script prints none). Prompts are real MuSiQue passages re-cut into `--chunks` chunks of `--chunk-tokens`.

    python benchmarks/gpu_shapes.py --tokenizer FOLDER --data musique_dev.json --shapes smollm2-135m,llama-8b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers as tf

from cacheblend_rag import CacheBlendEngine
from cacheblend_bench.datasets import rechunk
from cacheblend_bench.engine_bench import run
from cacheblend_bench.methods import MethodSpec
from cacheblend_rag.kernels.attention import _sdpa_masked_cuda
from cacheblend_rag.store import ChunkKV, KVKey
from cacheblend_rag.store.memory import MemoryStore

# name → (config class, model class, shape); vocab comes from the tokenizer
SHAPES = {
    "tiny": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2)),
    "smollm2-135m": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        rope_theta=100000.0, tie_word_embeddings=True)),
    # Llama-3.1-8B's shape (Mistral-7B, the CacheBlend paper's model, differs only in vocabulary)
    "llama-8b": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=500000.0)),
    # Qwen2.5-Coder-0.5B-Instruct, the packaged model that calls tools (GQA 14:2, untied 151k head)
    "qwen2.5-0.5b": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen2.5-7b": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, rope_theta=1000000.0)),
}
METHODS = ("full_prefill", "cacheblend@0.15", "relevance@0.15", "full_reuse")
GiB = 1024**3


class HostMemoryStore(MemoryStore):
    """The memory tier as it was before KV stayed on the model's device: entries moved to host RAM on put
    (pinned or pageable), so every request copies them back over PCIe."""

    def __init__(self, max_bytes: int, pinned: bool) -> None:
        super().__init__(max_bytes)
        self.pinned = pinned

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Move the entry to host RAM, then keep it."""
        host = (lambda t: t.cpu().pin_memory()) if self.pinned else (lambda t: t.cpu())
        super().put(key, ChunkKV(tuple(host(k) for k in kv.keys), tuple(host(v) for v in kv.values),
                                 kv.token_ids, kv.positions_start))


def make_store(kind: str):
    """gpu: the memory tier on the model's device (the default now); pinned / host: in host RAM."""
    if kind == "gpu":
        return MemoryStore(100 * GiB)
    return HostMemoryStore(100 * GiB, pinned=kind == "pinned")


def sdpa_variants(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """ms of one masked row-attention call (the layer loop's CacheBlend rows) per SDPA route, for a shape seen
    for the first time and again: default dispatch with GQA, default without cuDNN, K/V expanded + efficient,
    query groups folded into rows + efficient (the loop's route)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(route: str, q, k, v, mask):
        if route == "fold+efficient":  # what the layer loop runs (cacheblend_rag/kernels/attention.py)
            return _sdpa_masked_cuda(q, k, v, mask, 0.1)
        if route == "expand+efficient":
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        kw = dict(attn_mask=mask[None, None], enable_gqa=q.shape[1] != k.shape[1])
        if route == "default":
            return F.scaled_dot_product_attention(*args, **kw)
        backends = ([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] if route == "expand+efficient"
                    else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(*args, **kw)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3

    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for n in (3000, 8000):
        for route in ("default", "no-cudnn", "expand+efficient", "fold+efficient"):
            first, again = [], []
            for trial in range(3):
                m = int(0.15 * n) + 7 * trial + {"default": 1, "no-cudnn": 2, "expand+efficient": 3, "fold+efficient": 4}[route]
                rows = torch.randperm(n, generator=gen)[:m].sort().values.to(device)
                q = torch.randn(m, 32, 128, device=device, dtype=dtype)
                k, v = (torch.randn(n, 8, 128, device=device, dtype=dtype) for _ in range(2))
                keys = torch.arange(n, device=device)
                mask = torch.zeros(m, n, device=device, dtype=dtype).masked_fill_(keys[None] > rows[:, None],
                                                                                float("-inf"))
                first.append(timed(lambda: call(route, q, k, v, mask)))
                again.append(timed(lambda: call(route, q, k, v, mask)))
            rows_out.append({"keys": n, "route": route, "first_call_ms": statistics.median(first),
                             "same_shape_again_ms": statistics.median(again)})
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def random_model(shape: str, vocab_size: int, device: torch.device, dtype: torch.dtype):
    """A random-weight model of `shape`, built on the device (no checkpoint)."""
    config_cls, model_cls, dims = SHAPES[shape]
    config = config_cls(vocab_size=vocab_size, max_position_embeddings=32768, **dims)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config).to(dtype)
    return model.eval()


def long_items(data: list[dict], limit: int, num_chunks: int, chunk_tokens: int, tokenizer) -> list[dict]:
    """Each question with enough passages (its own, then the next questions') for num_chunks × chunk_tokens."""
    items = []
    for i in range(limit):
        passages = [f"{c['title']}\n{c['text']}" for j in range(len(data))
                    for c in data[(i + j) % len(data)]["ctxs"]][: 8 * num_chunks * max(1, chunk_tokens // 100)]
        chunks = rechunk(passages, chunk_tokens, num_chunks, tokenizer)
        items.append({**data[i], "ctxs": [{"title": "", "text": c} for c in chunks]})
    return items


def hf_forward_s(model, engine: CacheBlendEngine, item: dict, num_chunks: int, repeats: int = 3) -> tuple[float, int]:
    """Median seconds of one plain HF forward over the same token ids the engine's full prefill uses."""
    chunks = [c["text"] for c in item["ctxs"][:num_chunks]]
    ids = engine.prefill(chunks, item["question"], method="full_prefill").token_ids[None].to(model.device)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            torch.cuda.synchronize() if ids.is_cuda else None
            started = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].argmax().item()
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:]), ids.shape[1]


def decode_ms_per_token(model, engine: CacheBlendEngine, item: dict, num_chunks: int, new: int = 32) -> tuple[float, float]:
    """Decode ms per token after a CacheBlend prefill (the engine's KV decoder) and of HF generate on the same ids."""
    chunks = [c["text"] for c in item["ctxs"][:num_chunks]]
    gen = engine.generate(chunks, item["question"], max_new_tokens=new)
    ours = gen.stats["timing"]["decode_s"] / max(1, gen.stats["num_generated"] - 1) * 1e3
    ids = engine.prefill(chunks, item["question"], method="full_prefill").token_ids[None].to(model.device)

    def timed(n: int) -> float:
        torch.cuda.synchronize() if ids.is_cuda else None
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize() if ids.is_cuda else None
        return time.perf_counter() - started

    timed(2)
    hf = (timed(new) - timed(1)) / (new - 1) * 1e3
    return ours, hf


def profile(engine: CacheBlendEngine, item: dict, num_chunks: int) -> None:
    """torch.profiler tables (CPU and CUDA time per op) of one request per method, after a warm run of each."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    chunks = [c["text"] for c in item["ctxs"][:num_chunks]]
    for method in ("full_reuse", "cacheblend", "full_prefill"):
        engine.prefill(chunks, item["question"], method=method)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            pre = engine.prefill(chunks, item["question"], method=method)
        print(f"\n## {method}: ttft {pre.stats.timing}", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a folder with the tokenizer (SmolLM2's)")
    parser.add_argument("--data", required=True, help="MuSiQue-style JSON")
    parser.add_argument("--shapes", default="smollm2-135m,llama-8b")
    parser.add_argument("--contexts", default="6x512,8x1024", help="chunks×tokens per prompt, comma-separated")
    parser.add_argument("--stores", default="gpu,pinned,host",
                        help="where the memory tier holds KV: gpu (the model's device), pinned or host RAM")
    parser.add_argument("--sdpa", action="store_true", help="first time the masked SDPA routes")
    parser.add_argument("--profile", action="store_true", help="profile one request per method instead of the bench")
    parser.add_argument("--limit", type=int, default=5, help="questions per setting")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokenizer = tf.AutoTokenizer.from_pretrained(args.tokenizer)
    data = json.loads(Path(args.data).read_text())
    specs = [MethodSpec.parse(m) for m in METHODS]
    rows = []
    sdpa = sdpa_variants(device, dtype) if args.sdpa else []
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {args.dtype}", flush=True)
    for shape in args.shapes.split(","):
        started = time.perf_counter()
        model = random_model(shape, len(tokenizer), device, dtype)
        params = sum(p.numel() for p in model.parameters()) / 1e9
        print(f"{shape}: {params:.2f} B parameters, built in {time.perf_counter() - started:.1f} s", flush=True)
        for context in args.contexts.split(","):
            num_chunks, chunk_tokens = (int(x) for x in context.split("x"))
            items = long_items(data, args.limit, num_chunks, chunk_tokens, tokenizer)
            for store in args.stores.split(","):
                engine = CacheBlendEngine(model, tokenizer, make_store(store))
                if args.profile:
                    engine.ingest([c["text"] for c in items[0]["ctxs"][:num_chunks]], show_progress=False)
                    profile(engine, items[0], num_chunks)
                    continue
                out = run(engine, items, specs, num_chunks=num_chunks, max_new_tokens=1, show_progress=False,
                          warmup=False)
                hf = [hf_forward_s(model, engine, item, num_chunks) for item in items]
                decode = decode_ms_per_token(model, engine, items[0], num_chunks) if store == "gpu" else (None, None)
                hf_s = statistics.median(s for s, _ in hf)
                s = out["summary"]
                row = {"shape": shape, "params_b": round(params, 2), "store": store, "chunks": num_chunks,
                       "chunk_tokens": chunk_tokens, "prompt_tokens": statistics.median(n for _, n in hf),
                       "hf_forward_ms": hf_s * 1e3,
                       **{f"{m}_ms": s[m]["ttft_median_s"] * 1e3 for m in METHODS},
                       **{f"{m}_speedup": s[m]["speedup"] for m in METHODS},
                       "cacheblend_vs_hf": hf_s / s["cacheblend@0.15"]["ttft_median_s"],
                       "ingest_tokens_per_s": out["ingest"]["tokens_per_s"],
                       "decode_ms_per_token": decode[0], "hf_generate_ms_per_token": decode[1]}
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del model
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "sdpa": sdpa}, indent=1))
    print("\n| shape | store | prompt tokens | HF forward ms | full prefill ms | CacheBlend@0.15 ms | full reuse ms "
          "| relevance@0.15 ms | CB vs full prefill | relevance vs full prefill | CB vs HF forward |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['store']} | {r['prompt_tokens']:.0f} | {r['hf_forward_ms']:.1f} | "
              f"{r['full_prefill_ms']:.1f} | {r['cacheblend@0.15_ms']:.1f} | {r['full_reuse_ms']:.1f} | "
              f"{r['relevance@0.15_ms']:.1f} | {r['cacheblend@0.15_speedup']:.2f}× | "
              f"{r['relevance@0.15_speedup']:.2f}× | {r['cacheblend_vs_hf']:.2f}× |")
    print("\n| shape | prompt tokens | decode ms/token (ours) | HF generate ms/token |\n|---|---:|---:|---:|")
    for r in rows:
        if r["decode_ms_per_token"] is not None:
            print(f"| {r['shape']} | {r['prompt_tokens']:.0f} | {r['decode_ms_per_token']:.1f} | "
                  f"{r['hf_generate_ms_per_token']:.1f} |")


if __name__ == "__main__":
    main()
