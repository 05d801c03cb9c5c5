"""The engine's invariants on tiny random models of every supported architecture."""

from __future__ import annotations

import threading

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ChunkError, ConfigError, PromptTooLongError, Request
from cacheblend_rag.fuse.policies import CacheBlend, make_policy

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "The Eiffel Tower was finished in 1889 for the World's Fair in Paris, France.",
    "Basalt is an igneous rock formed from the rapid cooling of lava rich in iron.",
]
QUESTION = "Where does the river Lune reach the sea?"


@pytest.fixture
def engine(tiny):
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer)
    engine.ingest(TEXTS, show_progress=False)
    return engine


def _max_diff(a, b) -> float:
    return float((a.logits - b.logits).abs().max())


def test_full_prefill_equals_hf_forward(engine):
    pre = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    with torch.no_grad():
        expected = engine.model(pre.token_ids[None]).logits[0, -1]
    torch.testing.assert_close(pre.logits, expected, atol=1e-4, rtol=1e-4)


def test_ratio_one_is_full_prefill_and_ratio_zero_is_full_reuse(engine):
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    reuse = engine.prefill(TEXTS, QUESTION, method="full_reuse")
    assert _max_diff(engine.prefill(TEXTS, QUESTION, recompute_ratio=1.0), full) <= 1e-4
    assert _max_diff(engine.prefill(TEXTS, QUESTION, recompute_ratio=0.0), reuse) == 0.0
    assert _max_diff(reuse, full) > 1e-3, "reusing chunks out of context should change the logits"


def test_partial_recompute_lies_between(engine):
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    reuse = engine.prefill(TEXTS, QUESTION, method="full_reuse")
    blend = engine.prefill(TEXTS, QUESTION, recompute_ratio=0.5)
    assert 0 < blend.stats["num_recomputed"] < blend.stats["num_reused"]
    assert _max_diff(blend, full) < _max_diff(reuse, full)


