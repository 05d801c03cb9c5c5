"""The quality guard (fuse/guard.py) on a tiny random llama: its estimate, its flag and its escalation."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ConfigError
from conftest import tiny_model

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "The Eiffel Tower was finished in 1889 for the World's Fair in Paris, France.",
    "Basalt is an igneous rock formed from the rapid cooling of lava rich in iron.",
]
QUESTION = "Where does the river Lune reach the sea?"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a shared 2-core machine, 2 OpenMP threads per process oversubscribe and spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)
    engine.ingest(TEXTS, show_progress=False)
    return engine


def _guard(engine, ratio, **options):
    pre = engine.prefill(TEXTS, QUESTION, method="cacheblend", recompute_ratio=ratio, **options)
    return pre.stats, pre.stats["guard"]


def test_estimate_is_zero_when_nothing_stays_stale(engine):
    _, at_one = _guard(engine, 1.0, guard=0.0)
    assert at_one["estimate"] == 0.0 and not at_one["flagged"]
    # one chunk behind the lead-in it was computed after: exact, nothing reused
    pre = engine.prefill(TEXTS[:1], QUESTION, method="cacheblend", recompute_ratio=0.15, guard=0.0)
    assert pre.stats["num_reused"] == 0
    assert pre.stats["guard"]["estimate"] == 0.0 and not pre.stats["guard"]["flagged"]


def test_estimate_rises_as_the_budget_shrinks(engine):
    estimates = [_guard(engine, ratio, guard=1.0)[1]["estimate"] for ratio in (0.9, 0.5, 0.15, 0.05)]
    assert all(e > 0 for e in estimates)
    assert estimates == sorted(estimates) and estimates[0] < estimates[-1]


def test_flag_only_changes_nothing_and_escalation_recomputes_more(engine):
    plain = engine.prefill(TEXTS, QUESTION, method="cacheblend", recompute_ratio=0.15)
    assert "guard" not in plain.stats
    flagged_stats, flagged = _guard(engine, 0.15, guard=0.0)  # any stale mass exceeds 0: flagged
    assert flagged["flagged"] and not flagged["escalated"] and flagged["threshold"] == 0.0
    assert flagged_stats["num_recomputed"] == plain.stats["num_recomputed"]
    quiet_stats, quiet = _guard(engine, 0.15, guard=10.0, guard_ratio=0.6)  # never flagged: no escalation
    assert not quiet["flagged"] and not quiet["escalated"]
    assert quiet_stats["num_recomputed"] == plain.stats["num_recomputed"]
    escalated_stats, escalated = _guard(engine, 0.15, guard=0.0, guard_ratio=0.6)
    assert escalated["flagged"] and escalated["escalated"] and escalated["escalate_to"] == 0.6
    assert escalated_stats["num_recomputed"] == round(0.6 * plain.stats["num_reused"])
    assert escalated_stats["num_recomputed"] > plain.stats["num_recomputed"]
    assert escalated_stats.as_dict()["guard"] == escalated  # reported in the JSON-ready stats too


def test_escalating_to_everything_is_full_prefill(engine):
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    pre = engine.prefill(TEXTS, QUESTION, method="cacheblend", recompute_ratio=0.15, guard=0.0, guard_ratio=1.0)
    assert pre.stats["guard"]["escalated"]
    assert pre.stats["num_recomputed"] == pre.stats["num_reused"]
    assert float((pre.logits - full.logits).abs().max()) < 1e-3


@pytest.mark.parametrize("options, fix", [
    ({"guard": -0.1}, "guard must be a number"),
    ({"guard": "high"}, "guard must be a number"),
    ({"guard_ratio": 0.5}, "set the guard threshold too"),
    ({"guard": 0.1, "guard_ratio": 1.5}, "within \\[0, 1\\]"),
    ({"guard": 0.1, "guard_ratio": 0.1}, "below recompute_ratio"),
])
def test_bad_guard_options_are_config_errors(engine, options, fix):
    with pytest.raises(ConfigError, match=fix):
        engine.prefill(TEXTS, QUESTION, method="cacheblend", recompute_ratio=0.15, **options)
