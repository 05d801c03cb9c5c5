"""One request value: built and checked once from the keywords every surface takes, then run by each engine method
with the same result as the conveniences that build it."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlend, CacheBlendEngine, ConfigError, Request, SamplingOptions
from cacheblend_rag.fuse.policies import CacheCraft, FullReuse

from conftest import tiny_model

pytestmark = pytest.mark.model  # the tiny model borrows the real SmolLM2 tokenizer

TEXTS = ["The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
         "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two."]
QUESTION = "Where does the river Lune reach the sea?"


@pytest.fixture(scope="module")
def engine(tokenizer):
    # no stored prefixes: every call fuses its chunks, so two calls of one request compute the same thing
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, prefix_reuse=False)
    engine.ingest(TEXTS, show_progress=False)
    return engine


def test_of_splits_sampling_keys_from_the_policys_options():
    request = Request.of(TEXTS, QUESTION, "cacheblend", 0.3, max_tokens=7, temperature=0.5, seed=3,
                         check_layers=(2,), stop="\n")
    assert request.sampling == SamplingOptions(max_new_tokens=7, temperature=0.5, seed=3, stop=("\n",))
    assert request.policy == CacheBlend(recompute_ratio=0.3, check_layers=(2,))
    assert request.chunks == tuple(TEXTS) and request.question == QUESTION and not request.auto_ratio
    auto = Request.of(prompt="Q?", method="cachecraft", recompute_ratio="auto", alpha=0.5)
    assert isinstance(auto.policy, CacheCraft) and auto.policy.alpha == 0.5 and auto.auto_ratio
    assert Request.of("one chunk", QUESTION).chunks == ("one chunk",)  # one chunk, never its characters


@pytest.mark.parametrize("build, message", [
    (lambda: Request.of(TEXTS, QUESTION, check_layer=1), "has no option 'check_layer'"),
    (lambda: Request.of(TEXTS, QUESTION, "cacheblend", 1.5), "recompute_ratio"),
    (lambda: Request.of(TEXTS, QUESTION, "blend"), "unknown method 'blend'"),
    (lambda: Request.of(TEXTS, QUESTION, max_new_tokens=0), "max_new_tokens must be ≥ 1"),
    (lambda: Request.of(TEXTS, "  "), "question is empty"),
    (lambda: Request.of(TEXTS, QUESTION, prompt="and a prompt"), "exactly one"),
    (lambda: Request.of(method="full_reuse"), "exactly one"),
    (lambda: Request.of(prompt=[{"role": "user"}]), "prompt must be a string or a non-empty list"),
    (lambda: Request.of(TEXTS, QUESTION, history=[{"role": "system", "content": "x"}]), "system message"),
    (lambda: Request(prompt="Q?", history=({"role": "user", "content": "earlier"},)), "pass prompt alone"),
    (lambda: Request(question=QUESTION, policy="cacheblend"), "policy must be a Policy"),
])
def test_a_bad_request_is_refused_when_built_naming_the_problem(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_each_method_runs_the_request_as_its_convenience_does(engine):
    request = Request.of(TEXTS, QUESTION, "cacheblend", 0.3, max_new_tokens=6)
    by_value = engine.generate_request(request)
    by_keywords = engine.generate(TEXTS, QUESTION, "cacheblend", 0.3, max_new_tokens=6)
    assert by_value.token_ids == by_keywords.token_ids and by_value.stats["method"] == "cacheblend"
    torch.testing.assert_close(by_value.logits, by_keywords.logits)
    torch.testing.assert_close(engine.prefill_request(request).logits, by_value.logits)
    assert "".join(engine.stream_request(request)).strip() == by_value.text
    seq, stats = engine.start_request(request)
    while not seq.finished:
        engine.advance([seq])
    assert seq.generated == by_value.token_ids and stats["num_tokens"] == by_value.stats["num_tokens"]


def test_a_started_request_stores_its_missed_chunks_after_its_first_piece(tokenizer):
    """The batched path (the server's): `start_request` hands back a sequence with its first piece before the
    missed chunks' KV is computed and stored for the next request (a cold request's first token waited for that:
    about a second full prefill); the next `advance`, or the next `start_request`, stores it; the next request hits."""
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)

    def stored(ids: list[str]) -> list[str]:
        return [i for i in ids if i in {key.chunk_id for key in engine.kv_store.keys()}]

    request = Request.of(TEXTS, QUESTION, "cacheblend", 0.3, max_new_tokens=3)
    seq, stats = engine.start_request(request)
    missed = stats["chunk_misses"]
    assert len(missed) == len(TEXTS) and seq.first_piece is not None and stored(missed) == []
    engine.advance([seq])
    assert stored(missed) == missed
    assert engine.start_request(request)[1]["chunk_hits"] == missed

    one_token = Request.of(["Tarn Hows is a tarn in the Lake District."], QUESTION, max_new_tokens=1)
    seq, stats = engine.start_request(one_token)  # done at its first token: no `advance` follows
    assert seq.finished and len(stats["chunk_misses"]) == 1 and stored(stats["chunk_misses"]) == []
    assert engine.start_request(one_token)[1]["chunk_hits"] == stats["chunk_misses"]  # stored before it ran


def test_a_prompt_request_finds_the_stored_chunks_and_uses_its_policy_object(engine):
    prompt = "Context:\n" + "\n\n".join(TEXTS) + f"\n\nQuestion: {QUESTION}\nAnswer:"
    out = engine.generate_request(Request(prompt=prompt, policy=FullReuse(), sampling=SamplingOptions(max_new_tokens=2)))
    assert out.stats["method"] == "full_reuse" and len(out.stats["chunk_hits"]) == len(TEXTS)
    assert out.stats["num_recomputed"] == 0 and len(out.token_ids) == 2


def test_one_default_method_one_default_ratio_and_one_call_keyword_merge():
    from cacheblend_rag.fuse.policies import DEFAULT_METHOD, POLICIES
    from cacheblend_rag.request import DEFAULT_RECOMPUTE_RATIO, call_keywords

    default = POLICIES[DEFAULT_METHOD]()
    assert Request(question=QUESTION).policy == default == Request.of(TEXTS, QUESTION).policy
    assert DEFAULT_RECOMPUTE_RATIO == default.recompute_ratio
    ours = dict(method="cacheblend", recompute_ratio=0.2, policy_options={"check_layers": (1, 2)}, max_new_tokens=9)
    kept = call_keywords({"max_tokens": 4, "deviation": "v"}, **ours, temperature=0.0)
    assert kept == dict(check_layers=(1, 2), deviation="v", method="cacheblend", recompute_ratio=0.2,
                        max_new_tokens=4, temperature=0.0)
    other = call_keywords({"method": "full_reuse", "recompute_ratio": 0.5}, **ours)
    assert other == dict(method="full_reuse", recompute_ratio=0.5, max_new_tokens=9)  # the LLM's options stay home
    assert Request.of(TEXTS, QUESTION, **kept).policy == CacheBlend(0.2, check_layers=(1, 2), deviation="v")
