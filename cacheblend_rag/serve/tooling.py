"""OpenAI tool calling and structured output for `/v1/chat/completions`, in the chat template's own tool format or
`cacheblend_rag.tools`' generic one.

A request's `tools`, `tool_choice` and `response_format` become a `ChatPlan`: the chat messages (with the tools'
system text in the generic format; a template with its own format lists them itself, `ChatPlan.tools`) and the
grammar the answer must match (`tools.tool_grammar` / `tools.response_schema`, the same ones
`ChatCacheBlend.bind_tools` and `with_structured_output` use). History comes back in the same format: natively,
an assistant message's `tool_calls` and `tool` messages as the template renders them; generically, calls as
`<tool_call>` text and a `tool` message as a `<tool_response>` user message (its content verbatim either way, so
stored chunks in a retriever tool's result are reused).

The answer becomes `message.tool_calls` (`answer_message`); streamed, `CallStream` turns text pieces into the
deltas the OpenAI SDK accumulates: content, or one call's header (index, id, type, name, arguments "") followed by
its arguments' text in pieces.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import tools as generic_tools
from ..decode.grammar import Grammar
from ..errors import ConfigError
from ..tool_format import GENERIC, ToolFormat
from .schemas import ChatCompletionRequest, ChatMessage


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request asks of the engine beyond its sampling settings."""

    messages: list[dict[str, str]]  # the whole chat, rendered, with the system text below added
    system_text: str | None = None  # the tools' or schema's instructions (also for the documents path's template)
    grammar: Grammar | None = None
    functions: list[dict[str, Any]] = field(default_factory=list)  # the tools an answer may call (parsed for)
    tools: list[dict[str, Any]] | None = None  # listed by the chat template (its own tool format), for the request
    format: ToolFormat = GENERIC  # how calls are written (parsed and streamed)
    # under "auto": the calls whose results the chat already holds (`tools.answered_calls`), for `repeats`
    answered: frozenset[tuple[str, str]] = frozenset()

    def repeats(self, calls: Sequence[generic_tools.ToolCall]) -> bool:
        """Whether an answer's calls only repeat answered ones: not a step, answered again under "none" as the
        integrations answer it (`tools.ToolTurn.repeats`: an agent left on "auto" would loop to its limit)."""
        return bool(calls) and all(generic_tools.call_key(c.name, c.arguments) in self.answered for c in calls)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages OpenAI-shaped, before a tool format renders them (an assistant message's
    `tool_calls: [{"id", "name", "arguments": dict}]`, `tool` results); ConfigError for arguments that are not JSON."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role in ("tool", "function"):
            out.append({"role": "tool", "content": m.text(), "tool_call_id": m.tool_call_id})
            continue
        out.append({"role": m.role, "content": m.text()})
        calls = []
        for call in m.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as e:
                raise ConfigError(f"tool call {call.function.name!r} of an assistant message: arguments are not "
                                  f"JSON ({e}); send them as the JSON text the call returned") from None
            calls.append({"id": call.id, "name": call.function.name, "arguments": arguments})
        if calls:
            out[-1]["tool_calls"] = calls
    return out


def plan_chat(body: ChatCompletionRequest, fmt: ToolFormat = GENERIC) -> ChatPlan:
    """The plan of one chat request in the tool format `fmt` (`ToolFormat.of(tokenizer)` where the chat template
    renders the whole chat); ConfigError (a 400) for an unknown tool_choice, a bad schema, ..."""
    raw = openai_messages(body.messages)
    messages = fmt.chat_messages(raw)
    answer = generic_tools.response_schema(body.response_format.as_dict() if body.response_format else None)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if not tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise ConfigError(f"tool_choice {body.tool_choice!r} needs `tools`; this request sends none")
        if answer is None:
            return ChatPlan(messages)
        text = generic_tools.schema_prompt(answer) if body.response_format.type == "json_schema" else \
            "Answer with only a JSON object."
        return ChatPlan(generic_tools.with_system_text(messages, text), text, generic_tools.response_grammar(
            body.response_format.as_dict()))
    functions = generic_tools.functions_of(tools)
    choice = generic_tools.normalize_choice(body.tool_choice, [f["name"] for f in functions])
    parallel = bool(body.parallel_tool_calls)  # asked for: a small model left free repeats its call
    if fmt.native and choice == "none" and answer is None and any(m["role"] == "tool" for m in raw):
        # the answer from tool results, folded as the integrations fold it (tools.answer_turn): a native template
        # that lists the tools and shows the past calls has Qwen2.5-Coder write its call again, or junk
        turn = generic_tools.answer_turn(raw, tools, parallel, fmt)
        return ChatPlan(turn.messages, None, turn.grammar, [], None, fmt)
    # a native format's template lists the tools itself: only the response format's line goes to the system text
    lines = [] if fmt.native else [generic_tools.tools_prompt(functions, parallel)]
    if answer is not None and choice in ("auto", "none"):
        lines.append(generic_tools.schema_prompt(answer) if body.response_format.type == "json_schema"
                     else "Otherwise answer with only a JSON object.")
    text = "\n".join(lines) or None
    grammar = generic_tools.tool_grammar(functions, choice, answer, parallel, fmt)
    chat = generic_tools.with_system_text(messages, text) if text else messages
    answered = generic_tools.answered_calls(raw) if choice == "auto" else frozenset()
    return ChatPlan(chat, text, grammar, [] if choice == "none" else functions,
                    generic_tools.template_tools(functions) if fmt.native else None, fmt, answered)


