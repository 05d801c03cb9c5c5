"""Multi-turn chats on ChatCacheBlend (issue 27 item 3): LangChain message history and a LangGraph thread with a
checkpointer; each follow-up starts from the previous turn's stored KV (prompt and answer) on the real model."""

from __future__ import annotations

from langchain_cacheblend_testing import engine  # noqa: F401 (fixture; first: sets the offline environment)

import pytest
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables.history import RunnableWithMessageHistory

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.fuse.chunk_cache import PREFIX_BLOCK
from langchain_cacheblend import ChatCacheBlend

pytestmark = pytest.mark.model

CONTEXT = ("Honeybees have five eyes: two large compound eyes and three small simple eyes called ocelli on top of "
           "the head. A colony has one queen, a few hundred drones and tens of thousands of workers.")


@pytest.fixture()
def chat(engine):
    """ChatCacheBlend on a fresh engine over the session's model: no other test's stored prefixes."""
    return ChatCacheBlend(engine=CacheBlendEngine(engine.model, engine.tokenizer, None), max_tokens=12)


def _kept(reply: AIMessage) -> int:
    """Rows of this turn's prompt and answer that a follow-up can find stored (whole blocks; the answer's last
    token has no KV yet, and its text may re-tokenize at the edge)."""
    s = reply.response_metadata["cacheblend"]
    return s["num_tokens"] + s["num_generated"] - PREFIX_BLOCK - 1


def _assert_follows(reply: AIMessage, previous: AIMessage) -> None:
    s = reply.response_metadata["cacheblend"]
    assert s["num_tokens"] > previous.response_metadata["cacheblend"]["num_tokens"]  # the history is in the prompt
    assert s["num_prefix_rows"] >= _kept(previous) > 0
    assert reply.usage_metadata["input_token_details"]["cache_read"] >= s["num_prefix_rows"]


def test_a_chat_with_message_history_starts_each_turn_from_the_last(chat):
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer briefly from this context:\n{context}"),
        MessagesPlaceholder("history"),
        ("human", "{question}"),
    ])
    histories: dict[str, InMemoryChatMessageHistory] = {}
    chain = RunnableWithMessageHistory(prompt | chat, lambda sid: histories.setdefault(sid, InMemoryChatMessageHistory()),
                                       input_messages_key="question", history_messages_key="history")
    config = {"configurable": {"session_id": "bees"}}
    replies = [chain.invoke({"context": CONTEXT, "question": q}, config=config)
               for q in ("How many eyes does a honeybee have?", "What are the small ones called?", "Say it again.")]
    assert len(histories["bees"].messages) == 6
    assert replies[0].response_metadata["cacheblend"]["num_prefix_rows"] == 0
    for reply, previous in zip(replies[1:], replies):
        _assert_follows(reply, previous)


def test_a_langgraph_thread_with_a_checkpointer_starts_from_the_last_turn(chat):
    from langgraph.checkpoint.memory import MemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    graph = StateGraph(MessagesState)
    graph.add_node("model", lambda state: {"messages": [chat.invoke(state["messages"])]})
    graph.add_edge(START, "model")
    app = graph.compile(checkpointer=MemorySaver())
    thread = {"configurable": {"thread_id": "bees-1"}}
    first = app.invoke({"messages": [SystemMessage(f"Answer briefly from this context:\n{CONTEXT}"),
                                     HumanMessage("How many eyes does a honeybee have?")]}, thread)
    second = app.invoke({"messages": [HumanMessage("What are the small ones called?")]}, thread)
    assert len(second["messages"]) == 5  # the checkpointer kept turn 1: system, question, answer; + follow-up, answer
    _assert_follows(second["messages"][-1], first["messages"][-1])
    other = app.invoke({"messages": [HumanMessage("What are the small ones called?")]},
                       {"configurable": {"thread_id": "bees-2"}})  # a new thread: no history, nothing stored
    assert other["messages"][-1].response_metadata["cacheblend"]["num_prefix_rows"] == 0
