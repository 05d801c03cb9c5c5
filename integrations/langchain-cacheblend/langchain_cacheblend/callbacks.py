"""`StatsCallbackHandler`: the package's stats of every generation in a run, from any chain."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.outputs import ChatGeneration, LLMResult

from .retrievers import document_chunk_id

__all__ = ["StatsCallbackHandler"]


class StatsCallbackHandler(BaseCallbackHandler):
    """Collects the stats of every CacheBlendLLM / ChatCacheBlend generation in a run (pass it in `callbacks`).

    Example:
        >>> stats = StatsCallbackHandler()
        >>> _ = ChatCacheBlend(engine=engine, max_tokens=2).invoke("Hi", config={"callbacks": [stats]})
        >>> sorted(k for k in stats.last if k.startswith("chunk_"))
        ['chunk_hits', 'chunk_ids', 'chunk_misses']
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        """Stats of each generation, in the order they ended."""
        self.retrieved: list[list[str]] = []
        """Chunk ids of each retriever run, in the order runs ended (a wrapper ends after what it wraps)."""
        self._lock = threading.Lock()

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        """Record the chunk ids a retriever returned."""
        with self._lock:
            self.retrieved.append([d.metadata.get("chunk_id") or document_chunk_id(d) for d in documents])

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        """Record each generation's stats."""
        with self._lock:
            for gens in response.generations:
                for gen in gens:
                    if isinstance(gen, ChatGeneration) and "cacheblend" in gen.message.response_metadata:
                        self.requests.append(gen.message.response_metadata["cacheblend"])
                    elif gen.generation_info and "chunk_ids" in gen.generation_info:
                        self.requests.append(gen.generation_info)

    @property
    def last(self) -> dict[str, Any] | None:
        """Stats of the latest generation."""
        return self.requests[-1] if self.requests else None