def tool_call_json(call: generic_tools.ToolCall, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI's `message.tool_calls[i]` (arguments as JSON text)."""
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
    return out if index is None else {"index": index, **out}


def answer_message(text: str, finish_reason: str, functions: Sequence[dict[str, Any]],
                   fmt: ToolFormat = GENERIC) -> tuple[dict, str]:
    """(the assistant message, its finish_reason): a well-formed call becomes `tool_calls` with null content and
    finish_reason "tool_calls"; anything else (a call cut by max_tokens included) stays content."""
    content, calls = generic_tools.parse_tool_calls(text, functions, fmt) if functions else (text, [])
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return ({"role": "assistant", "content": content.strip() or None,
             "tool_calls": [tool_call_json(c) for c in calls]}, "tool_calls")


_DECODER = json.JSONDecoder()


def _spaced(literal: str) -> str:
    """A regex of a literal text, whitespace around and inside it free."""
    return r"\s*" + r"\s*".join(re.escape(part) for part in literal.split())


def _head(fmt: ToolFormat) -> re.Pattern | None:
    """`<tool_call>{"name": "NAME", "arguments": ` in the format (the grammar writes the call's keys in its
    schema's order); None when the name does not come first (such calls go out whole at the end)."""
    if not fmt.name_first:
        return None
    name_key, args_key = (re.escape(json.dumps(k)) for k in fmt.keys)
    return re.compile(_spaced(fmt.prefix) + r'\s*\{\s*' + name_key + r'\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                      + args_key + r'\s*:\s*')


class ArgsScan:
    """Where a call's arguments (a JSON value from `start` in a growing text) end, found in one pass over the
    text: strings, escapes and bracket depth are tracked from where the last call left off, and the value is
    parsed (`json.JSONDecoder.raw_decode`, the judge) only where the scan sees it close: once per value, not per
    piece. A value that does not start with "{" or "[" is parsed whole at each call, as before."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start  # the next character to scan
        self.depth = 0
        self.in_string = self.escaped = self.began = False
        self.failed = False  # the value closed and did not parse: more text cannot mend it
        self.end: int | None = None  # where the value ends, once it closed and parsed
        self.chars_scanned = 0  # characters looked at so far (tests pin that each is looked at once)

    def feed(self, text: str) -> int | None:
        """The end of the value in `text` (which only grows), or None while it is incomplete."""
        if self.failed or self.end is not None:
            return self.end
        if not self.began:
            first = len(text) - len(text[self.pos:].lstrip())
            if first >= len(text):
                self.chars_scanned += len(text) - self.pos
                self.pos = len(text)
                return None
            if text[first] not in "{[":  # a scalar: parse whole (arguments are objects; never streamed long)
                return self._parse(text, first)
            self.began, self.pos, self.first = True, first, first
        i, depth, in_string, escaped = self.pos, self.depth, self.in_string, self.escaped
        n = len(text)
        while i < n:
            ch = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth <= 0:
                    break
        self.chars_scanned += i - self.pos
        self.pos, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        if depth > 0 or i == self.first:
            return None
        self.end = self._parse(text, self.first)
        self.failed = self.end is None
        return self.end

    @staticmethod
    def _parse(text: str, first: int) -> int | None:
        try:
            return _DECODER.raw_decode(text, first)[1]
        except json.JSONDecodeError:
            return None


class CallStream:
    """Streamed text pieces → chat deltas (`{"content"}` or `{"tool_calls": [...]}`), the call's arguments
    streamed as they are decoded.

    Text that is, or may still become, a call is held back; once `<tool_call>{"name": ..., "arguments": ` is
    complete the call's header goes out, then its arguments' text except a tail that may be the call's closing
    `}</tool_call>`; once its arguments close, what follows may be the next call (parallel calls, index 1, 2, ...).
    A call whose text does not match that shape goes out whole at the end, or as content when it is not a
    well-formed call (cut by max_tokens).

    Each piece costs work on the piece, not on the text so far (#41): the arguments' JSON is scanned once, a
    character at a time (`ArgsScan`), and parsed only once the scan sees its value close; the hold-back looks at
    the last "}" and what follows it."""

    def __init__(self, functions: Sequence[dict[str, Any]], fmt: ToolFormat = GENERIC) -> None:
        self.functions = list(functions)
        self.format = fmt
        # calls streamed one by one where each is framed alone (a Mistral-style list goes out whole at the end)
        self.head = _head(fmt) if fmt.between is None or fmt.call_separator is not None else None
        self.closing = re.compile(r"\s*\}" + _spaced(fmt.suffix))
        self.tail = re.compile(r"\}" + _spaced(fmt.suffix) + r"\s*$")
        self.close = fmt.suffix.strip()
        self.text = ""  # everything seen (since the last complete call)
        self.mode = "undecided"  # "text" once it cannot be a call, "args" once the call's header went out
        self.started = False  # undecided text that begins a call for good (`tools.call_started`)
        self.args_start = 0  # where the arguments' text starts in `text`
        self.sent = 0  # characters of the arguments' text already sent
        self.scan: ArgsScan | None = None  # the arguments' JSON, scanned so far
        self.brace = -1  # where the last "}" of the arguments' text is in `text`
        self.calls = 0

    def _header(self, name: str, arguments: str = "") -> dict:
        self.calls += 1
        return {"tool_calls": [{"index": self.calls - 1, "id": _call_id(), "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def _arguments(self, piece: str) -> dict:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": piece}}]}

    def _call_end(self) -> tuple[int, int] | None:
        """(where the streamed call's arguments end, where its closing tag ends) in `text`, once both are there."""
        end = self.scan.feed(self.text)
        if end is None:
            return None
        closing = self.closing.match(self.text, end)
        return None if closing is None else (end, closing.end())

    def feed(self, piece: str) -> list[dict]:
        """The deltas this piece releases."""
        self.text += piece
        if self.mode == "text":
            return [{"content": piece}] if piece else []
        if self.mode == "undecided":
            if not self.started:
                stripped = self.text.lstrip()
                if not stripped:
                    return []
                if not generic_tools.may_be_call(stripped, self.format):
                    self.mode = "text"
                    return [{"content": stripped}]
                self.started = generic_tools.call_started(stripped, self.format)
            head = self.head.match(self.text) if self.head is not None else None  # anchored: reads the head only
            if head is None:
                return []
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                return []
            if name not in {f["name"] for f in self.functions}:
                return []  # left to the final parse
            self.mode, self.args_start, self.scan = "args", head.end(), ArgsScan(head.end())
            self.brace = self.text.rfind("}", self.args_start)  # the arguments' text so far: this piece's end
            return [self._header(name), *self._after_args()]
        brace = piece.rfind("}")
        if brace >= 0:
            self.brace = len(self.text) - len(piece) + brace
        return self._after_args()

    def _after_args(self) -> list[dict]:
        """The arguments' text released so far; a complete call hands what follows it to the next one."""
        end = self._call_end()
        if end is None:
            return self._release(final=False)
        args_end, call_end = end
        out = [self._arguments(self.text[self.args_start + self.sent:args_end])] \
            if args_end > self.args_start + self.sent else []
        self.text, self.mode, self.sent, self.started, self.scan = self.text[call_end:], "undecided", 0, False, None
        return out + self.feed("")

    def _release(self, final: bool) -> list[dict]:
        text, start = self.text, self.args_start
        if final:
            tail = self.tail.search(text, start)
            end = (tail.start() if tail else len(text)) - start
        else:  # hold back from the last "}" when all after it may still be the closing `}</tool_call>`
            stop = len(text)
            while stop > start and text[stop - 1].isspace():
                stop -= 1
            end = stop - start
            if self.brace >= start:
                after = self.brace + 1
                while after < len(text) and text[after].isspace():
                    after += 1
                if text.startswith(self.close, after) or (len(text) - after <= len(self.close)
                                                          and self.close.startswith(text[after:])):
                    end = min(end, self.brace - start)
        if end <= self.sent:
            return []
        piece, self.sent = text[start + self.sent:start + end], end
        return [self._arguments(piece)]

    def finish(self) -> list[dict]:
        """The deltas held back at the end of the answer."""
        if self.mode == "args":
            return self._release(final=True)
        if self.mode == "text" or not self.text.strip():
            return []
        content, calls = generic_tools.parse_tool_calls(self.text, self.functions, self.format)
        if not calls:
            self.mode = "text"
            return [{"content": self.text.strip()}]
        out = [self._header(call.name, json.dumps(call.arguments)) for call in calls]
        if content.strip():
            out.append({"content": content.strip()})
        return out

    @property
    def called(self) -> bool:
        """Whether a call went out (finish_reason "tool_calls")."""
        return self.calls > 0
