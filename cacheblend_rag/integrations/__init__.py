"""Framework integrations, shipped as partner packages (as LangChain and LlamaIndex integrations ship):

- `langchain-cacheblend` (module `langchain_cacheblend`): ChatCacheBlend, CacheBlendLLM, ChunkIdRetriever,
  ChromaRetriever, CacheBlendPromptTemplate, StatsCallbackHandler, create_stuff_chain / map-reduce / map-rerank.
- `llama-index-cacheblend` (`llama_index.llms.cacheblend`, `llama_index.postprocessor.cacheblend`):
  CacheBlendLLM, KVAwareNodePostprocessor, ChunkIdTransform, CacheBlendSynthesizer, as_query_engine.

`cacheblend_rag.integrations.langchain` and `.llama_index` re-export them for older imports. Nothing is
imported here, so `import cacheblend_rag` never pulls in a framework.
"""
