"""Codec measurement: size, error per layer group and speed of a codec setting over some chunks' KV.

Measurement only (the store never calls it); `codec_bench` prints its tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from cacheblend_rag.store.base import ChunkKV
from cacheblend_rag.store.codecs import KVCodec, get_codec, layer_group, layer_nbytes


@dataclass
class CodecMeasurement:
    """Size, error and speed of one codec setting over some chunks (timings depend on the machine's load)."""

    label: str
    codec: str
    params: dict[str, str]
    num_tokens: int
    nbytes: int
    fp16_nbytes: int
    encode_s: float
    decode_s: float
    # per layer group (thirds by depth, shallow first): (max |err| keys, mean |err| keys, max values, mean values)
    group_errors: list[tuple[float, float, float, float]]
    # per layer group: (fp16-equivalent bytes, stored bytes, encode seconds, decode seconds)
    group_speed: list[tuple[int, int, float, float]] | None = None

    def group_speed_row(self) -> str:
        """A markdown row: bits/value, encode and decode MB/s per layer group (see GROUP_SPEED_HEADER)."""
        cells = [f"{16 * st / fp:.2f} b · {fp / 1e6 / enc:.0f} / {fp / 1e6 / dec:.0f}"
                 for fp, st, enc, dec in (self.group_speed or [])]
        return f"| {self.label} | " + " | ".join(cells) + " |"

    @property
    def bytes_per_token(self) -> float:
        """Encoded bytes per token (all layers, keys and values)."""
        return self.nbytes / self.num_tokens

    @property
    def bits_per_value(self) -> float:
        """Encoded bits per stored KV element."""
        return 16 * self.nbytes / self.fp16_nbytes

    @property
    def ratio(self) -> float:
        """fp16 bytes / encoded bytes."""
        return self.fp16_nbytes / self.nbytes

    def as_row(self) -> str:
        """A markdown table row (see MEASUREMENT_HEADER)."""
        mb = self.fp16_nbytes / 1e6
        errs = " | ".join(f"{mk:.3g}/{ak:.2g} · {mv:.3g}/{av:.2g}" for mk, ak, mv, av in self.group_errors)
        return (f"| {self.label} | {self.bytes_per_token:,.0f} | {self.bits_per_value:.2f} | {self.ratio:.2f}× | "
                f"{errs} | {mb / self.encode_s:.0f} | {mb / self.decode_s:.0f} |")


MEASUREMENT_HEADER = (
    "| codec | B/token | bits/value | vs fp16 | |err| K max/mean · V max/mean, layers 0–⅓ | ⅓–⅔ | ⅔–1 | "
    "encode MB/s | decode MB/s |\n|---|---|---|---|---|---|---|---|---|"
)


GROUP_SPEED_HEADER = (
    "| codec | layers 0–⅓: bits/value · encode / decode MB/s | ⅓–⅔ | ⅔–1 |\n|---|---|---|---|"
)


def measure_codec(codec: KVCodec, kvs: list[ChunkKV], label: str | None = None) -> CodecMeasurement:
    """Encode and decode every chunk with `codec`: bytes, error per layer group vs the input, and speed.

    Speeds are in MB of fp16-equivalent KV per second (the same work unit for every codec).
    """
    nbytes = fp16 = tokens = 0
    enc_s = dec_s = 0.0
    num_layers = kvs[0].num_layers
    stats = [[0.0, 0.0, 0.0, 0.0, 0, 0] for _ in range(3)]  # max k, sum k, max v, sum v, n k, n v
    speed = [[0, 0, 0.0, 0.0] for _ in range(3)]  # fp16 bytes, stored bytes, encode s, decode s
    for kv in kvs:
        k0, v0 = kv.keys[0], kv.values[0]
        shape = dict(num_tokens=kv.num_tokens, num_kv_heads=k0.shape[1], head_dim=k0.shape[2],
                     v_head_dim=v0.shape[2], num_layers=num_layers, dtype=torch.float32)
        tokens += kv.num_tokens
        for layer in range(num_layers):
            k, v = kv.keys[layer], kv.values[layer]
            t0 = time.perf_counter()
            tensors = codec.encode_layer(k, v, layer, num_layers)
            t1 = time.perf_counter()
            dk, dv = codec.decode_layer(tensors, layer=layer, **shape)
            t2 = time.perf_counter()
            group = layer_group(layer, num_layers, 3)
            layer_fp16, layer_stored = 2 * (k.numel() + v.numel()), layer_nbytes(tensors)
            enc_s, dec_s = enc_s + t1 - t0, dec_s + t2 - t1
            nbytes, fp16 = nbytes + layer_stored, fp16 + layer_fp16
            g = speed[group]
            g[0], g[1], g[2], g[3] = g[0] + layer_fp16, g[1] + layer_stored, g[2] + t1 - t0, g[3] + t2 - t1
            s = stats[group]
            ek = (dk - k.float()).abs()
            ev = (dv - v.float()).abs()
            s[0], s[1], s[4] = max(s[0], float(ek.max())), s[1] + float(ek.sum()), s[4] + ek.numel()
            s[2], s[3], s[5] = max(s[2], float(ev.max())), s[3] + float(ev.sum()), s[5] + ev.numel()
    errors = [(s[0], s[1] / max(s[4], 1), s[2], s[3] / max(s[5], 1)) for s in stats]
    params = codec.params()
    shown = {k: v for k, v in params.items() if k != "checksum"}
    label = label or (f"{codec.name} {shown}" if shown else codec.name)
    return CodecMeasurement(label, codec.name, params, tokens,
                            nbytes, fp16, enc_s, dec_s, errors, [tuple(g) for g in speed])


def measure_codecs(kvs: list[ChunkKV], settings: list[tuple[str, dict[str, Any]]]) -> list[CodecMeasurement]:
    """measure_codec for each (name, params) setting."""
    return [measure_codec(get_codec(name, **params), kvs) for name, params in settings]
