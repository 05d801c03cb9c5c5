"""Tool calling: in the chat template's own format where it has one (`ToolFormat`, learned from the template), else
in a generic text format (the default SmolLM2's template has none).

A native format (Qwen2.5/3's Hermes blocks, Llama 3.1's bare JSON, Mistral's `[TOOL_CALLS]` list, ...) leaves the
tools to the template (`Request.tools` reaches `apply_chat_template(tools=...)`), past calls and results to its
own `tool_calls` and `tool` messages, and the grammar forces the template's own call syntax. The generic one:

Tools are OpenAI function specs (`{"type": "function", "function": {"name", "description", "parameters"}}`).
The generic format (documented in docs/design.md, "Tool formats"), in plain chat messages any template renders:

- a system message lists the tools as JSON inside `<tools>...</tools>` and says how to call one;
- the model calls a tool by answering exactly `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`
  (the Hermes / Qwen shape); grammar-constrained decoding makes that call well formed, to one of the bound tools,
  with arguments valid against its schema;
- a tool's result goes back as a user message `<tool_response>CONTENT</tool_response>`, its content verbatim
  (stored chunks inside a retriever tool's result are then found and fused like chunks anywhere in a prompt).

A call is also accepted as its JSON object alone, without its frame (`{"name": ..., "arguments": {...}}`), or as
that object in a ```json code block: models trained on a framed format (Qwen2.5-Coder) often write it so. Plain text
may start like neither a framed nor a bare call (a code block is parsed, not forced: a code answer starts so too).

`tool_choice`: "auto" (a call or a plain answer that does not start with "<" or "{"), "required" (alias "any": a call),
a tool's name (a call to that tool), "none" (plain text that does not start with "<"; the tools stay listed, in
the same system text whatever the choice, so an agent's steps share their prompt's start). One call per answer,
or with `parallel=True` (OpenAI's `parallel_tool_calls`) one or more, a call per line. A native format's plain
text may not start like its calls (its prefix's first character, or "{" for a bare JSON call), and parallel
calls are joined as its template joins them (one call only where the template writes one per turn).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .decode.grammar import Grammar, check_schema_depth, with_json_options
from .errors import ConfigError
from .request import check_tools
from .tool_format import GENERIC, RESULT_CLOSE, RESULT_OPEN, TOOL_CLOSE, TOOL_OPEN, ToolFormat, result_message

CHOICES = ("auto", "none", "required")
# A call written as a JSON code block: how Qwen2.5-Coder answers under "auto" when its tools are listed. Plain text
# may start so (a code answer), so it is parsed, not forced: a block holding exactly one call's JSON is that call
FENCE = "```json"
_FENCED = re.compile(r"\s*```json[ \t]*\n(.*)\n[ \t]*```\s*", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name, its arguments, and an id for the tool's result to refer to."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def functions_of(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function specs of OpenAI-format tools, checked: each has a unique name and an object schema."""
    functions, names = [], set()
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or "function" not in tool:
            raise ConfigError(f'a tool must be {{"type": "function", "function": {{"name", "parameters"}}}}, '
                              f"got {tool!r}; convert LangChain tools with convert_to_openai_tool")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a tool function needs a name, got {fn!r}")
        if name in names:
            raise ConfigError(f"two tools are named {name!r}; tool names must be unique")
        names.add(name)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if params.get("type", "object") != "object":
            raise ConfigError(f"tool {name!r}: parameters must be a JSON schema of type object")
        functions.append({"name": name, "description": fn.get("description", ""), "parameters": params})
    return functions


def normalize_choice(choice: str | dict | bool | None, names: Sequence[str]) -> str:
    """`tool_choice` as "auto", "none", "required" or a tool name (from LangChain's and OpenAI's spellings)."""
    if choice is None:
        return "auto"
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, dict):  # OpenAI's {"type": "function", "function": {"name": ...}}
        function = choice.get("function")
        if function is not None and not isinstance(function, dict):
            raise ConfigError(f'tool_choice\'s "function" must be an object {{"name": ...}}, got {function!r}')
        choice = (function or {}).get("name") or choice.get("name")
    if choice in CHOICES or choice in names:
        return choice
    raise ConfigError(f"tool_choice must be one of auto, none, required, any or a bound tool's name "
                      f"({', '.join(names)}), got {choice!r}")


