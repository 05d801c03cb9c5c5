"""Fixtures of llama-index-cacheblend's tests: one real engine (SmolLM2-135M-Instruct, fp32, in-memory KV) for the
session, LlamaIndex Settings set to it. Not a conftest.py: the root test run imports its own `conftest` by name."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def li_engine():
    """The real default model behind an in-memory KV store."""
    from cacheblend_rag import CacheBlendEngine, load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    return CacheBlendEngine(model, tokenizer, None)


@pytest.fixture()
def settings_llm(li_engine):
    """`Settings.llm` / `Settings.embed_model` set the standard way for one test, restored after it."""
    from llama_index.core import Settings
    from llama_index.llms.cacheblend import CacheBlendLLM, LocalEmbedding

    saved = Settings._llm, Settings._embed_model
    llm = CacheBlendLLM(engine=li_engine, max_new_tokens=4)
    Settings.llm, Settings.embed_model = llm, LocalEmbedding()  # never the OpenAI defaults
    yield llm
    Settings._llm, Settings._embed_model = saved
