"""Cache-Craft (fuse/policies/cachecraft/, its variants.py): equations, variants, robustness, stats."""

from __future__ import annotations

import math
import multiprocessing
import sqlite3

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ConfigError, Request
from cacheblend_rag.fuse.policies import POLICIES, CacheCraft, make_policy
from cacheblend_rag.fuse.policies.cachecraft import (DEFAULT_ALPHA, cache_fix_overhead, focused_chunks,
                                                     order_penalty, prefix_overlap)
from cacheblend_rag.ingest.chunks import Chunk
from cacheblend_rag.fuse.policies.cachecraft.variants import Variant, VariantStore, cci, variant_kv_id
from cacheblend_rag.store import ChunkKV, DiskStore, KVKey

from conftest import tiny_model

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "The Eiffel Tower was finished in 1889 for the World's Fair in Paris, France.",
    "Basalt is an igneous rock formed from the rapid cooling of lava rich in iron.",
]
QUESTION = "Where does the river Lune reach the sea?"


@pytest.fixture
def engine(tokenizer):
    """A cold engine (nothing ingested): caches come from live requests, as Cache-Craft assumes."""
    return CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)


def _chunks(prefill) -> list[dict]:
    return prefill.stats["cachecraft"]["chunks"]


# ---- options and equations -------------------------------------------------------------------

def test_registered_and_options_checked():
    assert POLICIES["cachecraft"] is CacheCraft
    assert make_policy("cachecraft", alpha=0.4, focus_window=2).alpha == 0.4
    for options, match in [({"alpha": -0.1}, "alpha"), ({"alpha": "high"}, "alpha"), ({"alpha": math.nan}, "alpha"),
                           ({"alpha": True}, "alpha"), ({"focus_window": 0}, "focus_window"),
                           ({"focus_min_layer": -1}, "focus_min_layer"),
                           ({"token_choice": "best"}, "token_choice"), ({"use_beta": "yes"}, "use_beta"),
                           ({"first_use": "never"}, "first_use"), ({"variant_budget_mb": -1}, "variant_budget_mb"),
                           ({"beta": 1}, "no option 'beta'")]:
        with pytest.raises(ConfigError, match=match):
            make_policy("cachecraft", **options)


def test_beta_gamma_cfo_cci_and_focus_by_hand():
    inter = {"a": 3.0, "b": 1.0}
    assert prefix_overlap(inter, ("a", "b"), ("b", "c")) == pytest.approx(0.25)  # eq. 6
    assert prefix_overlap(inter, ("a", "b"), ("c",)) == 0.0
    assert prefix_overlap({}, (), ("a",)) == 0.0  # the isolated precompute overlaps nothing
    assert order_penalty(("a", "b", "c"), ("a", "b", "c")) == 0.0  # eq. 7: Kendall tau distance
    assert order_penalty(("a", "b", "c"), ("c", "b", "a")) == 1.0
    assert order_penalty(("a", "b", "c"), ("a", "c", "b")) == pytest.approx(1 / 3)
    assert order_penalty(("a", "b", "x"), ("b", "a", "y")) == 1.0  # only the shared chunks count (m = 2)
    assert cache_fix_overhead(0.5, 0.8, 0.25) == pytest.approx(0.3)  # eq. 12
    assert cache_fix_overhead(3.0, 0.9, 0.0) == 1.0  # clipped: every token
    # eq. 9–11: ā = 2 / (4·2) = 0.25, b̄ = 8 / 4² = 0.5, CCI = sigmoid(0.5)
    assert cci({"x": 2.0}, 8.0, 4, {"x": 2}) == pytest.approx(1 / (1 + math.exp(-0.5)))
    # Algorithm 1: the big gap after the top two; a lone leader; flat attention keeps everything
    assert focused_chunks([10.0, 9.0, 1.0, 0.5]) == {0, 1}
    assert focused_chunks([1.0, 10.0, 0.9, 0.8]) == {1}
    assert focused_chunks([1.0, 1.0, 1.0]) == {0, 1, 2}


# ---- requests ----------------------------------------------------------------------------

