"""LangChain integration of cacheblend-rag: chat model, LLM, chunk-id retrievers, prompt, chains, stats.

Any prompt (a string or chat messages) in which stored chunks appear verbatim reuses their cached KV, so the
chains users already write — `retriever | format_docs | ChatPromptTemplate | ChatCacheBlend()` — get faster
without changes. `CacheBlendPromptTemplate` and `create_stuff_chain` pass the chunk ids explicitly;
`warm_from_vectorstore` precomputes the KV of what a vector store already holds.
"""

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

__all__ = [
    "RERANK_QUESTION", "CacheBlendLLM", "CacheBlendPromptTemplate", "CacheBlendPromptValue", "ChatCacheBlend",
    "ChromaRetriever", "ChunkIdRetriever", "StatsCallbackHandler", "StructuredOutputError", "create_map_reduce_chain",
    "create_map_rerank_chain", "create_stuff_chain", "document_chunk_id", "parse_scored_answer",
    "iter_vectorstore_documents", "to_chat_messages", "warm_from_vectorstore", "with_chunk_ids",
]
__version__ = "0.1.0"
