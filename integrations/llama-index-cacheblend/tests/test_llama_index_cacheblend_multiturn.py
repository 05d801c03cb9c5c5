"""LlamaIndex chat engines over CacheBlendLLM for several turns (issue 27 item 3): a later turn's prompt starts
with the previous turn's prompt and answer and reports those rows as a stored prefix (`last_stats`)."""

from __future__ import annotations

from llama_index_cacheblend_testing import li_engine  # noqa: F401 (fixture; first: sets the offline environment)

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.schema import TextNode

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.fuse.chunk_cache import PREFIX_BLOCK
from llama_index.llms.cacheblend import CacheBlendLLM, LocalEmbedding

pytestmark = pytest.mark.model

PASSAGE = ("Honeybees have five eyes: two large compound eyes and three small simple eyes called ocelli on top of "
           "the head. A colony has one queen, a few hundred drones and tens of thousands of workers.")
TURNS = ("How many eyes does a honeybee have?", "What are the small ones called?", "Say it again.")


@pytest.fixture(scope="module")
def index():
    """One passage: every turn retrieves the same context, so only the conversation grows."""
    return VectorStoreIndex([TextNode(text=PASSAGE, id_="bees")], embed_model=LocalEmbedding())


@pytest.mark.parametrize("chat_mode", ["context", "condense_plus_context"])
def test_a_chat_engines_later_turns_start_from_the_previous_turn(index, li_engine, chat_mode):
    llm = CacheBlendLLM(engine=CacheBlendEngine(li_engine.model, li_engine.tokenizer, None), max_new_tokens=12)
    chat = index.as_chat_engine(chat_mode=chat_mode, llm=llm, similarity_top_k=1)
    stats = []
    for turn in TURNS:
        assert str(chat.chat(turn)).strip()
        stats.append(dict(llm.last_stats))  # the answering call's (condense_plus_context condenses first)
    assert len(chat.chat_history) == 2 * len(TURNS)
    assert stats[0]["num_prefix_rows"] == 0
    for now, before in zip(stats[1:], stats):
        assert now["num_tokens"] > before["num_tokens"]  # the earlier turns are in the prompt
        # the context (system message), turn 1 and its answer come back unchanged: whole blocks of them are stored
        assert now["num_prefix_rows"] >= before["num_tokens"] + before["num_generated"] - PREFIX_BLOCK - 1
