"""LlamaIndex LLM of cacheblend-rag: `CacheBlendLLM`, plus stable chunk-id ingestion and a fused-prompt query engine."""

from llama_index.llms.cacheblend.base import CacheBlendLLM, QueryStatsHandler, install_query_stats_handler
from llama_index.llms.cacheblend.indexing import (
    ChunkIdTransform,
    LocalEmbedding,
    build_index,
    load_documents,
    node_chunk_id,
    node_text,
)
from llama_index.llms.cacheblend.synthesizer import CacheBlendSynthesizer, as_query_engine
from llama_index.llms.cacheblend.warm import iter_index_nodes, warm_from_index

__all__ = [
    "CacheBlendLLM", "CacheBlendSynthesizer", "ChunkIdTransform", "LocalEmbedding", "QueryStatsHandler",
    "as_query_engine", "build_index", "install_query_stats_handler", "iter_index_nodes", "load_documents", "node_chunk_id",
    "node_text", "warm_from_index",
]
