"""CacheBlendLLM as LlamaIndex's function-calling LLM: `predict_and_call`, `structured_predict`,
`as_structured_llm`, a `FunctionAgent` run, and a retriever tool whose output carries stored chunks."""

from __future__ import annotations

from llama_index_cacheblend_testing import li_engine  # noqa: F401 (fixture; first: sets the offline environment)
import asyncio

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from llama_index.llms.cacheblend import CacheBlendLLM

pytestmark = pytest.mark.model

PASSAGE = "Honeybee queens\nA queen honeybee develops from egg to adult in sixteen days, fed on royal jelly."
calls: list[dict] = []


def lookup_passage(topic: str) -> str:
    """Look up the encyclopedia passage about a topic."""
    calls.append({"topic": topic})
    return PASSAGE


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Bee(BaseModel):
    """Facts about a bee."""

    name: str
    days_to_adult: int


@pytest.fixture()
def llm(li_engine):
    return CacheBlendLLM(engine=li_engine, max_new_tokens=48)


def test_metadata_says_function_calling(llm):
    assert llm.metadata.is_function_calling_model


def test_a_required_call_is_well_formed_and_runs(llm):
    """tool_required forces a call to a bound tool with arguments valid for its schema; predict_and_call runs it."""
    tool = FunctionTool.from_defaults(multiply)
    response = llm.chat_with_tools([tool], user_msg="What is 6 times 7?", tool_required=True)
    (selection,) = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "multiply"
    assert set(selection.tool_kwargs) == {"a", "b"} and all(isinstance(v, int) for v in selection.tool_kwargs.values())
    out = llm.predict_and_call([tool], user_msg="What is 6 times 7?", tool_required=True)
    a, b = out.sources[0].raw_input["kwargs"]["a"], out.sources[0].raw_input["kwargs"]["b"]
    assert out.response == str(a * b)


def weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


def test_parallel_calls_are_allowed_when_asked_and_each_runs(li_engine):
    llm = CacheBlendLLM(engine=li_engine, max_new_tokens=80)
    tool = FunctionTool.from_defaults(weather)
    ask = "What is the weather in Paris and in London?"
    single = llm.chat_with_tools([tool], user_msg=ask, tool_required=True)
    assert len(llm.get_tool_calls_from_response(single)) == 1
    out = llm.predict_and_call([tool], user_msg=ask, tool_required=True, allow_parallel_tool_calls=True)
    assert [s.raw_input["kwargs"]["city"] for s in out.sources] == ["Paris", "London"]
    assert [s.content for s in out.sources] == ["sunny in Paris", "sunny in London"]


def test_no_call_is_an_error_only_when_one_was_expected(llm):
    response = llm.chat_with_tools([FunctionTool.from_defaults(multiply)], user_msg="Say hello.", tool_choice="none")
    assert response.message.content and not response.message.additional_kwargs.get("tool_calls")
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected a tool call"):
        llm.get_tool_calls_from_response(response)


def test_structured_predict_and_structured_llm_parse(llm):
    from llama_index.core.prompts import PromptTemplate

    bee = llm.structured_predict(Bee, PromptTemplate("{text}\nGive the bee's name and days to adult."),
                                 text=PASSAGE)
    assert isinstance(bee, Bee)
    structured = llm.as_structured_llm(Bee)
    out = structured.chat([ChatMessage(role=MessageRole.USER, content=f"{PASSAGE}\nDescribe the bee.")])
    assert isinstance(out.raw, Bee)


def test_streamed_call_arrives_whole_in_the_last_response(llm):
    tool = FunctionTool.from_defaults(multiply)
    kwargs = llm._prepare_chat_with_tools([tool], user_msg="What is 3 times 5?", tool_required=True)
    responses = list(llm.stream_chat(**kwargs))
    (call,) = responses[-1].message.additional_kwargs["tool_calls"]
    assert call["name"] == "multiply" and set(call["arguments"]) == {"a", "b"}


