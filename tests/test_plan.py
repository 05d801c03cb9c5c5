"""`cacheblend-rag plan`: KV sizes from a model's config, checked against what the store really writes."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import constants as hf_constants

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.cli import main
from cacheblend_rag.models.loader import load_config_and_tokenizer
from cacheblend_rag.store.sizing import KVLayout, chunk_bytes, kv_bytes_per_token
from conftest import tiny_model

HEADER_BOUND = 8 * 1024  # a stored file's safetensors header and per-tensor checksums, for a 4-layer model


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_layout_matches_the_adapter_of_every_family(tiny):
    """The config-only layout is the shape the adapter computes KV in (qwen3: head_dim ≠ hidden / heads)."""
    from cacheblend_rag.models.adapter import get_adapter

    _, model, _ = tiny
    adapter, layout = get_adapter(model), KVLayout.from_config(model.config)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (adapter.num_layers, adapter.num_kv_heads,
                                                                         adapter.head_dim)


@pytest.mark.model
@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_plan_figures_are_the_stored_entry_size(tmp_path, tokenizer, capsys, codec):
    """plan's per-chunk bytes for a model folder = the KV file the disk store writes for a chunk, header aside."""
    folder = tmp_path / "tiny-llama"
    tiny_model("llama", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    engine = CacheBlendEngine.from_pretrained(str(folder), kv_store=tmp_path / "kv", kv_codec=codec, device="cpu",
                                              dtype="float32")
    [cid] = engine.ingest(["Honeybees have five eyes: two compound eyes and three ocelli. " * 6],
                          show_progress=False)
    num_tokens = engine.resolve_chunk(cid).num_tokens
    plan = _plan(capsys, "--model", str(folder), "--chunk-tokens", str(num_tokens))
    predicted = plan["codecs"][codec]["chunk_bytes"]
    stored = engine.kv_nbytes(cid)
    assert predicted == chunk_bytes(KVLayout(4, 2, 16, 16), codec, num_tokens)
    assert predicted <= stored <= predicted + HEADER_BOUND, (predicted, stored)
    if codec == "fp16":  # the formula of the issue: layers × kv_heads × head_dim × 2 (K, V) × 2 bytes
        assert plan["codecs"]["fp16"]["kv_bytes_per_token"] == 4 * 2 * 16 * 2 * 2


def test_plan_of_a_hub_model_needs_only_its_config(tmp_path, capsys, monkeypatch):
    """An 8B-shaped hub model whose cache holds nothing but config.json: sized without its weights."""
    import transformers as tf

    snapshot = tmp_path / "hub" / "models--big-org--llama-8b" / "snapshots" / ("c" * 40)
    tf.LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                   head_dim=128).save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("c" * 40)
    assert hf_constants.is_offline_mode()
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    plan = _plan(capsys, "--model", "big-org/llama-8b", "--tokens", str(100_000 * 512))
    fp16 = plan["codecs"]["fp16"]
    assert fp16["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2 == 131072  # 128 KiB per token
    assert plan["corpus"] == {"chunks": 100_000, "tokens": 51_200_000}
    assert fp16["corpus_bytes"] == 51_200_000 * (131072 + 8)  # ~6.1 TiB before any codec
    assert plan["codecs"]["int8"]["kv_bytes_per_token"] == 32 * 8 * 256 + 32 * 2 * 8 * 2
    assert plan["memory"]["chunks"] == 512 * 1024**2 // (131072 * 512)  # 8 chunks in the CLI's 512 MiB
    config, tokenizer = load_config_and_tokenizer("big-org/llama-8b")
    assert config.num_hidden_layers == 32 and tokenizer is None


@pytest.mark.model
def test_plan_counts_a_corpus_as_ingest_splits_it(capsys):
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "examples" / "data"
    plan = _plan(capsys, "--corpus", str(data), "--chunk-tokens", "32")
    assert plan["corpus"]["chunks"] > len(list(data.iterdir()))  # 32-token chunks split the ~100-token files
    assert plan["codecs"]["fp16"]["corpus_bytes"] == plan["corpus"]["tokens"] * (23040 + 8)  # SmolLM2-135M


def test_plan_text_output_names_the_codecs(tmp_path, capsys, tokenizer):
    folder = tmp_path / "tiny-qwen3"
    tiny_model("qwen3", len(tokenizer)).save_pretrained(folder)
    assert main(["plan", "--model", str(folder), "--tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "4 layers x 2 KV heads x head_dim 16" in out and "2 chunks, 1,000 tokens" in out
    assert all(codec in out for codec in ("fp16", "int8", "cachegen")) and "estimate" in out


def test_plan_of_a_huge_token_count_is_closed_form_and_an_absurd_one_an_error(tmp_path, capsys, tokenizer):
    import time

    folder = tmp_path / "tiny-llama"
    tiny_model("llama", len(tokenizer)).save_pretrained(folder)
    started = time.monotonic()
    # before: a list of 2e11 chunk sizes (MemoryError; 1e11 tokens took > 10 min and 3.4 GB)
    plan = _plan(capsys, "--model", str(folder), "--tokens", str(10**14 + 1))
    assert time.monotonic() - started < 60
    assert plan["corpus"] == {"chunks": 10**14 // 512 + 1, "tokens": 10**14 + 1}
    assert plan["codecs"]["fp16"]["corpus_bytes"] == (10**14 + 1) * (4 * 2 * 32 * 2 + 8)
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", str(folder), "--tokens", str(10**16)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cacheblend-rag plan: argument --tokens") \
        and "more than any corpus" in err
