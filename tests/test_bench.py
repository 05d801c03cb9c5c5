"""Benchmark metrics on hand-checked cases, and the engine benchmark end to end on one real question."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from cacheblend_bench.engine_bench import summarize
from cacheblend_bench.methods import MethodSpec, parse_methods
from cacheblend_bench.metrics import (
    best_f1,
    first_token_kl,
    normalize_answer,
    percentile,
    rouge_l,
    token_f1,
)
from cacheblend_bench.report import format_table
from cacheblend_rag.cli import main as cli_main


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
    spec = MethodSpec.parse("cacheblend@0.15/deviation=kv/check_layers=1+2/candidate_factor=2/filter_layer=6/"
                            "chunk_head_tokens=4")
    assert (spec.method, spec.ratio) == ("cacheblend", 0.15)
    assert spec.options == {"deviation": "kv", "check_layers": (1, 2), "candidate_factor": 2.0, "filter_layer": 6,
                            "chunk_head_tokens": 4}
    assert MethodSpec.parse("full_reuse").ratio is None


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine, 2 OpenMP threads per process oversubscribe and spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.model
def test_engine_bench_end_to_end(musique, tmp_path, capsys, monkeypatch, one_thread):
    from conftest import musique_path

    assert cli_main(["bench", "methods", "--data", str(musique_path()), "--limit", "1", "--chunks", "2", "--methods",
                     "full_prefill,cacheblend@0.15", "--max-new-tokens", "4", "--dtype", "float32",
                     "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| full_prefill |" in printed and "| cacheblend@0.15 |" in printed
    result = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in result["records"]} == {"full_prefill", "cacheblend@0.15"}
    assert result["summary"]["full_prefill"]["speedup"] == pytest.approx(1.0)
    assert result["summary"]["full_prefill"]["agreement_f1"] == pytest.approx(1.0)
    assert 0 < result["summary"]["cacheblend@0.15"]["recompute_ratio_effective"] < 0.5


# ---- the `cacheblend-rag bench` command ----------------------------------------------------------------


def test_rouge_l_more_cases():
    assert rouge_l("Exeter College", "exeter college.") == 1.0
    # LCS of [b, c] vs [c, b] is 1 → P = R = 1/2
    assert rouge_l("red blue", "blue red") == pytest.approx(0.5)
    assert rouge_l("", "") == 1.0 and rouge_l("", "x") == 0.0


def test_percentile_nearest_rank():
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([float(i) for i in range(1, 11)], 0.9) == 10.0
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0


def test_parse_methods_expands_cacheblend_and_puts_full_prefill_first():
    specs = parse_methods("cacheblend,map_reduce", (0.05, 0.3))
    assert [s.label for s in specs] == ["full_prefill", "cacheblend@0.05", "cacheblend@0.30", "map_reduce"]
    assert specs[1].ratio == 0.05 and specs[3].is_chain and not specs[1].is_chain
    assert [s.label for s in parse_methods("cacheblend/deviation=k", (0.15,))][1] == "cacheblend@0.15/deviation=k"
    default = [s.label for s in parse_methods(None, (0.15,), hf_available=True)]
    assert default == ["full_prefill", "prefix_cache", "full_reuse", "cacheblend@0.15", "relevance", "stuff",
                       "tutorial", "map_reduce", "map_rerank", "hf_pipeline"]
    assert "hf_pipeline" not in [s.label for s in parse_methods(None, (0.15,), hf_available=False)]
    sweep = parse_methods(None, (0.1, 1.0), sweep=True)
    assert [s.ratio_of_recompute for s in sweep] == [1.0, 0.0, 0.1, 1.0]
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("full_prefil")
    with pytest.raises(ValueError, match="given twice"):
        parse_methods("full_reuse,full_reuse")


def _record(method, ttft, answer, *, kind="engine", kl=0.0, match=True):
    return {"method": method, "kind": kind, "ttft_kind": "prefill" if kind == "engine" else "first_stream_chunk",
            "ttft_s": ttft, "latency_s": ttft + 1, "f1": 1.0 if answer == "paris" else 0.0,
            "agreement_f1": token_f1(answer, "paris"), "agreement_rouge_l": rouge_l(answer, "paris"),
            "first_token_match": None if kind == "chain" else match, "kl": None if kind == "chain" else kl,
            "recompute_ratio_effective": 0.15 if method.startswith("cacheblend") else None,
            "kv_bytes_loaded": 2_000_000 if method.startswith("cacheblend") else None, "llm_calls": 1}


def test_summarize_and_table_with_chain_methods():
    records = [_record("full_prefill", 4.0, "paris"), _record("full_prefill", 2.0, "paris"),
               _record("cacheblend@0.15", 1.0, "paris", kl=0.2), _record("cacheblend@0.15", 0.5, "rome", match=False),
               _record("map_reduce", 6.0, "paris", kind="chain"), _record("map_reduce", 6.0, "paris", kind="chain")]
    summary = summarize(records, ["full_prefill", "cacheblend@0.15", "map_reduce"])
    assert summary["full_prefill"]["speedup"] == pytest.approx(1.0)
    cb = summary["cacheblend@0.15"]
    assert cb["speedup"] == pytest.approx(3.0 / 0.75) and cb["f1"] == 0.5 and cb["first_token_match"] == 0.5
    assert cb["kl"] == pytest.approx(0.1) and cb["kv_bytes_loaded"] == 2_000_000
    assert cb["ttft_p90_s"] == 1.0
    mr = summary["map_reduce"]
    assert mr["kl"] is None and mr["first_token_match"] is None and mr["speedup"] == pytest.approx(0.5)
    rows = format_table(summary).splitlines()
    assert len(rows) == 2 + 3 and all(r.count("|") == rows[0].count("|") for r in rows)
    assert rows[3].startswith("| cacheblend@0.15 | 0.750 |") and "| 2.0 |" in rows[3]
    assert rows[4].startswith("| map_reduce | 6.000* |") and "| – | – |" in rows[4]


def test_plots_and_markdown(tmp_path):
    from cacheblend_bench.report import (
        format_markdown,
        plot_quality_vs_ratio,
        plot_quality_vs_ttft,
    )

    records = [_record("full_prefill", 4.0, "paris"), _record("full_reuse", 0.5, "rome"),
               _record("cacheblend@0.15", 1.0, "paris"), _record("map_rerank", 6.0, "paris", kind="chain")]
    summary = summarize(records, ["full_prefill", "full_reuse", "cacheblend@0.15", "map_rerank"])
    for label, ratio in (("full_prefill", 1.0), ("full_reuse", 0.0), ("cacheblend@0.15", 0.15), ("map_rerank", None)):
        summary[label]["ratio"] = ratio
    png = plot_quality_vs_ttft(summary, tmp_path / "q.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_quality_vs_ratio(summary, tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    meta = {"dataset_name": "toy", "questions": 1, "chunks": 2, "chunk_tokens": None, "model": "m", "dtype": "float32",
            "lead_in": "prefix", "max_new_tokens": 4, "seed": 0, "machine": "here"}
    md = format_markdown({"meta": meta, "summary": summary, "throughput": None,
                          "ingest": {"chunks": 2, "tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0}})
    assert "| map_rerank | 6.000* |" in md and "## Throughput" not in md


def test_resolve_dataset_errors(tmp_path, monkeypatch):
    from cacheblend_rag import settings
    from cacheblend_bench import datasets
    from cacheblend_bench.datasets import resolve_dataset

    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_dataset(str(tmp_path / "missing.json"))
    monkeypatch.delenv(settings.ENV_MUSIQUE, raising=False)
    monkeypatch.chdir(tmp_path)  # no ../shared/data/musique_dev.json from here
    with pytest.raises(FileNotFoundError, match="no DATASET given"):
        resolve_dataset(None)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"ctxs": [{"title": "T", "text": "x"}], "question": "q?", "answers": ["a"]}]))
    monkeypatch.setenv(settings.ENV_MUSIQUE, str(data))
    assert resolve_dataset(None) == data
    assert datasets.load_dataset(data, 1)[0]["question"] == "q?"
    assert datasets.passages_of(datasets.load_dataset(data, None)[0], 6) == ["T\nx"]


@pytest.mark.model
def test_rechunk_to_token_length(musique, tokenizer):
    from cacheblend_bench.datasets import passages_of, question_passages

    chunks = question_passages(musique[0], 3, 64, tokenizer)
    assert len(chunks) == 3
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks]
    assert all(56 <= n <= 84 for n in lengths), lengths
    joined = " ".join(" ".join(p.split()) for p in passages_of(musique[0], None))
    assert " ".join(chunks[0].split()) in joined  # cut from the passages in order, whole words
    assert question_passages(musique[0], 2, None, tokenizer) == passages_of(musique[0], 2)


@pytest.mark.model
def test_bench_command_end_to_end(musique, tmp_path, capsys, one_thread):
    from conftest import musique_path

    out = tmp_path / "tmp"
    code = cli_main(["bench", "methods", str(musique_path()), "--limit", "1", "--chunks", "2", "--methods",
                     "full_prefill,cacheblend@0.15,map_reduce", "--max-new-tokens", "4", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert set(result) >= {"meta", "records", "summary", "ingest", "throughput"}
    assert result["meta"]["methods"] == ["full_prefill", "cacheblend@0.15", "map_reduce"]
    assert [r["method"] for r in result["records"]] == ["full_prefill", "cacheblend@0.15", "map_reduce"]
    record_keys = {"question_index", "method", "ttft_s", "latency_s", "answer", "gold", "f1", "agreement_f1",
                   "agreement_rouge_l", "first_token_match", "kl", "recompute_ratio_effective", "kv_bytes_loaded"}
    assert all(record_keys <= set(r) for r in result["records"])
    summary = result["summary"]
    assert list(summary) == ["full_prefill", "cacheblend@0.15", "map_reduce"]
    assert summary["full_prefill"]["speedup"] == pytest.approx(1.0)
    assert summary["full_prefill"]["agreement_f1"] == pytest.approx(1.0)
    assert summary["cacheblend@0.15"]["kv_bytes_loaded"] > 0 and summary["cacheblend@0.15"]["kl"] is not None
    assert summary["map_reduce"]["kind"] == "chain" and summary["map_reduce"]["kl"] is None
    assert summary["map_reduce"]["first_token_match"] is None and summary["map_reduce"]["llm_calls"] == 3
    md = (out / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["full_prefill", "cacheblend@0.15", "map_reduce"]
    assert (out / "quality_vs_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| cacheblend@0.15 |" in capsys.readouterr().out


@pytest.mark.model
def test_bench_breakdown_times_layers_and_ops(musique, tmp_path, capsys, one_thread):
    """`bench breakdown`: CacheBlend's deep layers carry a fraction of full prefill's rows, pairs and attention time."""
    from conftest import musique_path

    code = cli_main(["bench", "breakdown", str(musique_path()), "--limit", "1", "--chunks", "2", "--repeats", "1",
                     "--dtype", "float32", "--methods", "full_prefill,cacheblend@0.15", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "breakdown.json").read_text())["summary"]
    full, blend = summary["full_prefill"], summary["cacheblend@0.15"]
    assert len(full["layer_s"]) == len(blend["layer_s"]) and full["num_deep_layers"] == len(full["layer_s"]) - 2
    assert full["deep_rows_share"] == 1.0 and full["deep_pairs_share"] == 1.0 and full["until_settled_s"] == 0.0
    assert blend["until_settled_s"] > 0  # the check layer (and the candidates' layers) before the row set settles
    assert 0 < blend["deep_rows_share"] < 0.5 and 0 < blend["deep_pairs_share"] < 1
    assert blend["deep_pairs_share"] < full["deep_pairs_share"] and blend["deep_layer_s"] > 0
    assert full["attention_s"] > 0 and full["matmul_s"] > 0 and full["other_s"] > 0
    assert full["place_cached_kv_s"] == 0 < blend["place_cached_kv_s"]  # full prefill has no cached KV to place
    assert blend["select_rows_s"] > 0 and blend["plan_attention_s"] > 0 and blend["outside_layers_s"] > 0
    assert "| cacheblend@0.15 |" in (tmp_path / "breakdown.md").read_text() and "deep layer" in capsys.readouterr().out
    assert cli_main(["bench", "breakdown", str(musique_path()), "--methods", "stuff"]) == 2  # chains have no layers


def test_breakdown_layer_groups():
    from cacheblend_bench.breakdown import _layer_groups

    # CacheBlend-like: all rows at 0-1, candidates at 2-3, the settled selection from 4 to the one before last
    groups = _layer_groups([5.0, 4.0, 3.0, 3.0, 1.0, 1.0, 2.0, 0.5], [9, 9, 5, 5, 2, 2, 2, 1])
    assert groups == {"layer0_s": 5.0, "until_settled_s": 10.0, "deep_layer_s": 1.0, "num_deep_layers": 3,
                      "last_layer_s": 0.5}
    full = _layer_groups([5.0, 4.0, 6.0, 1.0], [9, 9, 9, 1])
    assert full["until_settled_s"] == 0.0 and full["deep_layer_s"] == 5.0 and full["num_deep_layers"] == 2
    shallow = _layer_groups([5.0, 1.0], [9, 1])  # no deep layers in a 2-layer model
    assert shallow["num_deep_layers"] == 0 and math.isnan(shallow["deep_layer_s"]) and shallow["last_layer_s"] == 1.0


# ---- one entry, a dataset found without leaving the package, methods from the policy registry -----------------


def test_dataset_from_the_working_folder_and_an_error_that_names_both_ways(tmp_path, monkeypatch, capsys):
    from cacheblend_rag import settings
    from cacheblend_bench.datasets import resolve_dataset

    monkeypatch.delenv(settings.ENV_MUSIQUE, raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.chdir(repo)
    with pytest.raises(FileNotFoundError) as missing:
        resolve_dataset(None)
    assert "--data PATH" in str(missing.value) and "$CACHEBLEND_RAG_MUSIQUE" in str(missing.value)
    assert cli_main(["bench", "methods", "--limit", "1"]) == 2  # before any model is loaded
    assert "--data PATH" in capsys.readouterr().err
    shared = tmp_path / "shared" / "data" / "musique_dev.json"
    shared.parent.mkdir(parents=True)
    shared.write_text("[]")
    assert resolve_dataset(None) == shared  # ../shared/data/musique_dev.json from the working folder
    monkeypatch.setenv(settings.ENV_MUSIQUE, str(tmp_path / "gone.json"))
    with pytest.raises(FileNotFoundError, match="CACHEBLEND_RAG_MUSIQUE is .*gone.json"):
        resolve_dataset(None)  # a variable that is set but wrong is an error, not a silent fallback


def test_bench_studies_are_subcommands_with_their_own_options(tmp_path, capsys):
    data = tmp_path / "d.json"
    data.write_text("[]")
    for argv, wrong in ((["--data", str(data)], "STUDY"),  # a study must be named
                        (["loading", "--data", str(data), "--methods", "full_prefill"], "--methods"),
                        (["methods", "--data", str(data), "--guard", "0.1"], "--guard"),  # trace's option
                        (["methods", "--data", str(data), "--peers", "kvboost"], "--peers")):  # conversation's
        with pytest.raises(SystemExit) as refused:
            cli_main(["bench", *argv])
        assert refused.value.code == 2 and wrong in capsys.readouterr().err
    assert cli_main(["bench", "methods", "--data", str(data), str(tmp_path / "other.json")]) == 2  # two datasets


def test_engine_methods_are_the_policy_registry_s():
    from cacheblend_rag.fuse.policies import METHODS

    from cacheblend_bench.methods import NAMED_ONLY

    default = parse_methods(None, (0.15,), chains=False)
    engine_methods = [m for m in METHODS if m not in NAMED_ONLY]
    assert [s.method for s in default] == engine_methods and not any(s.is_chain for s in default)
    assert {s.method for s in parse_methods(None, (0.15,))} == set(engine_methods) | {"stuff", "tutorial", "map_reduce", "map_rerank"}
    assert [s.method for s in parse_methods("cachecraft")] == ["full_prefill", "cachecraft"]  # when named


def test_loading_bench_compares_tiers_and_auto(tokenizer, tmp_path):
    from conftest import tiny_model

    from cacheblend_bench import loading_bench
    from cacheblend_bench.report import format_loading

    items = [{"question": "Which rivers meet in Lyon?", "ctxs": [
        {"title": "Lyon", "text": "Lyon sits where the Rhône meets the Saône."},
        {"title": "Granite", "text": "Granite forms from slowly cooled magma deep underground."},
        {"title": "Violin", "text": "The violin has four strings tuned in perfect fifths."}]}]
    result = loading_bench.run(tiny_model("llama", len(tokenizer)), tokenizer, items, tmp_path / "kv", num_chunks=3,
                               home=tmp_path, show_progress=False)
    assert list(result["tiers"]) == ["memory", "disk, pipelined (depth 2)", "disk, on demand (depth 0)"]
    assert result["tiers"]["memory"]["vs_memory"] == 1.0
    assert set(result["ratios"]) == {f"{t} {r}" for t in ("memory", "disk") for r in ("auto", "0.15", "0.30")}
    assert result["ratios"]["disk 0.30"]["ratio_mean"] == 0.30 and result["ratios"]["disk auto"]["ratio_mean"] >= 0.15
    assert all(r["kl"] >= -1e-6 for r in result["ratios"].values())
    assert set(result["tier_profiles"]) == {"memory", "disk"} and result["profile"]["layer_per_row_s"] > 0
    assert list((tmp_path / "profiles").glob("*.json"))  # measured once, before the timed requests
    table = format_loading(result).splitlines()
    assert len([line for line in table if line.startswith("| disk")]) == 2 + 3


def test_faq_set_is_seeded_and_each_answer_is_in_one_chunk():
    from cacheblend_bench.faq import correct, faq_set

    first, again = faq_set(12, k=4, seed=3), faq_set(12, k=4, seed=3)
    assert [q.question for q in first] == [q.question for q in again] and first != faq_set(12, k=4, seed=4)
    for q in first:
        assert len(q.chunks) == 4 and len(set(q.chunks)) == 4
        assert [q.answer in c for c in q.chunks].count(True) >= 1 and q.answer in q.chunks[q.gold]
    assert correct("The warranty is 24 months.", "24 months") and correct("24", "24 months")
    assert correct("It was founded by mira okafor!", "Mira Okafor") and not correct("Mira Novak", "Mira Okafor")


def test_first_token_entropy_is_high_when_flat_and_low_when_peaked():
    import math

    import torch

    from cacheblend_bench.frames import entropy

    assert entropy(torch.zeros(8)) == pytest.approx(math.log(8), abs=1e-6)
    assert entropy(torch.tensor([20.0, 0.0, 0.0, 0.0])) < 1e-6


def test_faq_scores_whole_words_of_the_first_line_only():
    """A quantity's digits inside a longer number, or a fact the completion runs on to after its answer line,
    is not the answer."""
    from cacheblend_bench.faq import correct

    assert not correct("The Vekva V3 lasts 13 hours.", "3 hours") and correct("It lasts 3 hours.", "3 hours")
    assert not correct("It costs 1190 euros.", "119 euros") and correct("119", "119 euros")
    assert not correct("119 euros\n\nQuestion: How long does the battery last?\nAnswer: 12 hours", "12 hours")
    assert correct("\n12 hours\n\nQuestion: ...", "12 hours")  # leading blank lines are not the answer line
    assert not correct("Sornax - Frequently asked questions\nSornax was founded by Hugo Haddad.", "Hugo Haddad")


@pytest.mark.model
def test_bench_frames_and_faq_end_to_end(musique, tmp_path, capsys, one_thread):
    """`bench frames`: every entry point's prompt against the model's own forward of it; full prefill is that
    forward (KL ≈ 0 in fp32); `bench faq` scores answers."""
    from conftest import musique_path

    out = tmp_path / "out"
    assert cli_main(["bench", "frames", str(musique_path()), "--limit", "1", "--chunks", "3", "--chunk-tokens", "96",
                     "--dtype", "float32", "--max-new-tokens", "4", "--out", str(out), "-q"]) == 0
    result = json.loads((out / "frames.json").read_text())
    assert result["meta"]["chunk_tokens"] == 96 and max(r["num_tokens"] for r in result["records"]) < 3 * 96 + 200
    rows = {(r["frame"], r["method"]): r for r in result["summary"]}
    assert {f for f, _ in rows} == {"chain", "chat", "string", "langchain", "llama_index"}
    for frame in ("chain", "chat", "string", "langchain", "llama_index"):
        assert rows[(frame, "full_prefill")]["kl_vs_model"] < 1e-4
        assert rows[(frame, "cacheblend@0.15")]["chunk_hits"] == 3  # every frame's prompt found its chunks
        assert rows[(frame, "full_reuse")]["kl_vs_model"] > rows[(frame, "full_prefill")]["kl_vs_model"]
        entropies = {rows[(frame, m)]["reference_entropy"] for m in ("full_prefill", "full_reuse")}
        assert len(entropies) == 1 and entropies.pop() > 0  # the frame's own forward, once for every method
    assert cli_main(["bench", "faq", "--limit", "1", "--k", "3", "--dtype", "float32", "--max-new-tokens", "8",
                     "--out", str(out), "-q"]) == 0
    faq = json.loads((out / "faq.json").read_text())
    pairs = {(r["frame"], r["method"]) for r in faq["summary"]}
    assert pairs >= {("chat", "full_prefill"), ("string", "cacheblend@0.15"), ("tool", "cacheblend@0.15")}
    assert len(faq["records"]) == 1 * 3 * 3 and "| tool | cacheblend@0.15 |" in (out / "faq.md").read_text()
    tool = next(r for r in faq["records"] if r["frame"] == "tool")  # the question first, the pages after it
    assert tool["question"] and tool["expected"]
    assert cli_main(["bench", "faq", "--limit", "1", "--k", "2", "--dtype", "float32", "--max-new-tokens", "4",
                     "--methods", "relevance@0.3,full_reuse", "--out", str(out), "-q"]) == 0
    faq = json.loads((out / "faq.json").read_text())
    assert [r["method"] for r in faq["summary"]] == ["relevance@0.3", "full_reuse"] * 3
    assert cli_main(["bench", "faq", "--methods", "relevance@most", "-q"]) == 2
    assert "the ratio after @ must be a number" in capsys.readouterr().err


@pytest.mark.model
def test_bench_conversation_end_to_end(tmp_path, one_thread):
    """`bench conversation`: turns 2+ start from the previous turn's stored prefix; the arm without them does not."""
    from conftest import musique_path

    out = tmp_path / "out"
    assert cli_main(["bench", "conversation", str(musique_path()), "--limit", "1", "--chunks", "1", "--dtype",
                     "float32", "--max-new-tokens", "4", "--out", str(out), "-q"]) == 0
    result = json.loads((out / "conversation.json").read_text())
    turns = result["summary"]["turns"]
    assert sorted(turns, key=int) == ["1", "2", "3", "4"] and len(result["records"]) == 4
    for t in ("2", "3", "4"):
        assert turns[t]["rows"]["prefix_rows"] >= turns[str(int(t) - 1)]["tokens"] - 16
        assert turns[t]["rows"]["chunk_rows"] == 0
    assert turns["1"]["rows"]["prefix_rows"] < turns["1"]["rows"]["chunk_rows"]
    assert "| 4 | 1 |" in (out / "conversation.md").read_text()