def test_repeat_hits_its_variants_and_recomputes_less(engine):
    full = engine.prefill(TEXTS, QUESTION, "full_prefill")
    first = engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=0.5)
    assert first.stats["num_hole_tokens"] == sum(c["num_tokens"] for c in _chunks(first))  # cold: all holes
    assert first.stats["cachecraft"]["variants_stored"] == 3  # every chunk after another one
    second = engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=0.5)
    cc = second.stats["cachecraft"]
    assert cc["variant_hits"] == 3 and [c["variant_kind"] for c in cc["chunks"]] == ["isolated"] + ["context"] * 3
    assert [c["variant"] for c in cc["chunks"]][1:] == [[c.chunk_id for c in second_chunks(engine)][:i]
                                                         for i in (1, 2, 3)]
    assert all(c["cfo"] == 0.0 and c["budget"] == 0 for c in cc["chunks"])  # same chunks, same order
    computed = lambda p: p.stats["num_recomputed"] + p.stats["num_hole_tokens"]  # noqa: E731
    assert computed(second) < computed(first)
    # the variants were computed in full context: reusing them as they are is full prefill's answer
    assert torch.allclose(second.logits, full.logits, atol=1e-3)


def second_chunks(engine):
    return [engine.resolve_chunk(t) for t in TEXTS]


def test_reordered_and_repeated_chunks(engine):
    engine.prefill(TEXTS, QUESTION, "cachecraft")
    reordered = engine.prefill(TEXTS[::-1], QUESTION, "cachecraft", alpha=1.0, use_focus=False)
    chunks = _chunks(reordered)
    assert len(chunks) == 4 and torch.isfinite(reordered.logits).all()
    assert all(c["variant_kind"] != "hole" for c in chunks)
    assert all(c["budget"] == math.ceil(c["cfo"] * c["num_tokens"] - 1e-9) for c in chunks)
    assert any(c["budget"] > 0 for c in chunks[1:])  # out of its old context: something is fixed
    assert sum(c["recomputed"] for c in chunks) == reordered.stats["num_recomputed"]
    repeated = engine.prefill([TEXTS[0], TEXTS[1], TEXTS[0], TEXTS[2]], QUESTION, "cachecraft", token_choice="hkvd")
    assert [c["position"] for c in _chunks(repeated)] == [0, 1, 2, 3]
    assert torch.isfinite(repeated.logits).all()


def test_focus_stops_unfocused_chunks(engine):
    engine.ingest(TEXTS, show_progress=False)
    wide = engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=1.0, use_focus=False, token_choice="hkvd")
    focused = engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=1.0, focus_window=1, token_choice="hkvd")
    cc = focused.stats["cachecraft"]
    assert cc["cutoff_layer"] is not None and 0 < len(cc["focused_chunks"]) < 4
    assert focused.stats["num_recomputed"] < wide.stats["num_recomputed"]
    assert all(c["recomputed"] == 0 for c in cc["chunks"] if c["position"] not in cc["focused_chunks"])
    assert wide.stats["cachecraft"]["cutoff_layer"] is None
    late = engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=1.0, focus_window=1, token_choice="hkvd",
                          focus_min_layer=2)
    assert late.stats["cachecraft"]["cutoff_layer"] >= 2  # never before the floor
    assert late.stats["num_recomputed"] >= focused.stats["num_recomputed"]


def test_random_tokens_ablation_keeps_the_budget(engine):
    engine.ingest(TEXTS, show_progress=False)
    ranked = engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=0.6, use_focus=False)
    random = engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=0.6, use_focus=False, use_cci=False)
    assert [c["budget"] for c in _chunks(random)] == [c["budget"] for c in _chunks(ranked)]
    assert {c["token_choice"] for c in _chunks(random) if c["budget"]} == {"random"}


