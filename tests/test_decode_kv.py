"""The engine's own decode over the fused KV (decode.kv_decode) against HF generate, the reference."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from cacheblend_rag import CacheBlendEngine, ConfigError
from cacheblend_rag.decode.generate import SamplingOptions, decode
from cacheblend_rag.decode.kv_decode import (GROUPED_MM_FROM_KEYS, KVDecoder, attend, attend_grouped_mm, attend_torch,
                                             kv_decode)
from cacheblend_rag.decode.text import StopFilter
from cacheblend_rag.kernels import decode_step as kernel

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "The Eiffel Tower was finished in 1889 for the World's Fair in Paris, France.",
]
QUESTIONS = ("Where does the river Lune reach the sea?", "Who won two prizes?")


def _engines(model, tokenizer) -> tuple[CacheBlendEngine, CacheBlendEngine]:
    kv, hf = CacheBlendEngine(model, tokenizer), CacheBlendEngine(model, tokenizer, decoder="hf")
    kv.ingest(TEXTS, show_progress=False)
    hf.ingest(TEXTS, show_progress=False)
    return kv, hf


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference for `attend`: torch's SDPA of q (H, d) over k, v (KVH, n, d), GQA expanded by SDPA → (H, d)."""
    gqa = q.shape[0] != k.shape[0]
    return F.scaled_dot_product_attention(q[None, :, None], k[None], v[None], scale=scale, enable_gqa=gqa)[0, :, 0]


def test_greedy_tokens_equal_hf_generate_on_every_family(tiny):
    _, model, tokenizer = tiny
    kv, hf = _engines(model, tokenizer)
    assert kv.decoder == "kv" and hf.decoder == "hf"
    for question in QUESTIONS:
        a = kv.generate(TEXTS, question, recompute_ratio=0.3, max_new_tokens=20)
        b = hf.generate(TEXTS, question, recompute_ratio=0.3, max_new_tokens=20)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 20
        assert a.text == b.text
    assert "".join(kv.stream(TEXTS, QUESTIONS[0], max_new_tokens=12)).strip() == \
        hf.generate(TEXTS, QUESTIONS[0], max_new_tokens=12).text


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_greedy_tokens_equal_hf_generate_with_a_sliding_window(tokenizer, arch):
    from conftest import tiny_model

    kv, hf = _engines(tiny_model(arch, len(tokenizer), sliding_window=16), tokenizer)
    a = kv.generate(TEXTS, QUESTIONS[0], max_new_tokens=24)
    assert a.stats["num_tokens"] > 4 * 16
    assert a.token_ids == hf.generate(TEXTS, QUESTIONS[0], max_new_tokens=24).token_ids


def test_greedy_tokens_equal_hf_generate_on_the_real_model(default_model, passages):
    model, tokenizer = default_model
    engine = CacheBlendEngine(model, tokenizer)
    engine.ingest(passages[:3], show_progress=False)
    pre = engine.prefill(passages[:3], "Which of these places is the oldest?", store_holes=False)
    sampling = SamplingOptions(max_new_tokens=24)
    ours = kv_decode(engine.adapter, tokenizer, pre.token_ids, pre.keys, pre.values, sampling)
    reference = decode(model, tokenizer, pre.token_ids, pre.keys, pre.values, sampling)
    assert ours.tolist() == reference.tolist() and ours.numel() > 0


def test_sequences_of_different_lengths_batched_equal_each_alone(tiny):
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer)
    engine.ingest(TEXTS, show_progress=False)
    prefills = [engine.prefill(TEXTS, QUESTIONS[0], store_holes=False),
                engine.prefill(TEXTS[1:], QUESTIONS[1], store_holes=False)]
    assert prefills[0].token_ids.numel() != prefills[1].token_ids.numel()
    greedy, sampled = SamplingOptions(max_new_tokens=10), SamplingOptions(max_new_tokens=6, temperature=0.9, seed=5)
    decoder = KVDecoder(engine.adapter, tokenizer)

    def alone(pre, settings):
        seq = decoder.sequence(pre.token_ids, pre.keys, pre.values, settings)
        while not seq.finished:
            decoder.advance([seq])
        return seq.generated

    expected = [alone(prefills[0], greedy), alone(prefills[1], sampled), alone(prefills[1], greedy)]
    seqs = [decoder.sequence(prefills[0].token_ids, prefills[0].keys, prefills[0].values, greedy),
            decoder.sequence(prefills[1].token_ids, prefills[1].keys, prefills[1].values, sampled)]
    decoder.advance(seqs)
    decoder.advance(seqs)
    # a sequence joins a running batch; a finished one leaves it
    seqs.append(decoder.sequence(prefills[1].token_ids, prefills[1].keys, prefills[1].values, greedy))
    while any(not s.finished for s in seqs):
        decoder.advance([s for s in seqs if not s.finished])
    assert [s.generated for s in seqs] == expected
    assert [s.finish_reason for s in seqs] == ["length"] * 3