@pytest.mark.model
def test_bench_agent_end_to_end(tmp_path, one_thread):
    """`bench agent`: step 1's forced call is well formed; step 2 starts from step 1's stored prompt and call and
    finds every passage of the tool's result as a stored chunk; both decoders' ms/token are measured."""
    from conftest import musique_path

    out = tmp_path / "out"
    assert cli_main(["bench", "agent", str(musique_path()), "--limit", "1", "--chunks", "2", "--dtype", "float32",
                     "--max-new-tokens", "32", "--out", str(out), "-q"]) == 0
    result = json.loads((out / "agent.json").read_text())
    first, second = sorted(result["records"], key=lambda r: r["step"])
    assert first["tool_choice"] == "required" and first["called"] and first["finish_reason"] == "stop"
    assert second["chunk_hits"] == 2 and second["prefix_rows"] >= first["num_tokens"] - 16
    assert second["chunk_rows"] > 0 and second["computed_rows"] < second["num_tokens"] // 4
    assert all(v is not None for r in result["records"] for v in r["ms_per_token"].values())
    assert "| 1 | required | 1 |" in (out / "agent.md").read_text()


def test_bench_peers_are_named(tmp_path):
    """`conversation --peers` takes only the peers it knows."""
    from cacheblend_bench.peers import parse_peers

    assert parse_peers("kvboost, llama.cpp") == ("kvboost", "llama.cpp") and parse_peers(None) == ()
    with pytest.raises(ValueError, match="unknown peer"):
        parse_peers("kvboost,vllm")


