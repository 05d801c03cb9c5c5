"""Per-layer KV loading: readers for each storage tier and a prefetcher that runs ahead of the layer loop."""

from .layers import DiskLayers, LayerReader, LayerReadError
from .prefetch import LayerLoader

__all__ = ["DiskLayers", "LayerLoader", "LayerReadError", "LayerReader"]
