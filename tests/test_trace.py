"""The trace benchmark (bench/trace.py): its request generator, warm and cold corpora, its report."""

from __future__ import annotations

import json

import pytest
import torch

from cacheblend_bench import trace
from cacheblend_bench.methods import MethodSpec
from conftest import tiny_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a shared 2-core machine, 2 OpenMP threads per process oversubscribe and spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_trace_is_seeded_interleaved_and_draws_subsets_in_random_order():
    requests = trace.make_trace([10] * 4, repeats=3, k=6, seed=7)
    assert requests == trace.make_trace([10] * 4, repeats=3, k=6, seed=7)  # reproducible
    assert requests != trace.make_trace([10] * 4, repeats=3, k=6, seed=8)
    assert [r.position for r in requests] == list(range(12))
    per_question = {q: [r for r in requests if r.question_index == q] for q in range(4)}
    assert all(len(rs) == 3 and sorted(r.repeat for r in rs) == [0, 1, 2] for rs in per_question.values())
    for r in requests:
        assert len(r.passages) == 6 and len(set(r.passages)) == 6 and all(0 <= i < 10 for i in r.passages)
    # interleaved: not grouped by question; subsets placed in random order, not sorted
    questions = [r.question_index for r in requests]
    assert questions != sorted(questions)
    assert any(list(r.passages) != sorted(r.passages) for r in requests)
    assert len({r.passages for r in requests}) == 12  # different companions each time
    # a question with fewer passages than k: all of them
    assert all(len(r.passages) == 3 for r in trace.make_trace([3], repeats=2, k=6))
    with pytest.raises(ValueError):
        trace.make_trace([10], repeats=0, k=6)


def test_methods_by_registry_name_with_options_and_guard_twins():
    specs = trace.parse_trace_methods("cacheblend@0.15/candidate_factor=2/filter_layer=3,full_reuse")
    assert [s.label for s in specs][0] == "full_prefill"  # the reference comes first
    assert specs[1].options == {"candidate_factor": 2, "filter_layer": 3}
    guarded = trace.with_guard(specs, 0.05, None)
    assert [s.label for s in guarded] == ["full_prefill", "cacheblend@0.15/candidate_factor=2/filter_layer=3",
                                          "cacheblend@0.15/candidate_factor=2/filter_layer=3/guard=0.05/"
                                          "guard_ratio=0.3", "full_reuse"]
    assert guarded[1].options["guard"] == 0.05 and "guard_ratio" not in guarded[1].options
    assert guarded[2].options["guard_ratio"] == 0.3
    with pytest.raises(ValueError, match="engine methods"):
        trace.parse_trace_methods("stuff")
    with pytest.raises(ValueError, match="twice"):
        trace.parse_trace_methods("cacheblend@0.15,cacheblend@0.15")


@pytest.fixture(scope="module")
def tiny_llama(tokenizer):
    return tiny_model("llama", len(tokenizer)), tokenizer


def _items(musique):
    # real passages, cut short: the tiny model's cost grows with the prompt, and the logic does not need length
    return [{"question": item["question"], "ctxs": [{"title": c["title"], "text": c["text"][:240]}
                                                     for c in item["ctxs"][:3]]} for item in musique[:2]]


@pytest.mark.parametrize("mode", trace.MODES)
def test_cold_starts_empty_and_warm_hits(musique, tiny_llama, mode):
    model, tokenizer = tiny_llama
    specs = [MethodSpec.parse("full_prefill"), MethodSpec.parse("cacheblend@0.15"), MethodSpec.parse("full_reuse")]
    result = trace.run(model, tokenizer, _items(musique), specs, mode=mode, repeats=2, k=2, max_new_tokens=2,
                       show_progress=False)
    records = result["records"]
    assert len(records) == 3 * len(result["trace"]) == 3 * 4
    blend = [r for r in records if r["method"] == "cacheblend@0.15"]
    reference = [r for r in records if r["method"] == "full_prefill"]
    assert all(r["kl"] == 0.0 and r["first_token_match"] and r["answer_match"] for r in reference)
    if mode == "cold":
        assert blend[0]["chunk_hits"] == 0 and blend[0]["chunk_misses"] == 2  # nothing precomputed
        assert blend[0]["num_hole_tokens"] > 0 and blend[0]["num_reused"] == 0
        items = _items(musique)
        seen, later_hits = set(), 0  # a passage is a hit exactly when an earlier request of this lane used it
        for request, r in zip(result["trace"], blend):
            ctxs = items[request["question_index"]]["ctxs"]
            key = [ctxs[i]["text"] for i in request["passages"]]
            assert r["chunk_hits"] == sum(k in seen for k in key)
            later_hits += r["chunk_hits"]
            seen.update(key)
        assert later_hits > 0
        assert result["summary"]["cacheblend@0.15"]["store_bytes"] > 0
    else:
        assert all(r["chunk_hits"] == 2 and r["chunk_misses"] == 0 and r["num_hole_tokens"] == 0 for r in blend)
        assert result["summary"]["cacheblend@0.15"]["chunk_hit_rate"] == 1.0
    assert result["summary"]["full_prefill"]["speedup"] == 1.0