def test_function_agent_calls_a_retriever_tool_and_its_chunk_is_reused(llm, li_engine):
    """A FunctionAgent (LlamaIndex's agent workflow) runs on the model: its retriever-shaped tool is called, the
    tool's output goes back as a tool message, and the stored passage inside it is a chunk hit on that turn."""
    li_engine.ingest([PASSAGE], show_progress=False)
    calls.clear()
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(lookup_passage)], llm=llm,
                          system_prompt="Use lookup_passage to find facts before answering.",
                          initial_tool_choice="lookup_passage")  # a 135M model, left to choose, answers directly

    async def run():
        return await agent.run("How many days does a queen honeybee take to develop?", max_iterations=4)

    out = asyncio.run(run())
    assert calls, "the agent never called its tool"
    assert isinstance(str(out), str)
    # the turn after the call carries the tool's output (the stored passage) and reuses its KV
    messages = [ChatMessage(role=MessageRole.USER, content="How long does a queen take?"),
                ChatMessage(role=MessageRole.ASSISTANT, content="",
                            additional_kwargs={"tool_calls": [{"id": "c1", "name": "lookup_passage",
                                                               "arguments": {"topic": "queen"}}]}),
                ChatMessage(role=MessageRole.TOOL, content=PASSAGE, additional_kwargs={"tool_call_id": "c1"})]
    response = llm.chat(messages)
    assert response.additional_kwargs["chunk_hits"], "the stored passage inside the tool's output was not reused"


def test_function_agent_with_a_query_engine_tool_reuses_the_retrieved_chunks(llm, li_engine):
    """The LlamaIndex agentic-RAG shape: a `QueryEngineTool` over a `VectorStoreIndex`, in a `FunctionAgent`, both
    on CacheBlendLLM. The agent calls the tool, the query engine answers over the retrieved node, and its prompt
    reuses the node's stored KV (ingested once, as a deployment's corpus is)."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.core.tools import QueryEngineTool
    from llama_index.llms.cacheblend import LocalEmbedding

    from cacheblend_rag import chunk_id

    li_engine.ingest([PASSAGE], show_progress=False)
    index = VectorStoreIndex([TextNode(text=PASSAGE, id_=chunk_id(PASSAGE))], embed_model=LocalEmbedding())
    engine_llm = CacheBlendLLM(engine=li_engine, max_new_tokens=16)
    query_engine = index.as_query_engine(llm=engine_llm, similarity_top_k=1)
    tool = QueryEngineTool.from_defaults(query_engine, name="bee_facts",
                                         description="Answers questions about honeybees from an encyclopedia.")
    agent = FunctionAgent(tools=[tool], llm=llm, system_prompt="Use bee_facts to answer questions about bees.",
                          initial_tool_choice="bee_facts")  # a 135M model, left to choose, answers directly

    async def run():
        from llama_index.core.agent.workflow import ToolCallResult

        handler = agent.run("How many days does a queen honeybee take to develop?", max_iterations=4)
        results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
        await handler
        return results

    called = [c for c in asyncio.run(run()) if c.tool_name == "bee_facts"]
    assert called, "the agent never called its query engine tool"
    assert called[0].tool_output.raw_output.source_nodes[0].node.text == PASSAGE
    assert engine_llm.last_stats["chunk_hits"] == [chunk_id(PASSAGE)], engine_llm.last_stats


@pytest.mark.parametrize("name", ["hermes", "llama_json", "mistral"])
def test_a_template_with_its_own_tool_format_gets_its_calls_and_tool_messages(li_engine, name):
    """A chat template with its own tool format (tests/chat_templates: Hermes, Llama-3.1-JSON and Mistral shapes):
    the call is parsed from its syntax, and the call and the tool's result go back as its own messages, the
    stored passage inside the result reused."""
    import copy
    from pathlib import Path

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.tool_format import ToolFormat
    from llama_index.llms.cacheblend.base import to_chat_messages

    tokenizer = copy.copy(li_engine.tokenizer)
    tokenizer.chat_template = (Path(__file__).resolve().parents[3] / "tests" / "chat_templates"
                               / f"{name}.jinja").read_text()
    engine = CacheBlendEngine(li_engine.model, tokenizer, None)
    llm = CacheBlendLLM(engine=engine, max_new_tokens=48)
    tool = FunctionTool.from_defaults(lookup_passage)
    response = llm.chat_with_tools([tool], user_msg="How long does a queen take?", tool_required=True)
    (selection,) = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "lookup_passage" and isinstance(selection.tool_kwargs.get("topic"), str)

    (passage_id,) = engine.ingest([PASSAGE], show_progress=False)
    messages = [ChatMessage(role=MessageRole.USER, content="How long does a queen take?"), response.message,
                ChatMessage(role=MessageRole.TOOL, content=PASSAGE,
                            additional_kwargs={"tool_call_id": selection.tool_id})]
    rendered = to_chat_messages(messages, ToolFormat.of(tokenizer))
    assert rendered[1]["tool_calls"][0]["function"]["name"] == "lookup_passage" and rendered[2]["role"] == "tool"
    answer = llm.chat(messages, tools=[tool.metadata.to_openai_tool()], tool_choice="none", max_new_tokens=4)
    assert answer.additional_kwargs["chunk_hits"] == [passage_id]