def test_relevance_token_choice_picks_the_rows_the_question_reads_within_each_budget(engine):
    """token_choice="relevance": the budgets are the ranking's; within each chunk's budget the rows recomputed are
    those the question attends to most over the stale KV (the relevance policy's probe pass); α 0 is the same
    request under every choice, a budget of every token is full prefill."""
    from cacheblend_rag.fuse.hkvd import question_relevance

    engine.prefill(TEXTS, QUESTION, "cachecraft")  # cold: variants in context
    engine.ingest(TEXTS, show_progress=False)
    order = TEXTS[::-1]
    ranked = engine.prefill(order, QUESTION, "cachecraft", alpha=0.6, use_focus=False)
    picked = engine.prefill(order, QUESTION, "cachecraft", alpha=0.6, use_focus=False, token_choice="relevance")
    assert [c["budget"] for c in _chunks(picked)] == [c["budget"] for c in _chunks(ranked)]
    partial = [c for c in _chunks(picked) if 0 < c["budget"] < c["num_tokens"]]
    assert partial and {c["token_choice"] for c in partial} == {"relevance"}
    assert all(c["recomputed"] == c["budget"] for c in partial)
    assert picked.stats["cachecraft"]["token_choice"] == "relevance"

    policy = make_policy("cachecraft", alpha=0.6, use_focus=False, token_choice="relevance", store_variants=False)
    fusion = engine.fusion_of(Request.of(order, QUESTION, method=policy))
    placed = policy.place(engine.cache, fusion)
    seq = engine.cache.sequence(fusion.layout.token_ids, fusion.layout.segment_of_row, placed.placements)
    try:
        selection = policy.start(engine.adapter, seq, placed)
        chosen = selection.active & seq.reused
        score = question_relevance(engine.adapter, seq, engine.adapter.num_layers // 3)
        plans = [p for p in selection.request.chunks if p.choice == "relevance"]
    finally:
        seq.close()
        placed.close()
    assert plans
    for p in plans:
        rows = torch.arange(p.row_start, p.row_start + p.chunk.num_tokens)
        kept, left = rows[chosen[rows]], rows[~chosen[rows]]
        assert kept.numel() == p.budget and float(score[kept].min()) >= float(score[left].max())

    none = [engine.prefill(order, QUESTION, "cachecraft", alpha=0.0, store_variants=False, token_choice=choice)
            for choice in ("ranking", "relevance")]
    assert torch.equal(none[0].logits, none[1].logits) and none[1].stats["num_recomputed"] == 0
    full = engine.prefill(order, QUESTION, "full_prefill")
    every = engine.prefill(order, QUESTION, "cachecraft", alpha=1e6, use_focus=False, store_variants=False,
                           token_choice="relevance")
    assert torch.allclose(every.logits, full.logits, atol=1e-3)


def _variant_rows(engine) -> tuple[VariantStore, list[tuple]]:
    variants = engine.cache.policy_state(CacheCraft)
    db = sqlite3.connect(variants.path)
    try:
        return variants, db.execute("SELECT chunk_id, kv_id FROM variants").fetchall()
    finally:
        db.close()


def test_corrupt_row_and_lost_variant_kv_degrade(engine):
    engine.prefill(TEXTS, QUESTION, "cachecraft")
    variants, rows = _variant_rows(engine)
    by_chunk = dict(rows)
    ids = [c.chunk_id for c in second_chunks(engine)]
    db = sqlite3.connect(variants.path, isolation_level=None)
    db.execute("UPDATE variants SET inter = '{not json' WHERE chunk_id = ?", (ids[1],))  # no longer parses
    db.close()
    engine.kv_store.delete(KVKey(engine.namespace, by_chunk[ids[2]]))  # chunk 2's variant KV is gone
    again = engine.prefill(TEXTS, QUESTION, "cachecraft")
    kinds = [c["variant_kind"] for c in _chunks(again)]
    assert kinds == ["isolated", "isolated", "isolated", "context"]  # fell back to the isolated precompute
    assert torch.isfinite(again.logits).all()
    _, rows = _variant_rows(engine)
    assert by_chunk[ids[2]] not in {kv for _, kv in rows}  # the variant whose KV was lost is forgotten


def test_locked_database_degrades_to_no_variants(engine):
    engine.prefill(TEXTS, QUESTION, "cachecraft")
    variants, _ = _variant_rows(engine)
    variants.close()  # it reconnects, as a new process would, while another holds the lock
    blocker = sqlite3.connect(variants.path, isolation_level=None)
    try:
        blocker.execute("PRAGMA locking_mode = EXCLUSIVE")
        blocker.execute("BEGIN EXCLUSIVE")
        blocker.execute("DELETE FROM variants WHERE 0")
        again = engine.prefill(TEXTS, QUESTION, "cachecraft")
        assert again.stats["cachecraft"]["variant_hits"] == 0 and torch.isfinite(again.logits).all()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def test_stats_keys_and_generate(engine):
    out = engine.generate(TEXTS[:3], QUESTION, method="cachecraft", alpha=0.3, focus_window=2, max_new_tokens=2)
    cc = out.stats["cachecraft"]
    assert {"alpha", "chunks", "focused_chunks", "cutoff_layer", "variant_hits", "variants_stored"} <= set(cc)
    assert cc["alpha"] == 0.3
    assert {"cfo", "budget", "variant", "variant_kind", "cci", "beta", "gamma", "recomputed"} <= set(cc["chunks"][0])
    assert out.stats.as_dict()["cachecraft"] is not None


def _synthetic_kv(n: int, seed: int) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(n, 2, 4, generator=g) for _ in range(2)]
    return ChunkKV(tuple(layers), tuple(layers), torch.arange(n))


