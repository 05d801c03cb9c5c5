"""Tool calling and structured output of ChatCacheBlend on the real default model (constrained decoding)."""

from __future__ import annotations

from langchain_cacheblend_testing import shared_engine  # first: sets the offline environment
from typing import Annotated

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from langchain_cacheblend import ChatCacheBlend, StructuredOutputError

pytestmark = pytest.mark.model


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's first name")
    age: int = Field(description="age in years")
    city: str = Field(description="the city they live in")


class PersonDict(TypedDict):
    """A person mentioned in the text."""

    name: Annotated[str, ..., "the person's first name"]
    age: Annotated[int, ..., "age in years"]


PEOPLE = [("Alice", 30, "Paris"), ("Bob", 42, "London"), ("Chen", 25, "Beijing"), ("Dora", 61, "Madrid"),
          ("Emil", 19, "Berlin"), ("Fatima", 35, "Cairo"), ("Giulia", 28, "Rome"), ("Hiro", 50, "Tokyo"),
          ("Ines", 33, "Lisbon"), ("Jonas", 47, "Oslo"), ("Kofi", 22, "Accra"), ("Lena", 39, "Vienna"),
          ("Mateo", 56, "Lima"), ("Nora", 27, "Dublin"), ("Omar", 44, "Amman"), ("Priya", 31, "Delhi"),
          ("Quinn", 24, "Boston"), ("Rosa", 68, "Havana"), ("Sven", 53, "Stockholm"), ("Tara", 29, "Sydney")]


@tool
def magic_function(input: int) -> int:
    """Applies a magic function to an input."""
    return input + 2


@pytest.fixture(scope="module")
def chat() -> ChatCacheBlend:
    """The real model, room for a whole structured answer."""
    return ChatCacheBlend(engine=shared_engine(), max_tokens=64)


def test_pydantic_structured_output_is_a_valid_instance_on_20_prompts(chat):
    structured = chat.with_structured_output(Person)
    exact = 0
    for name, age, city in PEOPLE:
        person = structured.invoke(f"{name} is {age} years old and lives in {city}. Extract the person.")
        assert isinstance(person, Person)  # always: the grammar makes the answer parse and validate
        exact += (person.name, person.age, person.city) == (name, age, city)
    assert exact >= 15  # what the model reads correctly (19 of 20 when written)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_every_method_and_schema_kind(chat, method):
    prompt = "Bob is 42 years old and lives in London. Extract the person as JSON with name and age."
    out = chat.with_structured_output(PersonDict, method=method).invoke(prompt)
    assert isinstance(out, dict)
    if method != "json_mode":  # json_mode only promises a JSON object
        assert set(out) == {"name", "age"} and isinstance(out["age"], int)
    raw = chat.with_structured_output(Person.model_json_schema(), method=method, include_raw=True).invoke(prompt)
    assert isinstance(raw["raw"], AIMessage) and raw["parsing_error"] is None and isinstance(raw["parsed"], dict)


def test_an_answer_cut_by_max_tokens_is_a_structured_output_error():
    short = ChatCacheBlend(engine=shared_engine(), max_tokens=3)
    with pytest.raises(StructuredOutputError, match="raise max_tokens"):
        short.with_structured_output(Person).invoke("Alice is 30 years old and lives in Paris.")
    raw = short.with_structured_output(Person, include_raw=True).invoke("Alice is 30.")
    assert raw["parsed"] is None and isinstance(raw["parsing_error"], StructuredOutputError)
    assert raw["raw"].response_metadata["finish_reason"] == "length"


def test_a_forced_tool_call_invoked_and_streamed(chat):
    bound = chat.bind_tools([magic_function], tool_choice="any")
    query = "What is the value of magic_function(3)? Use the tool."
    reply = bound.invoke(query)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("magic_function", {"input": 3})]
    assert reply.tool_calls[0]["id"] and reply.content == ""
    chunks = list(bound.stream(query))
    assert any(c.tool_call_chunks for c in chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("magic_function", {"input": 3})]


def test_a_malformed_tool_choice_is_a_clear_error(chat):
    from cacheblend_rag.errors import ConfigError

    with pytest.raises(ConfigError, match='"function" must be an object'):  # before: AttributeError on a str
        chat.bind_tools([magic_function], tool_choice={"type": "function", "function": "magic_function"})
    chat.bind_tools([magic_function], tool_choice={"type": "function", "function": {"name": "magic_function"}})


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


def test_parallel_tool_calls_when_bound_with_them(chat):
    query = "What is the weather in Paris and in London?"
    one = chat.bind_tools([get_weather], tool_choice="any").invoke(query, max_tokens=80)
    assert len(one.tool_calls) == 1
    bound = chat.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=True)
    both = bound.invoke(query, max_tokens=80)
    assert [(c["name"], c["args"]) for c in both.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "London"})]
    assert len({c["id"] for c in both.tool_calls}) == 2 and both.content == ""


