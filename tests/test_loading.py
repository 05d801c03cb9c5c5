"""Layer-wise KV loading from disk: pipelined and on-demand loading agree; a bad read mid-request recomputes."""

from __future__ import annotations

import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.loading import DiskLayers
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
    reader = DiskLayers.open(store, KVKey(engine.namespace, ids[1]))
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
