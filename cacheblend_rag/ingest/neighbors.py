"""Neighbour variants at ingestion (FusionRAG, arXiv 2601.12904, beyond Cache-Craft's paper).

A chunk's isolated KV has seen no context; the chunks most often retrieved beside it are its most similar ones.
So, offline, each chunk is also computed after its k most similar chunks (least similar first, the most similar
right before it) and stored as a Cache-Craft variant of the chunk. At request time Cache-Craft scores that
variant like any other (β: how much of its context attention went to chunks that are before it again), so a
chunk retrieved with its neighbours needs a small recompute budget instead of its isolated one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Embed = Callable[[list[str]], Sequence[Sequence[float]]]

NEIGHBOR_QUESTION = "Which of these passages are related?"  # the question rows do not touch the chunk's KV


def nearest_neighbors(vectors: torch.Tensor, k: int) -> list[list[int]]:
    """Per row of `vectors` (M, D): the indices of its k most similar other rows by cosine, least similar first."""
    if k < 1:
        raise ValueError(f"k (neighbours per chunk) must be ≥ 1, got {k}")
    m = vectors.shape[0]
    if m < 2:
        return [[] for _ in range(m)]
    unit = torch.nn.functional.normalize(vectors.float(), dim=1)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(float("-inf"))
    top = similarity.topk(min(k, m - 1), dim=1).indices  # most similar first
    return [row.flip(0).tolist() for row in top]


def default_embed(texts: list[str]) -> list[list[float]]:
    """The package's embedding model (the one its retrieval uses)."""
    from .embeddings import embed

    return embed(texts)