def test_layers_up_to_the_check_layer_are_fresh_for_every_row(engine):
    """CacheBlend computes every non-exact row through its check layers (§4.3), so their KV is full prefill's."""
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    blend = engine.prefill(TEXTS, QUESTION, "cacheblend", recompute_ratio=0.2, check_layers=(1,))
    for layer in (0, 1):
        torch.testing.assert_close(blend.keys[layer], full.keys[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(blend.values[layer], full.values[layer], atol=1e-5, rtol=1e-5)
    reused = blend.stats["num_reused"]
    not_exact = blend.stats["num_tokens"] - blend.stats["num_exact_cached"]  # the exact prefix is never recomputed
    assert blend.stats["rows_per_layer"][:2] == [not_exact] * 2
    assert blend.stats["rows_per_layer"][2] < blend.stats["num_tokens"] and 0 < blend.stats["num_recomputed"] < reused
    assert not torch.allclose(blend.values[2], full.values[2], atol=1e-5), "later layers reuse cached KV"
    n, pairs = full.stats["num_tokens"], full.stats["attention_pairs_per_layer"]
    assert pairs[:-1] == [n * (n + 1) // 2] * (len(pairs) - 1) and pairs[-1] == n  # the last layer: final row only
    assert len(blend.stats["layer_s"]) == len(pairs) and sum(blend.stats["attention_pairs_per_layer"][2:]) < sum(pairs[2:])


def test_single_chunk_full_reuse_equals_prefix_cache(engine):
    reuse = engine.prefill(TEXTS[:1], QUESTION, method="full_reuse")
    prefix = engine.prefill(TEXTS[:1], QUESTION, method="prefix_cache")
    assert _max_diff(reuse, prefix) == 0.0
    assert reuse.stats["num_exact_cached"] == prefix.stats["num_exact_cached"] > 0


def test_bos_lead_in_differs_from_prefix_cache(tiny):
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer, lead_in="bos")
    engine.ingest(TEXTS[:1], show_progress=False)
    reuse = engine.prefill(TEXTS[:1], QUESTION, method="full_reuse")
    prefix = engine.prefill(TEXTS[:1], QUESTION, method="prefix_cache")
    assert _max_diff(reuse, prefix) > 1e-4
    assert reuse.stats["num_reused"] > 0 and prefix.stats["num_reused"] == 0


def test_holes_are_computed_then_stored_and_the_rest_reused(engine):
    new_text = "Glaciers carve U-shaped valleys as they slowly move downhill."
    first = engine.prefill([*TEXTS[:2], new_text], QUESTION, method="cacheblend")
    assert first.stats["chunk_misses"] == [engine.resolve_chunk(new_text).chunk_id]
    assert len(first.stats["chunk_hits"]) == 2 and first.stats["num_hole_tokens"] > 0
    second = engine.prefill([*TEXTS[:2], new_text], QUESTION, method="cacheblend")
    assert second.stats["chunk_misses"] == [] and len(second.stats["chunk_hits"]) == 3


def test_chunks_by_id_text_order_and_repeats(engine):
    ids = engine.ingest(TEXTS, show_progress=False)
    by_text = engine.prefill(TEXTS, QUESTION)
    by_id = engine.prefill(ids, QUESTION)
    assert _max_diff(by_text, by_id) == 0.0
    again = engine.prefill(ids, QUESTION)
    assert _max_diff(again, by_id) == 0.0
    reordered = engine.prefill(ids[::-1], QUESTION)
    reference = engine.prefill(ids[::-1], QUESTION, method="full_prefill")
    assert reordered.stats["chunk_hits"] == ids[::-1]
    assert torch.isfinite(reordered.logits).all() and reference.token_ids.numel() == reordered.token_ids.numel()


def test_known_chunks_are_bounded_and_evicted_ids_still_resolve(tiny):
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer, max_known_chunks=2)
    ids = engine.ingest(TEXTS, show_progress=False)
    assert list(engine.chunks) == ids[-2:]  # the two most recently seen
    evicted = engine.resolve_chunk(ids[0])  # found again through its stored KV
    assert evicted.text == TEXTS[0] and list(engine.chunks) == [ids[3], ids[0]]
    assert _max_diff(engine.prefill(ids, QUESTION), engine.prefill(TEXTS, QUESTION)) == 0.0
    with pytest.raises(ConfigError, match="max_known_chunks"):
        CacheBlendEngine(model, tokenizer, max_known_chunks=0)


def test_a_chunk_id_resolves_only_under_the_salt_that_sent_its_text(tiny):
    """#50: an id is no oracle on another client's documents; the shared (ingested) corpus resolves for every salt."""
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer, max_known_chunks=1)
    shared = engine.ingest(TEXTS[:1], show_progress=False)[0]
    sent = engine.resolve_chunk(TEXTS[1], "tenant-a").chunk_id
    engine.prefill([TEXTS[1]], QUESTION, cache_salt="tenant-a")  # stores its KV under the salt
    engine.resolve_chunk(TEXTS[2], "tenant-a")  # pushes TEXTS[1] out of the one-entry registry
    assert engine.resolve_chunk(sent, "tenant-a").text == TEXTS[1]  # found again through the salt's stored KV
    for salt in ("tenant-b", None):
        with pytest.raises(ChunkError, match="unknown chunk id"):
            engine.resolve_chunk(sent, salt)
    assert engine.resolve_chunk(shared, "tenant-b").text == TEXTS[0]


def test_gradual_filtering_and_per_chunk_selection(engine):
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    gradual = engine.prefill(TEXTS, QUESTION, "cacheblend", recompute_ratio=0.3, candidate_factor=2,
                             filter_layer=2)
    rows = gradual.stats["rows_per_layer"]
    assert rows[0] == rows[1] > rows[2] > rows[3]  # all but the exact prefix through check layer 1, then 0.6, 0.3 from 2
    once = engine.prefill(TEXTS, QUESTION, "cacheblend", recompute_ratio=0.3, candidate_factor=1)
    assert once.stats["rows_per_layer"][2] == once.stats["rows_per_layer"][3] == rows[3]  # selected once, at layer 1
    random = engine.prefill(TEXTS, QUESTION, "cacheblend", recompute_ratio=0.3, candidate_factor=1,
                            selection="random")
    assert random.stats["rows_per_layer"] == once.stats["rows_per_layer"]  # the control: as many rows, drawn at random
    per_chunk = engine.prefill(TEXTS, QUESTION, "cacheblend", recompute_ratio=0.3, selection="per_chunk",
                               deviation="kv", check_layers=(1, 2), chunk_head_tokens=2)
    assert per_chunk.stats["num_recomputed"] > 0
    assert torch.isfinite(per_chunk.logits).all() and torch.isfinite(full.logits).all()