@pytest.mark.parametrize("name, module", [("kvboost", "kvboost"), ("llama.cpp", "llama_cpp")])
def test_bench_peer_not_installed_says_so_in_one_line(tmp_path, name, module):
    """Without the [peers] extra, a peer is reported as skipped in one line with the install hint, and not built."""
    from cacheblend_bench.peers import open_peers

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    peers, skipped = open_peers((name,), model="smollm2-135m", folder=tmp_path, dtype=torch.float32,
                                recompute_ratio=0.15, context_window=2048)
    assert peers == [] and len(skipped) == 1
    assert name in skipped[0] and "benchmarks[peers]" in skipped[0] and "\n" not in skipped[0]


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("kvboost") is None and importlib.util.find_spec("llama_cpp") is None,
                    reason="no peer installed (pip install -e 'benchmarks[peers]')")
def test_bench_conversation_with_peers(tmp_path, one_thread):
    """`--peers`: each installed peer sees every turn's text as the same tokens the engine does; kvboost carries
    earlier turns in its prefix-hashed chunks; the peers' table is written beside ours."""
    from conftest import musique_path

    names = [n for n, module in (("kvboost", "kvboost"), ("llama.cpp", "llama_cpp"))
             if importlib.util.find_spec(module) is not None]
    out = tmp_path / "out"
    assert cli_main(["bench", "conversation", str(musique_path()), "--peers", ",".join(names), "--limit", "1",
                     "--chunks", "1", "--dtype", "float32", "--max-new-tokens", "2", "--out", str(out), "-q"]) == 0
    result = json.loads((out / "conversation.json").read_text())
    assert result["meta"]["peers"]["ran"] == names
    for r in result["records"]:
        for name in names:
            peer = r["peers"][name]
            assert peer["prompt_tokens"] == r["num_tokens"] and peer["ttft_s"] > 0
    if "kvboost" in names:
        later = [r["peers"]["kvboost"] for r in result["records"] if r["turn"] > 1]
        assert all(p["cached_tokens"] > 0 for p in later)
        assert all(0 <= p["kl"] < 1 for p in later)
    md = (out / "conversation.md").read_text()
    assert "Peers on the same turns" in md
    assert all(name in md for name in names)


