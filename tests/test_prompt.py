"""Any prompt reuses the KV of the stored chunks it carries: the user's own template, chat messages, another
process's ingestion; what was found is exact where it must be."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheblend_rag import CacheBlendEngine, ConfigError
from cacheblend_rag.ingest.chunks import chunk_id, normalize_text
from cacheblend_rag.fuse.layout import align_chunk
from cacheblend_rag.ingest.index import ChunkIndex, normalize_prompt, normalize_prompt_map

from conftest import tiny_model

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "Basalt is an igneous rock formed from the rapid cooling of lava rich in iron.",
]
QUESTION = "Where does the river Lune reach the sea?"


def users_prompt(texts: list[str]) -> str:
    """A template of the user's own: numbering, metadata lines, their own instruction."""
    context = "\n\n".join(f"[{i + 1}] (source: notes.txt, page {i})\n{t}   " for i, t in enumerate(texts))
    return f"You answer from the context only.\n\nContext:\n{context}\n\nQ: {QUESTION}\nA:"


@pytest.fixture
def engine(tokenizer, tmp_path):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=tmp_path / "kv")
    engine.ingest(TEXTS, show_progress=False)
    return engine


def test_the_index_finds_chunks_at_any_offset_and_notices_edits(tmp_path):
    index = ChunkIndex(tmp_path / "index.sqlite")
    index.add((chunk_id(t), normalize_text(t)) for t in TEXTS)
    prompt = normalize_prompt(users_prompt([TEXTS[2], TEXTS[0]]) + TEXTS[1].replace("two", "three"))
    scan = index.scan(prompt)
    assert [m.chunk_id for m in scan.matches] == [chunk_id(TEXTS[2]), chunk_id(TEXTS[0])]
    assert all(prompt[m.start:m.end] == normalize_text(TEXTS[[2, 0][i]]) for i, m in enumerate(scan.matches))
    assert scan.changed == [chunk_id(TEXTS[1])]  # its head is there, its text is not
    again = ChunkIndex(tmp_path / "index.sqlite")  # another process
    assert len(again) == 3 and again.scan(prompt).matches == scan.matches
    again.remove([chunk_id(TEXTS[0])])
    assert [m.chunk_id for m in ChunkIndex(tmp_path / "index.sqlite").scan(prompt).matches] == [chunk_id(TEXTS[2])]


def _index_in_another_process(path, action: str, texts: list[str]) -> None:
    """`add` or `remove` these chunks through a ChunkIndex of a second Python process."""
    import subprocess
    import sys

    code = ("import sys, json\n"
            "from cacheblend_rag.ingest.chunks import chunk_id, normalize_text\n"
            "from cacheblend_rag.ingest.index import ChunkIndex\n"
            "path, action, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
            "index = ChunkIndex(path)\n"
            "index.add((chunk_id(t), normalize_text(t)) for t in texts) if action == 'add' "
            "else index.remove([chunk_id(t) for t in texts])\n")
    import json

    subprocess.run([sys.executable, "-c", code, str(path), action, json.dumps(texts)], check=True, timeout=120)


def test_a_loaded_index_sees_chunks_another_process_adds_or_removes_later(tmp_path):
    path = tmp_path / "index.sqlite"
    index = ChunkIndex(path)  # a running server's index: loaded by its first scan
    index.add([(chunk_id(TEXTS[0]), normalize_text(TEXTS[0]))])
    prompt = normalize_prompt(users_prompt(TEXTS))
    assert [m.chunk_id for m in index.scan(prompt).matches] == [chunk_id(TEXTS[0])]
    _index_in_another_process(path, "add", TEXTS[1:])  # `cacheblend-rag ingest` while the server runs
    assert [m.chunk_id for m in index.scan(prompt).matches] == [chunk_id(t) for t in TEXTS]
    assert index.text(chunk_id(TEXTS[2])) == normalize_text(TEXTS[2]) and len(index) == 3
    _index_in_another_process(path, "remove", TEXTS[:1])  # `cacheblend-rag delete` elsewhere
    assert [m.chunk_id for m in index.scan(prompt).matches] == [chunk_id(t) for t in TEXTS[1:]]
    _index_in_another_process(path, "add", TEXTS[:1])  # back again, perhaps under a reused rowid
    assert len(index) == 3 and len(index.scan(prompt).matches) == 3