def test_report_has_the_columns_the_guard_and_the_plot(musique, tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    specs = trace.with_guard(trace.parse_trace_methods("cacheblend@0.15"), 0.0, 0.6)
    result = trace.run(model, tokenizer, _items(musique)[:1], specs, mode="warm", repeats=2, k=3,
                       max_new_tokens=2, show_progress=False)
    table = trace.format_trace_table(result["summary"])
    for column in ("TTFT median", "speedup", "reused recomputed", "recompute_ratio_effective", "KL mean",
                   "1st-token match", "greedy answer = full", "variant hits", "store (MB)"):
        assert column in table
    assert set(result["summary"]) == {"full_prefill", "cacheblend@0.15",
                                      "cacheblend@0.15/guard=0/guard_ratio=0.6"}
    guard = result["guard"]["cacheblend@0.15"]
    assert guard["first_token"]["flag_rate"] == 1.0  # threshold 0: every request with stale mass is flagged
    escalation = guard["escalation"]
    assert escalation["escalated_share"] == 1.0 and escalation["escalate_to"] == 0.6
    twin = result["summary"]["cacheblend@0.15/guard=0/guard_ratio=0.6"]
    assert twin["recomputed_share"] > result["summary"]["cacheblend@0.15"]["recomputed_share"]
    assert "recall" in trace.format_guard_table(result["guard"])
    meta = {"questions": 1, "repeats": 2, "k": 3, "command": "test", "model": "tiny", "dtype": "float32",
            "machine": "here", "max_new_tokens": 2, "seed": 0}
    md, js, png = trace.write_trace_outputs(meta, [result], tmp_path)
    assert "## warm corpus" in md.read_text() and png.stat().st_size > 0
    assert json.loads(js.read_text())["results"][0]["summary"]["full_prefill"]["n"] == 2


def test_variant_hits_read_from_a_policy_report():
    assert trace.variant_facts(None) is None
    assert trace.variant_facts({"variant_hits": 3, "num_chunks": 6}) == {"variant_hits": 3, "chunks": 6}
    report = {"chunks": [{"variant": ["a", "b"]}, {"variant": []}, {"variant": ["c"]}]}
    assert trace.variant_facts(report) == {"variant_hits": 2, "chunks": 3}


@pytest.mark.model
@pytest.mark.slow
def test_bench_trace_command_end_to_end(musique, tmp_path, capsys):
    """`cacheblend-rag bench trace` on the real model: one question, two requests of two short passages."""
    from cacheblend_rag.cli import main as cli_main

    data = tmp_path / "short.json"
    data.write_text(json.dumps(_items(musique)[:1]))
    out = tmp_path / "out"
    code = cli_main(["bench", "trace", "--data", str(data), "--limit", "1", "--repeats", "2", "--k", "2",
                     "--trace-modes", "cold", "--methods", "full_prefill,cacheblend@0.15", "--guard", "0.01",
                     "--max-new-tokens", "2", "--threads", "1", "-q", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "trace.json").read_text())
    assert result["meta"]["methods"] == ["full_prefill", "cacheblend@0.15",
                                         "cacheblend@0.15/guard=0.01/guard_ratio=0.3"]
    (cold,) = result["results"]
    assert cold["mode"] == "cold" and len(cold["records"]) == 3 * 2
    first = [r for r in cold["records"] if r["method"] == "cacheblend@0.15"][0]
    assert first["chunk_hits"] == 0 and first["guard"]["estimate"] == 0.0  # nothing cached yet: nothing stale
    assert "| cacheblend@0.15 |" in capsys.readouterr().out
    assert (out / "trace_kl_vs_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rank_correlation_of_estimate_and_kl():
    assert trace.rank_correlation([0.1, 0.2, 0.3], [1.0, 2.0, 5.0]) == pytest.approx(1.0)
    assert trace.rank_correlation([0.1, 0.2, 0.3], [5.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert trace.rank_correlation([0.1, 0.1, 0.1], [1.0, 2.0, 3.0]) is None  # a constant side orders nothing
    assert trace.rank_correlation([0.1, 0.2], [1.0, 2.0]) is None


def test_neighbors_mode_serves_cachecraft_from_neighbour_variants(musique, tiny_llama):
    model, tokenizer = tiny_llama
    specs = [MethodSpec.parse("full_prefill"), MethodSpec("cachecraft", "cachecraft", None, {"use_focus": False})]
    result = trace.run(model, tokenizer, _items(musique), specs, mode="neighbors", repeats=2, k=2, max_new_tokens=2,
                       show_progress=False)
    craft = [r for r in result["records"] if r["method"] == "cachecraft"]
    assert all(r["chunk_hits"] == 2 and r["num_hole_tokens"] == 0 for r in craft)  # warm underneath
    assert sum(r["variants"]["variant_hits"] for r in craft) > 0  # some chunk came after a neighbour again


def test_each_guarded_method_is_compared_with_its_own_twin():
    specs = trace.with_guard(trace.parse_trace_methods("cachecraft,cachecraft/alpha=0.25"), 0.01, None)
    records = []
    for spec in specs[1:]:
        escalates = "guard_ratio" in spec.options
        for i in range(4):
            flagged = "alpha" in spec.options  # only the α = 0.25 lane flags (and its twin escalates)
            records.append({"method": spec.label, "ttft_s": 2.0 if flagged and escalates else 1.0, "kl": 0.1,
                            "first_token_match": i > 0, "answer_match": i > 0,
                            "guard": {"estimate": 0.02 if flagged else 0.0, "flagged": flagged,
                                      "escalated": flagged and escalates}})
    found = trace.guard_detection(records, specs)
    assert found["cachecraft"]["escalation"]["method"] == "cachecraft/guard=0.01/guard_ratio=0.3"
    assert found["cachecraft"]["escalation"]["escalated_share"] == 0.0
    assert found["cachecraft/alpha=0.25"]["escalation"]["escalated_share"] == 1.0
    assert found["cachecraft/alpha=0.25"]["escalation"]["extra_ttft"] == pytest.approx(1.0)