def test_empty_chunk_list_is_valid(engine):
    pre = engine.prefill([], QUESTION)
    assert pre.stats["num_reused"] == 0 and pre.logits.shape == (engine.model.config.vocab_size,)


@pytest.mark.parametrize("bad,error,match", [
    ([""], ChunkError, "empty chunk"),
    (["   \n "], ChunkError, "empty chunk"),
    (["0123456789abcdef0123456789abcdef"], ChunkError, "unknown chunk id"),
])
def test_bad_chunks_are_clear_errors(engine, bad, error, match):
    with pytest.raises(error, match=match):
        engine.prefill(bad, QUESTION)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_ratio_out_of_range(engine, ratio):
    with pytest.raises(ConfigError, match="within"):
        engine.prefill(TEXTS, QUESTION, recompute_ratio=ratio)


@pytest.mark.parametrize("options,match", [(dict(candidate_factor=0.5), "candidate_factor"),
                                           (dict(filter_layer=1), "filter_layer"),
                                           (dict(deviation="q"), "deviation")])
def test_bad_cacheblend_options(engine, options, match):
    with pytest.raises(ConfigError, match=match):
        engine.prefill(TEXTS, QUESTION, "cacheblend", **options)


def test_unknown_method(engine):
    with pytest.raises(ConfigError, match="unknown method"):
        engine.prefill(TEXTS, QUESTION, method="magic")


def test_prompt_longer_than_context(tiny):
    _, model, tokenizer = tiny
    model.config.max_position_embeddings = 64
    engine = CacheBlendEngine(model, tokenizer)
    with pytest.raises(PromptTooLongError, match=r"\d+ tokens .* context window of 64"):
        engine.prefill(TEXTS, QUESTION)


def test_generate_greedy_matches_between_ratio_one_and_full(engine):
    a = engine.generate(TEXTS, QUESTION, method="full_prefill", max_new_tokens=12)
    b = engine.generate(TEXTS, QUESTION, recompute_ratio=1.0, max_new_tokens=12)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    # The first generated token is the argmax of the prefill's logits.
    assert a.token_ids[0] == int(engine.prefill(TEXTS, QUESTION, method="full_prefill").logits.argmax())


def test_streaming_sampling_and_stop_strings(engine):
    full = engine.generate(TEXTS, QUESTION, max_new_tokens=16)
    streamed = "".join(engine.stream(TEXTS, QUESTION, max_new_tokens=16))
    assert streamed.strip() == full.text
    s1 = engine.generate(TEXTS, QUESTION, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=3)
    s2 = engine.generate(TEXTS, QUESTION, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=3)
    assert s1.token_ids == s2.token_ids
    if len(full.text) > 4:
        stop = full.text[2:4]
        cut = engine.generate(TEXTS, QUESTION, max_new_tokens=16, stop=[stop])
        assert stop not in cut.text and full.text.startswith(cut.text)
        streamed_cut = "".join(engine.stream(TEXTS, QUESTION, max_new_tokens=16, stop=[stop]))
        assert stop not in streamed_cut