def test_a_users_own_prompt_reuses_the_chunks_it_carries(engine):
    ids = [chunk_id(t) for t in TEXTS]
    out = engine.generate_prompt(users_prompt(TEXTS), max_new_tokens=3)
    assert out.stats["chunk_hits"] == ids and out.stats["chunk_misses"] == []
    assert out.stats["num_reused"] > sum(len(engine.tokenizer(t)["input_ids"]) for t in TEXTS) - 10
    assert len(out.token_ids) == 3


def test_prompt_prefill_is_exact_at_ratio_one_and_full_reuse_at_zero(engine):
    prompt = users_prompt(TEXTS)
    full = engine.prefill_prompt(prompt, method="full_prefill")
    with torch.no_grad():
        expected = engine.model(full.token_ids[None]).logits[0, -1]
    torch.testing.assert_close(full.logits, expected, atol=1e-4, rtol=1e-4)
    one = engine.prefill_prompt(prompt, recompute_ratio=1.0)
    assert torch.equal(one.token_ids, full.token_ids)
    assert float((one.logits - full.logits).abs().max()) <= 1e-4
    engine.prefill_prompt(prompt, recompute_ratio=0.0)  # the opening seen again: its chunks' KV computed behind it
    zero = engine.prefill_prompt(prompt, recompute_ratio=0.0)
    reuse = engine.prefill_prompt(prompt, method="full_reuse")
    assert torch.equal(zero.logits, reuse.logits) and float((reuse.logits - full.logits).abs().max()) > 1e-3


