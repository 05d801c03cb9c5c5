"""The engine over a real on-disk store: persistence across engines, damaged files, foreign models."""

from __future__ import annotations

import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.store import DiskStore, KVKey

from conftest import tiny_model

TEXTS = ["Lyon sits where the Rhône meets the Saône.", "Granite forms from slowly cooled magma deep underground."]
QUESTION = "Which rivers meet in Lyon?"


def _engine(tokenizer, path, seed=0):
    return CacheBlendEngine(tiny_model("llama", len(tokenizer), seed=seed), tokenizer, kv_store=path)


def test_kv_survives_a_new_engine_and_is_used(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path).ingest(TEXTS, show_progress=False)
    fresh = _engine(tokenizer, tmp_path)
    pre = fresh.prefill(ids, QUESTION, method="full_reuse")  # by id only: text comes back from the store
    assert pre.stats["chunk_hits"] == ids and pre.stats["chunk_misses"] == []
    assert fresh.kv_store.stats()["disk"]["hits"] >= 2


def test_truncated_file_is_recomputed_not_a_crash(tokenizer, tmp_path):
    engine = _engine(tokenizer, tmp_path)
    ids = engine.ingest(TEXTS, show_progress=False)
    reference = engine.prefill(TEXTS, QUESTION, method="full_reuse").logits
    path = DiskStore(tmp_path).path_for(KVKey(engine.namespace, ids[0]))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again = _engine(tokenizer, tmp_path)  # new engine: empty memory tier, must read the damaged file
    first = again.prefill(TEXTS, QUESTION, method="full_reuse")
    assert first.stats["chunk_misses"] == [ids[0]]  # treated as a hole, computed in full
    second = again.prefill(TEXTS, QUESTION, method="full_reuse")
    assert second.stats["chunk_misses"] == [] and torch.allclose(second.logits, reference, atol=1e-3)


def test_kv_of_another_model_is_never_used(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path, seed=0).ingest(TEXTS, show_progress=False)
    other = _engine(tokenizer, tmp_path, seed=1)
    assert other.namespace != _engine(tokenizer, tmp_path, seed=0).namespace
    pre = other.prefill(TEXTS, QUESTION, method="full_reuse")
    assert pre.stats["chunk_misses"] == ids