def test_conversation_peers_summary_hand_checked():
    """Per turn: medians of each arm and peer, ratios to ours with stored prefixes, the peers' cache and KL."""
    from cacheblend_bench.conversation import format_peers, summarize_peers

    def record(turn, prefix, kvb, llama, cached):
        return {"turn": turn, "ttft_s": {"prefix": prefix, "no_prefix": 2 * prefix, "full": 4 * prefix},
                "peers": {"kvboost": {"ttft_s": kvb, "prompt_tokens": 100, "cached_tokens": cached, "kl": 0.02},
                          "llama.cpp": {"ttft_s": llama, "prompt_tokens": 100, "cached_tokens": None, "kl": None}}}

    turns = summarize_peers([record(1, 1.0, 3.0, 2.0, 0), record(1, 3.0, 9.0, 4.0, 0),
                             record(2, 0.1, 2.0, 0.05, 96), {"turn": 2, "ttft_s": {}}])  # no peers: left out
    assert turns[1]["ttft_s"] == {"prefix": 2.0, "no_prefix": 4.0, "full": 8.0, "kvboost": 6.0, "llama.cpp": 3.0}
    assert turns[1]["vs_ours"]["kvboost"] == 3.0 and turns[1]["vs_ours"]["llama.cpp"] == 1.5
    assert turns[2]["n"] == 1 and turns[2]["vs_ours"]["llama.cpp"] == pytest.approx(0.5)
    assert turns[2]["cached_tokens"] == {"kvboost": 96} and turns[2]["kl"] == {"kvboost": 0.02}
    table = format_peers(turns)
    assert "| 2 | 1 | 0.100 s | 0.200 s (2.0×) | 0.400 s (4.0×) | 2.000 s (20.0×) | 0.050 s (0.5×) |" in table
    assert "kvboost 96/100" in table and format_peers({}) == ""


