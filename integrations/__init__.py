"""Framework integrations, each importable on its own optional extra:

- `cacheblend_rag.integrations.langchain` (extra `langchain`): CacheBlendLLM, ChunkIdRetriever, ChromaRetriever,
  CacheBlendPromptTemplate, create_stuff_chain / create_map_reduce_chain / create_map_rerank_chain.
- `cacheblend_rag.integrations.llama_index` (extra `llama-index`): CacheBlendLLM, ChunkIdTransform,
  KVAwareNodePostprocessor, CacheBlendSynthesizer, as_query_engine.

Nothing is imported here, so `import cacheblend_rag` never pulls in a framework.
"""
