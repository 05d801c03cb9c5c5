"""The CUDA path: exactness at ratio 0 and 1 in bf16, the decode path, the layer-wise prefetch, on tiny models of
every supported family. Marked `gpu`: `make gpu-check` runs them; on a machine without CUDA each one skips."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine
from conftest import ARCHS, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.model,  # the tiny models borrow the real SmolLM2 tokenizer
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch (make gpu-check)"),
]

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "The Eiffel Tower was finished in 1889 for the World's Fair in Paris, France.",
    "Basalt is an igneous rock formed from the rapid cooling of lava rich in iron.",
]
QUESTION = "Where does the river Lune reach the sea?"


def _cuda_engine(arch: str, tokenizer, dtype: torch.dtype, **kwargs) -> CacheBlendEngine:
    model = tiny_model(arch, len(tokenizer)).to("cuda", dtype)
    engine = CacheBlendEngine(model, tokenizer, **kwargs)
    engine.ingest(TEXTS, show_progress=False)
    return engine


def _max_diff(a, b) -> float:
    return float((a.logits.float() - b.logits.float()).abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_ratio_one_is_full_prefill_and_ratio_zero_is_full_reuse(arch, tokenizer):
    """The invariants of test_fusion on CUDA in bf16: ratio 1 computes what full prefill computes (bf16 rounding
    apart), ratio 0 reuses exactly what full reuse reuses; full prefill agrees with HF's own forward."""
    engine = _cuda_engine(arch, tokenizer, torch.bfloat16)
    assert engine.adapter.device.type == "cuda" and engine.adapter.dtype == torch.bfloat16
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    reuse = engine.prefill(TEXTS, QUESTION, method="full_reuse")
    scale = float(full.logits.float().abs().max())
    assert full.logits.device.type == "cuda"
    assert _max_diff(engine.prefill(TEXTS, QUESTION, recompute_ratio=1.0), full) <= 2e-2 * scale
    assert _max_diff(engine.prefill(TEXTS, QUESTION, recompute_ratio=0.0), reuse) <= 1e-3 * scale
    with torch.no_grad():
        hf = engine.model(full.token_ids[None].to("cuda")).logits[0, -1].float()
    assert float((full.logits.float() - hf).abs().max()) <= 2e-2 * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_on_cuda_matches_hf_generate(arch, tokenizer):
    """The engine's own decode over the fused KV gives HF generate's greedy tokens (fp32: no bf16 near-ties);
    in bf16 it runs and starts from the prefill's argmax."""
    kv = _cuda_engine(arch, tokenizer, torch.float32)
    hf = CacheBlendEngine(kv.model, tokenizer, decoder="hf")
    hf.ingest(TEXTS, show_progress=False)  # both fuse the same precomputed chunk KV
    a = kv.generate(TEXTS, QUESTION, recompute_ratio=0.3, max_new_tokens=16)
    b = hf.generate(TEXTS, QUESTION, recompute_ratio=0.3, max_new_tokens=16)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    bf16 = _cuda_engine(arch, tokenizer, torch.bfloat16)
    out = bf16.generate(TEXTS, QUESTION, method="full_prefill", max_new_tokens=8)
    assert out.token_ids[0] == int(bf16.prefill(TEXTS, QUESTION, method="full_prefill").logits.argmax())


def test_layerwise_prefetch_on_cuda_loads_exactly_what_on_demand_loads(tokenizer, tmp_path):
    """On CUDA the engine prefetches stored KV layers ahead of the loop (depth 2) on a background thread; the
    fused logits are those of on-demand loading, with the KV read from a disk store."""
    ahead = _cuda_engine("llama", tokenizer, torch.bfloat16, kv_store=tmp_path / "kv")
    assert ahead.prefetch_depth == 2
    on_demand = CacheBlendEngine(ahead.model, tokenizer, kv_store=tmp_path / "kv", prefetch_depth=0)
    for method in ("full_reuse", "cacheblend"):
        a = ahead.prefill(TEXTS, QUESTION, method=method)
        b = on_demand.prefill(TEXTS, QUESTION, method=method)
        assert len(a.stats["chunk_hits"]) == len(b.stats["chunk_hits"]) == len(TEXTS)
        assert torch.equal(a.logits, b.logits), method


def test_scattered_row_attention_on_cuda_matches_the_cpu_reference():
    """CacheBlend's scattered rows attend on CUDA through one masked call (K/V expanded to the query heads, the
    memory-efficient kernel): the same outputs as the CPU's grouped SDPA calls, with a sliding window too."""
    from cacheblend_rag.kernels import causal_attention_rows

    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, d = 700, 8, 2, 32
    rows = torch.randperm(n, generator=gen)[:120].sort().values
    q = torch.randn(rows.numel(), heads, d, generator=gen)
    k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
    for window in (None, 256):
        cpu = causal_attention_rows(q, k, v, rows, 0.2, window)
        cuda = causal_attention_rows(q.cuda(), k.cuda(), v.cuda(), rows.cuda(), 0.2, window)
        assert torch.allclose(cuda.cpu(), cpu, atol=1e-4), window


def test_chunk_kv_stays_on_the_gpu_in_the_memory_tier(tokenizer):
    """Ingested chunk KV is kept on the model's device by the memory tier: reading it back is a device copy."""
    engine = _cuda_engine("llama", tokenizer, torch.bfloat16)
    reader = engine.cache.reader(engine.resolve_chunk(engine.ingest(TEXTS[:1], show_progress=False)[0]))
    k, v = reader.layer(0)
    assert k.device.type == "cuda" and v.device.type == "cuda"
