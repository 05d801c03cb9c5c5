"""The call syntax a model's answers use: its chat template's own, learned from the template, or the generic one.

A chat template that takes `tools` (Qwen2.5/3, Llama 3.1+, Mistral, ...) lists them itself and writes an assistant
turn's `tool_calls` in its own syntax; the model was trained to answer in that syntax. `ToolFormat.of(tokenizer)`
learns it by rendering a probe conversation, with no list of model families:

    [user]                          with the generation prompt  ->  HEAD
    [user, assistant: content SENT] without                     ->  HEAD + "SENT" + END        (END: end of turn)
    [user, assistant: one call]     without                     ->  HEAD + PREFIX + {json} + SUFFIX + END
    [user, assistant: two calls]    without                     ->  HEAD + PREFIX + {json} + BETWEEN + {json} + ...

The probe call's JSON object (found with `json.JSONDecoder.raw_decode` from each "{") names the keys ("name" and
"arguments" or "parameters") and their order; the text around it is the call's literal frame. A template that
takes no tools, ignores them, cannot render the probe's calls or a `tool` result, or frames calls in a way not
found, gets the generic format (`cacheblend_rag.tools`): tools in a system text, `<tool_call>` text, results as
user messages.

Chat messages with calls and results are written once, in OpenAI's shape (an assistant message's
`tool_calls: [{"id", "name", "arguments": dict}]`, a `{"role": "tool", "content", "tool_call_id"}` message), and
`ToolFormat.chat_messages` renders them for the format: native, as the template's own `tool_calls` and `tool`
messages; generic, as text.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"

_PROBE_NAME = "probe_tool"
_PROBE_ARGS = ({"probe_key": "probe value"}, {"probe_key": "second value"})
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"}}, "required": ["probe_key"]}}}
_PROBE_IDS = ("probe0001", "probe0002")  # nine letters and digits: Mistral's templates refuse other call ids
_CONTENT = "probe-content-7f3a"
_RESULT = 'probe "result" 7f3a\nits second line'  # quotes and a newline: a template that escapes results shows it


@dataclass(frozen=True)
class ToolFormat:
    """How an answer writes its calls: `prefix` JSON `suffix` for one call; `between` two calls of one answer
    (None: the template writes one call per turn); the JSON object's keys, in the order written."""

    prefix: str
    suffix: str
    between: str | None
    keys: tuple[str, str] = ("name", "arguments")  # (the name's key, the arguments' key)
    name_first: bool = True  # the name written before the arguments
    arguments_as_text: bool = False  # the template takes a call's arguments as JSON text, not a dict
    native: bool = False  # the chat template's own format (tools go to apply_chat_template)
    results_verbatim: bool = True  # the template writes a tool's result as is (Llama 3.1's JSON-escapes it)
    # (text, id) of the tokenizer's added tokens in the frame (Qwen's `<tool_call>`): the model writes each as that
    # one token, which the grammar must name by id (llguidance matches an added token only as itself, not as text)
    tokens: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, tokenizer: Any) -> "ToolFormat":
        """The tokenizer's chat template's own format, or GENERIC; learned once per template."""
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            return GENERIC
        added = getattr(tokenizer, "added_tokens_decoder", {})
        key = (json.dumps(template, sort_keys=True), str(getattr(tokenizer, "special_tokens_map", "")),
               tuple(t.content for t in added.values()))
        with _LEARNED_LOCK:
            fmt = _LEARNED.get(key)
            if fmt is not None:
                _LEARNED.move_to_end(key)
                return fmt
        fmt = learn(tokenizer)  # outside the lock: it renders the template (two threads may both learn it)
        with _LEARNED_LOCK:
            _LEARNED[key] = fmt
            _LEARNED.move_to_end(key)
            while len(_LEARNED) > MAX_LEARNED:
                _LEARNED.popitem(last=False)
        return fmt

    @property
    def opener(self) -> str:
        """The text every framed call starts with (whitespace aside): the prefix, or the JSON object's "{"."""
        return self.prefix.strip() or "{"

    @property
    def openers(self) -> tuple[str, ...]:
        """What a call may start with: the frame's opener, and "{" for the same call written bare (models trained
        on a framed format, Qwen2.5-Coder among them, often write the call's JSON object alone)."""
        return (self.opener,) if self.opener == "{" else (self.opener, "{")

    def _first_chars(self, *extra: str) -> str:
        """The first characters of the call openers (and `extra`), escaped for a Lark regex character class."""
        chars = {o[0] for o in self.openers} | set(extra)
        return "".join(sorted("\\/" if c == "/" else re.escape(c) for c in chars))

    @property
    def plain_text(self) -> str:
        """A Lark regex of plain text: text that starts like no call, so it can never be a malformed one."""
        return f"/[^{self._first_chars()}][\\s\\S]*/"

    @property
    def answer_text(self) -> str:
        """A Lark regex of the answer under tool_choice "none": text whose first character past any whitespace
        starts no call in any form the parser takes (framed, bare JSON, a ```json block: no backtick either).
        Asked for no call, Qwen2.5-Coder-0.5B writes its call as a ```json block or after a space instead."""
        return f"/\\s*[^\\s{self._first_chars('`')}][\\s\\S]*/"

    def calls_rule(self, call_json: str, parallel: bool, bare: bool = True) -> str:
        """The Lark rules `calls` (one call, or with `parallel` and a template that allows it, one or more) around
        a call's JSON schema text (the rule `object`); with `bare`, the call's JSON object alone is a call too (one
        per line)."""
        def framed(body: str) -> str:  # the body between the prefix and suffix literals (an empty one left out)
            return " ".join([self.literal(self.prefix)] * bool(self.prefix) + [body]
                            + [self.literal(self.suffix)] * bool(self.suffix))

        sep = self.call_separator
        if not parallel or self.between is None:
            rules = f"framed: call\ncall: {framed('object')}"
        elif sep is not None:  # each call framed alone, a separator between (the generic: a line each)
            rules = f"framed: {f'call ({self.literal(sep)} call)*' if sep else 'call+'}\ncall: {framed('object')}"
        else:  # one frame around all the calls (a Mistral-style list): calls joined by `between`
            rules = f"framed: {framed(f'object ({self.literal(self.between)} object)*')}"
        alone = "" if not bare or self.opener == "{" else ' | object ("\\n" object)*' if parallel else " | object"
        return f"calls: framed{alone}\n{rules}\nobject: %json {call_json}"

    def literal(self, text: str) -> str:
        """A Lark sequence matching `text`: its added tokens by id (`<[151657]>`), the rest as quoted strings."""
        if not self.tokens:
            return json.dumps(text)
        pattern = "(" + "|".join(re.escape(t) for t, _ in sorted(self.tokens, key=lambda t: -len(t[0]))) + ")"
        ids = dict(self.tokens)
        return " ".join(f"<[{ids[piece]}]>" if piece in ids else json.dumps(piece)
                        for piece in re.split(pattern, text) if piece)

    @property
    def call_separator(self) -> str | None:
        """The text between two framed calls when `between` is suffix + separator + prefix, else None."""
        between = self.between
        if between is None or not between.startswith(self.suffix) or not between.endswith(self.prefix):
            return None
        if len(between) < len(self.suffix) + len(self.prefix):
            return None
        return between[len(self.suffix):len(between) - len(self.prefix)]

    def call_json(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A call's JSON object as this format writes it (keys in the template's order)."""
        name_key, args_key = self.keys
        pairs = [(name_key, name), (args_key, arguments)]
        return dict(pairs if self.name_first else pairs[::-1])

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """A call as the model writes it (the generic format's `<tool_call>` text)."""
        return f"{self.prefix}{json.dumps(self.call_json(name, arguments))}{self.suffix}"

    def chat_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """OpenAI-shaped chat messages (assistant `tool_calls: [{"id", "name", "arguments"}]`, `tool` results) as
        the chat template takes them: natively, its own `tool_calls` (`{"id", "type", "function"}`) and `tool`
        messages; generically, calls as `<tool_call>` text and results as `<tool_response>` user messages."""
        names = {c.get("id"): c["name"] for m in messages for c in m.get("tool_calls") or ()}
        out: list[dict[str, Any]] = []
        for m in messages:
            if m["role"] == "tool":
                out.append(self._result(m["content"], m.get("tool_call_id"), names))
                continue
            calls = m.get("tool_calls") or ()
            if not calls:
                out.append({"role": m["role"], "content": m["content"]})
            elif self.native:
                out.append({"role": m["role"], "content": m["content"], "tool_calls": [
                    {"id": c.get("id") or "", "type": "function", "function": {
                        "name": c["name"],
                        "arguments": json.dumps(c["arguments"]) if self.arguments_as_text else c["arguments"]}}
                    for c in calls]})
            else:
                out.append({"role": m["role"],
                            "content": m["content"] + "".join(self.render_call(c["name"], c["arguments"])
                                                              for c in calls)})
        return out

    def _result(self, content: str, call_id: str | None, names: dict) -> dict[str, Any]:
        """A tool's result as a chat message, its content verbatim (stored chunks in it are found and fused): a
        template that escapes results gets them as the generic format's user message instead, so the chunks in a
        retriever tool's result stay found."""
        if not self.native or not self.results_verbatim:
            return result_message(content)
        message = {"role": "tool", "content": content, "tool_call_id": call_id or ""}
        if names.get(call_id):
            message["name"] = names[call_id]
        return message


def result_message(content: str) -> dict[str, str]:
    """A tool's result in the generic format: a user message `<tool_response>` CONTENT `</tool_response>`."""
    return {"role": "user", "content": f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"}


GENERIC = ToolFormat(TOOL_OPEN, TOOL_CLOSE, TOOL_CLOSE + "\n" + TOOL_OPEN)
"""The generic format: `<tool_call>{"name", "arguments"}</tool_call>`, parallel calls a line each."""

MAX_LEARNED = 32
"""Chat templates whose format `ToolFormat.of` keeps learned (the least recently used beyond it is learned again)."""
_LEARNED: OrderedDict[tuple[str, str, tuple[str, ...]], ToolFormat] = OrderedDict()
_LEARNED_LOCK = threading.Lock()

Render = Callable[[list[dict[str, Any]], bool], str]


def learn(tokenizer: Any) -> ToolFormat:
    """The chat template's own call format, found by rendering a probe conversation; GENERIC when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template or "tools" not in json.dumps(template):
        return GENERIC

    def render(messages: list[dict[str, Any]], generation: bool, with_tools: bool = True) -> str:
        return tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL] if with_tools else None, tokenize=False,
                                             add_generation_prompt=generation)

    user = [{"role": "user", "content": "Hello."}]
    try:
        head = render(user, True)
        if head == render(user, True, False) or _PROBE_NAME not in head:
            return _generic("it does not list the tools")
        for as_text in (False, True):
            found = _probe(tokenizer, render, user, head, as_text)
            if found is not None:
                logger.info("tool calls use the chat template's own format: %r", found)
                return found
    except Exception as e:  # a template may raise anything (jinja2's exceptions, its own raise_exception)
        return _generic(f"rendering the probe failed: {e}")
    return _generic("its probe call's JSON object was not found")


def _generic(why: str) -> ToolFormat:
    logger.info("the chat template takes tools but its call format was not learned (%s): the generic format", why)
    return GENERIC


def _added(render: Render, messages: list[dict[str, Any]], head: str) -> str | None:
    """What an assistant turn adds to the conversation with the generation prompt (None: it does not extend it)."""
    full = render(messages, False)
    return full[len(head):] if full.startswith(head) else None


def _probe_call(i: int, as_text: bool) -> dict[str, Any]:
    args = _PROBE_ARGS[i]
    return {"id": _PROBE_IDS[i], "type": "function",
            "function": {"name": _PROBE_NAME, "arguments": json.dumps(args) if as_text else args}}


def _objects(text: str) -> list[tuple[int, int, dict]]:
    """(start, end, object) of each probe call's JSON object in the text, in order."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i >= 0:
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            value, end = None, i + 1
        if isinstance(value, dict) and len(value) == 2 and _PROBE_NAME in value.values() and any(
                v in _PROBE_ARGS for v in value.values()):
            found.append((i, end, value))
            i = text.find("{", end)
        else:
            i = text.find("{", i + 1)
    return found


def _probe(tokenizer: Any, render: Render, user: list[dict[str, Any]], head: str, as_text: bool) -> ToolFormat | None:
    """The format the probe conversations show with arguments passed as JSON text or as a dict, or None."""
    content = _added(render, [*user, {"role": "assistant", "content": _CONTENT}], head)
    end = content[content.find(_CONTENT) + len(_CONTENT):] if content and _CONTENT in content else ""
    one = _added(render, [*user, {"role": "assistant", "content": "", "tool_calls": [_probe_call(0, as_text)]}], head)
    objects = _objects(one or "")
    if len(objects) != 1:
        return None
    start, stop, value = objects[0]
    prefix, suffix = one[:start], one[stop:]
    if end and suffix.endswith(end):
        suffix = suffix[:-len(end)]
    keys = list(value)
    name_key = next(k for k in keys if value[k] == _PROBE_NAME)
    args_key = next(k for k in keys if k != name_key)
    result = render([*user, {"role": "assistant", "content": "", "tool_calls": [_probe_call(0, as_text)]},
                     {"role": "tool", "content": _RESULT, "tool_call_id": _PROBE_IDS[0], "name": _PROBE_NAME}], True)
    verbatim = _RESULT in result
    if not verbatim and json.dumps(_RESULT)[1:-1] not in result:
        return None  # the result is not rendered at all
    if not verbatim:  # stored chunks inside a result would not be found: say so once, when learned
        logger.warning("the chat template JSON-escapes tool results: they go back as <tool_response> user "
                       "messages instead, so stored chunks inside them are still found and reused")
    between = _between(render, user, head, as_text, prefix, suffix)
    frame = prefix + suffix + (between or "")
    added = getattr(tokenizer, "added_tokens_decoder", {})
    tokens = tuple(sorted((t.content, i) for i, t in added.items() if t.content.strip() and t.content in frame))
    return ToolFormat(prefix, suffix, between, (name_key, args_key), keys[0] == name_key, as_text, native=True,
                      results_verbatim=verbatim, tokens=tokens)


def _between(render: Render, user: list[dict[str, Any]], head: str, as_text: bool, prefix: str,
             suffix: str) -> str | None:
    """The text between two calls of one turn, when the template writes two (None: one call per turn)."""
    try:
        two = _added(render, [*user, {"role": "assistant", "content": "",
                                      "tool_calls": [_probe_call(0, as_text), _probe_call(1, as_text)]}], head)
    except Exception:  # Llama 3.1's template raises on more than one call: one call per answer
        return None
    objects = _objects(two or "")
    if len(objects) != 2 or not two.startswith(prefix) or suffix not in two[objects[1][1]:]:
        return None
    return two[objects[0][1]:objects[1][0]]
