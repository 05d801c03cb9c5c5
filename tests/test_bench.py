"""Benchmark metrics on hand-checked cases, and the engine benchmark end to end on one real question."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cacheblend_rag.bench.engine_bench import MethodSpec, main as bench_main
from cacheblend_rag.bench.metrics import best_f1, first_token_kl, normalize_answer, rouge_l, token_f1


def test_normalize_answer_follows_squad():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"


def test_token_f1_hand_checked():
    assert token_f1("Exeter College", "Exeter College") == 1.0
    # pred {university, of, oxford}, ref {university, college, oxford}: 2 common → P = R = 2/3
    assert math.isclose(token_f1("University of Oxford", "University College, Oxford"), 2 / 3)
    assert token_f1("Paris", "London") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("the", "Paris") == 0.0
    assert best_f1("in Paris", ["London", "Paris"]) == pytest.approx(2 / 3)


def test_rouge_l_hand_checked():
    # LCS of [a, b, c, d] and [a, c, d, e] (after normalization 'a' is an article, so use other words)
    assert math.isclose(rouge_l("cat sat on mat", "cat on mat today"), 2 * (3 / 4) * (3 / 4) / (3 / 4 + 3 / 4))
    assert rouge_l("x y", "z") == 0.0


def test_first_token_kl():
    logits = torch.tensor([2.0, 0.0, -1.0])
    assert first_token_kl(logits, logits) == pytest.approx(0.0, abs=1e-7)
    p = logits.softmax(-1)
    q = torch.tensor([0.0, 0.0, 0.0]).softmax(-1)
    assert first_token_kl(logits, torch.zeros(3)) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-5)


def test_method_spec_parsing():
    spec = MethodSpec.parse("cacheblend@0.15/deviation=kv/check_layers=1+2/schedule=6:0.1/chunk_head_tokens=4")
    assert (spec.method, spec.ratio) == ("cacheblend", 0.15)
    assert spec.options == {"deviation": "kv", "check_layers": (1, 2), "schedule": ((6, 0.1),), "chunk_head_tokens": 4}
    assert MethodSpec.parse("full_reuse").ratio is None


@pytest.mark.model
def test_engine_bench_end_to_end(musique, tmp_path, capsys, monkeypatch):
    from conftest import musique_path

    bench_main([str(musique_path()), "--limit", "1", "--chunks", "2", "--methods", "full_prefill,cacheblend@0.15",
                "--max-new-tokens", "4", "--dtype", "float32", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "| full_prefill |" in printed and "| cacheblend@0.15 |" in printed
    result = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in result["records"]} == {"full_prefill", "cacheblend@0.15"}
    assert result["summary"]["full_prefill"]["speedup"] == pytest.approx(1.0)
    assert result["summary"]["full_prefill"]["agreement_f1"] == pytest.approx(1.0)
    assert 0 < result["summary"]["cacheblend@0.15"]["recompute_ratio_effective"] < 0.5
