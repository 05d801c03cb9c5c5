"""KV codecs: how one layer of a chunk's KV becomes stored tensors and back (fp16, int8, CacheGen).

A codec turns one layer's keys (before RoPE) and values, each `(num_tokens, num_kv_heads, head_dim)`,
into a few named tensors (payload bytes as uint8, scales, ...) and decodes them back, one layer at a
time, so a layer loop can load layer `l` while it computes `l - 1`. The store writes the codec's
`name`, `version` and `params()` into its file header and rebuilds the codec with
`get_codec(name, **params)` when it reads.

Every decoder validates what it is given (tensor names, dtypes, shapes, value ranges, and a crc32 of
the layer's tensors when `checksum` is on) and raises `CodecError` on anything inconsistent: a bad
payload is a cache miss, never garbage KV, and never an unrelated exception.

Codecs (bytes per token for SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64):

    fp16 / bf16 / fp32   raw tensors                                   23,040 B (fp16)
    int8                 absmax int8, per-token steps (fp16)            11,880 B  (1.94x)
    cachegen             CacheGen: first row exact, anchors, layer-      5,322 B  (4.33x; 600-token chunks,
                         grouped bits, ANS coding (see CacheGenCodec)            ~2 kB fixed per layer)

The benchmarks distribution measures them on real KV (bytes/token, error per layer group, encode/decode
MB/s, first-token KL): `cacheblend-bench codecs` (benchmarks/cacheblend_bench/codec_bench.py).
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import CacheFormatError, ConfigError, MissingDependencyError
from .base import ChunkKV

logger = logging.getLogger(__name__)

LayerTensors = dict[str, torch.Tensor]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP16_MAX = float(torch.finfo(torch.float16).max)
_FP16_TINY = float(torch.finfo(torch.float16).tiny)  # smallest normal fp16


class CodecError(CacheFormatError):
    """A codec payload is corrupt, truncated or inconsistent with its header (read as a cache miss)."""


class UnknownCodecError(CodecError, ConfigError):
    """No codec has the requested name (or its parameters are invalid)."""


@runtime_checkable
class KVCodec(Protocol):
    """Encodes and decodes one layer of a chunk's KV; `name`, `version` and `params()` go in the file header."""

    name: str
    version: str

    def params(self) -> dict[str, str]:
        """The settings a decoder needs, as strings: `get_codec(name, **params())` rebuilds this codec."""

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int, num_layers: int) -> LayerTensors:
        """Tensors to store for one layer; keys (num_tokens, num_kv_heads, head_dim) before RoPE, values alike."""

    def decode_layer(
        self,
        tensors: LayerTensors,
        *,
        num_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        layer: int,
        num_layers: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) on CPU in `dtype`; raises CodecError on a corrupt or inconsistent payload."""


# ---- shared helpers ---------------------------------------------------------------------


def _bool_param(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes"):
        return True
    if str(value).lower() in ("0", "false", "no"):
        return False
    raise UnknownCodecError(f"codec parameter {name} must be a boolean ('1' or '0'), got {value!r}")


def _int_param(value: Any, name: str, lo: int, hi: int) -> int:
    out = None
    if isinstance(value, int) and not isinstance(value, bool):
        out = value
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        out = int(value.strip())
    if out is None or not lo <= out <= hi:
        raise UnknownCodecError(f"codec parameter {name} must be an integer in [{lo}, {hi}], got {value!r}")
    return out


def _half_bits(value: Any, name: str, lo: int, hi: int) -> float:
    """One bit width: a multiple of 0.5 in [lo, hi] (an int when whole, so '6' stays 6)."""
    out = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            out = None
    if out is None or not (lo <= out <= hi and (2 * out).is_integer()):
        raise UnknownCodecError(f"codec parameter {name} must be a multiple of 0.5 in [{lo}, {hi}], got {value!r}")
    return int(out) if out.is_integer() else out


def _bits_param(value: Any, name: str, lo: int = 2, hi: int = 8) -> tuple[float, ...]:
    """'6,4.5,4' or (6, 4.5, 4) -> bits per layer group (shallow first), in steps of half a bit."""
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    bits = tuple(_half_bits(b, name, lo, hi) for b in items)
    if not bits:
        raise UnknownCodecError(f"codec parameter {name} needs at least one bit width, got {value!r}")
    return bits


def levels_of(bits: float) -> int:
    """Quantization levels each side of zero for a bit width: 2**(bits-1) - 1, rounded (4.5 bits -> 10).

    Symbols are entropy-coded, so a bit width need not be whole: it sets the step (absmax / levels), and
    half bits let a layer group sit between two whole widths (each whole bit costs ~270 B/token here).
    """
    return round(2 ** (bits - 1)) - 1


def _axis_param(value: Any, name: str) -> str:
    if value not in ("token", "channel"):
        raise UnknownCodecError(f"codec parameter {name} must be 'token' or 'channel', got {value!r}")
    return value


def _check_input(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate an encoder's input and return float32 CPU copies."""
    if keys.dim() != 3 or values.dim() != 3 or keys.shape[:2] != values.shape[:2]:
        raise ConfigError(
            f"encode_layer expects keys and values (num_tokens, num_kv_heads, head_dim) with the same first two "
            f"dimensions, got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.dtype not in _FLOAT_DTYPES or values.dtype not in _FLOAT_DTYPES:
        raise ConfigError(f"encode_layer supports float32/float16/bfloat16 KV, got {keys.dtype} and {values.dtype}")
    return keys.detach().to("cpu", torch.float32), values.detach().to("cpu", torch.float32)


def _check_decode_args(
    num_tokens: int, num_kv_heads: int, head_dim: int, v_head_dim: int, layer: int, num_layers: int, dtype: torch.dtype
) -> None:
    for name, v in (("num_tokens", num_tokens), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("v_head_dim", v_head_dim), ("num_layers", num_layers)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CodecError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise CodecError(f"layer {layer!r} is outside [0, {num_layers})")
    if dtype not in _FLOAT_DTYPES:
        raise CodecError(f"cannot decode to {dtype}; use float32, float16 or bfloat16")


def _get(tensors: LayerTensors, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None) -> torch.Tensor:
    """tensors[name], checked for presence, dtype and shape (None: any 1-d shape)."""
    if not isinstance(tensors, dict):
        raise CodecError(f"a layer payload must be a dict of tensors, got {type(tensors).__name__}")
    t = tensors.get(name)
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"layer payload lacks tensor {name!r} (has {sorted(tensors)})")
    if t.dtype not in dtypes:
        raise CodecError(f"tensor {name!r} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if shape is None:
        if t.dim() != 1:
            raise CodecError(f"tensor {name!r} must be 1-d, got shape {tuple(t.shape)}")
    elif tuple(t.shape) != shape:
        raise CodecError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t.cpu()


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:  # memoryview cannot cast a view with a zero in its shape
        return memoryview(b"")
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def _crc_tensors(tensors: LayerTensors, skip: str = "crc") -> int:
    """crc32 over the names, dtypes, shapes and bytes of every tensor but `skip`, in name order."""
    crc = 0
    for name in sorted(tensors):
        if name == skip:
            continue
        t = tensors[name]
        crc = zlib.crc32(f"{name}:{t.dtype}:{tuple(t.shape)};".encode(), crc)
        crc = zlib.crc32(_bytes_of(t), crc)
    return crc


def _seal(tensors: LayerTensors, checksum: bool) -> LayerTensors:
    """Add the layer's crc32 tensor when checksums are on."""
    if checksum:
        tensors["crc"] = torch.tensor([_crc_tensors(tensors)], dtype=torch.int64)
    return tensors


def _verify(tensors: LayerTensors, checksum: bool, expected: set[str], crc_len: int = 1) -> None:
    """The payload has exactly the expected tensor names, and its crc matches when checksums are on."""
    if not isinstance(tensors, dict):
        raise CodecError(f"a layer payload must be a dict of tensors, got {type(tensors).__name__}")
    names = set(tensors)
    want = expected | ({"crc"} if checksum else set())
    if names != want:
        raise CodecError(f"layer payload has tensors {sorted(names)}, expected {sorted(want)}")
    if checksum:
        crc = _get(tensors, "crc", (torch.int64,), (crc_len,))
        if int(crc[0]) != _crc_tensors(tensors):
            raise CodecError("layer payload crc32 mismatch: the stored bytes are corrupt")


def _scales(amax: torch.Tensor, levels: int) -> torch.Tensor:
    """Quantization steps amax/levels, stored in fp16 rounded *up* (so |x/step| <= levels), else fp32.

    A zero amax gets step 1 (every symbol is 0). fp32 is used when fp16 cannot hold every step
    (overflow or below the smallest normal fp16).
    """
    step = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    if bool(((step > _FP16_MAX / 2) | (step < _FP16_TINY)).any()):
        return step.contiguous()
    half = step.to(torch.float16)
    low = half.float() < step
    if bool(low.any()):
        half = torch.where(low, torch.nextafter(half, torch.full_like(half, math.inf)), half)
    return half.contiguous()


def _check_steps(step: torch.Tensor, name: str) -> torch.Tensor:
    s = step.float()
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise CodecError(f"tensor {name!r} holds non-finite or non-positive quantization steps")
    return s


def _absmax(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Per-token amax over head_dim (num_tokens, num_kv_heads, 1) or per-channel over tokens (1, H, D)."""
    return x.abs().amax(dim=-1, keepdim=True) if axis == "token" else x.abs().amax(dim=0, keepdim=True)


def _step_shape(axis: str, num_tokens: int, num_kv_heads: int, dim: int) -> tuple[int, ...]:
    return (num_tokens, num_kv_heads, 1) if axis == "token" else (1, num_kv_heads, dim)


def _require_finite(x: torch.Tensor, what: str, codec: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise CodecError(f"{what} hold inf/nan, which the {codec} codec cannot quantize; store this chunk with fp32")


# ---- raw (fp16 / bf16 / fp32) --------------------------------------------------------------


class RawCodec:
    """Raw tensors in one float dtype (fp16 is today's format); exact for input already in that dtype.

    fp16/bf16 layers whose values overflow the dtype are stored as float32 (the decoder accepts both).
    """

    version = "1"

    def __init__(self, dtype: torch.dtype = torch.float16, *, checksum: Any = True) -> None:
        if dtype not in _FLOAT_DTYPES:
            raise UnknownCodecError(f"raw codec dtype must be float16, bfloat16 or float32, got {dtype}")
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        self.checksum = _bool_param(checksum, "checksum")

    def params(self) -> dict[str, str]:
        """{'checksum': '1'|'0'}."""
        return {"checksum": str(int(self.checksum))}

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int, num_layers: int) -> LayerTensors:
        """{'k', 'v'} in the codec's dtype (float32 where that dtype would overflow)."""
        if keys.dim() != 3 or values.dim() != 3 or keys.shape[:2] != values.shape[:2]:
            raise ConfigError(f"encode_layer expects (num_tokens, num_kv_heads, head_dim) KV, got "
                              f"{tuple(keys.shape)} and {tuple(values.shape)}")
        out: LayerTensors = {}
        for name, x in (("k", keys), ("v", values)):
            x = x.detach().cpu()
            cast = x.to(self.dtype)
            if cast.dtype != x.dtype and bool((torch.isfinite(x) & ~torch.isfinite(cast)).any()):
                logger.debug("%s layer %d overflows %s; stored as float32", name, layer, self.dtype)
                cast = x.to(torch.float32)
            out[name] = cast.contiguous()
        return _seal(out, self.checksum)

    def decode_layer(self, tensors: LayerTensors, *, num_tokens: int, num_kv_heads: int, head_dim: int,
                     v_head_dim: int, layer: int, num_layers: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) cast to `dtype`."""
        _check_decode_args(num_tokens, num_kv_heads, head_dim, v_head_dim, layer, num_layers, dtype)
        _verify(tensors, self.checksum, {"k", "v"})
        allowed = (self.dtype, torch.float32)
        k = _get(tensors, "k", allowed, (num_tokens, num_kv_heads, head_dim))
        v = _get(tensors, "v", allowed, (num_tokens, num_kv_heads, v_head_dim))
        return k.to(dtype), v.to(dtype)


# ---- int8 ---------------------------------------------------------------------------------


class Int8Codec:
    """Symmetric absmax int8: x ≈ q * step, q in [-127, 127], step per token (over head_dim) or per channel.

    Steps are stored in fp16 rounded up, so every element's error is at most step / 2.
    Defaults: per token for keys and values (1.94x). Per-channel key steps halve the keys' mean error
    but gave a higher first-token KL on MuSiQue (2 questions: +0.0027 vs -0.0011 over the fp16 store).
    """

    name = "int8"
    version = "1"
    LEVELS = 127

    def __init__(self, *, key_axis: str = "token", value_axis: str = "token", checksum: Any = True) -> None:
        self.key_axis = _axis_param(key_axis, "key_axis")
        self.value_axis = _axis_param(value_axis, "value_axis")
        self.checksum = _bool_param(checksum, "checksum")

    def params(self) -> dict[str, str]:
        """{'key_axis', 'value_axis', 'checksum'}."""
        return {"key_axis": self.key_axis, "value_axis": self.value_axis, "checksum": str(int(self.checksum))}

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int, num_layers: int) -> LayerTensors:
        """{'k', 'v'} int8 and {'k_step', 'v_step'} fp16 (fp32 if fp16 cannot hold them)."""
        k, v = _check_input(keys, values)
        out: LayerTensors = {}
        for name, x, axis in (("k", k, self.key_axis), ("v", v, self.value_axis)):
            _require_finite(x, "keys" if name == "k" else "values", self.name)
            step = _scales(_absmax(x, axis), self.LEVELS)
            q = torch.round(x / step.float()).clamp_(-self.LEVELS, self.LEVELS).to(torch.int8)
            out[name], out[f"{name}_step"] = q.contiguous(), step
        return _seal(out, self.checksum)

    def decode_layer(self, tensors: LayerTensors, *, num_tokens: int, num_kv_heads: int, head_dim: int,
                     v_head_dim: int, layer: int, num_layers: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) = q * step, in `dtype`."""
        _check_decode_args(num_tokens, num_kv_heads, head_dim, v_head_dim, layer, num_layers, dtype)
        _verify(tensors, self.checksum, {"k", "v", "k_step", "v_step"})
        out = []
        for name, dim, axis in (("k", head_dim, self.key_axis), ("v", v_head_dim, self.value_axis)):
            q = _get(tensors, name, (torch.int8,), (num_tokens, num_kv_heads, dim))
            if bool((q == -128).any()):
                raise CodecError(f"tensor {name!r} holds -128, outside the int8 codec's symbols [-127, 127]")
            step = _check_steps(_get(tensors, f"{name}_step", (torch.float16, torch.float32),
                                     _step_shape(axis, num_tokens, num_kv_heads, dim)), f"{name}_step")
            out.append((q.to(torch.float32) * step).to(dtype))
        return out[0], out[1]


# ---- CacheGen -------------------------------------------------------------------------------


def _constriction():
    try:
        import constriction
    except ImportError as e:  # pragma: no cover - a core dependency
        raise MissingDependencyError(
            "the cachegen codec needs `constriction`: pip install 'constriction>=0.4' (a core dependency of "
            "cacheblend-rag; reinstall the package)"
        ) from e
    return constriction


def layer_group(layer: int, num_layers: int, num_groups: int) -> int:
    """Which of `num_groups` equal depth bands (shallow first) a layer falls in."""
    return min(layer * num_groups // num_layers, num_groups - 1)


class CacheGenCodec:
    """CacheGen-style KV compression (Liu et al., SIGCOMM '24), per layer, on CPU.

    For keys and values of one layer, each `(num_tokens, num_kv_heads, dim)`:

    1. Anchors and deltas. Tokens form groups of `group_size` (0: the whole chunk); each group's
       anchor is its per-channel mean, stored in fp16, and every token is coded as its delta from
       the anchor. (CacheGen's anchor is the group's first token; on SmolLM2 a first-token anchor
       made deltas *larger* than the raw values, while a mean anchor removes the per-channel offsets
       of pre-RoPE keys; see `measure_codecs`.)
    2. Grouped by layer: every layer is encoded and decoded on its own.
    3. Quantized with `key_bits` / `value_bits[g]` bits in layer group g (layer groups are equal
       depth bands, shallow first, so shallow layers get more bits): q = round(delta / step) with
       step = absmax / levels_of(bits) (2**(bits-1) - 1; bits may be half-integers) per channel
       (`*_axis="channel"`, over the chunk's tokens) or per token and head (`"token"`), stored in fp16
       rounded up; |error| <= step / 2.
    Before step 1, the first `exact_rows` rows (default 1) are taken out and stored as they are (fp16, or the
    input's dtype when it is fp16/bf16): in the stored lead-in segment (position 0) the first row is the
    attention sink, whose quantization error alone moved the first-token KL by +0.03-0.11 on MuSiQue questions
    (issue 30, `cacheblend-rag codec-bench --half report`); its values would also set the per-channel steps of every
    other row. In a chunk the first row is an ordinary token and costs ~38 B/token of a 600-token chunk.

    4. Entropy-coded: the symbols of each (layer, K|V, KV head) share one categorical model whose
       symbol counts are stored in the payload (uint16), and all streams of a layer go through one
       `constriction` ANS coder (version 2; version 1 used its range coder, which decodes ~20 % slower
       for the same bytes: version-1 entries are a miss and get recomputed). Version 3 adds the exact rows
       (`k_exact`/`v_exact`, a 9th meta entry); version-2 entries are refused by the stores, a miss.

    Stored per layer: `meta` (int32 shape, settings, payload words, exact rows), `k_exact`/`v_exact`,
    `k_anchor`/`v_anchor`, `k_step`/`v_step`,
    `tables` (uint16 counts), `payload` (uint8 ANS words) and `crc` (int64 crc32 of the other
    tensors, then of the decoded symbols).
    """

    name = "cachegen"
    version = "3"

    def __init__(
        self,
        *,
        # keys: issue 16's sweep (their error moved the dev-set mean KL 5-10x more than the values' at equal bits).
        # values: one bit more than issue 16's 3.5/3/3 (5.08x), whose per-question tail on held-back questions
        # missed p90 ΔKL <= 0.03 (+0.043); the middle and deep values carried it (issue 30, codec-bench
        # "CacheGen's tail, the ratio that holds it"): 4.33x smaller than fp16
        key_bits: Any = (5.5, 4.5, 4.5),
        value_bits: Any = (4.5, 4, 4),
        group_size: Any = 0,
        # the first row of every entry stored as it is (issue 30): in the lead-in segment it is the attention
        # sink, whose error alone gave +0.03-0.11 first-token KL; it also set every other row's per-channel step
        exact_rows: Any = 1,
        key_axis: str = "channel",
        value_axis: str = "channel",
        checksum: Any = True,
    ) -> None:
        self.key_bits = _bits_param(key_bits, "key_bits")
        self.value_bits = _bits_param(value_bits, "value_bits")
        self.group_size = _int_param(group_size, "group_size", 0, 1 << 30)
        self.exact_rows = _int_param(exact_rows, "exact_rows", 0, 1 << 16)
        self.key_axis = _axis_param(key_axis, "key_axis")
        self.value_axis = _axis_param(value_axis, "value_axis")
        self.checksum = _bool_param(checksum, "checksum")
        self._cs = _constriction()

    def params(self) -> dict[str, str]:
        """Bits per layer group, group size, quantization axes and checksum, as strings."""
        return {
            "key_bits": ",".join(map(str, self.key_bits)),
            "value_bits": ",".join(map(str, self.value_bits)),
            "group_size": str(self.group_size),
            "exact_rows": str(self.exact_rows),
            "key_axis": self.key_axis,
            "value_axis": self.value_axis,
            "checksum": str(int(self.checksum)),
        }

    def bits_for(self, layer: int, num_layers: int) -> tuple[float, float]:
        """(key bits, value bits) of a layer."""
        return (self.key_bits[layer_group(layer, num_layers, len(self.key_bits))],
                self.value_bits[layer_group(layer, num_layers, len(self.value_bits))])

    def num_exact(self, num_tokens: int) -> int:
        """Leading rows of a chunk kept exact: `exact_rows`, but at least one row is always quantized."""
        return min(self.exact_rows, num_tokens - 1)

    @staticmethod
    def _exact(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Kept rows in the input's dtype when it is fp16/bf16 (bit-exact), else fp16 (the fp16 store's rounding),
        or float32 where fp16 would overflow."""
        if like.dtype in (torch.float16, torch.bfloat16):
            return x.detach().to("cpu", like.dtype).contiguous()
        half = x.to(torch.float16)
        return (half if bool(torch.isfinite(half).all()) else x.float()).contiguous()

    def _num_groups(self, num_tokens: int) -> int:
        g = self.group_size or num_tokens
        return -(-num_tokens // g)

    def _group_index(self, num_tokens: int) -> torch.Tensor:
        g = self.group_size or num_tokens
        return torch.arange(num_tokens) // g

    def _model(self, counts: np.ndarray):
        return self._cs.stream.model.Categorical(counts.astype(np.float32), perfect=False)

    def _quantize(self, x: torch.Tensor, bits: float, axis: str, gidx: torch.Tensor,
                  counts_per_group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(anchors, steps, int8 symbols) of one float32 (num_tokens, heads, dim) tensor: steps 1-3 of the scheme."""
        levels = levels_of(bits)
        mean = torch.zeros((self._num_groups(x.shape[0]),) + x.shape[1:]).index_add_(0, gidx, x) / counts_per_group
        anchor = mean.to(torch.float16) if bool(torch.isfinite(mean.to(torch.float16)).all()) else mean
        delta = x - anchor.float()[gidx]
        step = _scales(_absmax(delta, axis), levels)
        q = torch.round(delta / step.float()).clamp_(-levels, levels).to(torch.int8)
        return anchor.contiguous(), step, q

    @staticmethod
    def _dequantize(q: torch.Tensor, step: torch.Tensor, anchor: torch.Tensor, gidx: torch.Tensor) -> torch.Tensor:
        """q * step + anchor of each token's group, in float32 (in place: one temporary tensor fewer per layer)."""
        x = q.to(torch.float32).mul_(step)
        # one anchor group (the default) broadcasts; indexing would copy a (tokens, heads, dim) tensor
        return x.add_(anchor.float() if anchor.shape[0] == 1 else anchor.float()[gidx])

    def reconstruct_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int, num_layers: int,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What encode_layer then decode_layer return, without the (lossless) entropy coding: for quality sweeps.

        The same operations as decode_layer on the same symbols, so the result is bit-identical (tested).
        """
        k, v = _check_input(keys, values)
        kbits, vbits = self.bits_for(layer, num_layers)
        num_exact = self.num_exact(k.shape[0])
        gidx = self._group_index(k.shape[0] - num_exact)
        counts_per_group = torch.bincount(gidx).to(torch.float32).view(-1, 1, 1)
        out = []
        specs = (("k", k, keys, kbits, self.key_axis), ("v", v, values, vbits, self.value_axis))
        for name, x, raw, bits, axis in specs:
            _require_finite(x, "keys" if name == "k" else "values", self.name)
            anchor, step, q = self._quantize(x[num_exact:], bits, axis, gidx, counts_per_group)
            body = self._dequantize(q, step.float(), anchor, gidx)
            if num_exact:
                body = torch.cat([self._exact(raw[:num_exact], raw).float(), body])
            out.append(body.to(dtype))
        return out[0], out[1]

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int, num_layers: int) -> LayerTensors:
        """Anchors, steps, symbol tables and the ANS-coded symbols of one layer."""
        if not 0 <= layer < num_layers:
            raise ConfigError(f"layer {layer} is outside [0, {num_layers})")
        k, v = _check_input(keys, values)
        num_tokens, num_kv_heads = k.shape[:2]
        kbits, vbits = self.bits_for(layer, num_layers)
        num_exact = self.num_exact(num_tokens)
        gidx = self._group_index(num_tokens - num_exact)
        counts_per_group = torch.bincount(gidx).to(torch.float32).view(-1, 1, 1)
        out: LayerTensors = {"meta": torch.tensor(
            [num_tokens, num_kv_heads, k.shape[2], v.shape[2], self.group_size, levels_of(kbits), levels_of(vbits), 0,
             num_exact], dtype=torch.int32)}
        tables: list[np.ndarray] = []
        streams: list[tuple[np.ndarray, np.ndarray]] = []  # (symbols shifted to >= 0, counts)
        sym_crc = 0
        encoder = self._cs.stream.stack.AnsCoder()
        specs = (("k", k, keys, kbits, self.key_axis), ("v", v, values, vbits, self.value_axis))
        for name, x, raw, bits, axis in specs:
            _require_finite(x, "keys" if name == "k" else "values", self.name)
            levels = levels_of(bits)
            # the leading rows (attention-sink-like: the chunk's own first tokens) are stored as they are and
            # left out of the anchors and steps, whose range they would otherwise set for every other row
            out[f"{name}_exact"] = self._exact(raw[:num_exact], raw)
            anchor, step, q = self._quantize(x[num_exact:], bits, axis, gidx, counts_per_group)
            sym_crc = zlib.crc32(_bytes_of(q), sym_crc)
            out[f"{name}_anchor"], out[f"{name}_step"] = anchor.contiguous(), step
            # one head-major int32 copy of every head's symbols (shifted to >= 0), not a strided copy per head
            shifted = q.transpose(0, 1).reshape(num_kv_heads, -1).numpy().astype(np.int32) + levels
            for h in range(num_kv_heads):
                sym = shifted[h]
                counts = np.bincount(sym, minlength=2 * levels + 1)
                if counts.max() > 0xFFFF:  # keep every seen symbol >= 1 after scaling to uint16
                    counts = np.where(counts > 0, np.maximum(1, counts * 0xFFFF // counts.max()), 0)
                counts = counts.astype(np.uint16)
                tables.append(counts)
                streams.append((sym, counts))
        for sym, counts in reversed(streams):  # ANS is a stack: encode backwards so the decoder reads forwards
            encoder.encode_reverse(sym, self._model(counts))
        words = encoder.get_compressed().astype("<u4")
        out["meta"][7] = len(words)
        out["tables"] = torch.from_numpy(np.concatenate(tables))
        out["payload"] = torch.from_numpy(np.frombuffer(words.tobytes(), dtype=np.uint8).copy())
        if self.checksum:
            out["crc"] = torch.tensor([_crc_tensors(out), sym_crc], dtype=torch.int64)
        return out

    def decode_layer(self, tensors: LayerTensors, *, num_tokens: int, num_kv_heads: int, head_dim: int,
                     v_head_dim: int, layer: int, num_layers: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """ANS-decode the symbols, dequantize and add the anchors; (keys, values) in `dtype`."""
        _check_decode_args(num_tokens, num_kv_heads, head_dim, v_head_dim, layer, num_layers, dtype)
        _verify(tensors, self.checksum, {"meta", "k_anchor", "v_anchor", "k_step", "v_step", "tables", "payload",
                                         "k_exact", "v_exact"}, crc_len=2)
        crc = tensors["crc"] if self.checksum else None
        kbits, vbits = self.bits_for(layer, num_layers)
        payload = _get(tensors, "payload", (torch.uint8,), None)
        meta = _get(tensors, "meta", (torch.int32,), (9,)).tolist()
        num_exact = self.num_exact(num_tokens)
        want = [num_tokens, num_kv_heads, head_dim, v_head_dim, self.group_size, levels_of(kbits), levels_of(vbits),
                payload.numel() // 4, num_exact]
        if meta != want or payload.numel() % 4:
            raise CodecError(f"layer payload was encoded for (tokens, heads, head_dim, v_head_dim, group_size, "
                             f"key levels, value levels, words, exact rows) = {meta}; the header and payload say "
                             f"{want} ({payload.numel()} payload bytes)")
        num_rows = num_tokens - num_exact  # quantized rows
        num_groups = self._num_groups(num_rows)
        gidx = self._group_index(num_rows)
        specs = (("k", head_dim, kbits, self.key_axis), ("v", v_head_dim, vbits, self.value_axis))
        table_len = sum(num_kv_heads * (2 * levels_of(b) + 1) for _, _, b, _ in specs)
        tables = _get(tensors, "tables", (torch.uint16,), (table_len,)).numpy()
        words = payload.numpy().view("<u4").astype(np.uint32)
        try:
            decoder = self._cs.stream.stack.AnsCoder(words)
        except Exception as e:  # constriction rejects e.g. a stream ending in a zero word
            raise CodecError(f"the layer's ANS payload is invalid: {e}") from e
        sym_crc, pos, out = 0, 0, []
        for name, dim, bits, axis in specs:
            levels = levels_of(bits)
            anchor = _get(tensors, f"{name}_anchor", (torch.float16, torch.float32), (num_groups, num_kv_heads, dim))
            if not bool(torch.isfinite(anchor).all()):
                raise CodecError(f"tensor {name}_anchor holds inf/nan")
            step = _check_steps(_get(tensors, f"{name}_step", (torch.float16, torch.float32),
                                     _step_shape(axis, num_rows, num_kv_heads, dim)), f"{name}_step")
            exact = tensors[f"{name}_exact"]
            if (not isinstance(exact, torch.Tensor) or exact.dtype not in _FLOAT_DTYPES
                    or tuple(exact.shape) != (num_exact, num_kv_heads, dim) or not bool(torch.isfinite(exact).all())):
                got = f"{getattr(exact, 'dtype', type(exact).__name__)} {tuple(getattr(exact, 'shape', ()))}"
                raise CodecError(f"tensor {name}_exact must be ({num_exact}, {num_kv_heads}, {dim}) finite floats, "
                                 f"got {got}")
            # symbols land in uint8 (alphabets are at most 255 wide); subtracting `levels` wraps modulo 256,
            # so the bytes read as int8 are the signed symbols without another int32 pass
            sym = np.empty((num_kv_heads, num_rows * dim), dtype=np.uint8)
            for h in range(num_kv_heads):
                counts = tables[pos:pos + 2 * levels + 1]
                pos += 2 * levels + 1
                if not counts.any():
                    raise CodecError(f"symbol table of {name} head {h} is empty")
                try:
                    sym[h] = decoder.decode(self._model(counts), num_rows * dim)
                except Exception as e:  # constriction raises on exhausted or invalid streams
                    raise CodecError(f"entropy decoding {name} head {h} failed: {e}") from e
            sym -= np.uint8(levels)
            q = torch.from_numpy(sym.view(np.int8)).view(num_kv_heads, num_rows, dim).transpose(0, 1).contiguous()
            sym_crc = zlib.crc32(_bytes_of(q), sym_crc)
            body = self._dequantize(q, step, anchor, gidx)
            out.append((torch.cat([exact.cpu().float(), body]) if num_exact else body).to(dtype))
        if not decoder.is_empty():  # every word is consumed by exactly the symbols it was encoded from
            raise CodecError("the layer's ANS payload holds more data than its symbols: it is corrupt")
        if crc is not None and int(crc[1]) != sym_crc:
            raise CodecError("decoded symbols fail their crc32: the payload is corrupt or was coded by an "
                             "incompatible constriction version")
        return out[0], out[1]


# ---- registry and chunk helpers ----------------------------------------------------------------


CODECS: dict[str, Callable[..., KVCodec]] = {
    "fp16": lambda **p: RawCodec(torch.float16, **p),
    "bf16": lambda **p: RawCodec(torch.bfloat16, **p),
    "fp32": lambda **p: RawCodec(torch.float32, **p),
    "int8": Int8Codec,
    "cachegen": CacheGenCodec,
}


def get_codec(name: str, **params: Any) -> KVCodec:
    """The codec called `name` built with `params` (as stored by `codec.params()`); UnknownCodecError otherwise."""
    factory = CODECS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise UnknownCodecError(f"unknown KV codec {name!r}; choose one of {sorted(CODECS)}")
    try:
        return factory(**params)
    except TypeError as e:
        raise UnknownCodecError(f"invalid parameters {sorted(params)} for KV codec {name!r}: {e}") from e


def encode_chunk(codec: KVCodec, kv: ChunkKV) -> list[LayerTensors]:
    """Every layer of `kv` encoded by `codec`."""
    return [codec.encode_layer(k, v, layer, kv.num_layers) for layer, (k, v) in enumerate(zip(kv.keys, kv.values))]


def decode_chunk(codec: KVCodec, layers: list[LayerTensors], like: ChunkKV, dtype: torch.dtype) -> ChunkKV:
    """A ChunkKV decoded from `layers`, with the token ids, positions and shapes of `like`."""
    k0, v0 = like.keys[0], like.values[0]
    shape = dict(num_tokens=like.num_tokens, num_kv_heads=k0.shape[1], head_dim=k0.shape[2], v_head_dim=v0.shape[2],
                 num_layers=like.num_layers, dtype=dtype)
    decoded = [codec.decode_layer(t, layer=i, **shape) for i, t in enumerate(layers)]
    return ChunkKV(keys=tuple(k for k, _ in decoded), values=tuple(v for _, v in decoded),
                   token_ids=like.token_ids, positions_start=like.positions_start)


def layer_nbytes(tensors: LayerTensors) -> int:
    """Bytes of one encoded layer's tensors (what the store writes, without its header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