def test_concurrent_generation_is_serialised(engine):
    expected = {q: engine.generate(TEXTS, q, max_new_tokens=8).token_ids for q in (QUESTION, "Who won two prizes?")}
    results: dict[str, list[int]] = {}

    def ask(q: str) -> None:
        results[q] = engine.generate(TEXTS, q, max_new_tokens=8).token_ids

    threads = [threading.Thread(target=ask, args=(q,)) for q in expected for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


# ---- stats, decoding settings, templates, context room -------------------------------------------------


def test_stats_count_every_row_once_and_time_the_stages(engine):
    hole = "A hole: this passage was never ingested, so its KV is computed in context."
    pre = engine.prefill(TEXTS[:2] + [hole], QUESTION, "cacheblend", recompute_ratio=0.3, store_holes=False)
    s = pre.stats
    assert s["num_hole_tokens"] > 0 and len(s["chunk_misses"]) == 1 and len(s["chunk_hits"]) == 2
    assert s["num_reused"] + s["num_exact_cached"] + s["num_computed"] + s["num_hole_tokens"] == s["num_tokens"]
    assert set(s["timing"]) == {"kv_load_s", "kv_wait_s", "check_s", "layers_s"}
    assert all(v >= 0 for v in s["timing"].values()) and s["timing"]["check_s"] > 0
    assert s["ttft_s"] >= s["timing"]["check_s"] + s["timing"]["layers_s"]
    gen = engine.generate(TEXTS, QUESTION, max_new_tokens=5)
    assert gen.stats["num_generated"] == len(gen.token_ids) and gen.stats["timing"]["decode_s"] > 0
    streamed: dict = {}
    pieces = list(engine.stream(TEXTS, QUESTION, max_new_tokens=5, stats=streamed))
    assert "".join(pieces).strip() == gen.text
    assert streamed["num_generated"] == gen.stats["num_generated"] and streamed["timing"]["decode_s"] > 0


def test_generation_stops_at_eos(tiny):
    import copy

    _, model, tokenizer = tiny
    greedy = CacheBlendEngine(model, tokenizer).generate(TEXTS, QUESTION, max_new_tokens=12).token_ids
    # make a token the greedy answer produces (first seen at position k) the end-of-sequence token
    k = next((i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i]), None)
    if k is None:
        pytest.skip("the greedy answer repeats one token")
    eos_tokenizer = copy.deepcopy(tokenizer)
    eos_tokenizer.eos_token = eos_tokenizer.convert_ids_to_tokens(greedy[k])
    stopped = CacheBlendEngine(model, eos_tokenizer).generate(TEXTS, QUESTION, max_new_tokens=12)
    assert stopped.token_ids == greedy[: k + 1]


def test_sampling_follows_temperature_and_top_p(engine):
    greedy = engine.generate(TEXTS, QUESTION, max_new_tokens=8).token_ids
    # a nucleus this small holds only the most likely token: sampling is greedy whatever the temperature
    for seed in range(3):
        assert engine.generate(TEXTS, QUESTION, max_new_tokens=8, temperature=5.0, top_p=1e-9, seed=seed).token_ids == greedy
    hot = [engine.generate(TEXTS, QUESTION, max_new_tokens=8, temperature=5.0, seed=seed).token_ids for seed in range(3)]
    assert any(h != greedy for h in hot)


