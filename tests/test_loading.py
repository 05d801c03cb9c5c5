"""Layer-wise KV loading from disk: pipelined and on-demand loading agree; a bad read mid-request recomputes."""

from __future__ import annotations

import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.store import DiskStore, KVKey

from conftest import tiny_model

TEXTS = [
    "Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
    "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
    "The violin has four strings tuned in perfect fifths: G, D, A and E.",
]
QUESTION = "Which rivers meet in Lyon?"


def _engine(tokenizer, path, depth):
    model = tiny_model("qwen2", len(tokenizer))
    return CacheBlendEngine(model, tokenizer, kv_store=DiskStore(path, dtype=torch.float32), prefetch_depth=depth)


def test_pipelined_and_on_demand_loading_give_identical_kv_and_logits(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path, 0).ingest(TEXTS, show_progress=False)
    results = {}
    for depth in (0, 1, 4):
        engine = _engine(tokenizer, tmp_path, depth)  # disk only: every layer is read during the loop
        pre = engine.prefill(ids, QUESTION, recompute_ratio=0.3)
        assert pre.stats["chunk_hits"] == ids and pre.stats["kv_bytes_loaded"] > 0
        results[depth] = pre
    for depth in (1, 4):
        assert torch.equal(results[depth].logits, results[0].logits)
        for a, b in zip(results[depth].keys + results[depth].values, results[0].keys + results[0].values):
            assert torch.equal(a, b)


def test_a_layer_that_fails_mid_request_falls_back_to_computing_the_chunk(tokenizer, tmp_path):
    engine = _engine(tokenizer, tmp_path, 2)
    ids = engine.ingest(TEXTS, show_progress=False)
    reference = engine.prefill(ids, QUESTION, method="full_prefill")
    store = engine.kv_store
    path = store.path_for(KVKey(engine.namespace, ids[1]))
    reader = store.reader(KVKey(engine.namespace, ids[1]))
    assert reader is not None  # the header is fine when the request starts...
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # ...but the last layer's bytes are damaged
    path.write_bytes(bytes(data))
    pre = engine.prefill(ids, QUESTION, method="full_reuse")
    assert ids[1] in pre.stats["chunk_misses"]  # recomputed as a hole, not a crash
    assert torch.isfinite(pre.logits).all()
    again = engine.prefill(ids, QUESTION, method="full_reuse")  # the hole was stored again
    assert again.stats["chunk_misses"] == []
    assert torch.allclose(engine.prefill(ids, QUESTION, recompute_ratio=1.0).logits, reference.logits, atol=1e-4)


def test_disk_reads_are_promoted_to_memory(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path, 0).ingest(TEXTS, show_progress=False)
    model = tiny_model("qwen2", len(tokenizer))
    engine = CacheBlendEngine(model, tokenizer, kv_store=tmp_path)  # memory tier over the same disk
    assert engine.kv_store.stats()["memory"]["entries"] == 0
    first = engine.prefill(ids, QUESTION, method="full_reuse")
    assert engine.kv_store.stats()["memory"]["entries"] >= len(ids)
    second = engine.prefill(ids, QUESTION, method="full_reuse")
    assert torch.equal(first.logits, second.logits)


from cacheblend_rag.loading.controller import LoadingController, Tier  # noqa: E402
from cacheblend_rag.loading.profile import ComputeProfile, TierProfile  # noqa: E402

COMPUTE = ComputeProfile(num_tokens=4000, layer_fixed_s=0.002, layer_per_row_s=1e-5, full_prefill_s=8.0)


def _controller(disk_bytes_per_s: float) -> LoadingController:
    tiers = {"memory": TierProfile("memory", 10e9), "disk": TierProfile("disk", disk_bytes_per_s)}
    return LoadingController(COMPUTE, tiers, quality_floor=0.15)


def test_controller_follows_its_inputs():
    layer_bytes = 3000 * 3 * 64 * 2 * 2  # 3000 reused tokens, 3 kv heads, d=64, K+V, fp16
    fast = _controller(1e9).choose_ratio(3000, 100, 4000, {"memory": layer_bytes})
    assert fast.recompute_ratio == 0.15 and fast.balanced_ratio < 0.15  # fast memory: the quality floor
    slowish = _controller(200e6).choose_ratio(3000, 100, 4000, {"disk": layer_bytes})
    slower = _controller(100e6).choose_ratio(3000, 100, 4000, {"disk": layer_bytes})
    assert 0.15 < slowish.recompute_ratio < slower.recompute_ratio <= 1.0  # slower disk → larger r
    crawl = _controller(1e5).choose_ratio(3000, 100, 4000, {"disk": layer_bytes})
    assert crawl.recompute_ratio == 1.0  # capped
    # At the balanced ratio, the estimated recompute of a layer matches its load.
    assert abs(slowish.est_layer_recompute_s - slowish.est_layer_load_s) / slowish.est_layer_load_s < 0.05


def test_cheapest_tier_that_hides_the_load():
    c = _controller(1e9)
    tiers = [Tier("ram", 10e9, 5.0), Tier("ssd", 1e9, 0.1), Tier("hdd", 500e6, 0.02), Tier("s3", 5e6, 0.01)]
    layer_bytes = 3000 * 3 * 64 * 2 * 2
    assert c.cheapest_tier(tiers, 0.15, 3000, 100, 4000, layer_bytes).name == "hdd"
    assert c.cheapest_tier(tiers, 0.01, 3000, 0, 4000, layer_bytes * 20).name == "ram"  # none hides it: fastest


def test_auto_ratio_on_an_engine(tokenizer, tmp_path):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=tmp_path / "kv",
                              home=tmp_path, quality_floor=0.2)
    ids = engine.ingest(TEXTS, show_progress=False)
    pre = engine.prefill(ids, QUESTION, recompute_ratio="auto")
    decision = pre.stats["controller"]
    assert decision["recompute_ratio"] >= 0.2 and pre.stats["recompute_ratio"] == decision["recompute_ratio"]
    assert list((tmp_path / "profiles").glob("*.json"))  # measured once, cached
