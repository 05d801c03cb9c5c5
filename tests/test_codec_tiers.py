"""Codecs per tier: a coded memory tier, per-tier codecs in open_store specs, the simulated slow remote tier, and
the controller's per-tier codec choice from measured decode speeds."""

from __future__ import annotations

import time

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ConfigError
from cacheblend_rag.loading.controller import RECOMPUTE, LoadingController, choose_codec
from cacheblend_rag.loading.profile import (CodecProfile, ComputeProfile, TierProfile, measure_codec_profile,
                                            synthetic_kv)
from cacheblend_rag.store import ChunkKV, KVKey, LayerReadError, MemoryStore, TieredStore, open_store
from cacheblend_rag.store.codecs import CODECS, get_codec
from cacheblend_rag.store.throttled import MBIT, ThrottledStore

from conftest import tiny_model

KEY = KVKey("model-a", "abcdef01")
TEXTS = [
    "Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
    "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
    "The violin has four strings tuned in perfect fifths: G, D, A and E.",
]
QUESTION = "Which rivers meet in Lyon?"


def make_kv(tokens: int = 37, layers: int = 4, heads: int = 2, dim: int = 16, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(tuple(torch.randn(tokens, heads, dim, generator=g).to(dtype) for _ in range(layers)),
                   tuple(torch.randn(tokens, heads, dim, generator=g).to(dtype) for _ in range(layers)),
                   torch.arange(tokens), positions_start=3)


def _max_step_bound(codec_name: str, kv: ChunkKV) -> float:
    """Half the coarsest quantization step any layer of `kv` can get under the codec's defaults (absmax/levels)."""
    codec = get_codec(codec_name)
    bound = 0.0
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
        kb, vb = codec.bits_for(layer, kv.num_layers) if hasattr(codec, "bits_for") else (8, 8)
        for x, bits in ((k, kb), (v, vb)):
            amax = float(x.float().abs().max())
            # a delta from an anchor is at most twice the absmax; steps are rounded up to fp16 (+2**-10), anchors
            # stored in fp16 (+2**-11 of their size)
            bound = max(bound, 2 * amax / (round(2 ** (bits - 1)) - 1) / 2 * (1 + 2.0**-9) + amax * 2.0**-10)
    return bound


# ---- a coded memory tier ---------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp16", "int8", "cachegen"])
def test_coded_memory_tier_round_trips_within_the_codecs_bound_in_the_dtype_put(codec):
    kv = make_kv()
    store = MemoryStore(None, codec=codec)
    store.put(KEY, kv)
    out = store.get(KEY)
    assert out.keys[0].dtype == torch.float32 and torch.equal(out.token_ids, kv.token_ids)
    assert out.positions_start == 3
    bound = 2.0 ** -10 * 8 if codec == "fp16" else _max_step_bound(codec, kv)
    for a, b in zip(out.keys + out.values, kv.keys + kv.values):
        assert float((a - b).abs().max()) <= bound


@pytest.mark.parametrize("codec", ["int8", "cachegen"])
def test_coded_memory_reader_decodes_per_layer_and_counts_coded_bytes(codec):
    kv = make_kv()
    store = MemoryStore(None, codec=codec)
    store.put(KEY, kv)
    reader = store.reader(KEY)
    assert reader.tier == "memory" and reader.num_layers == 4 and reader.num_tokens == 37
    whole = store.get(KEY)
    for layer in (2, 0, 1, 3):
        k, v = reader.layer(layer)
        assert torch.equal(k, whole.keys[layer]) and torch.equal(v, whole.values[layer])
    coded = store.entry_nbytes(KEY) - kv.token_ids.numel() * 8
    assert reader.bytes_read == coded  # every layer read once: the coded bytes, not the decoded ones
    assert coded < kv.nbytes / 2  # fp32 input: int8 is under a quarter, cachegen less


def test_a_byte_budget_holds_more_chunks_coded_densely():
    kvs = [make_kv(seed=i, tokens=64) for i in range(8)]
    probe = MemoryStore(None, codec="fp16")
    probe.put(KEY, kvs[0])
    budget = int(3.5 * probe.entry_nbytes(KEY))  # 3 entries in fp16
    held = {}
    for codec in ("fp16", "int8", "cachegen"):
        store = MemoryStore(budget, codec=codec)
        for i, kv in enumerate(kvs):
            store.put(KVKey("m", f"c{i}"), kv)
        held[codec] = len(store)
        assert store.stats()["bytes"] <= budget and store.stats()["codec"] == codec
    assert held["fp16"] == 3 and held["int8"] == 6 and held["cachegen"] == 8


def test_a_corrupt_coded_memory_entry_is_a_miss_and_a_layer_read_error():
    store = MemoryStore(None, codec="cachegen")
    store.put(KEY, make_kv())
    entry = store._entries[KEY]
    entry.layers[1]["payload"][5] ^= 0xFF
    with pytest.raises(LayerReadError):
        store.reader(KEY).layer(1)
    assert store.get(KEY) is None and not store.contains(KEY)  # dropped: the next put recomputes it


def test_coded_memory_evictions_hand_decoded_kv_to_the_spill():
    kv = make_kv(tokens=64)
    spilled = []
    memory = MemoryStore(int(kv.nbytes * 0.3), lambda key, kv: spilled.append((key, kv)), codec="int8")  # holds one
    memory.put(KVKey("m", "a"), kv)
    memory.put(KVKey("m", "b"), make_kv(tokens=64, seed=1))
    assert [k.chunk_id for k, _ in spilled] == ["a"] and isinstance(spilled[0][1], ChunkKV)
    assert torch.allclose(spilled[0][1].keys[0], kv.keys[0], atol=_max_step_bound("int8", kv))


def test_memory_codec_none_keeps_the_kv_as_put():
    kv = make_kv()
    store = MemoryStore(None)
    store.put(KEY, kv)
    assert store.get(KEY) is kv and store.stats()["codec"] is None and store.keys() == [KEY]


def test_unknown_memory_codec_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown memory-tier codec"):
        MemoryStore(None, codec="zstd")


def test_engine_over_a_coded_memory_tier_hits_and_stays_close_to_exact(tokenizer):
    model = tiny_model("qwen2", len(tokenizer))
    exact = CacheBlendEngine(model, tokenizer, kv_store=None)
    coded = CacheBlendEngine(model, tokenizer, kv_store=["memory?codec=int8"])
    for engine in (exact, coded):
        engine.ingest(TEXTS, show_progress=False)
    a = exact.prefill(TEXTS, QUESTION, method="full_reuse")
    b = coded.prefill(TEXTS, QUESTION, method="full_reuse")
    assert len(b.stats["chunk_hits"]) == 3 and not b.stats["chunk_misses"]
    assert 0 < b.stats["kv_bytes_loaded"] < a.stats["kv_bytes_loaded"] / 3  # fp32 engine: int8 < 1/4 + steps
    key = KVKey(exact.namespace, a.stats["chunk_hits"][0])
    want, got = exact.kv_store.get(key), coded.kv_store.get(key)
    for x, y in zip(want.keys + want.values, got.keys + got.values):
        assert float((x - y).abs().max()) <= float(x.abs().max()) / 127  # absmax int8: half a step per token
    assert float((a.logits - b.logits).abs().max()) < 0.05 * float(a.logits.abs().max())


# ---- per-tier codecs in open_store specs ---------------------------------------------------------


def test_tier_specs_choose_each_tiers_codec(tmp_path):
    store = open_store(["memory?codec=int8", f"disk:{tmp_path}?codec=cachegen"])
    assert store.memory.codec.name == "int8" and store.disk.codec.name == "cachegen"
    single = open_store("memory?codec=cachegen")
    assert isinstance(single, MemoryStore) and single.codec.name == "cachegen"
    plain = open_store(["memory", f"disk:{tmp_path}"], codec="int8")
    assert plain.memory.codec is None and plain.disk.codec.name == "int8"  # codec= is the disk default


@pytest.mark.parametrize("spec,match", [("memory?codec=zstd", "unknown KV codec"),
                                        ("memory?level=3", "unknown tier option"),
                                        ("memory?codec=", "unknown tier option")])
def test_bad_tier_codec_options_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        open_store([spec])


def test_auto_tier_codec_is_a_measured_choice(tmp_path):
    store = open_store(["memory?codec=auto", f"disk:{tmp_path}?codec=auto"])
    assert store.memory.codec.name in CODECS
    assert (store.disk.codec.name if store.disk.codec is not None else "fp16") in CODECS


# ---- the simulated slow remote tier ----------------------------------------------------------------


def test_throttled_reader_returns_the_inner_layers_no_faster_than_the_link():
    kv = make_kv(tokens=64)
    inner = MemoryStore(None, codec="int8")
    inner.put(KEY, kv)
    bandwidth = 2 * MBIT  # 250 kB/s: the 4 layers take tens of milliseconds
    store = ThrottledStore(inner, bandwidth, latency_s=0.01)
    started = time.perf_counter()
    reader = store.reader(KEY)
    layers = [reader.layer(i) for i in range(4)]
    elapsed = time.perf_counter() - started
    assert reader.tier == "remote" and reader.bytes_read == inner.entry_nbytes(KEY) - 64 * 8
    assert elapsed >= 0.01 + reader.bytes_read / bandwidth  # a lower bound: sleeping never returns early
    for i, (k, v) in enumerate(layers):
        assert torch.equal(k, inner.get(KEY).keys[i]) and torch.equal(v, inner.get(KEY).values[i])


def test_readers_open_at_once_share_the_link():
    inner = MemoryStore(None)
    keys = [KVKey(KEY.namespace, f"chunk{i}") for i in range(3)]
    for i, key in enumerate(keys):
        inner.put(key, make_kv(tokens=64, seed=i))
    bandwidth = 4 * MBIT
    store = ThrottledStore(inner, bandwidth)
    started = time.perf_counter()
    readers = [store.reader(key) for key in keys]
    for layer in range(4):  # as the layer loop reads: layer l of every chunk, then l + 1
        for reader in readers:
            reader.layer(layer)
    elapsed = time.perf_counter() - started
    total = sum(r.bytes_read for r in readers)
    assert elapsed >= total / bandwidth  # all three entries crossed one link, not one link each


def test_throttled_get_misses_and_passes_writes_through():
    inner = MemoryStore(None)
    store = ThrottledStore(inner, 1e9, name="slow")
    assert store.get(KEY) is None and store.reader(KEY) is None
    store.put(KEY, make_kv())
    assert inner.contains(KEY) and store.contains(KEY) and store.tiers() == {"slow": None}
    assert torch.equal(store.get(KEY).keys[0], make_kv().keys[0])
    assert store.stats()["tier"] == "slow" and store.delete(KEY) and not inner.contains(KEY)


@pytest.mark.parametrize("bw,latency", [(0, 0.0), (-1.0, 0.0), (1e6, -0.1), ("fast", 0.0)])
def test_throttled_store_rejects_bad_settings(bw, latency):
    with pytest.raises(ConfigError):
        ThrottledStore(MemoryStore(None), bw, latency_s=latency)


def test_engine_over_a_throttled_tier_promotes_into_memory(tokenizer):
    model = tiny_model("qwen2", len(tokenizer))
    remote = ThrottledStore(MemoryStore(None, codec="cachegen"), 100 * MBIT)
    engine = CacheBlendEngine(model, tokenizer, kv_store=TieredStore(MemoryStore(None), remote))
    engine.ingest(TEXTS, show_progress=False)
    engine.kv_store.memory.clear()
    first = engine.prefill(TEXTS, QUESTION, method="full_reuse")
    assert len(first.stats["chunk_hits"]) == 3 and first.stats["kv_bytes_loaded"] > 0
    hits = [KVKey(engine.namespace, c) for c in first.stats["chunk_hits"]]
    assert all(engine.kv_store.memory.contains(k) for k in hits)  # promoted when the request ended
    assert engine.prefill(TEXTS, QUESTION, method="full_reuse").stats["kv_bytes_loaded"] > 0


# ---- choosing a codec per tier ---------------------------------------------------------------------


CODEC_PROFILES = {  # fp16-equivalent decode speeds: raw is a cast, int8 a multiply, cachegen entropy decoding
    "fp16": CodecProfile("fp16", 1.0, 2e9),
    "int8": CodecProfile("int8", 0.52, 5e8),
    "cachegen": CodecProfile("cachegen", 0.19, 3e7),
}


def test_fast_tiers_choose_raw_and_slow_tiers_choose_denser_codecs():
    pick = {bw: choose_codec(TierProfile("t", bw), CODEC_PROFILES).codec for bw in (10e9, 200e6, 1e6)}
    assert pick == {10e9: "fp16", 200e6: "int8", 1e6: "cachegen"}


def test_the_choice_minimises_the_estimated_fetch_time():
    tier = TierProfile("remote", 12.5e6)
    choice = choose_codec(tier, CODEC_PROFILES)
    for name, seconds in choice.seconds_per_mb.items():
        assert seconds == pytest.approx(1e6 * CODEC_PROFILES[name].size_ratio / 12.5e6
                                        + 1e6 / CODEC_PROFILES[name].decode_bytes_per_s)
        assert choice.seconds_per_mb[choice.codec] <= seconds


def test_the_quality_floor_limits_the_candidates():
    assert choose_codec(TierProfile("t", 1e6), CODEC_PROFILES, allowed=("fp16", "int8")).codec == "int8"
    with pytest.raises(ConfigError, match="no codec is allowed"):
        choose_codec(TierProfile("t", 1e6), CODEC_PROFILES, allowed=("zstd",))


def test_the_controller_recomputes_when_fetching_is_slower():
    compute = ComputeProfile(num_tokens=2048, layer_fixed_s=1e-3, layer_per_row_s=1e-5, full_prefill_s=1.0)
    tiers = {"memory": TierProfile("memory", 10e9), "remote": TierProfile("remote", 1e5)}
    controller = LoadingController(compute, tiers)
    per_token_layer = 2 * 2 * 3 * 64  # fp16 bytes of one token's K and V in one layer
    assert controller.choose_codec("memory", CODEC_PROFILES, per_token_layer).codec == "fp16"
    slow = controller.choose_codec("remote", CODEC_PROFILES, per_token_layer)
    assert slow.codec == RECOMPUTE and slow.seconds_per_mb[RECOMPUTE] == pytest.approx(1e-5 * 1e6 / per_token_layer)
    with pytest.raises(ConfigError, match="no profile for tier"):
        controller.choose_codec("redis", CODEC_PROFILES, per_token_layer)


def test_measured_codec_profiles_order_the_codecs_by_size():
    kv = synthetic_kv(num_layers=2, num_tokens=128)
    profiles = {n: measure_codec_profile(n, [kv], repeats=1) for n in ("fp16", "int8", "cachegen")}
    assert profiles["fp16"].size_ratio == pytest.approx(1.0, rel=1e-3)
    assert 0.5 < profiles["int8"].size_ratio < 0.56
    assert profiles["cachegen"].size_ratio < 0.4
    assert all(p.decode_bytes_per_s > 0 for p in profiles.values())


def test_profile_command_prints_each_tiers_codec_choice(tokenizer, capsys):
    from cacheblend_rag.cli import _print_codec_choice

    engine = CacheBlendEngine(tiny_model("qwen2", len(tokenizer)), tokenizer, kv_store=None)
    compute = ComputeProfile(num_tokens=2048, layer_fixed_s=1e-3, layer_per_row_s=1e-5, full_prefill_s=1.0)
    _print_codec_choice(engine, compute, {"memory": TierProfile("memory", 10e9), "disk": TierProfile("disk", 1e9)})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["codec fp16", "codec int8", "codec cachegen", "KV on memory",
                                                      "KV on disk", "KV on 1 Gbit/s", "KV on 100 Mbit/s"]
    picks = [line.split(": ")[1].split(" ")[0] for line in lines[3:]]
    assert all(p in ("fp16", "int8", "cachegen", RECOMPUTE) for p in picks)
