"""LangChain integration of cacheblend-rag: chat model, LLM, chunk-id retrievers, prompt, chains, stats.

Any prompt (a string or chat messages) in which stored chunks appear verbatim reuses their cached KV, so the
chains users already write — `retriever | format_docs | ChatPromptTemplate | ChatCacheBlend()` — get faster
without changes. `CacheBlendPromptTemplate` and `create_stuff_chain` pass the chunk ids explicitly;
`warm_from_vectorstore` precomputes the KV of what a vector store already holds.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

# Each public name, from the module that defines it. They load at first use (PEP 562): `cacheblend-rag ask`,
# which needs the LLM and the chains, does not pay for building the chat model's pydantic classes (~0.3 s on a
# 2-core CPU), and a command that only builds the CLI's parser pays for no LangChain at all (#41).
_EXPORTS = MappingProxyType({
    "StatsCallbackHandler": "callbacks",
    "RERANK_QUESTION": "chains", "create_map_reduce_chain": "chains", "create_map_rerank_chain": "chains",
    "create_stuff_chain": "chains", "parse_scored_answer": "chains",
    "ChatCacheBlend": "chat_models", "StructuredOutputError": "chat_models", "to_chat_messages": "chat_models",
    "CacheBlendLLM": "llms",
    "CacheBlendPromptTemplate": "prompts", "CacheBlendPromptValue": "prompts",
    "ChromaRetriever": "retrievers", "ChunkIdRetriever": "retrievers", "document_chunk_id": "retrievers",
    "with_chunk_ids": "retrievers",
    "iter_vectorstore_documents": "warm", "warm_from_vectorstore": "warm",
})

if TYPE_CHECKING:
    from langchain_cacheblend.callbacks import StatsCallbackHandler
    from langchain_cacheblend.chains import (
        RERANK_QUESTION,
        create_map_reduce_chain,
        create_map_rerank_chain,
        create_stuff_chain,
        parse_scored_answer,
    )
    from langchain_cacheblend.chat_models import ChatCacheBlend, StructuredOutputError, to_chat_messages
    from langchain_cacheblend.llms import CacheBlendLLM
    from langchain_cacheblend.prompts import CacheBlendPromptTemplate, CacheBlendPromptValue
    from langchain_cacheblend.retrievers import ChromaRetriever, ChunkIdRetriever, document_chunk_id, with_chunk_ids
    from langchain_cacheblend.warm import iter_vectorstore_documents, warm_from_vectorstore


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "RERANK_QUESTION", "CacheBlendLLM", "CacheBlendPromptTemplate", "CacheBlendPromptValue", "ChatCacheBlend",
    "ChromaRetriever", "ChunkIdRetriever", "StatsCallbackHandler", "StructuredOutputError", "create_map_reduce_chain",
    "create_map_rerank_chain", "create_stuff_chain", "document_chunk_id", "parse_scored_answer",
    "iter_vectorstore_documents", "to_chat_messages", "warm_from_vectorstore", "with_chunk_ids",
]
__version__ = "0.1.0"
