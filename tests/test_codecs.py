"""KV codecs: round trips on real model KV within bounds derived from the bits, odd shapes, dtypes, bad payloads."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cacheblend_rag.errors import CacheFormatError, ConfigError
from cacheblend_rag.store import ChunkKV, KVKey
from cacheblend_rag.store.codecs import (
    CODECS,
    CacheGenCodec,
    CodecError,
    Int8Codec,
    UnknownCodecError,
    decode_chunk,
    encode_chunk,
    get_codec,
    layer_nbytes,
)

from cacheblend_bench.codec_measure import measure_codec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# relative rounding of a value cast to each dtype (half an ulp)
ROUND = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# absolute rounding below the normal range (half the smallest subnormal step)
TINY = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
SETTINGS = [("fp16", {}), ("bf16", {}), ("fp32", {}), ("int8", {}),
            ("int8", {"key_axis": "channel", "value_axis": "channel"}), ("cachegen", {}),
            ("cachegen", {"key_bits": "8,2", "value_bits": "3", "group_size": 10, "value_axis": "token"}),
            ("cachegen", {"key_bits": "5.5,3.5", "value_bits": "2.5,4.5"})]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(SETTINGS)]
# bf16 and fp32 run the fp16 codec's code (RawCodec) on other dtypes: the costly real-KV tests leave them out
QUANT = [(s, i) for s, i in zip(SETTINGS, IDS) if s[0] not in ("bf16", "fp32")]
# (input dtype, output dtype): every dtype the engine supports goes in and comes out at least once
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
               (torch.float16, torch.float32)]


def _boundary_layers(num_layers: int, group_counts: tuple[int, ...] = (2, 3)) -> list[int]:
    """First and last layers of each layer group, for each number of groups (where the bits per layer change)."""
    edges = {0, num_layers - 1}
    for groups in group_counts:
        for g in range(1, groups):
            first = -(-g * num_layers // groups)  # the first layer of group g (see codecs._layer_group)
            edges |= {first - 1, first}
    return sorted(edges)


@pytest.fixture(scope="module")
def real_kv(default_model, passages):
    """The stored KV (fp32, keys before RoPE) of one real MuSiQue passage, computed by the real model."""
    from cacheblend_rag import CacheBlendEngine

    engine = CacheBlendEngine(*default_model)
    (cid,) = engine.ingest(passages[:1], show_progress=False)
    kv = engine.kv_store.get(KVKey(engine.namespace, cid))
    assert kv is not None and kv.keys[0].dtype == torch.float32 and kv.num_tokens > 100
    return kv


def _shape(k: torch.Tensor, v: torch.Tensor, layer: int, num_layers: int, dtype=torch.float32) -> dict:
    return dict(num_tokens=k.shape[0], num_kv_heads=k.shape[1], head_dim=k.shape[2], v_head_dim=v.shape[2],
                layer=layer, num_layers=num_layers, dtype=dtype)


class _NoExact:
    """A cachegen codec seen without its exact rows (for the bound over the quantized rows)."""

    def __init__(self, codec) -> None:
        self._codec = codec

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def num_exact(self, num_tokens: int) -> int:
        return 0


def _bound(codec, enc: dict, name: str, x: torch.Tensor, layer: int, num_layers: int) -> torch.Tensor:
    """Per-element error bound implied by the codec's bits: half a quantization step of the stored input."""
    if codec.name in ("fp16", "bf16", "fp32"):
        return x.abs() * ROUND[codec.dtype] + TINY[codec.dtype]
    axis = codec.key_axis if name == "k" else codec.value_axis
    if codec.name == "int8":
        levels, centred = 127, x
    elif codec.num_exact(x.shape[0]):  # leading rows kept exact (fp16 for fp32 input); the rest as usual
        n = codec.num_exact(x.shape[0])
        rest = {**enc, f"{name}_anchor": enc[f"{name}_anchor"]}
        head = x[:n].abs() * ROUND[torch.float16] + TINY[torch.float16]
        return torch.cat([head, _bound(_NoExact(codec), rest, name, x[n:], layer, num_layers)])
    else:
        bits = codec.bits_for(layer, num_layers)[0 if name == "k" else 1]
        levels = round(2 ** (bits - 1)) - 1  # half bits (4.5) round to whole levels (10)
        g = codec.group_size or x.shape[0]
        anchor = enc[f"{name}_anchor"].float()
        groups = torch.arange(x.shape[0]) // g
        # the anchor is the group's mean, rounded to fp16
        means = torch.stack([x[groups == i].mean(0) for i in range(anchor.shape[0])])
        torch.testing.assert_close(anchor, means, atol=1e-6, rtol=2.0**-10)
        centred = x - anchor[groups]
    amax = centred.abs().amax(-1, keepdim=True) if axis == "token" else centred.abs().amax(0, keepdim=True)
    step = amax / levels * (1 + 2.0**-10)  # the stored step is amax/levels rounded up to fp16
    return step / 2 + 1e-6 * x.abs() + 1e-30


