"""A chat template's own tool format, learned from the template: three templates written for these tests (the
Hermes, Llama-3.1-JSON and Mistral shapes, in tests/chat_templates/) on the real SmolLM2 model and tokenizer,
whose own template has no tool format (the generic one is kept for it)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.prompt_match import prompt_text
from cacheblend_rag.request import Request
from cacheblend_rag.tool_format import GENERIC, ToolFormat
from cacheblend_rag.tools import (
    answer_turn,
    answered_calls,
    chat_turn,
    functions_of,
    may_be_call,
    parse_tool_calls,
    tool_grammar,
    tool_turn,
)

TEMPLATES = Path(__file__).parent / "chat_templates"
NAMES = ("hermes", "llama_json", "mistral")
LISTING = {"hermes": "You may call these functions:", "llama_json": "To call a function, answer with only",
           "mistral": "[AVAILABLE_TOOLS]"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather like in Paris today?"}]


def with_template(tokenizer, name: str):
    """A copy of the tokenizer with one of the test templates (the session's tokenizer stays as it is)."""
    tok = copy.copy(tokenizer)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


@pytest.fixture(scope="module", params=NAMES)
def native(request, default_model, tmp_path_factory) -> tuple[str, CacheBlendEngine]:
    """(template name, an engine over the real model whose tokenizer has that template)."""
    model, tokenizer = default_model
    return request.param, CacheBlendEngine(model, with_template(tokenizer, request.param),
                                           tmp_path_factory.mktemp(f"kv-{request.param}"))


def test_the_generic_format_is_kept_for_smollm2s_own_template(tokenizer):
    assert ToolFormat.of(tokenizer) is GENERIC and not GENERIC.native
    # the generic grammar: a call framed in <tool_call> tags or its JSON object alone, parallel calls a line each;
    # plain text starts like neither
    grammar = tool_grammar(functions_of([WEATHER]), "auto", parallel=True).source
    assert 'calls: framed | object ("\\n" object)*\nframed: call ("\\n" call)*\n' in grammar
    assert 'call: "<tool_call>" object "</tool_call>"\nobject: %json ' in grammar
    assert grammar.endswith('\ntext: /[^<\\{][\\s\\S]*/\n')


@pytest.mark.parametrize("name, prefix, suffix, between, keys", [
    ("hermes", "<tool_call>\n", "\n</tool_call>", "\n</tool_call>\n<tool_call>\n", ("name", "arguments")),
    ("llama_json", "", "", None, ("name", "parameters")),  # the template raises on two calls: one per turn
    ("mistral", "[TOOL_CALLS][", "]", ", ", ("name", "arguments")),
])
def test_the_format_is_learned_from_each_template(tokenizer, name, prefix, suffix, between, keys):
    fmt = ToolFormat.of(with_template(tokenizer, name))
    assert fmt.native and (fmt.prefix, fmt.suffix, fmt.between, fmt.keys) == (prefix, suffix, between, keys)
    assert ToolFormat.of(with_template(tokenizer, name)) is fmt  # learned once per template


@pytest.mark.parametrize("name", NAMES)
def test_calls_the_template_renders_parse_back_and_may_be_held_back(tokenizer, name):
    tok = with_template(tokenizer, name)
    fmt = ToolFormat.of(tok)
    calls = [{"id": "call00001", "name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
             {"id": "call00002", "name": "get_time", "arguments": {"timezone": "Europe/Oslo"}}]
    calls = calls if fmt.between is not None else calls[:1]
    head = tok.apply_chat_template(ASK, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    turn = fmt.chat_messages([*ASK, {"role": "assistant", "content": "", "tool_calls": calls}])
    full = tok.apply_chat_template(turn, tools=[WEATHER, TIME], tokenize=False)
    answer = full[len(head):]
    content, parsed = parse_tool_calls(answer.replace("<|eot_id|>", "").replace("</s>", "").replace(
        "<|im_end|>", ""), functions_of([WEATHER, TIME]), fmt)
    assert [(c.name, c.arguments) for c in parsed] == [(c["name"], c["arguments"]) for c in calls] and content == ""
    assert may_be_call(answer[:3], fmt) and not may_be_call("Paris is sunny.", fmt)
    assert parse_tool_calls("Paris is sunny.", functions_of([WEATHER]), fmt) == ("Paris is sunny.", [])


def test_an_integrations_chat_turn_and_the_request_settings_it_adds():
    """Both integrations' chat calls build their turn with `chat_turn`: `tool_turn` over the rendered messages with
    the conversation's answered calls, or `answer_turn` for the plain answer after a repeated call."""
    call = {"id": "call00001", "name": "get_weather", "arguments": {"city": "Paris"}}
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "Sunny, 21 degrees.", "tool_call_id": "call00001"}]
    turn = chat_turn(history, [WEATHER], "auto", fmt=GENERIC)
    assert turn == tool_turn(GENERIC.chat_messages(history), [WEATHER], "auto", fmt=GENERIC,
                             answered=answered_calls(history)) and turn.answered
    assert turn.request_settings() == {"grammar": turn.grammar}  # the generic format: the template lists no tools
    assert chat_turn(history, [WEATHER], "auto", fmt=GENERIC, answer=True) == answer_turn(history, [WEATHER])
    rendered = [{"role": "system", "content": "Answer briefly."}, *GENERIC.chat_messages(history)]
    assert chat_turn(history, [WEATHER], fmt=GENERIC, rendered=rendered).messages[0]["content"].startswith(
        "Answer briefly.\n\nYou have these tools:")  # the rendered messages given, the tools' text added
    assert chat_turn(ASK, []).request_settings() == {}


@pytest.mark.model
@pytest.mark.slow
def test_the_prompt_lists_the_tools_through_the_template(native):
    name, engine = native
    fmt = ToolFormat.of(engine.tokenizer)
    turn = tool_turn(ASK, [WEATHER], "auto", fmt=fmt)
    assert turn.messages == ASK and turn.tools == [WEATHER]  # no generic system text: the template lists them
    text, _ = prompt_text(engine.tokenizer, turn.messages, turn.tools)
    assert LISTING[name] in text and '"get_weather"' in text and "<tools>" not in text.replace(
        "You may call these functions:\n<tools>", "")


@pytest.mark.model
@pytest.mark.slow
def test_a_required_call_is_written_in_the_templates_syntax(native):
    name, engine = native
    fmt = ToolFormat.of(engine.tokenizer)
    turn = tool_turn(ASK, [WEATHER, TIME], "required", fmt=fmt)
    out = engine.generate_request(Request.of(prompt=turn.messages, tools=turn.tools, max_new_tokens=64,
                                             grammar=turn.grammar))
    assert out.text.startswith(fmt.prefix.strip() or "{") and "<tool_call>" not in out.text.replace(
        fmt.prefix.strip(), "")
    content, (call,) = parse_tool_calls(out.text, turn.functions, fmt)
    schema = next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == call.name)
    jsonschema.validate(call.arguments, schema)
    assert content == "" and out.grammar_satisfied