def test_eviction_keeps_the_most_useful(tmp_path):
    store = DiskStore(tmp_path / "kv")
    variants = VariantStore(store, tmp_path / "kv" / "v.sqlite")
    made = []
    for i in range(3):
        v = Variant("c" * 32, variant_kv_id("c" * 32, f"d{i}"), ("a",), f"d{i}", 8, {"a": 1.0}, 1.0, 0.7,
                    list(range(8)))
        assert variants.add("ns", v, _synthetic_kv(8, i))
        made.append(v)
    variants.touch("ns", made[0], 0.1)  # f_r += 10
    variants.touch("ns", made[2], 0.5)  # f_r += 2
    evicted = variants.evict("ns", made[0].nbytes + made[2].nbytes)
    assert evicted == [made[1].kv_id]
    assert not store.contains(KVKey("ns", made[1].kv_id))
    assert {v.kv_id for v in variants.lookup("ns", "c" * 32)} == {made[0].kv_id, made[2].kv_id}


def _add_variants(root: str, worker: int, count: int) -> None:
    variants = VariantStore(DiskStore(root), f"{root}/v.sqlite")
    for i in range(count):
        digest = f"w{worker}-{i}"
        v = Variant("c" * 32, variant_kv_id("c" * 32, digest), (f"{worker}",), digest, 8, {f"{worker}": 1.0}, 1.0,
                    0.6, list(range(8)))
        if not variants.add("ns", v, _synthetic_kv(8, worker * 100 + i)):
            raise SystemExit(1)


def test_two_processes_add_variants_of_one_chunk(tmp_path):
    root = str(tmp_path / "kv")
    DiskStore(root)
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_add_variants, args=(root, w, 6)) for w in range(2)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(120)
    assert [p.exitcode for p in workers] == [0, 0]
    store = DiskStore(root)
    variants = VariantStore(store, f"{root}/v.sqlite")
    found = variants.lookup("ns", "c" * 32)
    assert len(found) == 12
    for v in found:
        reader = variants.reader("ns", v, Chunk("c" * 32, "text", torch.arange(8)))
        assert reader is not None
        reader.close()


def test_calibrated_alpha_is_the_default(engine, tmp_path, monkeypatch):
    from cacheblend_rag.cachecraft_calibration import calibrate, store_calibration

    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path))
    result = calibrate(engine, [(QUESTION, TEXTS)], target_kl=1e9, alphas=(0.2, 0.9), num_chunks=3)
    assert result["alpha"] == 0.2 and result["met"]  # any KL meets a huge target: the smallest α
    assert [row["alpha"] for row in result["table"]] == [0.2, 0.9]
    assert engine.prefill(TEXTS, QUESTION, "cachecraft").stats["cachecraft"]["alpha"] == DEFAULT_ALPHA  # none yet
    store_calibration(engine, {**result, "alpha": 0.7})
    assert engine.prefill(TEXTS, QUESTION, "cachecraft").stats["cachecraft"]["alpha"] == 0.7
    assert engine.prefill(TEXTS, QUESTION, "cachecraft", alpha=0.1).stats["cachecraft"]["alpha"] == 0.1


