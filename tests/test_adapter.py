"""The model adapter reproduces each architecture's own forward; unsupported ones are refused."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import UnsupportedModelError
from cacheblend_rag.fuse.loop import run_layers
from cacheblend_rag.fuse.placement import Placements
from cacheblend_rag.fuse.policies import FullPrefill
from cacheblend_rag.fuse.sequence import FusedSequence
from cacheblend_rag.models.adapter import get_adapter

from conftest import tiny_model


def _adapter_logits(model, ids: torch.Tensor) -> torch.Tensor:
    adapter = get_adapter(model)
    seq = FusedSequence(ids, torch.full_like(ids, -1), [], adapter.num_layers, adapter.num_kv_heads,
                        adapter.head_dim, adapter.dtype)
    selection = FullPrefill().start(adapter, seq, Placements())
    result = run_layers(adapter, seq, selection)
    return adapter.logits(result.hidden)


def test_adapter_reproduces_hf_logits(tiny):
    arch, model, _ = tiny
    ids = torch.randint(0, model.config.vocab_size, (77,))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    got = _adapter_logits(model, ids)
    assert expected.abs().max() > 1.0, "logits too flat to test anything"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])  # every layer windowed; Gemma 3's every other layer
def test_sliding_window_matches_hf(tokenizer, arch):
    model = tiny_model(arch, len(tokenizer), sliding_window=16)
    ids = torch.randint(0, model.config.vocab_size, (90,))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    torch.testing.assert_close(_adapter_logits(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_rope_scaling_is_honoured(tokenizer):
    model = tiny_model("llama", len(tokenizer), rope_scaling={"rope_type": "linear", "factor": 4.0})
    ids = torch.randint(0, model.config.vocab_size, (50,))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    torch.testing.assert_close(_adapter_logits(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*gpt2"):
        get_adapter(model)


@pytest.mark.parametrize("config, match", [({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
                                           ({"use_bidirectional_attention": True}, "use_bidirectional_attention")])
def test_gemma3_configs_the_loop_cannot_run_are_refused(tokenizer, config, match):
    with pytest.raises(UnsupportedModelError, match=match):
        get_adapter(tiny_model("gemma3", len(tokenizer), **config))


def test_gemma3_final_logit_softcapping_matches_hf(tokenizer):
    model = tiny_model("gemma3", len(tokenizer), final_logit_softcapping=1.0)
    ids = torch.randint(0, model.config.vocab_size, (40,))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
        uncapped = model.lm_head(model.model(ids[None]).last_hidden_state)[0]
    assert uncapped.abs().max() > 2.0 and expected.abs().max() < 1.0  # the cap binds
    torch.testing.assert_close(_adapter_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
