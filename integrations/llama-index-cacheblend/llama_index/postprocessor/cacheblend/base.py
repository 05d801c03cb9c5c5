"""`KVAwareNodePostprocessor`: dedups retrieved nodes by chunk id and warms the KV of the ones not stored yet."""

from __future__ import annotations

import logging
import threading
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from llama_index.core import Settings
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.llms.cacheblend.base import CacheBlendLLM
from llama_index.llms.cacheblend.indexing import is_empty, node_chunk_id, node_text

__all__ = ["KVAwareNodePostprocessor"]

logger = logging.getLogger(__name__)


class KVAwareNodePostprocessor(BaseNodePostprocessor):
    """Dedups retrieved nodes by chunk id, warms the KV of the ones not stored yet, and records hits/misses.

    Empty nodes (an empty file that made it into the index) are dropped, never ingested. Without `engine=`
    it uses the engine of `Settings.llm` when that is a `CacheBlendLLM`. With `reorder_cached_first` (off by
    default: it overrides the retriever's ranking), chunks whose KV was already stored come first.

    Example:
        >>> from llama_index.core.schema import TextNode
        >>> pp = KVAwareNodePostprocessor(engine=engine)
        >>> nodes = [NodeWithScore(node=TextNode(text="Drones do not sting."), score=1.0),
        ...          NodeWithScore(node=TextNode(text=""), score=0.5)]
        >>> [n.node.text for n in pp.postprocess_nodes(nodes)], engine.has_kv(pp.last_stats["chunk_ids"][0])
        (['Drones do not sting.'], True)
    """

    warm: bool = Field(default=True, description="Precompute the KV of retrieved chunks that are not stored.")
    reorder_cached_first: bool = Field(default=False, description="Put already-cached chunks first.")

    _engine: CacheBlendEngine | None = PrivateAttr(default=None)
    _last: dict = PrivateAttr(default_factory=dict)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, engine: CacheBlendEngine | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        """Registry name."""
        return "KVAwareNodePostprocessor"

    @property
    def engine(self) -> CacheBlendEngine | None:
        """The given engine, else the one of `Settings.llm` when it is a CacheBlendLLM."""
        if self._engine is not None:
            return self._engine
        llm = Settings._llm  # not `Settings.llm`: that would resolve (and fail on) the OpenAI default
        return llm.engine if isinstance(llm, CacheBlendLLM) else None

    @property
    def last_stats(self) -> dict:
        """Of the latest call: chunk_ids (after dedup), hits, misses (before warming), warmed, duplicates, empty."""
        with self._lock:
            return dict(self._last)

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        unique: list[NodeWithScore] = []
        seen: set[str] = set()
        empty = 0
        for n in nodes:
            if is_empty(n.node):
                empty += 1
                continue
            cid = node_chunk_id(n.node)
            if cid not in seen:
                seen.add(cid)
                unique.append(n)
        if empty:
            logger.info("dropped %d empty retrieved node(s)", empty)
        ids = [node_chunk_id(n.node) for n in unique]
        engine = self.engine
        hits, misses, warmed = ids, [], []
        if engine is not None:
            cached = {cid for cid in ids if engine.has_kv(cid)}
            hits = [cid for cid in ids if cid in cached]
            misses = [cid for cid in ids if cid not in cached]
            if self.warm and misses:
                warmed = engine.ingest([node_text(n.node) for n in unique if node_chunk_id(n.node) in misses],
                                       show_progress=False)
            if self.reorder_cached_first:
                unique = sorted(unique, key=lambda n: node_chunk_id(n.node) not in cached)
        with self._lock:
            self._last = {"chunk_ids": [node_chunk_id(n.node) for n in unique], "hits": hits, "misses": misses,
                          "warmed": list(warmed), "duplicates": len(nodes) - len(unique) - empty, "empty": empty}
        return unique
