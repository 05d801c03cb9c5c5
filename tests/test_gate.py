"""The fidelity gate: a model's ratio measured against its own full prefill on the built-in calibration set, used by
every request that names no ratio, reported in its stats; a model that meets the target at no ratio below 1 is
served full prefill's answers, with a warning."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, Request, gate
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.policies import DEFAULT_METHOD, Relevance
from cacheblend_rag.serve.schemas import CacheBlendOptions

from conftest import tiny_model

TEXTS = ["Glasgow\nThe University of Glasgow was founded in 1451 by a papal bull.",
         "Princeton\nPrinceton University in New Jersey was founded in 1746.",
         "Exeter\nExeter College is one of the constituent colleges of the University of Oxford."]
QUESTION = "Which university was founded in 1451?"


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """This machine's decisions in a folder of the test's own, measured on first use as by default."""
    monkeypatch.setenv("CACHEBLEND_RAG_MODELS", str(tmp_path / "models"))
    monkeypatch.delenv("CACHEBLEND_RAG_GATES", raising=False)
    monkeypatch.delenv("CACHEBLEND_RAG_CALIBRATE", raising=False)
    return tmp_path / "models"


@pytest.fixture
def model(tokenizer):
    return tiny_model("qwen2", len(tokenizer))


def _engine(model, tokenizer, **kwargs) -> CacheBlendEngine:
    return CacheBlendEngine(model, tokenizer, None, model_name="tiny-qwen2", **kwargs)


def test_calibration_picks_the_first_ratio_that_meets_the_target_or_none(model, tokenizer, models_dir):
    engine = _engine(model, tokenizer)
    items = gate.calibration_items()[:2]
    easy = gate.calibrate(engine, target_kl=1e9, min_agreement=0.5, ratios=(0.3, 0.5), items=items,
                          answerable=[], show_progress=False)
    assert (easy.ratio, easy.met, [row["ratio"] for row in easy.table]) == (0.3, True, [0.3])
    assert easy.expected_kl == easy.table[0]["mean_kl"] and easy.num_questions == 2 and easy.mean_tokens > 100
    hard = gate.calibrate(engine, target_kl=1e-12, min_agreement=1.0, ratios=(0.3, 0.5), items=items,
                          answerable=[], show_progress=False)
    assert (hard.ratio, hard.met, [row["ratio"] for row in hard.table]) == (1.0, False, [0.3, 0.5])
    assert all(row["mean_kl"] > 1e-12 for row in hard.table)  # measured, not assumed: reuse is approximate here
    assert not models_dir.exists()  # calibrating stores nothing by itself
    with pytest.raises(ConfigError, match="recompute ratio"):
        gate.calibrate(engine, "full_reuse", items=items, show_progress=False)


def test_a_request_that_names_no_ratio_runs_at_the_models_ratio(model, tokenizer, models_dir):
    engine = _engine(model, tokenizer)
    decision = gate.calibrate(engine, target_kl=1e9, min_agreement=0.5, ratios=(0.5,),
                              items=gate.calibration_items()[:1], answerable=[], show_progress=False)
    path = gate.store(decision)
    assert path.is_file() and path.parent == models_dir / "gates"
    assert gate.find(engine.fingerprint, engine.model_name) == decision

    served = _engine(model, tokenizer)  # a new engine on the same model reads this machine's decision
    ids = served.ingest(TEXTS, show_progress=False)
    out = served.prefill(ids, QUESTION)
    assert out.stats["method"] == DEFAULT_METHOD and out.stats["recompute_ratio"] == 0.5
    assert out.stats["fidelity"] == decision.stats() and out.stats["fidelity"]["met"]
    named = served.prefill(ids, QUESTION, recompute_ratio=0.15)  # a named ratio always wins
    assert named.stats["recompute_ratio"] == 0.15 and "fidelity" not in named.stats
    other = served.prefill(ids, QUESTION, "cacheblend")  # no decision for that method: its own default
    assert other.stats["recompute_ratio"] == 0.15 and "fidelity" not in other.stats
    auto = served.prefill(ids, QUESTION, recompute_ratio="auto")
    assert "fidelity" not in auto.stats


def test_a_model_that_meets_no_ratio_is_served_full_prefills_answers_with_a_warning(model, tokenizer, models_dir,
                                                                                    caplog):
    engine = _engine(model, tokenizer)
    gate.store(gate.calibrate(engine, target_kl=1e-12, min_agreement=1.0, ratios=(0.2,),
                              items=gate.calibration_items()[:1], answerable=[], show_progress=False))
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.engine"):
        served = _engine(model, tokenizer)
    assert "tiny-qwen2" in caplog.text and "at no recompute ratio up to 0.2" in caplog.text
    ids = served.ingest(TEXTS, show_progress=False)
    gated = served.prefill(ids, QUESTION)
    full = served.prefill(ids, QUESTION, "full_prefill")
    assert gated.stats["recompute_ratio"] == 1.0 and not gated.stats["fidelity"]["met"]
    torch.testing.assert_close(gated.logits, full.logits, rtol=1e-4, atol=1e-4)
    reuse = served.prefill(ids, QUESTION, recompute_ratio=0.0)  # still the user's to trade away
    assert reuse.stats["num_recomputed"] == 0


def test_from_pretrained_calibrates_a_model_on_first_use_only(tokenizer, tmp_path, models_dir, monkeypatch):
    folder = tmp_path / "tiny-llama"
    tiny_model("llama", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    items = gate.calibration_items()[:2]
    monkeypatch.setattr(gate, "calibration_items", lambda: items)
    few = gate.calibration_answerable()[:2]
    monkeypatch.setattr(gate, "calibration_answerable", lambda: few)
    first = CacheBlendEngine.from_pretrained(str(folder), device="cpu", dtype="float32")
    decision = first.gate(DEFAULT_METHOD)
    assert decision is not None and decision.source == "measured" and decision.num_questions == 2
    assert gate.gate_path(first.fingerprint, DEFAULT_METHOD).is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("calibrated twice")

    monkeypatch.setattr(gate, "calibrate", refuse)
    again = CacheBlendEngine.from_pretrained(str(folder), device="cpu", dtype="float32")
    assert again.gate(DEFAULT_METHOD) == decision
    skipped = CacheBlendEngine.from_pretrained(str(folder), device="cpu", dtype="float32", calibrate=False)
    assert skipped.gate(DEFAULT_METHOD) == decision  # calibrate=False measures nothing, but reads what is stored


def test_the_environment_moves_the_decisions_and_turns_measuring_off(tokenizer, tmp_path, models_dir, monkeypatch):
    """$CACHEBLEND_RAG_GATES: where this machine's decisions live; $CACHEBLEND_RAG_CALIBRATE=0: a first use reads
    stored and shipped decisions only; a value that is neither is an error before the model loads."""
    folder = tmp_path / "tiny-llama"
    tiny_model("llama", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.setenv("CACHEBLEND_RAG_GATES", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("CACHEBLEND_RAG_CALIBRATE", "off")
    engine = CacheBlendEngine.from_pretrained(str(folder), device="cpu", dtype="float32")
    assert engine.gate(DEFAULT_METHOD) is None and not (tmp_path / "elsewhere").exists()
    decision = gate.calibrate(engine, target_kl=1e9, min_agreement=0.5, ratios=(0.5,),
                              items=gate.calibration_items()[:1], answerable=[], show_progress=False)
    assert gate.store(decision).parent == tmp_path / "elsewhere" and not models_dir.exists()
    assert CacheBlendEngine.from_pretrained(str(folder), device="cpu", dtype="float32").gate(DEFAULT_METHOD) == decision
    monkeypatch.setenv("CACHEBLEND_RAG_CALIBRATE", "sometimes")
    with pytest.raises(ConfigError, match="CACHEBLEND_RAG_CALIBRATE"):
        CacheBlendEngine.from_pretrained("no-such-model")


def test_the_packaged_models_ship_their_decisions():
    """Each packaged model's decision for the default method ships with the package, so a first use measures
    nothing; each names the ratio it met the target at, or the fallback with what it measured."""
    for alias in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        decision = gate.find("no-such-fingerprint", alias, dtype="bfloat16")
        assert decision is not None and decision.source == "shipped" and decision.method == DEFAULT_METHOD
        assert decision.dtype == "bfloat16"
        assert decision.table and (decision.ratio == decision.table[-1]["ratio"] if decision.met
                                   else decision.ratio == gate.FALLBACK_RATIO)
    assert gate.find("no-such-fingerprint", "/some/local/folder") is None
    # the default model's decision holds for the dtype it runs in: fp32 (an AVX2-only CPU) has its own
    fp32 = gate.find("no-such-fingerprint", "smollm2-135m", dtype="float32")
    assert fp32 is not None and fp32.dtype == "float32" and fp32.kept is not None  # scored on answers too
    assert gate.find("no-such-fingerprint", "smollm2-135m", dtype="float16") is None  # none shipped: not bf16's
    # ... but another dtype's full prefill holds in any dtype (ratio 1 is exact)
    qwen = gate.find("no-such-fingerprint", "qwen2.5-coder-1.5b", dtype="float16")
    assert qwen is not None and qwen.ratio == gate.FALLBACK_RATIO and not qwen.met


def test_a_decision_measured_with_links_serves_only_those_links(model, tokenizer, models_dir):
    from cacheblend_rag.fuse.links import Links
    from cacheblend_rag.links_training import initial_links

    engine = _engine(model, tokenizer, links=None)
    start = initial_links(engine, 4)
    engine.links = Links(start.embeds * 1.5, start.fingerprint, start.vocab_size)
    # an easy target met at once: the first configuration tried, without links, then with them
    decision = gate.calibrate(engine, target_kl=1e9, min_agreement=0.5, ratios=(0.3,),
                              items=gate.calibration_items()[:1], answerable=[], show_progress=False)
    assert decision.links is None and [row["links"] for row in decision.table] == [False]
    stored = dataclasses.replace(decision, links=engine.links.digest[:16])
    gate.store(stored)
    assert gate.find(engine.fingerprint, engine.model_name, links=engine.links.digest[:16]) == stored
    assert gate.find(engine.fingerprint, engine.model_name, links=None) is None  # other (or no) links: not it
    served = _engine(model, tokenizer, links=engine.links)
    ids = served.ingest(TEXTS, show_progress=False)
    out = served.prefill(ids, QUESTION)  # no ratio named: the gate's, with its links
    assert out.stats["recompute_ratio"] == 0.3 and out.stats["links"]["ran"]
    gate.store(decision)  # measured without links: requests it decides run without them
    plain = _engine(model, tokenizer, links=engine.links).prefill(TEXTS, QUESTION)
    assert plain.stats["recompute_ratio"] == 0.3 and plain.stats["links"] == {"ran": False}


def test_the_answerable_part_keeps_full_prefills_right_answers(model, tokenizer, models_dir):
    """A configuration that loses a right answer of full prefill's does not meet the target, whatever its KL."""
    engine = _engine(model, tokenizer)
    full = engine.generate_request(Request.of(TEXTS, QUESTION, "full_prefill", max_new_tokens=gate.ANSWER_TOKENS))
    words = full.text.split()
    assert words, "the tiny model answered nothing"
    answerable = [{"question": QUESTION, "passages": TEXTS, "answers": [" ".join(words)]}]
    loose = gate.calibrate(engine, target_kl=1e9, min_agreement=0.0001, ratios=(0.0, 1.0),
                           items=gate.calibration_items()[:1], answerable=answerable, show_progress=False)
    first = loose.table[0]
    if first["kept"] == 1.0:  # reuse kept the answer word for word: met at once
        assert loose.ratio == 0.0 and loose.kept == 1.0
    else:  # lost it: only full prefill's ratio keeps it
        assert first["kept"] == 0.0 and loose.ratio == 1.0 and loose.table[1]["kept"] == 1.0
    assert loose.min_kept == gate.MIN_KEPT


def test_every_surface_leaves_an_unnamed_ratio_to_the_gate():
    assert Request.of(TEXTS, QUESTION).calibrated_ratio
    assert not Request.of(TEXTS, QUESTION, recompute_ratio=0.15).calibrated_ratio
    assert not Request.of(TEXTS, QUESTION, recompute_ratio="auto").calibrated_ratio
    assert not Request.of(TEXTS, QUESTION, "full_prefill").calibrated_ratio  # no ratio to choose
    assert not Request.of(TEXTS, QUESTION, Relevance(0.15)).calibrated_ratio  # a policy object is as built
    assert CacheBlendOptions().calibrated_ratio and not CacheBlendOptions(recompute_ratio=0.3).calibrated_ratio
    assert not CacheBlendOptions(method="full_reuse").calibrated_ratio