@pytest.mark.model
@pytest.mark.slow
def _faults(scenarios: str, out) -> dict:
    """`bench faults` on one question with a tiny random model: its faults.json."""
    from conftest import musique_path

    code = cli_main(["bench", "faults", str(musique_path()), "--limit", "1", "--chunks", "2", "--model", "tiny-random",
                     "--fault-scenarios", scenarios, "--out", str(out)])
    assert code == 0
    return json.loads((out / "faults.json").read_text())


def test_bench_faults_grammar_scenarios_end_to_end(musique, tmp_path, capsys):
    grammar = {r["scenario"]: r for r in _faults("schema_bomb,grammar_fails,stop_in_json", tmp_path / "out")["grammar"]}
    bomb = grammar["schema_bomb"]
    assert bomb["bombs"] >= 6 and set(bomb["bomb_statuses"]) == {"400"}, bomb  # every bomb refused
    assert bomb["latency_ratio"] > 0 and bomb["rss_before_mib"] > 0 and bomb["rss_after_mib"] > 0
    fails = grammar["grammar_fails"]
    assert fails["ref_loop"]["status"] == 400 and fails["blown_pattern"]["status"] == 400, fails
    cases = grammar["stop_in_json"]["cases"]
    assert [c["stop"] for c in cases] == [",", '"}'], cases
    for row in cases:  # the stop string occurs inside the only answer the schema allows: the JSON stays whole
        assert row["status"] == 200 and row["parses"] and row["finish_reason"] in ("stop", "length"), row
    printed = capsys.readouterr().out
    assert "| schema_bomb |" in printed and "(target ≤ 2×)" in printed


@pytest.mark.model
@pytest.mark.slow
def test_bench_faults_privacy_scenarios_find_no_oracle(musique, tmp_path, capsys):
    privacy = {r["scenario"]: r for r in _faults("document_oracle,metrics_oracle", tmp_path / "out")["privacy"]}
    documents = privacy["document_oracle"]
    assert documents["a_status"] == 200 and documents["sent_memo"]["status"] == 400, documents
    assert documents["sent_memo"] == documents["edited_memo"] and not documents["oracle"], documents
    metrics = privacy["metrics_oracle"]
    for guess in ("exact", "wrong"):
        assert metrics[f"client_{guess}"] == {"status": 401, "rise": None}, metrics  # B cannot read the counters
        assert metrics[f"operator_{guess}"]["status"] == 200 and metrics[f"operator_{guess}"]["rise"] >= 0, metrics
    assert not metrics["oracle"]
    assert "| document_oracle |" in capsys.readouterr().out