def test_tool_results_go_back_into_the_prompt_and_none_forbids_a_call(chat):
    bound = chat.bind_tools([magic_function])
    call = bound.bind(tool_choice="magic_function").invoke("What is magic_function(3)?")
    assert call.tool_calls and call.tool_calls[0]["name"] == "magic_function"
    history = [HumanMessage("What is magic_function(3)?"), call,
               ToolMessage("5", tool_call_id=call.tool_calls[0]["id"])]
    answer = bound.bind(tool_choice="none").invoke(history)
    assert not answer.tool_calls and answer.content and "<tool_call>" not in answer.content
    auto = bound.invoke("Say hello to me.")  # a plain answer or a call, never a malformed one
    assert auto.tool_calls or not auto.content.lstrip().startswith("<")


def test_standard_init_params(chat):
    relaxed = ChatCacheBlend(engine=shared_engine(), max_tokens=4, max_retries=2, api_key="unused", timeout=60)
    assert relaxed.invoke("Hi").content
    hurried = ChatCacheBlend(engine=shared_engine(), max_tokens=32, timeout=1e-9)  # past before the first piece
    with pytest.raises(TimeoutError, match="timeout"):
        hurried.invoke("Tell me about bees.")
    with pytest.raises(ValueError):
        ChatCacheBlend(engine=shared_engine(), timeout=0)


def test_langchain_rag_agent_tutorial_tool_results_are_chunk_hits(tmp_path):
    """LangChain v1's RAG agent tutorial, unchanged but for the model: `create_agent(model, [retrieve_context])`
    over the user's own langchain-chroma store, the tool serialising documents as the tutorial does. The model
    call after the tool's turn finds the stored passages inside the ToolMessage and reuses their KV."""
    from pathlib import Path

    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, wrap_model_call
    from langchain_chroma import Chroma

    from cacheblend_rag import chunk_id
    from langchain_cacheblend import warm_from_vectorstore
    from langchain_cacheblend_testing import LocalEmbeddings

    data = Path(__file__).resolve().parents[3] / "examples" / "data"
    texts = [(data / name).read_text() for name in ("07_senses.txt", "04_honey.txt")]
    vector_store = Chroma("agent_docs", embedding_function=LocalEmbeddings(), persist_directory=str(tmp_path / "db"))
    vector_store.add_texts(texts)

    @tool(response_format="content_and_artifact")
    def retrieve_context(query: str):
        """Retrieve information to help answer a query."""
        retrieved_docs = vector_store.similarity_search(query, k=2)
        serialized = "\n\n".join(f"Source: {doc.metadata}\nContent: {doc.page_content}" for doc in retrieved_docs)
        return serialized, retrieved_docs

    @wrap_model_call
    def retrieve_first(request: ModelRequest, handler):
        """A 135M model left to choose answers directly: the first model call must call the retriever."""
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice="retrieve_context")
        return handler(request)

    model = ChatCacheBlend(engine=shared_engine(), max_tokens=96)  # room for the call's query
    warm_from_vectorstore(model, vector_store)
    agent = create_agent(model, [retrieve_context], middleware=[retrieve_first],
                         system_prompt="You have access to a tool that retrieves context. Use it to answer.")
    result = agent.invoke({"messages": [{"role": "user", "content": "How many eyes does a honeybee have?"}]})
    messages = result["messages"]
    tool_messages = [m for m in messages if isinstance(m, ToolMessage)]
    assert tool_messages and "Content: " in tool_messages[0].content
    answer = next(m for m in messages[messages.index(tool_messages[0]):] if isinstance(m, AIMessage))
    hits = answer.response_metadata["cacheblend"]["chunk_hits"]
    assert set(hits) == {chunk_id(t) for t in texts}, hits


