"""Stored prefixes: a finished request's KV (prompt and answer) is the exact start of the next request that begins
with the same tokens (a conversation's next turn, an agent's next step); misses of any kind fall back to computing."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ConfigError
from cacheblend_rag.fuse.chunk_cache import PREFIX_BLOCK
from cacheblend_rag.fuse.loop import run_layers
from cacheblend_rag.fuse.policy import RowSelection
from cacheblend_rag.fuse.sequence import Placement
from cacheblend_rag.ingest.chunks import chunk_id
from cacheblend_rag.request import Request
from cacheblend_rag.store import MemoryStore

from conftest import tiny_model

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "Basalt is an igneous rock formed from the rapid cooling of lava rich in iron.",
]
PROMPT = ("You answer from the context only.\n\nContext:\n" + "\n\n".join(TEXTS)
          + "\n\nQ: Where does the river Lune reach the sea?\nA:")
FOLLOW_UP = "\nQ: Which passage says so?\nA:"


def _tiny_engine(tokenizer, **kwargs) -> CacheBlendEngine:
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=None, **kwargs)
    engine.ingest(TEXTS, show_progress=False)
    return engine


def _turn_two(engine: CacheBlendEngine, method: str = "cacheblend"):
    """Turn 1 (decoded: its KV is kept), then turn 2's text: turn 1's prompt, its answer, a follow-up."""
    first = engine.generate_prompt(PROMPT, method, max_new_tokens=8)
    return first, PROMPT + engine.tokenizer.decode(first.token_ids) + FOLLOW_UP


def test_the_second_turn_of_a_chat_starts_from_the_first_turns_prompt_and_answer(default_model, passages):
    model, tokenizer = default_model
    engine = CacheBlendEngine(model, tokenizer, kv_store=None)
    engine.ingest(passages[:3], show_progress=False)
    messages = [{"role": "user", "content": "Context:\n" + "\n\n".join(passages[:3]) + "\n\nQ: Who is mentioned?"}]
    first = engine.generate_prompt(messages, max_new_tokens=12)
    assert first.stats["num_prefix_rows"] == 0 and first.stats["num_chunk_rows"] > 0
    follow = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Answer in one word."}]
    second = engine.generate_prompt(follow, max_new_tokens=4)
    s = second.stats
    # the answer re-rendered by the chat template tokenizes as generated: the hit reaches into it
    assert s["num_prefix_rows"] >= first.stats["num_tokens"] + first.stats["num_generated"] - PREFIX_BLOCK - 1
    assert s["num_prefix_rows"] % PREFIX_BLOCK == 0 and s["num_chunk_rows"] == 0
    assert s["chunk_hits"] == first.stats["chunk_hits"] and s["chunk_misses"] == []  # reused inside the prefix
    assert s["num_exact_cached"] >= s["num_prefix_rows"]
    assert s["num_prefix_rows"] + s["num_computed"] + s["num_reused"] == s["num_tokens"]
    third = engine.generate_prompt(follow + [{"role": "assistant", "content": second.text},
                                            {"role": "user", "content": "Which passage says so?"}], max_new_tokens=4)
    assert third.stats["num_prefix_rows"] >= s["num_tokens"] - PREFIX_BLOCK


def test_a_prefix_hit_equals_full_prefill_when_the_first_turn_was_exact(tokenizer):
    engine = _tiny_engine(tokenizer)
    first, text = _turn_two(engine, "full_prefill")
    hit = engine.prefill_prompt(text, "cacheblend", recompute_ratio=0.15)
    n1 = first.stats["num_tokens"]
    assert hit.stats["num_prefix_rows"] >= n1 - PREFIX_BLOCK - 1
    full = engine.prefill_prompt(text, "full_prefill")
    assert full.stats["num_prefix_rows"] == 0  # the reference computes every row
    torch.testing.assert_close(hit.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_a_prefix_hit_equals_placing_the_stored_kv_by_hand(tokenizer):
    engine = _tiny_engine(tokenizer)
    _, text = _turn_two(engine)  # turn 1 fused by CacheBlend: the stored prefix is its fused KV, as is
    hit = engine.prefill_prompt(text, "full_reuse")
    ids = hit.token_ids
    cache = engine.cache
    reader = cache.stored_prefix(ids)
    assert reader is not None and reader.num_tokens == hit.stats["num_prefix_rows"] > 0
    seq = cache.sequence(ids, torch.full_like(ids, -1), [Placement(0, reader, exact=True)])
    result = run_layers(engine.adapter, seq, RowSelection(~seq.cached), num_output_rows=1)
    by_hand = engine.adapter.logits(result.hidden[-1:])[0].float()
    torch.testing.assert_close(hit.logits, by_hand, atol=1e-5, rtol=1e-5)


def test_an_edited_earlier_turn_reuses_only_up_to_the_edit(tokenizer):
    engine = _tiny_engine(tokenizer)
    _, text = _turn_two(engine)
    edited = text.replace("Marie Curie", "Pierre Curie")
    before, after = tokenizer(text)["input_ids"], tokenizer(edited)["input_ids"]
    first_change = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    hit = engine.prefill_prompt(edited, "cacheblend")
    assert hit.stats["num_prefix_rows"] == first_change // PREFIX_BLOCK * PREFIX_BLOCK > 0
    assert TEXTS[2] in edited and hit.stats["chunk_hits"]  # the chunks after the edit are still fused
    full = engine.prefill_prompt(edited, "full_prefill")
    assert torch.nn.functional.kl_div(hit.logits.log_softmax(-1), full.logits.log_softmax(-1), log_target=True,
                                      reduction="sum") < 0.5


def test_prefix_reuse_off_keeps_nothing(tokenizer):
    engine = _tiny_engine(tokenizer, prefix_reuse=False)
    _, text = _turn_two(engine)
    assert not engine.prefix_reuse and engine.prefill_prompt(text).stats["num_prefix_rows"] == 0


def test_an_evicted_prefix_is_a_miss_and_the_request_is_computed(tokenizer, caplog):
    prefixes = MemoryStore()
    engine = _tiny_engine(tokenizer, prefix_store=prefixes)
    _, text = _turn_two(engine, "full_prefill")
    assert len(prefixes) == 1
    prefixes.clear()
    missed = engine.prefill_prompt(text, "full_reuse")
    assert missed.stats["num_prefix_rows"] == 0 and missed.stats["chunk_hits"]
    small = _tiny_engine(tokenizer, prefix_store=MemoryStore(max_bytes=1024))  # nothing fits its budget
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag"):
        _, text = _turn_two(small, "full_prefill")
        assert small.prefill_prompt(text).stats["num_prefix_rows"] == 0
    said = [r.getMessage() for r in caplog.records if "larger than the prefix store's budget" in r.getMessage()]
    assert len(said) == 1 and "0.0 MiB" in said[0]  # said once, naming the budget


def test_another_process_finds_a_prefix_on_disk_and_a_corrupt_one_is_a_miss(tokenizer, tmp_path):
    folder = tmp_path / "prefixes"
    engine = _tiny_engine(tokenizer, prefix_store=folder)
    _, text = _turn_two(engine, "full_prefill")
    full = engine.prefill_prompt(text, "full_prefill").logits
    other = _tiny_engine(tokenizer, prefix_store=folder)  # a new index: found by probing the store
    hit = other.prefill_prompt(text, "full_reuse")
    assert hit.stats["num_prefix_rows"] > 0
    torch.testing.assert_close(hit.logits, full, atol=1e-3, rtol=1e-3)  # fp16 on disk
    for path in folder.rglob("pfx-*.safetensors"):
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF  # a flipped byte in the last layer's data: its crc fails mid-request
        path.write_bytes(bytes(raw))
    third = _tiny_engine(tokenizer, prefix_store=folder)
    missed = third.prefill_prompt(text, "full_reuse")
    assert missed.stats["num_prefix_rows"] == 0
    assert torch.isfinite(missed.logits).all()


def test_a_dead_prefix_tier_is_a_miss_never_an_error(tokenizer):
    engine = _tiny_engine(tokenizer, prefix_store=["redis://127.0.0.1:9/0"])  # nothing listens there
    _, text = _turn_two(engine)
    again = engine.generate_prompt(text, max_new_tokens=4)
    assert again.stats["num_prefix_rows"] == 0 and again.stats["chunk_hits"]


def test_two_threads_sharing_a_prefix_get_what_one_thread_gets(tokenizer):
    engine = _tiny_engine(tokenizer)
    _, text = _turn_two(engine)
    follow_ups = [text + f" Q{i}: and then?" for i in range(4)]
    alone = [engine.generate_prompt(t, max_new_tokens=6) for t in follow_ups]
    shared = _tiny_engine(tokenizer)
    _turn_two(shared)
    got: dict[int, object] = {}

    def run(i: int) -> None:
        for j in (i, (i + 1) % 4):
            got[j, i] = shared.generate_prompt(follow_ups[j], max_new_tokens=6)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (j, _), g in got.items():
        assert g.stats["num_prefix_rows"] > 0
        assert g.token_ids == alone[j].token_ids
        torch.testing.assert_close(g.logits, alone[j].logits, atol=1e-4, rtol=1e-4)


def test_a_stored_prefix_is_named_by_a_hash_chain_of_whole_blocks(tokenizer):
    engine = _tiny_engine(tokenizer)
    cache = engine.cache
    ids = torch.arange(3 * PREFIX_BLOCK + 5)
    chain = cache.block_hashes(ids)
    assert len(chain) == 3 and chain[:2] == cache.block_hashes(ids[: 2 * PREFIX_BLOCK + 1])
    changed = ids.clone()
    changed[PREFIX_BLOCK + 1] += 1
    assert cache.block_hashes(changed)[0] == chain[0] and cache.block_hashes(changed)[1:] != chain[1:]


# ---- the documents path (engine.generate with history=): chunks stay in the first user turn ---------------------


def _rendered(tokenizer, question: str, history=()) -> list[int]:
    """Token ids of a documents-path prompt over TEXTS[:2], as the engine assembles it."""
    from cacheblend_rag.fuse.layout import PromptTemplate

    prefix, sep, suffix = PromptTemplate().render(tokenizer, question, history)
    chunks = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:2]]
    return prefix + chunks[0] + sep + chunks[1] + suffix


@pytest.mark.parametrize("chat_template", [True, False], ids=["chat-template", "plain-text"])
def test_a_follow_ups_prompt_starts_with_the_previous_prompt_and_answer(tokenizer, chat_template):
    import copy

    if not chat_template:  # a base model's tokenizer (as gemma3-270m's GGUF): the package's plain-text template
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = None
    q1, answer, q2 = "Where does the Lune reach the sea?", "At Sunderland Point.", "Which passage says so?"
    first = _rendered(tokenizer, q1)
    said = tokenizer((" " if not chat_template else "") + answer, add_special_tokens=False)["input_ids"]
    second = _rendered(tokenizer, q2, [{"role": "user", "content": q1}, {"role": "assistant", "content": answer}])
    assert second[:len(first) + len(said)] == first + said  # turn 1's prompt + answer, token for token
    text = tokenizer.decode(second[len(first):])
    assert q2 in text and q1 not in text  # the follow-up is a turn of its own; the first question stays in turn 1
    third = _rendered(tokenizer, "Answer in one word.", [{"role": "user", "content": q1},
                      {"role": "assistant", "content": answer}, {"role": "user", "content": q2},
                      {"role": "assistant", "content": "The first."}])
    assert third[:len(second)] == second


def test_documents_with_earlier_turns_start_from_the_previous_turns_kv(tokenizer):
    engine = _tiny_engine(tokenizer)
    q1 = "Where does the river Lune reach the sea?"
    first = engine.generate(TEXTS[:2], q1, max_new_tokens=6)
    assert first.stats["num_prefix_rows"] == 0 and first.stats["chunk_hits"]
    history = [{"role": "user", "content": q1}, {"role": "assistant", "content": first.text or "?"}]
    second = engine.generate(TEXTS[:2], "Which passage says so?", history=history, max_new_tokens=4)
    s = second.stats
    assert s["num_tokens"] > first.stats["num_tokens"]
    # turn 1's prompt tokens come back unchanged (the random model's answer may re-tokenize otherwise)
    assert s["num_prefix_rows"] >= first.stats["num_tokens"] // PREFIX_BLOCK * PREFIX_BLOCK > 0
    assert s["num_chunk_rows"] == 0  # both chunks lie inside the stored prefix
    with pytest.raises(ConfigError, match="system"):
        engine.generate(TEXTS[:2], "Why?", history=[{"role": "system", "content": "Be brief."}])
    with pytest.raises(ConfigError, match="history"):
        engine.generate(TEXTS[:2], "Why?", history="What?")


def test_the_prefix_tier_never_holds_more_than_its_budget(tokenizer):
    budget = 400_000  # a few of the tiny model's conversations: older prefixes are evicted
    prefixes = MemoryStore(max_bytes=budget)
    engine = _tiny_engine(tokenizer, prefix_store=prefixes)
    most = 0
    for i in range(6):
        messages = f"{PROMPT} (chat {i})"  # every chat's prefix is new
        first = engine.generate_prompt(messages, max_new_tokens=4)
        engine.generate_prompt(messages + tokenizer.decode(first.token_ids) + FOLLOW_UP, max_new_tokens=4)
        most = max(most, prefixes.stats()["bytes"])
        assert prefixes.stats()["bytes"] <= budget
    assert prefixes.stats()["evictions"] > 0 and most > budget // 2


def test_the_cache_remembers_a_bounded_number_of_its_own_prefixes(tokenizer, monkeypatch):
    # a store evicts without telling the cache: its record of the prefixes it stored must not grow per request
    from cacheblend_rag.fuse import chunk_cache

    monkeypatch.setattr(chunk_cache, "_MAX_OWN_PREFIXES", 3)
    engine = _tiny_engine(tokenizer)
    for n in range(6):
        engine.generate_prompt(f"Question {n}: " + PROMPT, "full_prefill", max_new_tokens=2)
    assert len(engine.cache._prefix_entries) == 3
    last = "Question 5: " + PROMPT
    assert engine.prefill_prompt(last + " More.").stats["num_prefix_rows"] > 0  # the newest is still found


def test_requests_with_different_cache_salts_share_no_prefix_segment_or_learned_chunk(tokenizer):
    engine = _tiny_engine(tokenizer)
    documents = [TEXTS[0], "A chunk no operator ingested: the client sent it, so its KV is learned from the request."]

    def ask(salt: str | None):
        return engine.generate_request(Request.of(documents, "Where does the Lune reach the sea?",
                                                  max_new_tokens=4, cache_salt=salt))

    first = ask("alice")
    assert first.stats["chunk_hits"] == [chunk_id(TEXTS[0])]  # the operator's chunk is shared with any salt
    assert first.stats["num_prefix_rows"] == 0
    again = ask("alice")  # the same salt: the stored prefix and the learned chunk are found
    assert again.stats["num_prefix_rows"] > 0 and again.stats["chunk_misses"] == []
    other = ask("bob")  # another salt: neither is found; it reports what the very first request did
    assert other.stats["num_prefix_rows"] == 0
    assert {k: other.stats[k] for k in ("num_exact_cached", "num_reused", "num_hole_tokens")} == \
        {k: first.stats[k] for k in ("num_exact_cached", "num_reused", "num_hole_tokens")}
    assert other.stats["chunk_hits"] == [chunk_id(TEXTS[0])] and other.stats["chunk_misses"] == [chunk_id(documents[1])]
    unsalted = ask(None)  # unsalted requests share among themselves only
    assert unsalted.stats["num_prefix_rows"] == 0 and unsalted.stats["chunk_misses"] == [chunk_id(documents[1])]
    assert ask(None).stats["num_prefix_rows"] > 0
    with pytest.raises(ConfigError, match="cache_salt"):
        Request.of(prompt="hi", cache_salt="")