def test_a_recurring_opening_gets_its_chunks_kv_behind_it(engine, tokenizer, tmp_path):
    # A plain string begins unlike the chat template's system turn the chunks were computed behind. Seen once, its
    # chunks come from there; seen again, they are computed behind the string's own opening after the answer, and
    # from then on a lone chunk right after that opening is exact: full reuse gives the model's own logits.
    prompt = f"You answer from the context only.\n\n{TEXTS[0]}\n\nQ: {QUESTION}\nA:"
    once = engine.prefill_prompt(prompt, method="full_reuse")
    again = engine.prefill_prompt(prompt, method="full_reuse")  # seen before: its chunks are computed behind it after
    full = engine.prefill_prompt(prompt, method="full_prefill")
    assert torch.equal(once.logits, again.logits) and float((once.logits - full.logits).abs().max()) > 1e-3
    learned = engine.prefill_prompt(prompt, method="full_reuse")
    assert learned.stats["chunk_hits"] == [chunk_id(TEXTS[0])] and learned.stats["chunk_misses"] == []
    torch.testing.assert_close(learned.logits, full.logits, atol=1e-4, rtol=1e-4)
    # the same through generation, which stores what it learned after the answer (without stored prefixes: the
    # first answer's own KV would otherwise be the longest stored prefix of the next prompt, and placed instead)
    generating = CacheBlendEngine(engine.model, tokenizer, kv_store=tmp_path / "kv2", prefix_reuse=False)
    generating.ingest(TEXTS, show_progress=False)
    other = f"Notes follow.\n\n{TEXTS[1]}\n\nQ: Who won two Nobel prizes?\nA:"
    expected = generating.prefill_prompt(other, method="full_prefill").logits
    for _ in range(2):
        generating.generate_prompt(other, "full_reuse", max_new_tokens=2)
    torch.testing.assert_close(generating.prefill_prompt(other, method="full_reuse").logits, expected,
                               atol=1e-4, rtol=1e-4)
    # chat messages begin like the lead-in, and their chunks' KV stays where it was computed; only the first chunk
    # of a recurring opening is computed behind it, where it is then exact (a lone chunk: the model's own logits)
    chat = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"{TEXTS[2]}\n\nWhat is basalt?"}]
    lone = engine.prefill_prompt(chat, method="full_prefill")
    first = engine.prefill_prompt(chat, method="full_reuse")
    assert float((first.logits - lone.logits).abs().max()) > 1e-3
    engine.prefill_prompt(chat, method="full_reuse")
    learned = engine.prefill_prompt(chat, method="full_reuse")
    assert learned.stats["num_reused"] == 0 and learned.stats["chunk_hits"] == [chunk_id(TEXTS[2])]
    torch.testing.assert_close(learned.logits, lone.logits, atol=1e-4, rtol=1e-4)
    two = [chat[0], {"role": "user", "content": f"{TEXTS[2]}\n\n{TEXTS[0]}\n\nWhat is basalt?"}]
    for _ in range(2):
        engine.prefill_prompt(two, method="full_reuse")
    both = engine.prefill_prompt(two, method="full_reuse")  # the second chunk still from behind the lead-in
    assert both.stats["chunk_hits"] == [chunk_id(TEXTS[2]), chunk_id(TEXTS[0])]
    assert both.stats["num_reused"] == len(engine.tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"])


def test_chat_messages_with_a_users_system_prompt(engine):
    messages = [{"role": "system", "content": "Be brief. Use the documents."},
                {"role": "user", "content": "Documents:\n" + "\n---\n".join(TEXTS) + f"\n\n{QUESTION}"}]
    pieces: list[str] = []
    stats: dict = {}
    for piece in engine.stream_prompt(messages, max_new_tokens=4, stats=stats):
        pieces.append(piece)
    assert stats["chunk_hits"] == [chunk_id(t) for t in TEXTS] and stats["num_generated"] >= 1
    with pytest.raises(ConfigError, match="messages"):
        engine.generate_prompt([{"role": "user"}])
    with pytest.raises(ConfigError, match="prompt is empty"):
        engine.generate_prompt("  ")


def test_another_process_finds_the_chunks_through_the_stored_index(engine, tmp_path):
    other = CacheBlendEngine(engine.model, engine.tokenizer, kv_store=tmp_path / "kv")
    pre = other.prefill_prompt(users_prompt(TEXTS[:2]), method="full_reuse")
    assert pre.stats["chunk_hits"] == [chunk_id(t) for t in TEXTS[:2]]


def test_a_matched_chunk_whose_kv_is_missing_is_computed_then_stored(engine):
    engine.drop_kv([chunk_id(TEXTS[0])])
    engine.index.add([(chunk_id(TEXTS[0]), normalize_text(TEXTS[0]))])  # known text, no KV
    first = engine.prefill_prompt(users_prompt(TEXTS))
    assert first.stats["chunk_misses"] == [chunk_id(TEXTS[0])]
    assert engine.prefill_prompt(users_prompt(TEXTS)).stats["chunk_misses"] == []


def test_a_long_prompt_with_no_stored_chunk_warns_once(engine, caplog, monkeypatch):
    monkeypatch.setattr(engine._no_match_warning, "said", False)
    edited = TEXTS[0].replace("Sunderland Point", "Sunderland Pier")  # edited after its first 48 characters
    prompt = users_prompt([edited] + ["Some unrelated context of the user's own. " * 10] * 4)
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.fuse.prompt_match"):
        engine.prefill_prompt(prompt, method="full_reuse")
        engine.prefill_prompt(prompt, method="full_reuse")
    warnings = [r for r in caplog.records if "no stored chunk" in r.getMessage()]
    assert len(warnings) == 1 and "differs" in warnings[0].getMessage()


# ---- token-exact alignment: the prompt is tokenized once, as the model tokenizes it ----------------------------

def merging_prompt(texts: list[str]) -> str:
    """Chunks glued to the text around them: a space before each (" The" is one token), CRLF line ends, trailing
    spaces: the chunk's own first token is not the prompt's."""
    return ("Notes: " + " and ".join(texts) + "   \r\nQ: " + QUESTION + "\r\nA:")


def test_full_prefill_of_a_string_prompt_is_the_models_own_forward(engine):
    prompt = merging_prompt(TEXTS)
    expected_ids = engine.tokenizer(prompt)["input_ids"]
    full = engine.prefill_prompt(prompt, method="full_prefill")
    assert full.token_ids.tolist() == expected_ids
    with torch.no_grad():
        expected = engine.model(torch.tensor([expected_ids])).logits[0, -1]
    torch.testing.assert_close(full.logits, expected, atol=1e-4, rtol=1e-4)
    blend = engine.prefill_prompt(prompt, recompute_ratio=1.0)
    assert blend.stats["chunk_hits"] == [chunk_id(t) for t in TEXTS]  # found and placed, though their edges merged
    own = sum(len(engine.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in TEXTS)
    assert own - 2 * len(TEXTS) <= blend.stats["num_reused"] < own  # all but the merged edge tokens
    torch.testing.assert_close(blend.logits, expected, atol=1e-4, rtol=1e-4)
    reuse = engine.prefill_prompt(prompt, method="full_reuse")
    assert reuse.token_ids.tolist() == expected_ids and float((reuse.logits - expected).abs().max()) > 1e-3


def test_full_prefill_of_chat_messages_is_the_models_forward_over_the_chat_template(engine):
    messages = [{"role": "system", "content": "Answer from the notes."},
                {"role": "user", "content": "Notes: " + " ".join(TEXTS) + f" Question: {QUESTION}"}]
    expected_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]
    for method, ratio in (("full_prefill", None), ("cacheblend", 1.0)):
        pre = engine.prefill_prompt(messages, method, ratio)
        assert pre.token_ids.tolist() == list(expected_ids)
        with torch.no_grad():
            expected = engine.model(torch.tensor([expected_ids])).logits[0, -1]
        torch.testing.assert_close(pre.logits, expected, atol=1e-4, rtol=1e-4)
    assert pre.stats["chunk_hits"] == [chunk_id(t) for t in TEXTS]


def test_a_merged_first_chunk_is_placed_in_part_and_its_whole_kv_stored(engine):
    engine.drop_kv([chunk_id(TEXTS[0])])
    engine.index.add([(chunk_id(TEXTS[0]), normalize_text(TEXTS[0]))])
    prompt = merging_prompt(TEXTS[:1])
    first = engine.prefill_prompt(prompt, method="prefix_cache")  # the first token merged: not exact behind it
    own = len(engine.tokenizer(normalize_text(TEXTS[0]), add_special_tokens=False)["input_ids"])
    assert first.stats["chunk_misses"] == [chunk_id(TEXTS[0])] and first.stats["num_exact_cached"] < own
    engine.prefill_prompt(prompt)  # a hole: computed in place, then the whole chunk stored
    assert torch.equal(engine.cache.token_ids(chunk_id(TEXTS[0])),
                       torch.tensor(engine.tokenizer(normalize_text(TEXTS[0]), add_special_tokens=False)["input_ids"]))
    assert engine.prefill_prompt(prompt).stats["chunk_hits"] == [chunk_id(TEXTS[0])]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab \t\r\n\u00e9")), max_size=40))
def test_the_normalized_prompt_maps_back_to_the_users_characters(text):
    normalized, index = normalize_prompt_map(text)
    assert normalized == normalize_prompt(text) and len(index) == len(normalized)
    assert index == sorted(set(index))
    assert all(c == text[j] or (c == "\n" and text[j] == "\r") for c, j in zip(normalized, index))


def test_align_chunk_leaves_out_merged_edges():
    # prompt tokens: [x][" The"][cat][sat][.\n]; the chunk "The cat sat." alone: [The][cat][sat][.]
    prompt_ids, offsets = [9, 1, 2, 3, 7], [(0, 5), (5, 9), (9, 13), (13, 17), (17, 19)]
    assert align_chunk(prompt_ids, offsets, 6, 18, [4, 2, 3, 5]) == (2, 1, 3)
    assert align_chunk(prompt_ids, offsets, 6, 18, [8, 8]) is None