def test_the_first_token_comes_from_the_prefill_logits_without_a_step(tiny):
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer)
    engine.ingest(TEXTS, show_progress=False)
    pre = engine.prefill(TEXTS, QUESTIONS[0], store_holes=False)
    first = int(pre.logits.argmax())
    seq, _ = engine.start(TEXTS, QUESTIONS[0], max_new_tokens=8)
    # chosen before any step: every prompt row is in the buffer, the first word is ready to hand out
    assert seq.generated == [first] and seq.length == pre.token_ids.numel()
    assert seq.first_piece == tokenizer.decode([first], skip_special_tokens=True)
    while not seq.finished:
        engine.advance([seq])
    # the same answer as recomputing the last prompt token first (the reference path's way)
    decoder = KVDecoder(engine.adapter, tokenizer)
    assert seq.generated == kv_decode(engine.adapter, tokenizer, pre.token_ids, pre.keys, pre.values,
                                      SamplingOptions(max_new_tokens=8)).tolist()
    assert engine.generate(TEXTS, QUESTIONS[0], max_new_tokens=1).token_ids == [first]
    assert decoder.sequence(pre.token_ids, pre.keys, pre.values, SamplingOptions(1), first_logits=pre.logits).finished


def test_stop_strings_and_cancel_on_the_kv_path(tiny):
    _, model, tokenizer = tiny
    kv, hf = _engines(model, tokenizer)
    full = kv.generate(TEXTS, QUESTIONS[0], max_new_tokens=16)
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = kv.generate(TEXTS, QUESTIONS[0], max_new_tokens=16, stop=[stop])
    assert cut.token_ids == hf.generate(TEXTS, QUESTIONS[0], max_new_tokens=16, stop=[stop]).token_ids
    assert stop not in cut.text and full.text.startswith(cut.text) and len(cut.token_ids) < 16
    cancel = threading.Event()
    cancel.set()
    pre = kv.prefill(TEXTS, QUESTIONS[0], store_holes=False)
    assert kv_decode(kv.adapter, tokenizer, pre.token_ids, pre.keys, pre.values, SamplingOptions(8),
                     cancel=cancel).numel() == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("n", [257, GROUPED_MM_FROM_KEYS + 50])  # attend takes SDPA, then (bf16) the matmuls
def test_attend_equals_sdpa_over_a_sliced_head_major_buffer(dtype, tol, heads, kv_heads, n):
    gen = torch.Generator().manual_seed(0)
    capacity, d, lo = n + 43, 64, 40  # a buffer with unfilled rows, attended from a window's start
    k = torch.randn(kv_heads, capacity, d, generator=gen).to(dtype)
    v = torch.randn(kv_heads, capacity, d, generator=gen).to(dtype)
    k[:, n:] = float("nan")  # rows past the filled length must never be read
    q = (3 * torch.randn(heads, d, generator=gen)).to(dtype)
    outs = []
    for start in (0, lo):  # the whole cache, then a sliding window's rows only
        ref = attend_sdpa(q.float(), k[:, start:n].float(), v[:, start:n].float(), 0.125)
        for fn in (attend, attend_torch, attend_grouped_mm):
            out = fn(q, k[:, start:n], v[:, start:n], 0.125, torch.empty(heads, d, dtype=dtype))
            assert out.dtype == dtype and torch.allclose(out.float(), ref, atol=tol, rtol=tol), fn.__name__
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1], atol=tol)  # the window does change what is attended


def _compiler() -> bool:
    """Whether the C kernels can be built and are wanted here (a C compiler, not switched off)."""
    import shutil

    from cacheblend_rag import settings
    return settings.decode_kernel_enabled() and any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.mark.skipif(not _compiler(), reason="no C compiler here (or CACHEBLEND_RAG_DECODE_KERNEL=0): decode stays on torch's ops")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 3000])  # one key; around a block of 256; many blocks