def closed(schema: Any) -> Any:
    """A copy of the schema where objects with listed properties allow no others unless they say so (as OpenAI's
    strict mode does): a small model must not invent extra keys. GrammarError for one nested past MAX_SCHEMA_DEPTH."""
    check_schema_depth(schema)
    return _closed(schema)


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out and "properties" in out:
        out["additionalProperties"] = False
    return out


def call_schema(functions: Sequence[dict[str, Any]], fmt: ToolFormat = GENERIC) -> dict[str, Any]:
    """The JSON schema of one call `{"name", "arguments"}` (the format's keys, in its order) to any of these
    functions."""
    options = [{"type": "object", "properties": fmt.call_json({"const": fn["name"]}, closed(fn["parameters"])),
                "required": list(fmt.call_json("", {})), "additionalProperties": False} for fn in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(functions: Sequence[dict[str, Any]], choice: str, answer: dict[str, Any] | None = None,
                 parallel: bool = False, fmt: ToolFormat = GENERIC) -> Grammar | None:
    """The grammar for an answer under `choice`: a call, or a call or plain text ("auto"); for "none", plain text.
    `answer`: a JSON schema the plain answer must match instead ("auto" with a response format: a call or that
    JSON, which the call parser tells apart). `parallel`: one or more calls, joined as `fmt` joins them."""
    text = fmt.plain_text
    if choice == "none":  # plain text that cannot start a call in any form (or the response format's JSON)
        return Grammar.lark(f"start: {fmt.answer_text}\n") if answer is None else Grammar.json_schema(answer)
    targets = [fn for fn in functions if choice in ("auto", "required") or fn["name"] == choice]
    # JSON embedded in Lark gets the same spacing options as a plain schema: without them whitespace is free
    # inside a call, and SmolLM2 emitted newlines after `"arguments": {` until max_tokens
    # a call's bare JSON object counts too, except beside a JSON answer (which it would look like)
    calls = fmt.calls_rule(json.dumps(with_json_options(call_schema(targets, fmt))), parallel,
                           bare=not (choice == "auto" and answer is not None))
    if choice == "auto" and answer is not None:
        return Grammar.lark(f"start: calls | answer\n{calls}\nanswer: %json {json.dumps(with_json_options(answer))}\n")
    if choice == "auto":  # plain text may not start like a call, so it can never be a malformed one
        return Grammar.lark(f"start: calls | text\n{calls}\ntext: {text}\n")
    return Grammar.lark(f"start: calls\n{calls}\n")


def response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema an OpenAI-style `response_format` holds the answer to (None for {"type": "text"} or none):
    `{"type": "json_object"}` any JSON object (or, as LangChain's json_mode passes it, its `schema`),
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` that schema with its objects closed
    (strict or not: the schema is always enforced). ConfigError for any other shape."""
    kind = (response_format or {}).get("type", "text") if isinstance(response_format, (dict, type(None))) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return closed(schema) if isinstance(schema, dict) else {"type": "object"}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if isinstance(schema, dict):
            return closed(schema)
        raise ConfigError('response_format {"type": "json_schema"} needs json_schema.schema, a JSON schema object: '
                          '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}')
    raise ConfigError(f'response_format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                      f'"json_schema", "json_schema": {{"name", "schema"}}}}, got {response_format!r}')


def response_grammar(response_format: dict[str, Any] | None) -> Grammar | None:
    """The grammar of an OpenAI-style `response_format` (None for text)."""
    schema = response_schema(response_format)
    if schema is None:
        return None
    return Grammar.json_object() if schema == {"type": "object"} else Grammar.json_schema(schema)


def tools_prompt(functions: Sequence[dict[str, Any]], parallel: bool = False) -> str:
    """The system text that lists the tools and the call format (`parallel`: several calls, one per line)."""
    listed = "\n".join(json.dumps(fn) for fn in functions)
    how = (f'To call a tool, answer with only {TOOL_OPEN}{{"name": <tool name>, "arguments": <JSON object>}}'
           f"{TOOL_CLOSE}. A tool's result comes back as {RESULT_OPEN}...{RESULT_CLOSE}.")
    if parallel:
        how += " To call several tools at once, write one call per line."
    # One text whatever the choice (the grammar enforces it): an agent loop that forces its first call, leaves
    # the next to the model or forbids one keeps the same system text, so each step's prompt starts with the
    # previous one's and reuses its stored prefix
    rule = "Call a tool when it helps; otherwise answer in plain text."
    return f"You have these tools:\n<tools>\n{listed}\n</tools>\n{how}\n{rule}"


def with_tools_prompt(messages: Sequence[dict[str, str]], functions: Sequence[dict[str, Any]],
                      parallel: bool = False) -> list[dict[str, str]]:
    """The chat messages with the tools' system text added to the system message (or a new one first)."""
    return with_system_text(messages, tools_prompt(functions, parallel))


def call_key(name: str, arguments: Any) -> tuple[str, str]:
    """A call's identity: its tool's name and its arguments as canonical JSON (key order aside)."""
    return name, json.dumps(arguments, sort_keys=True)


def answered_calls(messages: Sequence[dict[str, Any]]) -> frozenset[tuple[str, str]]:
    """The calls (`call_key`) of OpenAI-shaped chat messages (an assistant message's `tool_calls: [{"id", "name",
    "arguments"}]`, before a tool format renders them) whose result came back: a `tool` message after them."""
    answered: set[tuple[str, str]] = set()
    pending: list[tuple[str, str]] = []
    for m in messages:
        if m.get("role") == "tool":
            answered.update(pending)
        for call in m.get("tool_calls") or ():
            pending.append(call_key(call["name"], call.get("arguments") or {}))
    return frozenset(answered)


@dataclass(frozen=True)
class ToolTurn:
    """One answer's tool calling: the chat messages to render, the grammar of the answer, the functions its calls
    are parsed for (none under "none"), and the tools the chat template lists itself (a native format), if any;
    `choice` as normalized and the calls already answered in the conversation (`answered_calls`)."""

    messages: list[dict[str, Any]]
    grammar: Grammar | None = None
    functions: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # for `Request.tools`
    choice: str = "auto"
    answered: frozenset[tuple[str, str]] = frozenset()

    def repeats(self, calls: Sequence[ToolCall]) -> bool:
        """Whether an answer under "auto" only repeats calls whose results the conversation already holds.

        Such an answer is not a step: the same call brings back the same result, and an agent that runs it loops
        until its recursion limit (Qwen2.5-Coder-0.5B writes the same call again after its result with p≈0.99,
        SmolLM2-135M too). The integrations then decode the answer again under "none" (plain text; the prompt is
        the same, so that second pass starts from the first one's stored prefix). A forced call ("required", a
        tool's name) is kept: the caller asked for one."""
        return self.choice == "auto" and bool(calls) and all(call_key(c.name, c.arguments) in self.answered
                                                              for c in calls)

    def request_settings(self) -> dict[str, Any]:
        """What the turn sets on the engine's request (`Request.of` keywords): its grammar and the tools its chat
        template lists, those it has."""
        return {key: value for key, value in (("grammar", self.grammar), ("tools", self.tools)) if value is not None}


def tool_turn(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], choice: Any = None,
              parallel: bool = False, fmt: ToolFormat = GENERIC,
              answered: frozenset[tuple[str, str]] = frozenset()) -> ToolTurn:
    """One answer with these OpenAI tool specs bound, in `fmt` (`ToolFormat.of(tokenizer)`): the generic format
    adds the tools' system text to the messages, a native one hands the tools to the chat template; the grammar
    `choice` asks for. Without tools, the messages as they are and no grammar. `answered`: the conversation's
    answered calls (`answered_calls` of the messages before `fmt` rendered them), for `ToolTurn.repeats`."""
    functions = functions_of(tools)
    if not functions:
        return ToolTurn(list(messages), choice="none")
    choice = normalize_choice(choice, [f["name"] for f in functions])
    grammar = tool_grammar(functions, choice, parallel=parallel, fmt=fmt)
    called = [] if choice == "none" else functions
    if fmt.native:
        return ToolTurn(list(messages), grammar, called, template_tools(functions), choice, answered)
    return ToolTurn(with_tools_prompt(messages, functions, parallel), grammar, called, None, choice, answered)


def chat_turn(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], choice: Any = None,
              parallel: bool = False, fmt: ToolFormat = GENERIC, answer: bool = False,
              rendered: Sequence[dict[str, Any]] | None = None) -> ToolTurn:
    """An integration's chat call with these tools bound: `messages` OpenAI-shaped (before `fmt` renders them);
    `tool_turn` over `rendered` (default `fmt.chat_messages(messages)`) with the conversation's answered calls, or,
    with `answer`, the plain answer after an "auto" answer that only repeated them (`answer_turn`). A call's own
    `tools` are checked here, as `Request.of` checks a prompt's (a LangChain or LlamaIndex call passes them raw)."""
    tools = check_tools(tools, messages)
    if answer:
        return answer_turn(messages, tools, parallel, fmt)
    chat = fmt.chat_messages(messages) if rendered is None else rendered
    return tool_turn(chat, tools, choice, parallel, fmt, answered_calls(messages))


def answer_turn(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], parallel: bool = False,
                fmt: ToolFormat = GENERIC) -> ToolTurn:
    """The answer after an "auto" answer that only repeated answered calls (`ToolTurn.repeats`): plain text from
    the results. `messages`: OpenAI-shaped (before `fmt` renders them).

    In the generic format, the same prompt under "none" (its tools' system text is the same whatever the choice,
    so the answer starts from the repeated call's stored prefix; SmolLM2-135M then answers). A native format's
    template lists the tools and shows the past calls, and Qwen2.5-Coder-0.5B writes its call again even under
    "none" (as a ```json block, after "(", after a sentence: measured on the RAG agent's step after a retriever
    result); so the conversation is folded: no tools listed, past calls left out (an assistant turn keeps its
    text, if any), each result a `<tool_response>` user turn, verbatim (stored chunks in it are still found and
    fused). There the model answers from the result ("5" to "How many eyes does a honeybee have?")."""
    if not fmt.native:
        return tool_turn(fmt.chat_messages(messages), tools, "none", parallel, fmt)
    folded: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            folded.append(result_message(m["content"]))
        elif m["content"] or not m.get("tool_calls"):  # a call-only assistant turn is left out
            folded.append({"role": m["role"], "content": m["content"]})
    return ToolTurn(folded, Grammar.lark(f"start: {fmt.answer_text}\n"), choice="none")


def template_tools(functions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked functions as the OpenAI tool specs chat templates take (`apply_chat_template(tools=...)`)."""
    return [{"type": "function", "function": dict(fn)} for fn in functions]


def schema_prompt(schema: dict[str, Any]) -> str:
    """The system text asking for a JSON answer of this schema (the grammar enforces the shape; the text tells a
    small model what the fields mean and to keep their values brief, so it closes them within max_tokens)."""
    return (f"Answer with only a JSON object that matches this JSON schema:\n{json.dumps(schema)}\n"
            f"Keep each string value brief.")


def with_system_text(messages: Sequence[dict[str, str]], text: str) -> list[dict[str, str]]:
    """The chat messages with `text` added to the system message (or as a new system message first)."""
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """A past call as the assistant wrote it, in the generic format."""
    return GENERIC.render_call(name, arguments)


def render_result(content: str) -> dict[str, str]:
    """A tool's result as the chat message that carries it back (content verbatim), in the generic format."""
    return result_message(content)


def may_be_call(text: str, fmt: ToolFormat = GENERIC) -> bool:
    """Whether streamed text so far is, or may still become, a call (so a stream holds it back). Once False, it
    stays False for every continuation of the text; once `call_started`, it stays True."""
    text = text.lstrip()
    if any(text.startswith(opener) or opener.startswith(text) for opener in fmt.openers) or FENCE.startswith(text):
        return True
    return text.startswith(FENCE) and text[len(FENCE):].lstrip()[:1] in ("", "{")


def call_started(text: str, fmt: ToolFormat = GENERIC) -> bool:
    """Whether text so far begins a call for good: `may_be_call` holds for it and for every continuation of it, so a
    stream holding it back need not look again (looking again at each piece costs the whole held text: #41)."""
    text = text.lstrip()
    if any(text.startswith(opener) for opener in fmt.openers):
        return True
    return text.startswith(FENCE) and text[len(FENCE):].lstrip()[:1] == "{"


def _after(text: str, literal: str) -> str | None:
    """The text after `literal` at its start, whitespace around and inside the literal free (None: not there)."""
    for part in literal.split():
        text = text.lstrip()
        if not text.startswith(part):
            return None
        text = text[len(part):]
    return text


def parse_tool_calls(text: str, functions: Sequence[dict[str, Any]] = (),
                     fmt: ToolFormat = GENERIC) -> tuple[str, list[ToolCall]]:
    """(plain content, calls) of an answer in `fmt`: well-formed calls to known tools become ToolCalls; anything
    else stays content (a call cut by max_tokens, or text in a format the grammar did not force)."""
    name_key, args_key = fmt.keys
    known = {fn["name"] for fn in functions}
    rest = _after(text, fmt.prefix)
    if rest is None or not rest.lstrip().startswith("{"):
        fenced = _FENCED.fullmatch(text)
        bare = _bare_calls(fenced.group(1) if fenced else text, known, fmt)
        return ("" if bare else text), bare
    decoder, calls = json.JSONDecoder(), []
    while True:
        # the JSON value first, then the closing text: a string argument may itself contain "</tool_call>"
        try:
            call, end = decoder.raw_decode(rest, len(rest) - len(rest.lstrip()))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get(name_key), str) or (
                known and call[name_key] not in known) or (not fmt.prefix.strip() and set(call) - set(fmt.keys)):
            return text, []  # (a bare-JSON format: a JSON answer with other keys is not a call)
        calls.append(ToolCall(call[name_key], copy.deepcopy(call.get(args_key) or {})))
        after = rest[end:]
        following = _after(after, fmt.between) if fmt.between is not None else None
        if following is not None and following.lstrip().startswith("{"):
            rest = following
            continue
        done = _after(after, fmt.suffix)
        return (done.strip(), calls) if done is not None else (text, [])


def _bare_calls(text: str, known: set[str], fmt: ToolFormat) -> list[ToolCall]:
    """The calls of an answer that is only calls' JSON objects without their frame (one per line), each with
    exactly the format's keys and a known tool's name; [] for anything else."""
    decoder, calls, at = json.JSONDecoder(), [], len(text) - len(text.lstrip())
    name_key, args_key = fmt.keys
    while at < len(text):
        try:
            call, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return []
        if not isinstance(call, dict) or set(call) - {name_key, args_key} or not isinstance(call.get(name_key), str) \
                or (known and call[name_key] not in known) or not isinstance(call.get(args_key, {}), dict):
            return []
        calls.append(ToolCall(call[name_key], copy.deepcopy(call.get(args_key) or {})))
        at += len(text[at:]) - len(text[at:].lstrip())
    return calls
