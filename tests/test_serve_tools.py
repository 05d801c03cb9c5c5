"""`cacheblend-rag serve`: OpenAI tool calling and structured output, end to end with the real default model.

A real server in a subprocess (test_serve.py's `ServerProcess`) answers the `openai` SDK and LangChain's
`ChatOpenAI`: forced, "required", "auto" and "none" tool choices, a streamed call accumulated by the SDK's own
stream parser, tool results in the history, `response_format` json_schema (strict) and json_object, a grammar cut
by max_tokens, and the 400s for requests that cannot be honoured.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from pydantic import BaseModel, ConfigDict, ValidationError  # noqa: E402
from test_serve import KEY, MODEL, ServerProcess, _home  # noqa: E402

from cacheblend_rag.serve.tooling import CallStream  # noqa: E402


def real_model(test):
    """A test against the server with the real default model."""
    return pytest.mark.model(pytest.mark.slow(test))



class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str
    unit: str | None = None


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timezone: str


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    age: int


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                         "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(_home(tmp_path_factory.mktemp("serve-tools")), "--api-key", KEY, "--max-batch", "2")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _chat(client, messages=ASK, **kw):
    kw.setdefault("max_tokens", 64)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def _valid_call(call) -> dict:
    """The call's arguments, checked against its tool's schema (the pydantic models mirror them)."""
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    ARGS[call.function.name].model_validate(args)
    return args


# ---- tools -------------------------------------------------------------------------------------


@real_model
def test_forced_call_returns_schema_valid_tool_calls(client):
    out = _chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _valid_call(choice.message.tool_calls[0])

    required = _chat(client, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    _valid_call(required.message.tool_calls[0])


@real_model
def test_tool_choice_none_gives_text_and_auto_either(client):
    none = _chat(client, tools=[WEATHER], tool_choice="none", max_tokens=24).choices[0]
    assert none.message.tool_calls is None and isinstance(none.message.content, str) and none.message.content
    assert none.finish_reason in ("stop", "length")

    auto = _chat(client, tools=[WEATHER, TIME], tool_choice="auto").choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls" and auto.message.content is None
        _valid_call(auto.message.tool_calls[0])
    else:  # a plain answer can never be a malformed call
        assert auto.finish_reason in ("stop", "length") and not auto.message.content.startswith("<")


@real_model
def test_streamed_call_accumulates_to_the_same_call(client):
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    solo = _chat(client, **kw).choices[0].message.tool_calls[0]

    deltas = []
    with client.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=64, **kw) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                deltas += event.chunk.choices[0].delta.tool_calls
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert _valid_call(call) == json.loads(solo.function.arguments)  # greedy: the same arguments
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert len(rest) > 1  # the arguments arrive in pieces as they are decoded
    assert first.function.arguments + "".join(d.function.arguments for d in rest) == call.function.arguments


@real_model
def test_parallel_tool_calls_give_one_call_per_city_streamed_with_their_indexes(client):
    ask = [{"role": "user", "content": "What is the weather in Paris and in London?"}]
    kw = dict(tools=[WEATHER], tool_choice="required", max_tokens=80)
    one = _chat(client, ask, **kw).choices[0]  # parallel_tool_calls unset: one call
    assert len(one.message.tool_calls) == 1
    both = _chat(client, ask, parallel_tool_calls=True, **kw).choices[0]
    assert both.finish_reason == "tool_calls" and both.message.content is None
    assert [_valid_call(c)["city"] for c in both.message.tool_calls] == ["Paris", "London"]
    assert len({c.id for c in both.message.tool_calls}) == 2

    with client.chat.completions.stream(model=MODEL, messages=ask, parallel_tool_calls=True, **kw) as stream:
        final = stream.get_final_completion()  # the SDK accumulates the deltas by their index
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in both.message.tool_calls]


@real_model
def test_tool_result_in_history_is_accepted_and_answered_in_text(client):
    first = _chat(client, tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "tool_call_id": call.id, "content": "Paris: sunny, 24 degrees celsius."}]
    out = _chat(client, history, tools=[WEATHER], tool_choice="none", max_tokens=32)
    answer = out.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert out.usage.prompt_tokens > _chat(client, ASK, max_tokens=1).usage.prompt_tokens  # the result was sent


# ---- structured output ---------------------------------------------------------------------------


@real_model
def test_json_schema_strict_content_validates(client):
    messages = [{"role": "user", "content": "Alice is 30 years old. Extract her name and age."}]
    out = _chat(client, messages, response_format=PERSON_FORMAT)
    assert out.choices[0].finish_reason == "stop"
    person = Person.model_validate_json(out.choices[0].message.content)
    assert isinstance(person.age, int)

    parsed = client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=64, response_format=Person)
    assert parsed.choices[0].message.parsed == person  # the SDK's own parse, and the same greedy answer

    streamed = "".join(c.choices[0].delta.content or "" for c in
                       _chat(client, messages, response_format=PERSON_FORMAT, stream=True) if c.choices)
    assert Person.model_validate_json(streamed) == person


@real_model
def test_json_object_parses_and_length_cuts(client):
    out = _chat(client, [{"role": "user", "content": "Give the capital of France as JSON."}],
                response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)

    cut = _chat(client, ASK, response_format=PERSON_FORMAT, max_tokens=3).choices[0]
    assert cut.finish_reason == "length"
    with pytest.raises((ValidationError, ValueError)):
        Person.model_validate_json(cut.message.content)


@real_model
def test_tools_with_a_response_format_and_with_documents(client):
    messages = [{"role": "user", "content": "Alice is 30 years old. Extract her name and age."}]
    either = _chat(client, messages, tools=[WEATHER], tool_choice="auto", response_format=PERSON_FORMAT).choices[0]
    if either.message.tool_calls:  # "auto" with a response format: a call or that JSON, nothing else
        _valid_call(either.message.tool_calls[0])
    else:
        Person.model_validate_json(either.message.content)

    docs = ["Paris is the capital of France.", "The weather service covers every city in Europe."]
    out = _chat(client, tools=[WEATHER], tool_choice="required", extra_body={"documents": docs}).choices[0]
    assert out.finish_reason == "tool_calls"  # the tools' instructions reach the documents path's system text
    _valid_call(out.message.tool_calls[0])


# ---- errors --------------------------------------------------------------------------------------


@real_model
@pytest.mark.parametrize("kw, says", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_stock"}}), "get_stock"),
    (dict(tool_choice="required"), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "object"),
    (dict(tools=[WEATHER, WEATHER]), "unique"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "grammar"),
    (dict(response_format={"type": "yaml"}), "response_format"),
])
def test_bad_requests_are_400(client, kw, says):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **kw)
    assert e.value.status_code == 400 and says in e.value.body["message"], e.value.body


@real_model
def test_unparsable_arguments_in_history_are_400(client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        _chat(client, history, tools=[WEATHER])


# ---- LangChain's ChatOpenAI against the server ---------------------------------------------------


@real_model
def test_langchain_chat_openai_tools_and_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, max_tokens=64,
                                      temperature=0, max_retries=0)

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)
    streamed = None
    for chunk in llm.bind_tools([get_weather], tool_choice="any").stream("What is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk  # LangChain merges the tool_call_chunks
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in msg.tool_calls]

    person = llm.with_structured_output(Person).invoke("Alice is 30 years old. Extract her name and age.")
    assert isinstance(person, Person)


# ---- the stream of a call, in process ------------------------------------------------------------

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": {"name": "Paris"}, "unit": "celsius"}}</tool_call>'


@pytest.mark.parametrize("size", [1, 2, 5, 13, len(CALL)])
def test_call_stream_sends_header_then_argument_pieces(size):
    stream = CallStream([WEATHER["function"]])
    deltas = [d for i in range(0, len(CALL), size) for d in stream.feed(CALL[i:i + size])] + stream.finish()
    calls = [d["tool_calls"][0] for d in deltas]
    assert all("content" not in d for d in deltas) and stream.called
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": {"name": "Paris"}, "unit": "celsius"}
    if size < len(CALL):
        assert len(calls) > 2  # pieces went out before the answer ended


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_call_stream_sends_parallel_calls_with_their_own_index(size):
    from cacheblend_rag.tools import render_call

    text = (render_call("get_weather", {"city": "Oslo </tool_call> x"}) + "\n"
            + render_call("get_weather", {"city": "Bergen", "unit": "celsius"}) + "\nThat is all.")
    stream = CallStream([WEATHER["function"]])
    deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
    calls: dict[int, str] = {}
    for delta in deltas:
        for c in delta.get("tool_calls", ()):
            calls[c["index"]] = calls.get(c["index"], "") + c["function"]["arguments"]
    assert {i: json.loads(a) for i, a in calls.items()} == {0: {"city": "Oslo </tool_call> x"},
                                                            1: {"city": "Bergen", "unit": "celsius"}}
    assert "".join(d.get("content", "") for d in deltas) == "That is all." and stream.calls == 2


def test_the_parallel_grammar_takes_calls_a_line_each_and_the_single_one_takes_one(tokenizer):
    from cacheblend_rag.decode.grammar import GrammarCompiler
    from cacheblend_rag.tools import functions_of, render_call, tool_grammar

    functions = functions_of([WEATHER])
    one = render_call("get_weather", {"city": "Oslo"})
    compiler = GrammarCompiler(tokenizer)
    for choice in ("required", "auto"):
        single, parallel = (tool_grammar(functions, choice, parallel=p) for p in (False, True))
        for text, single_ok, parallel_ok in ((one, True, True), (one + "\n" + one, False, True),
                                             (one + one, False, False)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert compiler.check(single, ids)[0] is single_ok and compiler.check(parallel, ids)[0] is parallel_ok


def test_call_stream_text_and_odd_shapes():
    text = CallStream([WEATHER["function"]])
    assert text.feed("  ") == [] and text.feed(" Sunny") == [{"content": "Sunny"}]
    assert text.feed(", 24 C") == [{"content": ", 24 C"}] and text.finish() == [] and not text.called

    cut = CallStream([WEATHER["function"]])  # a call cut by max_tokens before its header: content
    assert cut.feed("<tool_ca") == [] and cut.finish() == [{"content": "<tool_ca"}] and not cut.called

    reordered = CallStream([WEATHER["function"]])  # keys in another order: the call goes out whole at the end
    assert reordered.feed('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>') == []
    (delta,) = reordered.finish()
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_a_closing_tag_inside_an_argument_string_stays_in_the_argument():
    # SmolLM2 wrote "</tool_call>" inside a retriever query (bench agent): the JSON is read first, then the tag
    from cacheblend_rag.tools import parse_tool_calls

    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo</tool_call>Bergen"}}</tool_call>'
    content, (call,) = parse_tool_calls(text, [WEATHER["function"]])
    assert content == "" and call.arguments == {"city": "Oslo</tool_call>Bergen"}
    stream = CallStream([WEATHER["function"]])
    deltas = [d for i in range(0, len(text), 4) for d in stream.feed(text[i:i + 4])] + stream.finish()
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(arguments) == call.arguments and stream.called
    assert parse_tool_calls(text[:-len("</tool_call>")], [WEATHER["function"]])[1] == []  # unclosed: no call


# ---- the packaged model that calls tools ---------------------------------------------------------------------

QWEN = "qwen2.5-coder-0.5b"


@real_model
def test_qwens_auto_call_comes_back_parsed_and_its_result_is_answered(tmp_path_factory):
    """`serve --model qwen2.5-coder-0.5b`: left to choose (auto), the model calls the weather tool in its template's
    own format; the openai SDK gets it as `tool_calls`, whole and streamed; with the result sent back the next
    step answers from it in text, under "none" and under "auto" (where this model writes its call again: answered
    instead under "none")."""
    server = ServerProcess(_home(tmp_path_factory.mktemp("serve-qwen")), "--api-key", KEY, "--model", QWEN)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        out = client.chat.completions.create(model=QWEN, messages=ASK, tools=[WEATHER, TIME], max_tokens=64)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and _valid_call(call)["city"] == "Paris"
        pieces = list(client.chat.completions.create(model=QWEN, messages=ASK, tools=[WEATHER, TIME], max_tokens=64,
                                                     stream=True))
        streamed = [d for p in pieces for d in (p.choices[0].delta.tool_calls or [])]
        assert streamed[0].function.name == "get_weather"
        assert json.loads("".join(d.function.arguments or "" for d in streamed)) == json.loads(call.function.arguments)
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                   {"role": "tool", "tool_call_id": call.id, "content": "Paris: sunny, 24 degrees celsius."}]
        answer = client.chat.completions.create(model=QWEN, messages=history, tools=[WEATHER, TIME],
                                                tool_choice="none", max_tokens=32).choices[0]
        assert answer.message.tool_calls is None and ("24" in answer.message.content
                                                      or "sunny" in answer.message.content.lower())
        # under "auto" the model writes the same call again: not a step (an agent would loop), answered instead
        again = client.chat.completions.create(model=QWEN, messages=history, tools=[WEATHER, TIME],
                                               max_tokens=32).choices[0]
        assert again.finish_reason == "stop" and again.message.tool_calls is None
        assert "24" in again.message.content or "sunny" in again.message.content.lower()
        pieces = list(client.chat.completions.create(model=QWEN, messages=history, tools=[WEATHER, TIME],
                                                     max_tokens=32, stream=True))
        assert not any(p.choices[0].delta.tool_calls for p in pieces if p.choices)
        streamed = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
        assert "24" in streamed or "sunny" in streamed.lower()
        assert pieces[-1].choices[0].finish_reason == "stop"
    finally:
        assert server.stop() == 0, server.log.read_text()