def test_cli_accepts_the_method_and_checks_calibrate_options(capsys):
    from cacheblend_rag.cli import build_parser, main

    assert build_parser().parse_args(["ask", "q?", "--method", "cachecraft"]).method == "cachecraft"
    assert main(["calibrate", "--target-kl", "-1"]) == 2
    assert "--target-kl" in capsys.readouterr().err
    assert build_parser().parse_args(["ingest", "docs", "--neighbor-variants", "2"]).neighbor_variants == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ingest", "docs", "--neighbor-variants", "0"])


def test_first_use_full_grows_variants_on_a_warm_corpus(engine):
    engine.ingest(TEXTS, show_progress=False)
    reuse = engine.prefill(TEXTS, QUESTION, "cachecraft")
    assert reuse.stats["cachecraft"]["variants_stored"] == 0  # reused from the isolated KV: nothing in context
    first = engine.prefill(TEXTS, QUESTION, "cachecraft", first_use="full", use_focus=False)
    assert [c["budget"] == c["num_tokens"] for c in _chunks(first)] == [False, True, True, True]
    assert first.stats["cachecraft"]["variants_stored"] == 3
    again = engine.prefill(TEXTS, QUESTION, "cachecraft", first_use="full")
    assert again.stats["cachecraft"]["variant_hits"] == 3 and again.stats["num_recomputed"] == 0


# ---- neighbour variants at ingestion (FusionRAG) ------------------------------------------------------


def _bag_of_words(texts: list[str]) -> list[list[float]]:
    """A real (if crude) embedding: word counts over the texts' vocabulary."""
    vocab = sorted({w for t in texts for w in t.lower().split()})
    return [[float(t.lower().split().count(w)) for w in vocab] for t in texts]


def test_nearest_neighbors_are_the_most_similar_others_least_similar_first():
    from cacheblend_rag.ingest.neighbors import nearest_neighbors

    vectors = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.6, 0.4]])
    assert nearest_neighbors(vectors, 2) == [[3, 1], [3, 0], [1, 3], [0, 1]]
    assert nearest_neighbors(vectors, 9)[2] == [0, 1, 3]  # k beyond the others: all of them
    assert nearest_neighbors(vectors[:1], 2) == [[]]
    with pytest.raises(ValueError, match="k"):
        nearest_neighbors(vectors, 0)


def test_ingest_neighbor_variants_are_reused_when_the_neighbours_come_first(engine):
    from cacheblend_rag.ingest.neighbors import nearest_neighbors

    ids = engine.ingest(TEXTS, variants="neighbors", neighbors=2, embed=_bag_of_words, show_progress=False)
    near = nearest_neighbors(torch.tensor(_bag_of_words(TEXTS)), 2)
    variants = engine.cache.policy_state(CacheCraft)
    for i, cid in enumerate(ids):
        contexts = [v.context for v in variants.lookup(engine.namespace, cid)]
        assert tuple(ids[j] for j in near[i]) in contexts  # computed after its two nearest, least similar first
    target = 0
    order = [ids[j] for j in near[target]] + [ids[target]]
    pre = engine.prefill(order, QUESTION, "cachecraft", use_focus=False)
    last = _chunks(pre)[-1]
    assert last["variant_kind"] == "context" and last["variant"] == order[:-1]
    assert last["budget"] == 0  # the same chunks before it, in the same order: nothing to fix
    assert engine.ingest_variants(ids, k=2, embed=_bag_of_words, show_progress=False) == 0  # stored already


def test_ingest_rejects_unknown_variant_kinds_and_bad_neighbour_counts(engine):
    with pytest.raises(ConfigError, match="variants"):
        engine.ingest(TEXTS, variants="similar", show_progress=False)
    with pytest.raises(ConfigError, match="neighbors"):
        engine.ingest(TEXTS, variants="neighbors", neighbors=0, show_progress=False)


# ---- the quality guard inside Cache-Craft -------------------------------------------------------------