@pytest.mark.model
@pytest.mark.slow
def test_a_second_turn_renders_the_call_and_result_natively_and_the_results_chunk_is_a_hit(native, passages):
    name, engine = native
    fmt = ToolFormat.of(engine.tokenizer)
    (passage_id,) = engine.ingest(passages[0], show_progress=False)
    call = {"id": "call00001", "name": "get_weather", "arguments": {"city": "Paris"}}
    history = fmt.chat_messages([*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "content": passages[0], "tool_call_id": "call00001"}])
    assert history[-1]["role"] == "tool" and history[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    turn = tool_turn(history, [WEATHER], "none", fmt=fmt)
    text, _ = prompt_text(engine.tokenizer, turn.messages, turn.tools)
    assert fmt.render_call("get_weather", {"city": "Paris"}) in text and passages[0] in text
    out = engine.generate_request(Request.of(prompt=turn.messages, tools=turn.tools, max_new_tokens=4,
                                             grammar=turn.grammar))
    assert out.stats.chunk_hits == [passage_id]
    assert not out.text.lstrip().startswith(fmt.opener)  # "none": plain text


def test_tools_go_with_chat_messages_only():
    with pytest.raises(ConfigError, match="chat messages"):
        Request.of(prompt="Hi", tools=[WEATHER])
    with pytest.raises(ConfigError, match="tools must be"):
        Request.of(prompt=ASK, tools=[{"name": "x"}])
    assert Request.of(prompt=ASK, tools=[WEATHER]).tools == (WEATHER,)


def test_json_answers_are_not_bare_json_calls(tokenizer):
    fmt = ToolFormat.of(with_template(tokenizer, "llama_json"))
    answer = json.dumps({"name": "get_weather", "city": "Paris"})  # a JSON answer that names a tool: no call
    assert parse_tool_calls(answer, functions_of([WEATHER]), fmt) == (answer, [])


@pytest.fixture(scope="module")
def served(native):
    """(template name, engine, an `openai` client of a server over that engine, in process)."""
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from cacheblend_rag.serve.app import ServeConfig, create_app

    name, engine = native
    with TestClient(create_app(engine, ServeConfig(model_name="native"))) as http:
        yield name, engine, openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                                          max_retries=0)