def _roundtrip_check(codec, k, v, layer, num_layers, out_dtype):
    enc = codec.encode_layer(k, v, layer, num_layers)
    dk, dv = codec.decode_layer(enc, **_shape(k, v, layer, num_layers, out_dtype))
    for name, x, d in (("k", k, dk), ("v", v, dv)):
        assert d.dtype == out_dtype and d.shape == x.shape and d.device.type == "cpu"
        x = x.float()
        bound = _bound(codec, enc, name, x, layer, num_layers) + d.float().abs() * ROUND[out_dtype] + TINY[out_dtype]
        err = (d.float() - x).abs()
        assert bool((err <= bound).all()), f"{codec.name} {name} layer {layer}: max excess {float((err - bound).max())}"
    return enc


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_round_trip_on_real_kv_is_within_the_bound_of_its_bits_in_every_layer_group(real_kv, name, params):
    codec = get_codec(name, **params)
    # cachegen's bits change only at layer-group boundaries: check those layers; the others code every layer alike
    n = real_kv.num_layers
    layers = (_boundary_layers(n, (len(codec.key_bits), len(codec.value_bits))) if name == "cachegen"
              else (0, n // 2, n - 1))
    for layer in layers:
        _roundtrip_check(codec, real_kv.keys[layer], real_kv.values[layer], layer, real_kv.num_layers, torch.float32)


@pytest.mark.parametrize("params", [{}, {"key_bits": "8,2", "value_bits": "3", "group_size": 10, "value_axis": "token"}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cachegen_reconstruct_equals_encode_then_decode_bit_for_bit(params, dtype):
    """The quality sweep's shortcut (no range coding) must give exactly what the store would return."""
    codec = get_codec("cachegen", **params)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(37, 2, 16, generator=g) * 3 + 1
    v = torch.randn(37, 2, 8, generator=g)
    for layer in (0, 3):
        dk, dv = codec.decode_layer(codec.encode_layer(k, v, layer, 4), **_shape(k, v, layer, 4, dtype))
        rk, rv = codec.reconstruct_layer(k, v, layer, 4, dtype)
        assert torch.equal(dk, rk) and torch.equal(dv, rv)


@pytest.mark.model
def test_fp16_round_trip_is_exact_for_fp16_kv_and_equals_the_cast_for_fp32(real_kv):
    codec = get_codec("fp16")
    for layer in (0, real_kv.num_layers - 1):
        k, v = real_kv.layer(layer)
        dk, dv = codec.decode_layer(codec.encode_layer(k, v, layer, real_kv.num_layers),
                                    **_shape(k, v, layer, real_kv.num_layers, torch.float16))
        assert torch.equal(dk, k.half()) and torch.equal(dv, v.half())
        k16, v16 = k.half(), v.half()
        dk, dv = codec.decode_layer(codec.encode_layer(k16, v16, layer, real_kv.num_layers),
                                    **_shape(k, v, layer, real_kv.num_layers, torch.float16))
        assert torch.equal(dk, k16) and torch.equal(dv, v16)


@pytest.mark.model
@pytest.mark.parametrize(("in_dtype", "out_dtype"), DTYPE_PAIRS, ids=[f"{a}-{b}" for a, b in DTYPE_PAIRS])
@pytest.mark.parametrize("name", ["fp16", "int8", "cachegen"])
def test_every_engine_dtype_in_and_out(real_kv, name, in_dtype, out_dtype):
    codec = get_codec(name)
    for layer in (0, real_kv.num_layers - 1):
        k, v = (t[:64].to(in_dtype) for t in real_kv.layer(layer))
        _roundtrip_check(codec, k, v, layer, real_kv.num_layers, out_dtype)


@pytest.mark.model
@pytest.mark.parametrize("num_tokens", [1, 9, 10, 11])  # one token; below, at and above a group of 10
@pytest.mark.parametrize(("name", "params"), [s for s, _ in QUANT], ids=[i for _, i in QUANT])
def test_odd_token_counts_of_real_kv(real_kv, name, params, num_tokens):
    codec = get_codec(name, **params)
    for layer in (0, real_kv.num_layers - 1):
        k, v = (t[3:3 + num_tokens] for t in real_kv.layer(layer))
        _roundtrip_check(codec, k, v, layer, real_kv.num_layers, torch.float32)


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_odd_shapes_other_value_head_dim_zeros_and_constants(name, params):
    codec = get_codec(name, **params)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(13, 2, 8, generator=gen) * 5 + 3
    v = torch.randn(13, 2, 16, generator=gen)
    for layer, num_layers in ((0, 1), (0, 3), (2, 3), (6, 7)):
        _roundtrip_check(codec, k, v, layer, num_layers, torch.float32)
    for fill in (0.0, 2.5):
        z = torch.full((5, 1, 4), fill)
        enc = codec.encode_layer(z, z, 0, 2)
        dk, dv = codec.decode_layer(enc, **_shape(z, z, 0, 2))
        torch.testing.assert_close(dk, z, rtol=2.0**-10, atol=0)
        torch.testing.assert_close(dv, z, rtol=2.0**-10, atol=0)


def test_fp16_layer_that_overflows_is_stored_in_float32_and_round_trips_exactly():
    codec = get_codec("fp16")
    k = torch.tensor([[[1e6, -2.0]]])
    enc = codec.encode_layer(k, k, 0, 1)
    assert enc["k"].dtype == torch.float32
    dk, _ = codec.decode_layer(enc, **_shape(k, k, 0, 1))
    assert torch.equal(dk, k)


@pytest.mark.parametrize("name", ["int8", "cachegen"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_quantizers_refuse_non_finite_kv(name, bad):
    k = torch.ones(4, 1, 4)
    k[1, 0, 2] = bad
    with pytest.raises(CodecError, match="fp32"):
        get_codec(name).encode_layer(k, torch.ones(4, 1, 4), 0, 1)


def test_steps_that_fp16_cannot_hold_are_stored_in_float32():
    codec = get_codec("int8")
    for scale in (1e-9, 1e8):
        k = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(1)) * scale
        enc = _roundtrip_check(codec, k, k, 0, 1, torch.float32)
        assert enc["k_step"].dtype == torch.float32


# ---- sizes on real KV -------------------------------------------------------------------------


@pytest.mark.model
def test_int8_and_cachegen_sizes_on_real_kv(real_kv):
    # two layers from each third of the model: the same bits per layer group as the whole chunk, a fifth of the work
    layers = sorted({0, 1, real_kv.num_layers // 2 - 1, real_kv.num_layers // 2, real_kv.num_layers - 2,
                     real_kv.num_layers - 1})
    kv = ChunkKV(tuple(real_kv.keys[i] for i in layers), tuple(real_kv.values[i] for i in layers), real_kv.token_ids)
    assert [get_codec("cachegen").bits_for(i, kv.num_layers) for i in range(6)] == [
        get_codec("cachegen").bits_for(i, real_kv.num_layers) for i in layers]
    fp16 = measure_codec(get_codec("fp16"), [kv])
    int8 = measure_codec(get_codec("int8"), [kv])
    cachegen = measure_codec(get_codec("cachegen"), [kv])
    assert fp16.ratio == pytest.approx(1.0, abs=0.01)
    assert int8.ratio >= 1.9
    assert cachegen.ratio >= 4.2  # 4.33x on whole chunks (issue 30's default; these six layers weigh alike)
    # shallow layers get more bits: their error is smaller than the deep layers'
    assert cachegen.group_errors[0][1] < cachegen.group_errors[2][1]
    assert cachegen.group_errors[0][3] < cachegen.group_errors[2][3]


@pytest.mark.model
def test_chunk_helpers_round_trip_a_whole_chunk(real_kv):
    codec = get_codec("int8")
    kv = ChunkKV(real_kv.keys[:4], real_kv.values[:4], real_kv.token_ids, positions_start=real_kv.positions_start)
    layers = encode_chunk(codec, kv)
    assert len(layers) == kv.num_layers
    out = decode_chunk(codec, layers, kv, torch.bfloat16)
    assert out.num_layers == kv.num_layers and torch.equal(out.token_ids, kv.token_ids)
    assert out.keys[3].dtype == torch.bfloat16 and out.positions_start == kv.positions_start
    assert sum(layer_nbytes(t) for t in layers) < kv.nbytes / 3.5


# ---- registry and parameters ------------------------------------------------------------------


def test_unknown_codec_name_is_a_clear_error():
    with pytest.raises(UnknownCodecError, match=r"unknown KV codec 'zstd'.*cachegen.*fp16.*int8"):
        get_codec("zstd")
    assert issubclass(UnknownCodecError, CacheFormatError) and issubclass(UnknownCodecError, ConfigError)


@pytest.mark.parametrize(("name", "params"), [
    ("int8", {"key_axis": "row"}), ("int8", {"levels": "4"}), ("cachegen", {"key_bits": "9"}),
    ("cachegen", {"key_bits": "1"}), ("cachegen", {"value_bits": ""}), ("cachegen", {"group_size": "-1"}),
    ("cachegen", {"group_size": "ten"}), ("fp16", {"checksum": "maybe"}), ("cachegen", {"key_bits": True}),
    ("cachegen", {"key_bits": "4.3"}),
])
def test_invalid_codec_parameters_are_clear_errors(name, params):
    with pytest.raises(UnknownCodecError, match=name if "levels" in params else next(iter(params))):
        get_codec(name, **params)


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_params_rebuild_a_codec_that_decodes_the_payload(name, params):
    codec = get_codec(name, **params)
    stored = codec.params()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in stored.items())
    assert set(CODECS) >= {"fp16", "int8", "cachegen"}
    k = torch.randn(7, 2, 8, generator=torch.Generator().manual_seed(2))
    enc = codec.encode_layer(k, k, 1, 3)
    rebuilt = get_codec(codec.name, **stored)
    assert rebuilt.params() == stored
    for a, b in zip(rebuilt.decode_layer(enc, **_shape(k, k, 1, 3)), codec.decode_layer(enc, **_shape(k, k, 1, 3))):
        assert torch.equal(a, b)


def test_cachegen_bits_per_layer_group_are_shallow_first():
    codec = CacheGenCodec(key_bits="8,6,4", value_bits="5")
    assert [codec.bits_for(layer, 30)[0] for layer in (0, 9, 10, 19, 20, 29)] == [8, 8, 6, 6, 4, 4]
    assert {codec.bits_for(layer, 30)[1] for layer in range(30)} == {5}
    assert [codec.bits_for(layer, 2)[0] for layer in range(2)] == [8, 6]


# ---- corrupt, truncated and inconsistent payloads ------------------------------------------------


def _payload(name: str, params: dict, checksum: bool = True):
    codec = get_codec(name, **params, checksum=checksum)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    return codec, codec.encode_layer(k, v, 1, 4), _shape(k, v, 1, 4)


def _reseal(codec, enc: dict) -> dict:
    """Recompute the crc over tampered tensors, as a hostile writer could."""
    from cacheblend_rag.store import codecs as C

    old = enc["crc"]
    enc = {k: t for k, t in enc.items() if k != "crc"}
    # the symbols' crc (cachegen) stays the original's, so a failure is the value check's
    return {**enc, "crc": torch.tensor([C._crc_tensors(enc)] + old.tolist()[1:], dtype=torch.int64)}


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_any_flipped_byte_is_a_codec_error(name, params):
    codec, enc, shape = _payload(name, params)
    for tname, t in enc.items():
        raw = t.contiguous().view(torch.uint8).reshape(-1)
        if raw.numel() == 0:  # cachegen's exact rows with exact_rows=0: no byte to flip
            continue
        for pos in sorted({0, raw.numel() // 2, raw.numel() - 1}):
            bad = raw.clone()
            bad[pos] ^= 0x41
            tampered = {**enc, tname: bad.view(t.dtype).reshape(t.shape)}
            with pytest.raises(CodecError):
                codec.decode_layer(tampered, **shape)


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_truncated_missing_extra_retyped_and_reshaped_tensors_are_codec_errors(name, params, checksum):
    codec, enc, shape = _payload(name, params, checksum)
    for tname, t in enc.items():
        cases = [
            {**enc, tname: t.reshape(-1)[:-1]},  # truncated
            {k: x for k, x in enc.items() if k != tname},  # missing
            {**enc, tname: t.reshape(-1)[:0]},  # empty
            {**enc, tname: t.to(torch.float64)},  # another dtype
            {**enc, tname: torch.cat([t.reshape(-1), t.reshape(-1)])},  # too long
        ]
        if t.dim() > 1:
            cases.append({**enc, tname: t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) if t.dim() > 2
                          else t.reshape(-1)})
        for tampered in cases:
            with pytest.raises(CodecError):
                codec.decode_layer(tampered, **shape)
    with pytest.raises(CodecError):
        codec.decode_layer({**enc, "extra": torch.zeros(1)}, **shape)
    with pytest.raises(CodecError):
        codec.decode_layer(list(enc.values()), **shape)


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_a_payload_read_with_other_shapes_or_layers_is_a_codec_error(name, params):
    codec, enc, shape = _payload(name, params)
    for change in (dict(num_tokens=11), dict(num_tokens=13), dict(num_kv_heads=1), dict(head_dim=4),
                   dict(v_head_dim=16), dict(layer=4), dict(layer=-1), dict(num_tokens=0), dict(dtype=torch.int8)):
        with pytest.raises(CodecError):
            codec.decode_layer(enc, **{**shape, **change})


def test_cachegen_payload_for_other_bits_or_group_size_is_a_codec_error():
    codec, enc, shape = _payload("cachegen", {})
    for other in (dict(key_bits="7,5,4"), dict(value_bits="5"), dict(group_size=4), dict(key_axis="token")):
        with pytest.raises(CodecError):
            get_codec("cachegen", **other).decode_layer(enc, **shape)
    # layer 1 of 4 sits in the first layer group; read as layer 3 of 4 it needs other bits
    with pytest.raises(CodecError, match="encoded for"):
        codec.decode_layer(enc, **{**shape, "layer": 3})


@pytest.mark.parametrize("checksum", [True, False])
def test_hostile_but_well_formed_values_are_codec_errors(checksum):
    """Tampered tensors with a recomputed crc (or none): the decoders check their values, not only bytes."""
    int8, enc, shape = _payload("int8", {}, checksum)
    cases = [{**enc, "k": torch.full_like(enc["k"], -128)}, {**enc, "k_step": torch.zeros_like(enc["k_step"])},
             {**enc, "v_step": torch.full_like(enc["v_step"], math.inf)},
             {**enc, "v_step": -enc["v_step"]}]
    cg, cenc, cshape = _payload("cachegen", {}, checksum)
    ccases = [{**cenc, "tables": torch.zeros_like(cenc["tables"])},
              {**cenc, "k_anchor": torch.full_like(cenc["k_anchor"], math.nan)},
              {**cenc, "v_step": torch.zeros_like(cenc["v_step"])},
              {**cenc, "meta": cenc["meta"] + 1},
              {**cenc, "payload": cenc["payload"][:-1]}]
    for codec, tampered_list, s in ((int8, cases, shape), (cg, ccases, cshape)):
        for tampered in tampered_list:
            if checksum:
                tampered = _reseal(codec, tampered)
            with pytest.raises(CodecError):
                codec.decode_layer(tampered, **s)


def test_cachegen_symbols_that_decode_differently_fail_their_crc():
    """A rewritten ANS payload with a valid outer crc still fails: the symbols' crc catches it."""
    codec, enc, shape = _payload("cachegen", {})
    from cacheblend_rag.store import codecs as C

    payload = enc["payload"].clone()
    payload[len(payload) // 2] ^= 0xFF
    tampered = {**enc, "payload": payload}
    tampered["crc"] = torch.tensor([C._crc_tensors(tampered), int(enc["crc"][1])], dtype=torch.int64)
    with pytest.raises(CodecError, match="symbols"):
        codec.decode_layer(tampered, **shape)


@pytest.mark.parametrize("seed", range(16))
def test_random_corruption_without_checksums_never_raises_anything_but_codec_error(seed):
    """With checksums off a decoder may return wrong values, but only a CodecError or well-shaped KV."""
    gen = torch.Generator().manual_seed(seed)
    name, params = SETTINGS[int(torch.randint(len(SETTINGS), (1,), generator=gen))]
    codec, enc, shape = _payload(name, params, checksum=False)
    tname = sorted(enc)[int(torch.randint(len(enc), (1,), generator=gen))]
    raw = enc[tname].contiguous().view(torch.uint8).reshape(-1).clone()
    idx = torch.randint(raw.numel(), (3,), generator=gen)
    raw[idx] = torch.randint(256, (3,), generator=gen, dtype=torch.uint8)
    tampered = {**enc, tname: raw.view(enc[tname].dtype).reshape(enc[tname].shape)}
    try:
        k, v = codec.decode_layer(tampered, **shape)
    except CodecError:
        return
    assert k.shape == (12, 2, 8) and v.shape == (12, 2, 8)


def test_int8_steps_are_per_token_by_default_and_per_channel_on_request():
    k = torch.randn(5, 2, 4)
    enc = Int8Codec().encode_layer(k, k, 0, 1)
    assert enc["k_step"].shape == (5, 2, 1) and enc["v_step"].shape == (5, 2, 1)
    enc = Int8Codec(key_axis="channel").encode_layer(k, k, 0, 1)
    assert enc["k_step"].shape == (1, 2, 4) and enc["v_step"].shape == (5, 2, 1)


def test_cachegen_half_bits_set_the_levels_between_the_whole_widths():
    """4.5 bits: 10 levels each side (21 symbols), between 4 bits' 7 and 5 bits' 15; the params round-trip."""
    codec = CacheGenCodec(key_bits="6,4.5", value_bits="3.5")
    assert codec.params()["key_bits"] == "6,4.5" and codec.params()["value_bits"] == "3.5"
    assert get_codec("cachegen", **codec.params()).bits_for(1, 2) == (4.5, 3.5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 2, 16, generator=g)
    enc = codec.encode_layer(x, x, 1, 2)
    assert enc["meta"][5:7].tolist() == [10, 5]  # levels: round(2**3.5) - 1, round(2**2.5) - 1
    dk, dv = codec.decode_layer(enc, **_shape(x, x, 1, 2))
    for name, d in (("k", dk), ("v", dv)):
        assert bool(((d - x).abs() <= enc[f"{name}_step"].float() / 2 + 1e-6).all())
    # finer than the whole width below it, coarser than the one above
    errs = [float((CacheGenCodec(key_bits=b).reconstruct_layer(x, x, 0, 1, torch.float32)[0] - x).abs().mean())
            for b in (4, 4.5, 5)]
    assert errs[0] > errs[1] > errs[2]


def test_combined_quality_tables_keep_only_settings_every_run_has(tmp_path, capsys):
    from cacheblend_bench.codec_bench import print_combined

    def run(path, settings, kl):
        path.write_text(json.dumps({s: {"kl": [kl, kl], "agreement": [1.0, 1.0], "bpt": [2.0, 2.0],
                                        "match": [1.0, 1.0]} for s in settings}))
        return str(path)

    print_combined([run(tmp_path / "a.json", ["fp16", "int8", "cachegen"], 0.1),
                    run(tmp_path / "b.json", ["fp16", "int8"], 0.3)])
    out = capsys.readouterr().out
    assert "4 questions from 2 runs (left out, not in every run: cachegen)" in out
    assert "| int8 |" in out and "| cachegen |" not in out


# ---- exact leading rows (issue 30) ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("exact_rows", [1, 4])
def test_cachegen_exact_rows_decode_bit_exact_and_leave_the_others_steps_alone(dtype, exact_rows):
    """The first rows come back as the fp16 store would give them (their own dtype when fp16/bf16), and an
    outlier among them no longer sets the quantization step of every other row."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(40, 2, 16, generator=g)
    v = torch.randn(40, 2, 16, generator=g)
    k[0] *= 50  # a sink-like first row
    k, v = k.to(dtype), v.to(dtype)
    plain, kept = CacheGenCodec(exact_rows=0), CacheGenCodec(exact_rows=exact_rows)
    shape = _shape(k, v, 0, 3, torch.float32)
    dk, dv = kept.decode_layer(kept.encode_layer(k, v, 0, 3), **shape)
    cast = torch.float16 if dtype == torch.float32 else dtype
    assert torch.equal(dk[:exact_rows], k[:exact_rows].to(cast).float())
    assert torch.equal(dv[:exact_rows], v[:exact_rows].to(cast).float())
    pk, _ = plain.decode_layer(plain.encode_layer(k, v, 0, 3), **shape)
    rest = k[exact_rows:].float()
    assert float((dk[exact_rows:] - rest).abs().mean()) < 0.2 * float((pk[exact_rows:] - rest).abs().mean())
    rk, rv = kept.reconstruct_layer(k, v, 0, 3, torch.float32)
    assert torch.equal(rk, dk) and torch.equal(rv, dv)


@pytest.mark.parametrize("num_tokens", [1, 2, 4, 5])
def test_cachegen_chunks_shorter_than_the_exact_rows_keep_one_quantized_row(num_tokens):
    codec = CacheGenCodec(exact_rows=4)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(num_tokens, 2, 8, generator=g), torch.randn(num_tokens, 2, 8, generator=g)
    enc = codec.encode_layer(k, v, 0, 2)
    assert enc["k_exact"].shape[0] == codec.num_exact(num_tokens) == min(4, num_tokens - 1)
    _roundtrip_check(codec, k, v, 0, 2, torch.float32)


def test_a_version_2_cachegen_payload_is_a_clear_codec_error():
    """Version 2 had no exact rows and an 8-entry meta: read by version 3 it is refused, never misread (the
    stores refuse the v2 header before this: an old entry is a miss and gets recomputed)."""
    codec, enc, shape = _payload("cachegen", {"exact_rows": 0}, checksum=False)
    old = {n: t for n, t in enc.items() if n not in ("k_exact", "v_exact")}
    old["meta"] = enc["meta"][:8].clone()
    with pytest.raises(CodecError, match="expected"):
        codec.decode_layer(old, **shape)
    with pytest.raises(CodecError, match="meta"):
        codec.decode_layer({**old, "k_exact": enc["k_exact"], "v_exact": enc["v_exact"]}, **shape)
    assert CacheGenCodec.version == "3"


def test_cachegen_exact_rows_is_a_validated_parameter_in_the_header():
    assert get_codec("cachegen", exact_rows="2").params()["exact_rows"] == "2"
    for bad in ("-1", "x", 1.5):
        with pytest.raises(UnknownCodecError):
            get_codec("cachegen", exact_rows=bad)


def test_tail_stats_are_per_question_deltas_against_the_fp16_store():
    from cacheblend_bench.codec_bench import tail_rows, tail_stats

    n = 10
    fp16 = {"kl": [0.1] * n, "agreement": [1.0] * n, "bpt": [20.0] * n, "question": [float(i) for i in range(n)],
            "text": ["a b"] * n}
    coded = {**fp16, "kl": [0.1] * 8 + [0.15, 0.4], "agreement": [1.0] * 9 + [0.5], "bpt": [4.0] * n,
             "text": ["a b"] * 9 + ["c"], "kl_none": [0.01 * i for i in range(n)]}
    t = tail_stats({"fp16": fp16, "cachegen": coded})["cachegen"]
    assert t["ratio"] == pytest.approx(5.0) and t["median"] == pytest.approx(0.0)
    assert t["mean"] == pytest.approx(0.035) and t["max"] == pytest.approx(0.3) and t["worst_question"] == 9
    assert t["p90"] == pytest.approx(0.3)  # nearest rank: the 10th of 10
    assert t["none_p90"] == pytest.approx(0.09) and math.isnan(tail_stats({"fp16": fp16})["fp16"]["none_p90"])  # older JSON
    assert t["d_agreement"] == pytest.approx(-0.05) and t["f1_vs_base"] == pytest.approx(0.9)
    assert "(q9)" in tail_rows({"fp16": fp16, "cachegen": coded})[1]


def test_diagnosis_mix_codes_only_the_named_layers_and_puts_first_rows_back():
    from cacheblend_bench.codec_bench import _mixed

    g = torch.Generator().manual_seed(0)
    orig = ChunkKV(tuple(torch.randn(6, 1, 4, generator=g) for _ in range(3)),
                   tuple(torch.randn(6, 1, 4, generator=g) for _ in range(3)), torch.arange(6))
    coded = ChunkKV(tuple(k + 1 for k in orig.keys), tuple(v + 1 for v in orig.values), orig.token_ids)
    mixed = _mixed(orig, coded, k_layers={1}, v_layers={0, 2}, exact_rows=2)
    assert torch.equal(mixed.keys[0], orig.keys[0]) and torch.equal(mixed.values[1], orig.values[1])
    assert torch.equal(mixed.keys[1][:2], orig.keys[1][:2]) and torch.equal(mixed.keys[1][2:], coded.keys[1][2:])
    assert torch.equal(mixed.values[2][2:], coded.values[2][2:])