@pytest.mark.parametrize("settings,match", [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                            (dict(top_p=1.5), "top_p"), (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_sampling_settings(engine, settings, match):
    with pytest.raises(ConfigError, match=match):
        engine.generate(TEXTS, QUESTION, **settings)


def test_prompt_plus_new_tokens_longer_than_context(tiny):
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer)
    n = engine.prefill(TEXTS[:1], QUESTION).stats["num_tokens"]
    model.config.max_position_embeddings = n + 4
    engine = CacheBlendEngine(model, tokenizer)
    assert len(engine.generate(TEXTS[:1], QUESTION, max_new_tokens=4).token_ids) <= 4
    with pytest.raises(PromptTooLongError, match=rf"{n} tokens \+ max_new_tokens=5 exceeds .* {n + 4}"):
        engine.generate(TEXTS[:1], QUESTION, max_new_tokens=5)
    with pytest.raises(PromptTooLongError, match="max_new_tokens=5"):
        list(engine.stream(TEXTS[:1], QUESTION, max_new_tokens=5))


def test_template_per_request_and_without_chat_template(tiny):
    import copy

    from cacheblend_rag import PromptTemplate

    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer)
    template = PromptTemplate(system="Reply in French.", question="\n\nQ: {question}")
    pre = engine.prefill(TEXTS[:2], QUESTION, template=template)
    text = tokenizer.decode(pre.token_ids)
    assert "Reply in French." in text and f"Q: {QUESTION}" in text and "You are a helpful assistant" not in text
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None  # a base model's tokenizer: the template falls back to plain text
    plain_engine = CacheBlendEngine(model, plain)
    pre = plain_engine.prefill(TEXTS[:2], QUESTION, recompute_ratio=0.3)
    text = plain.decode(pre.token_ids)
    assert text.rstrip().endswith("Answer:") and "<|im_start|>" not in text
    full = plain_engine.prefill(TEXTS[:2], QUESTION, method="full_prefill")
    full_one = plain_engine.prefill(TEXTS[:2], QUESTION, recompute_ratio=1.0)
    torch.testing.assert_close(full_one.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_cacheblend_with_nothing_to_select_reuses_the_exact_rows(engine):
    """One chunk right after the prefix it was precomputed behind is exact: nothing is approximate, nothing recomputed."""
    blend = engine.prefill(TEXTS[:1], QUESTION, recompute_ratio=0.15)
    full = engine.prefill(TEXTS[:1], QUESTION, method="full_prefill")
    assert blend.stats["num_reused"] == 0 and blend.stats["num_exact_cached"] > 0
    assert blend.stats["rows_per_layer"][0] == blend.stats["num_tokens"] - blend.stats["num_exact_cached"]
    torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_concurrent_stream_and_generate_do_not_mix(engine):
    other = "Who won two Nobel prizes?"
    expected_stream = "".join(engine.stream(TEXTS, QUESTION, max_new_tokens=8))
    expected_gen = engine.generate(TEXTS, other, max_new_tokens=8).token_ids
    results: dict[str, list] = {"stream": [], "generate": []}

    def stream() -> None:
        results["stream"].append("".join(engine.stream(TEXTS, QUESTION, max_new_tokens=8)))

    def generate() -> None:
        results["generate"].append(engine.generate(TEXTS, other, max_new_tokens=8).token_ids)

    threads = [threading.Thread(target=f) for f in (stream, generate, stream, generate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"stream": [expected_stream] * 2, "generate": [expected_gen] * 2}


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sliding_window_model_through_the_engine(tokenizer, arch):
    """A window shorter than the prompt: full prefill is HF's forward, ratio 1 is full prefill."""
    from conftest import tiny_model

    model = tiny_model(arch, len(tokenizer), sliding_window=16)
    engine = CacheBlendEngine(model, tokenizer)
    engine.ingest(TEXTS, show_progress=False)
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    assert full.stats["num_tokens"] > 4 * 16
    with torch.no_grad():
        expected = model(full.token_ids[None]).logits[0, -1]
    torch.testing.assert_close(full.logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.prefill(TEXTS, QUESTION, recompute_ratio=1.0).logits, full.logits,
                               atol=1e-4, rtol=1e-4)
    # each window sees fewer pairs than causality alone would allow
    n = full.stats["num_tokens"]
    assert full.stats["attention_pairs_per_layer"][0] < n * (n + 1) // 2
    blend = engine.generate(TEXTS, QUESTION, recompute_ratio=0.3, max_new_tokens=6)
    assert 0 < blend.stats["num_recomputed"] < blend.stats["num_reused"] and len(blend.token_ids) > 0


def test_holes_are_stored_once_the_answer_is_done(engine, monkeypatch):
    """A chunk first seen as a hole is computed in context, then stored after decoding so the next request hits."""
    import cacheblend_rag.engine as engine_module
    from cacheblend_rag.store import KVKey

    holes = [f"Hole {i}: a passage that was never ingested, number {i} of three." for i in range(3)]
    ids = [engine.resolve_chunk(h).chunk_id for h in holes]
    stored_when_decoding: list[tuple[bool, ...]] = []
    decode = engine_module.kv_decode  # the engine's decoder, for generate and (on its worker) stream alike

    def observed_decode(*args, **kwargs):  # the real decode; it only notes whether the holes were stored yet
        stored_when_decoding.append(tuple(engine.kv_store.contains(KVKey(engine.namespace, i)) for i in ids[1:]))
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine_module, "kv_decode", observed_decode)
    pre = engine.prefill(TEXTS[:1] + holes[:1], QUESTION, store_holes=False)
    assert pre.stats["chunk_misses"] == ids[:1] and [c.chunk_id for c in pre.unstored_holes] == ids[:1]
    assert engine.prefill(TEXTS[:1] + holes[:1], QUESTION).stats["chunk_misses"] == ids[:1]  # not stored: a miss
    assert engine.prefill(TEXTS[:1] + holes[:1], QUESTION).stats["chunk_misses"] == []  # stored by the last call
    gen = engine.generate(TEXTS[:1] + holes[1:2], QUESTION, max_new_tokens=4)
    assert gen.stats["chunk_misses"] == ids[1:2] and len(gen.token_ids) > 0
    list(engine.stream(TEXTS[:1] + holes[2:], QUESTION, max_new_tokens=4))
    again = engine.prefill(TEXTS[:1] + holes, QUESTION)
    assert again.stats["chunk_misses"] == [] and again.stats["chunk_hits"] == [engine.resolve_chunk(TEXTS[0]).chunk_id] + ids
    # generate decoded before storing its hole (ids[1]), stream before storing its own (ids[2])
    assert stored_when_decoding == [(False, False), (True, False)]


def test_chunks_longer_than_the_sliding_window_are_reused_exactly_as_computed(tokenizer):
    """Gemma 3 with a window shorter than every chunk: a chunk's stored KV is what the model computes for it alone
    (its local layers see only the window), so ratio 0 is full reuse, ratio 1 full prefill (HF's forward), and
    the decode path gives HF generate's tokens past the window."""
    from conftest import tiny_model

    window = 8
    model = tiny_model("gemma3", len(tokenizer), sliding_window=window)
    engine = CacheBlendEngine(model, tokenizer)
    engine.ingest(TEXTS, show_progress=False)
    assert min(engine.resolve_chunk(t).num_tokens for t in TEXTS) > window
    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    with torch.no_grad():
        expected = model(full.token_ids[None]).logits[0, -1]
    torch.testing.assert_close(full.logits, expected, atol=1e-4, rtol=1e-4)
    assert _max_diff(engine.prefill(TEXTS, QUESTION, recompute_ratio=1.0), full) <= 1e-4
    reuse = engine.prefill(TEXTS, QUESTION, method="full_reuse")
    assert _max_diff(engine.prefill(TEXTS, QUESTION, recompute_ratio=0.0), reuse) == 0.0
    assert _max_diff(reuse, full) > 1e-3
    hf = CacheBlendEngine(model, tokenizer, decoder="hf")
    hf.ingest(TEXTS, show_progress=False)
    ours = engine.generate(TEXTS, QUESTION, recompute_ratio=0.3, max_new_tokens=16)
    assert ours.token_ids == hf.generate(TEXTS, QUESTION, recompute_ratio=0.3, max_new_tokens=16).token_ids


def test_chunks_computed_behind_a_neighbour_keep_the_invariants(tiny):
    """`ingest(behind="neighbor")`: each chunk's stored KV is its KV behind the lead-in and its most similar other
    chunk (computed, not stored), under its own key; ratio 1 is still full prefill, ratio 0 full reuse of it."""
    from cacheblend_rag import chunk_id
    from cacheblend_rag.ingest.neighbors import nearest_neighbors

    _, model, tokenizer = tiny

    def embed(texts: list[str]) -> list[list[float]]:  # a fixed similarity: 0 and 1 are neighbours, 2 and 3
        return [[1.0, 0.1 * i, 0.0] if i < 2 else [0.0, 0.1 * i, 1.0] for i in range(len(texts))]

    plain, near = CacheBlendEngine(model, tokenizer), CacheBlendEngine(model, tokenizer)
    plain.ingest(TEXTS, show_progress=False)
    near.ingest(TEXTS, show_progress=False, behind="neighbor", embed=embed)
    (j,) = nearest_neighbors(torch.tensor(embed(TEXTS)), 1)[0]
    assert j == 1
    gap = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    lead = near.cache.lead_in_ids + near.chunks.get(chunk_id(TEXTS[1])).token_ids.tolist() + gap
    chunk = near.chunks.get(chunk_id(TEXTS[0]))
    # remembered, so the chunk learned again behind a prompt's own opening is computed behind its neighbour too
    assert list(near.cache.neighbor(chunk.chunk_id)) == lead[len(near.cache.lead_in_ids):]
    expected = near.cache.compute(chunk.token_ids, near.cache.exact_segment(lead))
    stored = near.cache.reader(chunk)
    for layer in range(model.config.num_hidden_layers):
        keys, values = stored.layer(layer)
        torch.testing.assert_close(keys, expected.keys[layer])
        torch.testing.assert_close(values, expected.values[layer])
    assert not torch.allclose(stored.layer(1)[0], plain.cache.reader(chunk).layer(1)[0])  # not the lead-in's KV

    full = near.prefill(TEXTS, QUESTION, method="full_prefill")
    reuse = near.prefill(TEXTS, QUESTION, method="full_reuse")
    assert _max_diff(full, plain.prefill(TEXTS, QUESTION, method="full_prefill")) == 0.0
    assert _max_diff(near.prefill(TEXTS, QUESTION, recompute_ratio=1.0), full) <= 1e-4
    assert _max_diff(near.prefill(TEXTS, QUESTION, recompute_ratio=0.0), reuse) == 0.0
    assert _max_diff(reuse, plain.prefill(TEXTS, QUESTION, method="full_reuse")) > 1e-4
    with pytest.raises(ConfigError, match="behind must be one of"):
        near.ingest(TEXTS[:1], behind="previous")


def test_relevance_keeps_the_invariants_and_recomputes_the_rows_the_question_reads(engine, tiny):
    """`method="relevance"`: ratio 1 is full prefill, ratio 0 full reuse; in between, the same rows in every layer
    (no layer runs over every row): the uncached ones and the top share of reused rows by the question's attention
    over the stale KV (a probe pass of the uncached rows)."""
    from cacheblend_rag.fuse.hkvd import question_relevance

    full = engine.prefill(TEXTS, QUESTION, method="full_prefill")
    reuse = engine.prefill(TEXTS, QUESTION, method="full_reuse")
    assert _max_diff(engine.prefill(TEXTS, QUESTION, method="relevance", recompute_ratio=1.0), full) <= 1e-4
    assert _max_diff(engine.prefill(TEXTS, QUESTION, method="relevance", recompute_ratio=0.0), reuse) == 0.0
    mid = engine.prefill(TEXTS, QUESTION, method="relevance", recompute_ratio=0.3)
    stats = mid.stats
    budget = round(0.3 * stats["num_reused"])
    assert stats["num_recomputed"] == budget > 0
    assert set(stats["rows_per_layer"]) == {stats["num_tokens"] - stats["num_reused"] - stats["num_exact_cached"]
                                            + budget}
    assert 0 < _max_diff(mid, full) and 0 < _max_diff(mid, reuse)

    # the reused rows it recomputes are those the question reads most over the stale KV
    policy = make_policy("relevance", 0.3)
    fusion = engine.fusion_of(Request.of(TEXTS, QUESTION, method=policy))
    placed = policy.place(engine.cache, fusion)
    seq = engine.cache.sequence(fusion.layout.token_ids, fusion.layout.segment_of_row, placed.placements)
    try:
        chosen = policy.start(engine.adapter, seq, placed).active & seq.reused
        score = question_relevance(engine.adapter, seq, engine.adapter.num_layers // 3)
    finally:
        seq.close()
        placed.close()
    left = seq.reused & ~chosen
    assert int(chosen.sum()) == budget and float(score[chosen].min()) >= float(score[left].max())
    with pytest.raises(ConfigError, match="from_layer"):
        engine.prefill(TEXTS, QUESTION, method="relevance", recompute_ratio=0.3, from_layer=-1)


LOOKALIKE_PAGES = [  # one template, other facts: the pages where reuse answers with a neighbour's facts
    f"{name} - Frequently asked questions\nWho founded {name}? {name} was founded by {founder}.\n"
    f"Where is {name} based? {name} is based in {city}.\nHow much does the {name} X4 cost? It costs {price} euros."
    for name, founder, city, price in (("Zenva", "Mira Okafor", "Tallinn", 129), ("Trolum", "Kofi Novak", "Porto", 349),
                                       ("Pexdal", "Yuna Haddad", "Ghent", 518))
]


def test_lookalike_scores_tell_shared_phrasing_from_shared_text(tokenizer):
    """A page that repeats an earlier page's phrasing with other content scores high; a repeated page (overlapping
    windows of one text) and an unrelated one score near 0; the first page scores 0."""
    from cacheblend_rag.fuse.lookalike import lookalike_scores

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in LOOKALIKE_PAGES + TEXTS[:2]]
    first, second, third, river, curie = lookalike_scores(ids)
    assert first == 0.0 and second > 0.2 and third > 0.2 and river < 0.1 and curie < 0.1
    repeated = lookalike_scores([ids[0], ids[0][5:] + ids[3]])[1]
    assert abs(repeated) < 0.1


def test_cacheblend_recomputes_lookalike_pages_whole_and_keeps_the_invariants(tiny):
    """Among look-alike pages, CacheBlend (and relevance) recompute every page after the first in full (their rows in
    every layer), on top of the ratio; ratio 0 is still full reuse, 1 full prefill, and `lookalike=None` turns it
    off."""
    _, model, tokenizer = tiny
    engine = CacheBlendEngine(model, tokenizer)
    engine.ingest(LOOKALIKE_PAGES, show_progress=False)
    question = "How much does the Trolum X4 cost?"
    full = engine.prefill(LOOKALIKE_PAGES, question, method="full_prefill")
    reuse = engine.prefill(LOOKALIKE_PAGES, question, method="full_reuse")
    assert _max_diff(engine.prefill(LOOKALIKE_PAGES, question, recompute_ratio=0.0), reuse) == 0.0
    assert _max_diff(engine.prefill(LOOKALIKE_PAGES, question, recompute_ratio=1.0), full) <= 1e-4

    later = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in LOOKALIKE_PAGES[1:]]
    stats = engine.prefill(LOOKALIKE_PAGES, question, recompute_ratio=0.15).stats
    off = engine.prefill(LOOKALIKE_PAGES, question, recompute_ratio=0.15, lookalike=None).stats
    assert stats["lookalike_rows"] == sum(later) and "lookalike_rows" not in off
    assert stats["num_recomputed"] >= sum(later) > off["num_recomputed"]
    uncached = stats["num_tokens"] - stats["num_reused"] - stats["num_exact_cached"]
    assert min(stats["rows_per_layer"]) >= uncached + sum(later) > min(off["rows_per_layer"])
    distinct = engine.prefill(TEXTS, QUESTION, recompute_ratio=0.15).stats
    assert "lookalike_rows" not in distinct
    ranked = engine.prefill(LOOKALIKE_PAGES, question, method="relevance", recompute_ratio=0.15).stats
    assert ranked["lookalike_rows"] == sum(later) and min(ranked["rows_per_layer"]) >= uncached + sum(later)
    assert _max_diff(engine.prefill(LOOKALIKE_PAGES, question, method="relevance", recompute_ratio=0.0), reuse) == 0.0
    with pytest.raises(ConfigError, match="lookalike"):
        engine.prefill(LOOKALIKE_PAGES, question, recompute_ratio=0.15, lookalike=2.0)


def test_a_lookalike_group_is_recomputed_with_its_first_page(tiny):
    """Where a look-alike group's first page is reused too (a plain-string prompt, or an agent's step after a tool:
    the question before the pages), the first page is recomputed with the pages that look like it, so the group
    is the model's own prefill: a stale first page costs the answers on the pages after it (docs/benchmarks.md)."""
    _, model, tokenizer = tiny
    prompt = "Answer from these pages.\n\n" + "\n\n".join(LOOKALIKE_PAGES) + "\n\nHow much does the Trolum X4 cost?"
    pages = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in LOOKALIKE_PAGES)
    for method in ("relevance", "cacheblend"):
        for lookalike in (None, 0.2):  # each on a fresh engine: the prompt's opening is new, every page reused
            engine = CacheBlendEngine(model, tokenizer)
            engine.ingest(LOOKALIKE_PAGES, show_progress=False)
            fused = engine.prefill_prompt(prompt, method=method, recompute_ratio=0.15, lookalike=lookalike)
            full = engine.prefill_prompt(prompt, method="full_prefill")
            assert fused.stats["num_reused"] >= pages - 3, method  # every page (edge tokens merged aside)
            if lookalike is None:
                assert _max_diff(fused, full) > 1e-3, method  # stale pages: not the model's own prefill
            else:
                assert fused.stats["lookalike_rows"] == fused.stats["num_reused"], method
                assert _max_diff(fused, full) <= 1e-4, method