def test_decode_attention_kernel_equals_sdpa_in_fp32(dtype, tol, n):
    assert kernel.library() is not None  # a compiler is here: the kernel must build
    gen = torch.Generator().manual_seed(n)
    heads, kv_heads, d = 9, 3, 64
    k = torch.randn(kv_heads, n + 7, d, generator=gen).to(dtype)
    v = torch.randn(kv_heads, n + 7, d, generator=gen).to(dtype)
    k[:, n:], v[:, n:] = float("nan"), float("nan")  # unfilled rows are never read
    q = (4 * torch.randn(heads, d, generator=gen)).to(dtype)
    out = torch.full((heads, d), float("nan"), dtype=dtype)
    assert kernel.decode_attention(q, k[:, :n], v[:, :n], 0.125, out) is out
    ref = attend_sdpa(q.float(), k[:, :n].float(), v[:, :n].float(), 0.125)
    # bf16: the kernel is closer to an fp32 reference than the bf16 matmul path, whose scores are rounded to bf16
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not _compiler(), reason="no C compiler here (or CACHEBLEND_RAG_DECODE_KERNEL=0): decode stays on torch's ops")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_linear_rows_kernel_equals_f_linear(dtype, tol, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.randn(960, 576, generator=gen) / 24).to(dtype)
    bias = torch.randn(960, generator=gen).to(dtype)
    for b in (None, bias):
        ours = kernel.linear_rows(x, weight, b)
        ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
        assert ours is not None and ours.dtype == dtype and ours.shape == (rows, 960)
        assert torch.allclose(ours.float(), ref, atol=tol, rtol=tol)
    assert kernel.linear_rows(torch.randn(5, 576).to(dtype), weight) is None  # > 4 rows: oneDNN's matmul instead
    assert kernel.linear_rows(x, weight.t().contiguous().t()) is None  # a transposed view: not row-major


def test_decode_attention_kernel_declines_what_it_does_not_take():
    q, k = torch.randn(4, 64, dtype=torch.float16), torch.randn(2, 10, 64, dtype=torch.float16)
    assert kernel.decode_attention(q, k, k, 0.125, torch.empty_like(q)) is None  # fp16
    k32 = torch.randn(2, 10, 128)[..., ::2]  # rows not contiguous
    assert kernel.decode_attention(torch.randn(4, 64), k32, k32, 0.125, torch.empty(4, 64)) is None
    q3 = torch.randn(3, 64)  # 3 query heads over 2 KV heads: not grouped-query attention
    assert kernel.decode_attention(q3, torch.randn(2, 10, 64), torch.randn(2, 10, 64), 0.1, torch.empty(3, 64)) is None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [3, 6])  # the C GEMV's rows, then oneDNN's packed matmul (more than 4 rows)
def test_packed_weights_compute_what_the_hf_modules_do(tiny, dtype, tol, rows):
    from conftest import tiny_model
    from cacheblend_rag.models.adapter import get_adapter

    arch, model, tokenizer = tiny
    adapter = get_adapter(tiny_model(arch, len(tokenizer)).to(dtype))  # its own copy: packing is per adapter
    if not adapter.packed():
        pytest.skip("this torch build or CPU has no oneDNN packed linear for this dtype")
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(rows, model.config.hidden_size, generator=gen).to(dtype)
    for layer in (0, adapter.num_layers - 1):
        for ours, theirs in zip(adapter.project_qkv(layer, hidden, packed=True), adapter.project_qkv(layer, hidden)):
            assert ours.shape == theirs.shape and torch.allclose(ours.float(), theirs.float(), atol=tol, rtol=tol)
        attn = torch.randn(rows, adapter.num_heads, adapter.head_dim, generator=gen).to(dtype)
        ours, theirs = adapter.finish_layer(layer, hidden, attn, packed=True), adapter.finish_layer(layer, hidden, attn)
        assert torch.allclose(ours.float(), theirs.float(), atol=tol, rtol=tol)
    ours, theirs = adapter.logits(hidden, packed=True), adapter.logits(hidden)
    assert ours.shape == (rows, len(tokenizer)) and torch.allclose(ours.float(), theirs.float(), atol=tol, rtol=tol)


def test_stop_filter_cuts_a_stop_string_across_pieces():
    f = StopFilter(("END",))
    out = [f.push(p) for p in ["ab", "cE", "N", "Dx"]]
    assert "".join(out) == "abc" and f.found
    g = StopFilter(())
    assert g.push("abc") == "abc" and g.flush() == ""


def test_unknown_decoder_is_a_config_error(tiny):
    _, model, tokenizer = tiny
    with pytest.raises(ConfigError, match="decoder"):
        CacheBlendEngine(model, tokenizer, decoder="fast")


def test_decode_bench_reports_both_decoders_and_the_bound(tiny, musique):
    from cacheblend_bench import decode_bench

    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer)
    result = decode_bench.run(engine, musique[:1], lengths=(64, 200), new_tokens=4, batches=(1, 2), repeats=1)
    rows = result["rows"]
    assert [r["prompt_tokens"] >= t for r, t in zip(rows, (64, 200))] == [True, True]
    assert all(r["identical"] and r["new_tokens"] == 4 and r["bound_ms_per_token"] > 0 for r in rows)
    assert [b["batch"] for b in result["batches"]] == [1, 2]
    assert "identical greedy tokens" in decode_bench.format_table(result)
