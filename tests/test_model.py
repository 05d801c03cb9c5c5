"""The real default model: offline loading, precompute exactness, and the engine invariants on real text."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ModelNotFoundError, load_model
from cacheblend_bench.metrics import first_token_kl
from cacheblend_rag.fuse.policies import CacheBlend, HKVDSelection
from cacheblend_rag.models.loader import model_folder, resolve_dtype

pytestmark = pytest.mark.model


def test_default_model_loads_offline_from_the_converted_cache(default_model):
    """A second load reads the cached safetensors folder: no GGUF conversion, no hub (timing is for the bench)."""
    model, tokenizer = default_model
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert (model_folder("smollm2-135m") / "model.safetensors").is_file()
    code = ("import logging, time; logging.basicConfig(level=logging.INFO); t = time.perf_counter(); "
            "from cacheblend_rag import load_model; load_model('smollm2-135m', device='cpu', dtype='float32'); "
            "print(f'{time.perf_counter() - t:.2f}')")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    assert "converting" not in done.stderr and "loaded" in done.stderr
    print(f"cached load in a fresh process: {done.stdout.strip()} s")


@pytest.mark.slow
def test_the_packaged_gguf_converts_once_per_machine_in_a_child_process(tmp_path):
    """Two fresh homes, one conversion into the shared models cache, done out of process: its dequantization heap
    never inflates the caller, and no home gets a copy."""
    code = ("import sys, logging; logging.basicConfig(level=logging.INFO); "
            "from cacheblend_rag.models.loader import model_folder; "
            "folder = model_folder('smollm2-135m', home=sys.argv[1]); "
            "assert (folder / 'config.json').is_file() and (folder / 'model.safetensors').is_file(); "
            "assert 'gguf' not in sys.modules, 'the GGUF was read in this process'; print(folder)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", CACHEBLEND_RAG_MODELS=str(tmp_path / "models"))
    runs = [subprocess.run([sys.executable, "-c", code, str(tmp_path / home)], capture_output=True, text=True,
                           timeout=900, env=env) for home in ("home-a", "home-b")]
    for done in runs:
        assert done.returncode == 0, done.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith(str(tmp_path / "models"))
    assert "converting" in runs[0].stderr and "converting" not in runs[1].stderr
    assert not (tmp_path / "home-a" / "models").exists() and not (tmp_path / "home-b" / "models").exists()
    assert not any(p.name.startswith(".") for p in (tmp_path / "models").iterdir())  # no temp folder left


def test_a_home_converted_before_the_shared_cache_is_reused(tmp_path, monkeypatch, default_model):
    """A home whose own models/ holds the conversion (older versions wrote it there) is not converted again."""
    from cacheblend_rag import settings

    converted = model_folder("smollm2-135m")
    home = tmp_path / "old-home"
    (home / "models").mkdir(parents=True)
    (home / "models" / converted.name).symlink_to(converted, target_is_directory=True)
    monkeypatch.setenv(settings.ENV_MODELS, str(tmp_path / "empty-shared-cache"))
    assert model_folder("smollm2-135m", home=home) == home / "models" / converted.name
    assert not (tmp_path / "empty-shared-cache").exists()


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a packaged model"):
        load_model(tmp_path / "nothing-here")


def test_auto_dtype_follows_the_hardware():
    from cacheblend_rag.models.loader import cpu_has_native_bf16

    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.fixture(scope="module")
def engine(default_model):
    model, tokenizer = default_model
    # the module compares methods on the same prompts: no request may be served from another's stored prefix
    return CacheBlendEngine(model, tokenizer, prefix_reuse=False)


@pytest.fixture(scope="module")
def three(passages) -> list[str]:
    return passages[:3]


QUESTION = "Which country is mentioned first in the passages?"


def test_precomputed_keys_match_a_plain_prefill(engine, three):
    """Stored K (before RoPE), rotated at its lead-in positions, equals the K of an HF prefill of lead-in + chunk."""
    [cid] = engine.ingest(three[:1], show_progress=False)
    chunk = engine.resolve_chunk(cid)
    kv = engine.kv_store.get(__import__("cacheblend_rag.store", fromlist=["KVKey"]).KVKey(engine.namespace, cid))
    lead = torch.tensor(engine.lead_in_ids)
    ids = torch.cat([lead, chunk.token_ids])
    with torch.no_grad():
        out = engine.model(ids[None], use_cache=True)
    positions = torch.arange(lead.numel(), ids.numel())
    rope = engine.adapter.rotary(positions)
    for layer in (0, 15, 29):
        hf_k = out.past_key_values.layers[layer].keys[0].transpose(0, 1)[lead.numel():]  # (n, kv_heads, d)
        hf_v = out.past_key_values.layers[layer].values[0].transpose(0, 1)[lead.numel():]
        torch.testing.assert_close(engine.adapter.rope(layer, kv.keys[layer], rope), hf_k, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(kv.values[layer], hf_v, atol=2e-4, rtol=1e-4)


def test_invariants_on_real_text(engine, three):
    ids = engine.ingest(three, show_progress=False)
    full = engine.prefill(ids, QUESTION, method="full_prefill")
    with torch.no_grad():
        hf = engine.model(full.token_ids[None]).logits[0, -1]
    assert float((full.logits - hf).abs().max()) <= 1e-3
    assert float((engine.prefill(ids, QUESTION, recompute_ratio=1.0).logits - full.logits).abs().max()) <= 1e-3
    reuse = engine.prefill(ids, QUESTION, method="full_reuse")
    assert torch.equal(engine.prefill(ids, QUESTION, recompute_ratio=0.0).logits, reuse.logits)
    one_reuse = engine.prefill(ids[:1], QUESTION, method="full_reuse")
    one_prefix = engine.prefill(ids[:1], QUESTION, method="prefix_cache")
    assert float((one_reuse.logits - one_prefix.logits).abs().max()) <= 1e-4


def test_ratio_one_generates_the_full_prefill_text(engine, three):
    ids = engine.ingest(three, show_progress=False)
    a = engine.generate(ids, QUESTION, method="full_prefill", max_new_tokens=16)
    b = engine.generate(ids, QUESTION, recompute_ratio=1.0, max_new_tokens=16)
    assert a.text == b.text and a.text


def test_hkvd_selection_does_real_work(engine, three):
    """At the same ratio, recomputing the highest-deviation tokens beats recomputing the lowest ones."""
    ids = engine.ingest(three, show_progress=False)
    full = engine.prefill(ids, QUESTION, method="full_prefill")

    class LowestSelection(HKVDSelection):
        def select(self, score, seq, ratio):
            return super().select(torch.where(torch.isinf(score), score, -score), seq, ratio)

    class LowestDeviation(CacheBlend):
        def start(self, adapter, seq, placed):
            selection = super().start(adapter, seq, placed)
            assert isinstance(selection, HKVDSelection)  # 0.15 of reused rows: a real selection
            return LowestSelection(**vars(selection))

    kl_high = first_token_kl(full.logits, engine.prefill(ids, QUESTION, recompute_ratio=0.15).logits)
    kl_low = first_token_kl(full.logits, engine.prefill(ids, QUESTION, LowestDeviation(0.15)).logits)
    kl_reuse = first_token_kl(full.logits, engine.prefill(ids, QUESTION, method="full_reuse").logits)
    assert kl_high < kl_low and kl_high < kl_reuse


def test_bos_lead_in_costs_fidelity(default_model, three):
    """Reporting the lead-in's cost: a BOS-only lead-in makes the single-chunk reuse differ from prefix caching."""
    model, tokenizer = default_model
    engine = CacheBlendEngine(model, tokenizer, lead_in="bos")
    ids = engine.ingest(three[:1], show_progress=False)
    reuse = engine.prefill(ids, QUESTION, method="full_reuse")
    prefix = engine.prefill(ids, QUESTION, method="prefix_cache")
    diff = float((reuse.logits - prefix.logits).abs().max())
    kl = first_token_kl(prefix.logits, reuse.logits)
    print(f"BOS lead-in vs exact prefix: max |Δlogit| {diff:.3f}, first-token KL {kl:.4f}")
    assert diff > 1e-2