def test_cachecraft_guard_estimates_and_escalates_every_partial_budget(engine):
    engine.ingest(TEXTS, show_progress=False)
    plain = engine.prefill(TEXTS, QUESTION, "cachecraft", use_focus=False)
    assert "guard" not in plain.stats.as_dict()
    flagged = engine.prefill(TEXTS, QUESTION, "cachecraft", use_focus=False, guard=0.0)
    guard = flagged.stats["guard"]
    assert guard["estimate"] > 0 and guard["flagged"] and not guard["escalated"]  # flag only: same budgets
    assert [c["budget"] for c in _chunks(flagged)] == [c["budget"] for c in _chunks(plain)]
    quiet = engine.prefill(TEXTS, QUESTION, "cachecraft", use_focus=False, guard=1e9, guard_ratio=0.8)
    assert not quiet.stats["guard"]["flagged"] and quiet.stats["num_recomputed"] == flagged.stats["num_recomputed"]
    escalated = engine.prefill(TEXTS, QUESTION, "cachecraft", use_focus=False, guard=0.0, guard_ratio=0.8)
    assert escalated.stats["guard"]["escalated"]
    for c in _chunks(escalated)[1:]:  # the first chunk follows the lead-in: exact, nothing to fix
        assert c["recomputed"] >= math.ceil(0.8 * c["num_tokens"] - 1e-9)
    assert escalated.stats["num_recomputed"] > flagged.stats["num_recomputed"]


def test_cachecraft_guard_reads_zero_when_nothing_reused_stays_stale(engine):
    pre = engine.prefill(TEXTS, QUESTION, "cachecraft", guard=0.01)  # cold: every chunk a hole, computed in full
    assert pre.stats["guard"]["estimate"] == 0.0 and not pre.stats["guard"]["flagged"]
    with pytest.raises(ConfigError, match="guard"):
        make_policy("cachecraft", guard=-1)
    with pytest.raises(ConfigError, match="guard_ratio"):
        make_policy("cachecraft", guard_ratio=0.5)  # an escalation without a threshold


def test_side_car_files_live_in_the_folder_the_store_declares(tmp_path):
    """Variants' metadata goes where the store says side-car files go: the disk tier's folder, else a private
    temporary database (a memory-only or Redis-only store has no folder)."""
    from cacheblend_rag.fuse.policies.cachecraft.variants import VARIANTS_FILE
    from cacheblend_rag.store import MemoryStore, TieredStore

    disk = DiskStore(tmp_path / "kv")
    tiered = TieredStore(MemoryStore(), disk)
    assert disk.side_car_dir() == tiered.side_car_dir() == disk.root and MemoryStore().side_car_dir() is None
    assert VariantStore.beside(tiered).path == disk.root / VARIANTS_FILE
    private = VariantStore.beside(MemoryStore())
    assert tmp_path not in private.path.parents and private.path.name == VARIANTS_FILE
    assert private.lookup("ns", "c" * 32) == [] and private.path.is_file()


def test_the_engine_owns_its_variant_store(tokenizer, tmp_path):
    """One VariantStore per engine (its cache's, made by the policy), beside its disk tier with the chunk index, and
    the one the policy stores into."""
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=tmp_path / "kv")
    variants = engine.cache.policy_state(CacheCraft)
    folder = engine.kv_store.side_car_dir()
    assert folder is not None and variants.path.parent == folder
    assert engine.index.path == folder / "chunk-index.sqlite"  # the chunk index takes its folder from there too
    engine.prefill(TEXTS, QUESTION, "cachecraft", first_use="full")
    stored = [v for c in engine.ingest(TEXTS, show_progress=False) for v in variants.lookup(engine.namespace, c)]
    assert stored and variants.num_added == len(stored)


def test_a_policy_state_is_made_once_per_cache_and_shared_by_salted_views(engine):
    """`ChunkCache.policy_state`: the policy's own `chunk_state`, made on first use, one per method name; salted
    views share it (its entries are named by their namespace); a method that keeps none has None."""
    from cacheblend_rag.fuse.policies import Relevance

    variants = engine.cache.policy_state(CacheCraft)
    assert isinstance(variants, VariantStore) and variants.store is engine.kv_store
    assert engine.cache.policy_state(make_policy("cachecraft", alpha=0.3)) is variants
    assert engine.cache.salted("client-a").policy_state(CacheCraft) is variants
    assert engine.cache.policy_state(Relevance) is None
    pre = engine.prefill(TEXTS, QUESTION, "cachecraft", first_use="full")  # cold: holes, nothing kept in context
    assert pre.kept == pre.stats["cachecraft"]["variants_stored"] == variants.num_added
