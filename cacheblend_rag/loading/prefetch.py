"""LayerLoader: assembles the cached KV of layer i+1.. on a background thread while layer i is computed.

CacheBlend §5: the selective recompute of one layer can hide the loading of the
next, so KV can live on slower, cheaper storage without adding TTFT. With
`depth` > 0 a thread runs up to `depth` layers ahead of the loop (Cache-Craft
§3.4.2's preload depth); with 0 each layer is read when the loop asks for it.
Both give identical tensors.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ..store import LayerReader


@dataclass(frozen=True)
class Placed:
    """A reader whose rows start at `row_start` in the fused sequence."""

    row_start: int
    reader: LayerReader


class LayerLoader:
    """Per-layer assembly of all placed chunks' cached K (before RoPE) and V into (N, kv_heads, d) tensors."""

    def __init__(self, placed: list[Placed], num_rows: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype, depth: int = 0) -> None:
        self.placed = placed
        self.shape = (num_rows, num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.device, self.dtype = device, dtype
        self.depth = depth
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._errors: dict[int, BaseException] = {}
        self._cond = threading.Condition()
        self._wanted = 0  # highest layer the loop has asked for
        self._thread: threading.Thread | None = None
        self._closed = False
        self.wait_s = 0.0  # time the loop spent waiting for a layer
        self.load_s = 0.0  # time spent reading + assembling layers
        # Rows no chunk covers: only these need zeroing, not the whole (N, kv_heads, d) buffer each layer.
        covered = torch.zeros(num_rows, dtype=torch.bool)
        for p in placed:
            covered[p.row_start:p.row_start + p.reader.num_tokens] = True
        self._gaps = (~covered).nonzero().squeeze(1).to(device)

    def _assemble(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        keys = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        values = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        keys[self._gaps] = 0
        values[self._gaps] = 0
        for p in self.placed:
            k, v = p.reader.layer(layer)
            end = p.row_start + k.shape[0]
            keys[p.row_start:end] = k.to(self.device, non_blocking=True)
            values[p.row_start:end] = v.to(self.device, non_blocking=True)
        self.load_s += time.perf_counter() - started
        return keys, values

    def _run(self) -> None:
        for layer in range(self.num_layers):
            with self._cond:
                while not self._closed and layer > self._wanted + self.depth:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                loaded = self._assemble(layer)
            except BaseException as e:  # handed to the loop, which decides
                with self._cond:
                    self._errors[layer] = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[layer] = loaded
                self._cond.notify_all()

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cached K and V, handed over once (the loader keeps no reference); waits for the
        prefetcher if it is behind."""
        if self.depth <= 0:
            return self._assemble(layer)
        with self._cond:
            self._wanted = max(self._wanted, layer)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="kv-prefetch")
                self._thread.start()
            started = time.perf_counter()
            while layer not in self._ready and not self._errors:
                self._cond.wait()
            self.wait_s += time.perf_counter() - started
            if layer in self._ready:
                return self._ready.pop(layer)
            raise next(iter(self._errors.values()))

    def close(self) -> None:
        """Stop the prefetcher (at the end of a request or on error) and drop layers it loaded but nobody took."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._ready.clear()