def test_langgraph_tool_node_loop_reuses_the_previous_step_and_the_tool_results_chunks():
    """A LangGraph agent built by hand: a model node with bound tools, LangGraph's prebuilt `ToolNode` and
    `tools_condition`. The first model call is forced to the retriever (a 135M model, left to choose, answers
    directly), the next must answer (tool_choice "none"; left to choose, it calls the tool again until the
    recursion limit). That second call starts with the first call's stored prompt and answer (a stored prefix:
    the tools' system text is the same whatever the choice) and finds the passages inside the tool's result."""
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from cacheblend_rag import chunk_id

    passages = ["Honeybee eyes\nA honeybee has five eyes: two compound eyes and three simple ocelli.",
                "Drones\nDrones are male honeybees; they do not sting and do not gather nectar."]
    engine = shared_engine()
    engine.ingest(passages, show_progress=False)

    @tool
    def search_bees(query: str) -> str:
        """Search the bee encyclopedia."""
        return "\n\n".join(passages)  # the documents' text verbatim, as docs/langchain.md advises

    model = ChatCacheBlend(engine=engine, max_tokens=48)
    forced = model.bind_tools([search_bees], tool_choice="search_bees")
    answer = model.bind_tools([search_bees], tool_choice="none")
    replies: list[AIMessage] = []

    def agent(state: MessagesState) -> dict:
        called = any(isinstance(m, ToolMessage) for m in state["messages"])
        reply = (answer if called else forced).invoke(state["messages"])
        replies.append(reply)
        return {"messages": [reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([search_bees]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    result = graph.compile().invoke({"messages": [HumanMessage("How many eyes does a honeybee have?")]},
                                    {"recursion_limit": 8})
    tool_messages = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    assert tool_messages and tool_messages[0].name == "search_bees"
    assert len(replies) == 2 and replies[0].tool_calls and not replies[1].tool_calls
    first, second = (r.response_metadata["cacheblend"] for r in replies[:2])
    assert second["num_prefix_rows"] >= first["num_tokens"] - 16, (first, second)  # whole 16-token blocks
    assert set(second["chunk_hits"]) == {chunk_id(p) for p in passages}, second


@pytest.mark.parametrize("name", ["hermes", "llama_json", "mistral"])
def test_bind_tools_on_a_template_with_its_own_tool_format(name):
    """A chat template with its own tool format (tests/chat_templates: the Hermes, Llama-3.1-JSON and Mistral
    shapes) gets its own syntax: the template lists the tools, the answer is a call in its syntax, the call and a
    ToolMessage go back as its own tool_calls and tool messages, and the result's stored chunk is a hit."""
    import copy
    from pathlib import Path

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.tool_format import ToolFormat
    from langchain_cacheblend import to_chat_messages

    base = shared_engine()
    tokenizer = copy.copy(base.tokenizer)
    tokenizer.chat_template = (Path(__file__).resolve().parents[3] / "tests" / "chat_templates"
                               / f"{name}.jinja").read_text()
    engine = CacheBlendEngine(base.model, tokenizer, None)
    fmt = ToolFormat.of(tokenizer)
    bound = ChatCacheBlend(engine=engine, max_tokens=64).bind_tools([magic_function], tool_choice="any")
    query = "What is the value of magic_function(3)? Use the tool."
    reply = bound.invoke(query)
    assert fmt.native and [c["name"] for c in reply.tool_calls] == ["magic_function"]
    assert isinstance(reply.tool_calls[0]["args"]["input"], int) and reply.content == ""
    streamed = list(bound.stream(query))
    full = streamed[0]
    for c in streamed[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]

    result = (Path(__file__).resolve().parents[3] / "examples" / "data" / "04_honey.txt").read_text()
    (result_id,) = engine.ingest(result, show_progress=False)
    history = [HumanMessage(query), reply, ToolMessage(result, tool_call_id=reply.tool_calls[0]["id"])]
    rendered = to_chat_messages(history, fmt)
    assert rendered[1]["tool_calls"][0]["function"]["name"] == "magic_function" and rendered[2]["role"] == "tool"
    answer = bound.bind(tool_choice="none").invoke(history, max_tokens=4)
    assert not answer.tool_calls and answer.response_metadata["cacheblend"]["chunk_hits"] == [result_id]


def test_binding_tools_starts_the_grammar_warm_up_and_never_loads_a_model(monkeypatch):
    """bind_tools / with_structured_output start the grammar compiler's one-time set-up on the built engine (#41),
    so a first tool call made a while later does not pay it; an engine not built yet stays unbuilt."""
    engine = shared_engine()
    calls = []
    monkeypatch.setattr(engine.grammars, "warm_up", lambda **kw: calls.append(kw))
    chat = ChatCacheBlend(engine=engine, max_tokens=8)
    chat.bind_tools([Person])
    chat.with_structured_output(PersonDict)
    assert len(calls) == 2
    lazy = ChatCacheBlend(model="smollm2-135m")
    lazy.bind_tools([Person])
    assert lazy.engine is None


def _nested(depth: int) -> dict:
    """An object schema `depth` objects deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return {"title": "Deep", **schema}


def test_a_schema_nested_too_deep_or_a_bound_past_64_bits_is_a_clear_error(chat):
    """#50: before, a schema 300 objects deep raised RecursionError in tools.closed(), and a bound of 10**20 got
    llguidance's bare ValueError ("Value is not JSON serializable")."""
    from cacheblend_rag.errors import ConfigError

    deep = _nested(300)
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    with pytest.raises(ConfigError, match="more than 128 levels deep"):
        chat.bind(response_format=response_format).invoke("Hi")
    with pytest.raises(ConfigError, match="more than 128 levels deep"):
        chat.with_structured_output(deep).invoke("Hi")
    huge = {"title": "Huge", "type": "object", "properties": {"a": {"type": "array", "minItems": 10**20}}}
    with pytest.raises(ConfigError, match="must fit in 64 bits"):
        chat.with_structured_output(huge).invoke("Hi")
    # a schema 20 objects deep (41 levels) still compiles and decodes (64 tokens may cut its answer)
    assert isinstance(chat.with_structured_output(_nested(20), include_raw=True).invoke("Hi")["raw"], AIMessage)
