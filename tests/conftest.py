"""Shared fixtures: tiny random-weight models of the supported architectures, the real default model, real text."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
MUSIQUE_ENV = "CACHEBLEND_RAG_MUSIQUE"


def musique_path() -> Path:
    """Where the MuSiQue dev sample lives (overridable by $CACHEBLEND_RAG_MUSIQUE)."""
    return Path(os.environ.get(MUSIQUE_ENV, REPO.parent / "shared" / "data" / "musique_dev.json"))


@pytest.fixture(scope="session")
def musique() -> list[dict]:
    """The MuSiQue questions; a skip outside CI when absent, a failure under CI."""
    path = musique_path()
    if not path.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"MuSiQue data missing at {path} (set ${MUSIQUE_ENV}); CI needs real text")
        pytest.skip(f"MuSiQue data not found at {path}; set ${MUSIQUE_ENV} to run tests on real text")
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def passages(musique) -> list[str]:
    """Real passages (title + text), as the benchmark builds them."""
    return [f"{c['title']}\n{c['text']}" for item in musique[:3] for c in item["ctxs"][:6]]


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct in fp32 (converted once into the package home)."""
    from cacheblend_rag import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(default_model):
    """The real SmolLM2 tokenizer (with a chat template)."""
    return default_model[1]


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6)


def tiny_model(arch: str, vocab_size: int, seed: int = 0, **overrides):
    """A random-weight fp32 model of a real architecture, small enough for exactness tests."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
        # half of each head rotated, as Phi-4-mini's partial_rotary_factor 0.75 leaves part of it unrotated
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {"partial_rotary_factor": 0.5, "sliding_window": None,
                                                     "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}),
        # local and global layers interleaved, each with its own RoPE base; an attention scale that is not
        # head_dim**-0.5; the window (the 270M's 512) longer than these tests' prompts: the windowed tests set it
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {
            "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}),
    }
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab_size, **{**TINY, **extra, **overrides})
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    # Random init leaves RoPE-free logits nearly flat; scale up so mistakes show.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return model


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")


@pytest.fixture(params=ARCHS)
def tiny(request, tokenizer):
    """(arch, model, tokenizer) for each supported architecture."""
    return request.param, tiny_model(request.param, len(tokenizer)), tokenizer


@pytest.fixture(scope="session")
def integrations_home(tmp_path_factory, default_model):
    """A home shared by the integration tests (the KV store is content-addressed, so sharing only saves
    recomputation); its models folder links to the already-converted model (no second conversion)."""
    from cacheblend_rag import settings

    home = tmp_path_factory.getbasetemp() / "integrations-home"
    home.mkdir(exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
    return home


@pytest.fixture(scope="session")
def integrations_engine(default_model, integrations_home):
    """One engine over the shared integrations home."""
    from cacheblend_rag import CacheBlendEngine, settings

    model, tokenizer = default_model
    return CacheBlendEngine(model, tokenizer, settings.kv_dir(integrations_home))
