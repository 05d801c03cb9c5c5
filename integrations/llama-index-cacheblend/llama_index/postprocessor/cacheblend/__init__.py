"""LlamaIndex node postprocessor of cacheblend-rag: `KVAwareNodePostprocessor`."""

from llama_index.postprocessor.cacheblend.base import KVAwareNodePostprocessor

__all__ = ["KVAwareNodePostprocessor"]