@pytest.mark.model
@pytest.mark.slow
def test_the_server_answers_the_openai_sdk_in_the_templates_format(served, passages):
    name, engine, client = served
    kw = dict(model="native", tools=[WEATHER, TIME], max_tokens=64,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(messages=ASK, **kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    with client.chat.completions.stream(messages=ASK, **kw) as stream:  # the SDK accumulates the deltas
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [("get_weather", args)]

    (passage_id,) = engine.ingest(passages[1], show_progress=False)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "tool_call_id": call.id, "content": passages[1]}]
    second = client.chat.completions.create(model="native", messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=4)
    assert second.choices[0].message.tool_calls is None
    assert second.usage.to_dict()["cacheblend"]["hit_ids"] == [passage_id]  # the result's chunk, fused


@pytest.mark.model
@pytest.mark.slow
def test_a_template_that_escapes_tool_results_keeps_its_calls_and_gets_results_verbatim_as_user_text(
        default_model, tmp_path, passages):
    model, tokenizer = default_model
    tok = with_template(tokenizer, "llama_json")
    tok.chat_template = tok.chat_template.replace(  # as Llama 3.1's template writes a string result: tojson
        "'<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content",
        "'<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | tojson")
    assert "message.content | tojson" in tok.chat_template
    fmt = ToolFormat.of(tok)
    assert fmt.native and fmt.keys == ("name", "parameters") and not fmt.results_verbatim
    assert ToolFormat.of(with_template(tokenizer, "llama_json")).results_verbatim
    engine = CacheBlendEngine(model, tok, tmp_path)
    (passage_id,) = engine.ingest(passages[2], show_progress=False)
    call = {"id": "call00001", "name": "get_weather", "arguments": {"city": "Paris"}}
    history = fmt.chat_messages([*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "content": passages[2], "tool_call_id": "call00001"}])
    assert "tool_calls" in history[-2] and history[-1] == {
        "role": "user", "content": f"<tool_response>\n{passages[2]}\n</tool_response>"}
    out = engine.generate_request(Request.of(prompt=history, tools=[WEATHER], max_new_tokens=2))
    assert out.stats.chunk_hits == [passage_id]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_call_stream_sends_calls_in_the_templates_syntax(tokenizer, name, size):
    from cacheblend_rag.serve.tooling import CallStream

    fmt = ToolFormat.of(with_template(tokenizer, name))
    args = [{"city": "Oslo", "unit": "celsius"}, {"city": "Bergen"}]
    if fmt.between is None:  # one call per turn
        args = args[:1]
    bodies = [json.dumps(fmt.call_json("get_weather", a)) for a in args]
    text = fmt.prefix + (fmt.between or "").join(bodies) + fmt.suffix
    stream = CallStream([WEATHER["function"]], fmt)
    deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
    calls: dict[int, str] = {}
    for delta in deltas:
        assert "content" not in delta
        for c in delta["tool_calls"]:
            calls[c["index"]] = calls.get(c["index"], "") + c["function"]["arguments"]
    assert [json.loads(calls[i]) for i in sorted(calls)] == args and stream.calls == len(args)
    streamed = [d for d in deltas[:-1] if d["tool_calls"][0]["function"].get("arguments")]
    if name != "mistral" and size < len(text):  # framed alone: arguments go out in pieces before the end
        assert len(streamed) > 1


def test_learned_formats_are_bounded(tokenizer, monkeypatch):
    import cacheblend_rag.tool_format as tool_format

    monkeypatch.setattr(tool_format, "MAX_LEARNED", 2)
    monkeypatch.setattr(tool_format, "_LEARNED", type(tool_format._LEARNED)())
    formats = [ToolFormat.of(with_template(tokenizer, name)) for name in NAMES]
    assert len(tool_format._LEARNED) == 2  # the least recently used template was dropped
    assert ToolFormat.of(with_template(tokenizer, NAMES[0])) == formats[0]  # learned again, the same format
