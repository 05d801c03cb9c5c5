"""Agents end to end on the packaged model that calls tools (Qwen2.5-Coder-0.5B-Instruct, its template's own tool
format), tool_choice "auto" at every step, no middleware: LangChain v1 `create_agent` with a retriever tool over an
ingested corpus, and a LangGraph `ToolNode` + `tools_condition` loop. Each agent calls the tool, answers from its
result and ends; the step after the tool finds the result's passages stored (chunk hits) and reuses stored prompt
rows. The docs' SmolLM2 recipe (the first call forced by a middleware, "auto" after it) ends too.

Left to itself after a retriever's result, Qwen2.5-Coder-0.5B writes the same call again (p≈0.99 on its first
token) and the agent would loop to its recursion limit: ChatCacheBlend answers such a repeated call from the results
instead (`cacheblend_rag.tools.ToolTurn.repeats` / `answer_turn`), which these tests exercise for real.
"""

from __future__ import annotations

from langchain_cacheblend_testing import LocalEmbeddings, qwen_engine, shared_engine  # first: offline environment
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.vectorstores import InMemoryVectorStore

from cacheblend_rag import chunk_id
from langchain_cacheblend import ChatCacheBlend

pytestmark = [pytest.mark.model, pytest.mark.slow]

DATA = Path(__file__).resolve().parents[3] / "examples" / "data"
FILES = ("07_senses.txt", "04_honey.txt", "05_wax.txt")


def _corpus(engine) -> tuple[list[str], InMemoryVectorStore]:
    """The example corpus's files, ingested (KV stored) and in a vector store."""
    texts = [(DATA / name).read_text() for name in FILES]
    engine.ingest(texts, show_progress=False)
    store = InMemoryVectorStore(LocalEmbeddings())
    store.add_texts(texts)
    return texts, store


def _retriever_tool(store: InMemoryVectorStore):
    @tool(response_format="content_and_artifact")
    def retrieve_context(query: str):
        """Retrieve information to help answer a query."""
        docs = store.similarity_search(query, k=2)
        # LangChain's RAG agent tutorial's serialisation: each page_content verbatim, so its stored KV is found
        return "\n\n".join(f"Source: {d.metadata}\nContent: {d.page_content}" for d in docs), docs

    return retrieve_context


def _after_tool(messages: list) -> tuple[list[ToolMessage], AIMessage]:
    """The tool results and the model's message after the first one."""
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert results, [type(m).__name__ for m in messages]
    answer = next(m for m in messages[messages.index(results[0]):] if isinstance(m, AIMessage))
    return results, answer


def _assert_answered_from(answer: AIMessage, results: list[ToolMessage], texts: list[str], *facts: str) -> None:
    """A plain answer naming one of the facts; the passages in the tool's result were chunk hits and stored prompt
    rows were reused on that step."""
    assert not answer.tool_calls and any(f in answer.content.lower() for f in facts), answer
    meta = answer.response_metadata["cacheblend"]
    in_result = {chunk_id(t) for t in texts if t in results[0].content}
    assert in_result and in_result <= set(meta["chunk_hits"]), meta
    assert meta["num_prefix_rows"] > 0, meta


def test_create_agent_on_qwen_with_auto_calls_the_retriever_answers_from_it_and_ends():
    """LangChain v1 `create_agent(ChatCacheBlend, [retriever tool])`, tool_choice left "auto", no middleware."""
    from langchain.agents import create_agent

    engine = qwen_engine()
    texts, store = _corpus(engine)
    model = ChatCacheBlend(engine=engine, max_tokens=40)
    agent = create_agent(model, [_retriever_tool(store)],
                         system_prompt="You have access to a tool that retrieves context. Use it to answer.")
    result = agent.invoke({"messages": [{"role": "user", "content": "How many eyes does a honeybee have?"}]},
                          {"recursion_limit": 8})
    messages = result["messages"]
    first = next(m for m in messages if isinstance(m, AIMessage))
    assert [c["name"] for c in first.tool_calls] == ["retrieve_context"], first  # called under "auto"
    results, answer = _after_tool(messages)
    assert messages[-1] is answer and len(results) == 1  # it ended after one tool step
    _assert_answered_from(answer, results, texts, "5", "five")


def test_langgraph_tool_node_loop_on_qwen_with_auto_at_every_step_ends():
    """A LangGraph graph built by hand: a model node with `bind_tools` (tool_choice "auto" at every step),
    LangGraph's `ToolNode` and `tools_condition`."""
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    engine = qwen_engine()
    texts, store = _corpus(engine)
    retrieve = _retriever_tool(store)
    model = ChatCacheBlend(engine=engine, max_tokens=40).bind_tools([retrieve], tool_choice="auto")

    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([retrieve]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    ask = [SystemMessage("You have access to a tool that retrieves context. Use it to answer."),
           HumanMessage("How many eyes does a honeybee have?")]
    result = graph.compile().invoke({"messages": ask}, {"recursion_limit": 8})
    messages = result["messages"]
    results, answer = _after_tool(messages)
    assert messages[-1] is answer and len(results) == 1
    _assert_answered_from(answer, results, texts, "5", "five")


def test_docs_smollm2_recipe_forced_first_call_then_auto_ends():
    """docs/langchain.md's SmolLM2 recipe: a middleware forces the first call; after the tool's result the
    model is left "auto". It used to call the same tool again after every result until the recursion limit."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, wrap_model_call

    engine = shared_engine()
    texts, store = _corpus(engine)

    @wrap_model_call
    def retrieve_first(request: ModelRequest, handler):
        if not any(m.type == "tool" for m in request.messages):
            request = request.override(tool_choice="retrieve_context")
        return handler(request)

    agent = create_agent(ChatCacheBlend(engine=engine, max_tokens=48), [_retriever_tool(store)],
                         middleware=[retrieve_first])
    result = agent.invoke({"messages": [{"role": "user", "content": "How many eyes does a honeybee have?"}]},
                          {"recursion_limit": 8})
    messages = result["messages"]
    results, answer = _after_tool(messages)
    assert messages[-1] is answer and len(results) == 1 and not answer.tool_calls
    meta = answer.response_metadata["cacheblend"]
    assert {chunk_id(t) for t in texts if t in results[0].content} <= set(meta["chunk_hits"]), meta
    assert meta["num_prefix_rows"] > 0, meta  # the generic format: the same prompt start as the forced call's
