"""A LlamaIndex `FunctionAgent` with a `QueryEngineTool` end to end on the packaged model that calls tools
(Qwen2.5-Coder-0.5B-Instruct, its template's own tool format), tool_choice "auto" (no `initial_tool_choice`): the
agent calls the query engine, answers from its result and ends within its iterations. After the result the model
writes the same call again; CacheBlendLLM answers that repeated call from the result instead
(`cacheblend_rag.tools.ToolTurn.repeats`)."""

from __future__ import annotations

from llama_index_cacheblend_testing import li_engine  # noqa: F401 (first: sets the offline environment)
import asyncio
import functools
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

PASSAGE = (Path(__file__).resolve().parents[3] / "examples" / "data" / "07_senses.txt").read_text()


@functools.cache
def qwen_engine():
    from cacheblend_rag import CacheBlendEngine, load_model

    model, tokenizer = load_model("qwen2.5-coder-0.5b", device="cpu", dtype="float32")
    return CacheBlendEngine(model, tokenizer, None)


def test_function_agent_with_a_query_engine_tool_on_qwen_with_auto_answers_and_ends():
    from llama_index.core import VectorStoreIndex
    from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
    from llama_index.core.schema import TextNode
    from llama_index.core.tools import QueryEngineTool
    from llama_index.llms.cacheblend import CacheBlendLLM, LocalEmbedding

    from cacheblend_rag import chunk_id

    engine = qwen_engine()
    engine.ingest([PASSAGE], show_progress=False)
    index = VectorStoreIndex([TextNode(text=PASSAGE, id_=chunk_id(PASSAGE))], embed_model=LocalEmbedding())
    engine_llm = CacheBlendLLM(engine=engine, max_new_tokens=24)
    tool = QueryEngineTool.from_defaults(index.as_query_engine(llm=engine_llm, similarity_top_k=1),
                                         name="bee_facts",
                                         description="Answers a question about honeybees from an encyclopedia. "
                                                     "Input: the user's whole question.")
    # one call per answer (FunctionAgent's default lets an answer hold several, and the 0.5B model then adds a
    # call with a one-letter input beside its repeated one)
    agent = FunctionAgent(tools=[tool], llm=CacheBlendLLM(engine=engine, max_new_tokens=40),
                          allow_parallel_tool_calls=False,
                          system_prompt="You have access to a tool that answers questions about bees. Use it to answer.")

    async def run():
        handler = agent.run("How many eyes does a honeybee have?", max_iterations=4)
        events = [ev async for ev in handler.stream_events() if isinstance(ev, (ToolCallResult, AgentOutput))]
        return events, await handler

    events, final = asyncio.run(run())
    called = [e for e in events if isinstance(e, ToolCallResult)]
    # called under "auto"; the model may call once more with the first result as its input (a new call), then
    # repeats a call and is answered from the results: the run ends within max_iterations either way
    assert called and {c.tool_name for c in called} == {"bee_facts"} and len(called) <= 2, (called, final)
    assert called[0].tool_output.raw_output.source_nodes[0].node.text == PASSAGE
    assert engine_llm.last_stats["chunk_hits"] == [chunk_id(PASSAGE)], engine_llm.last_stats
    assert any(w in str(final.response.content).lower() for w in ("5", "five")), final.response  # its answer
