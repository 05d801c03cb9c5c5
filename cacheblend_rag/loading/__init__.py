"""Per-layer KV loading: a prefetcher that assembles stored layers ahead of the layer loop; measured profiles and
the loading controller. The per-chunk readers themselves live in `cacheblend_rag.store`."""

from .prefetch import LayerLoader

__all__ = ["LayerLoader"]
