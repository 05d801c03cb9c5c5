"""The per-token text path does work per token that does not grow with the answer (#41), pinned by counts, never by
timing: ids decoded per token (`IncrementalText`), characters searched per piece (`StopFilter`), characters the
tool-call stream parser scans (`CallStream`), and the hold-back's look at held text; and the pieces stay those of
the whole-line decode they replace."""

from __future__ import annotations

import json

import pytest

from cacheblend_rag import tools as generic_tools
from cacheblend_rag.decode.generate import SamplingOptions
from cacheblend_rag.decode.text import CONTEXT_TOKENS, Answer, IncrementalText, StopFilter
from cacheblend_rag.serve.tooling import CallStream
from cacheblend_rag.tool_format import GENERIC

PARAGRAPH = ("The honeybee has five eyes . It can't see red , but it sees ultraviolet ! Emoji 🐝🌼, CJK 蜜蜂有五只眼睛。 "
             "café, naïve, “quotes” … ") * 40


class WholeLine:
    """The decoder this replaces: each token decodes every id since the last newline."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self._ids, self._printed = tokenizer, [], 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        stable = len(text.rstrip("\ufffd"))
        piece = text[self._printed:stable]
        self._printed = max(self._printed, stable)
        if text.endswith("\n"):
            self._ids, self._printed = [], 0
        return piece


@pytest.mark.parametrize("text", [PARAGRAPH, 'def f(x):\n\tif x:\n\t\treturn {"a": [1]}\n\n' * 8 + "   spaced   out  " * 20])
def test_incremental_text_pieces_match_whole_line_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[:40] + [tokenizer.eos_token_id] + ids[40:]  # a special token inside is skipped, as before
    reference, incremental = WholeLine(tokenizer), IncrementalText(tokenizer)
    assert [incremental.push(i) for i in ids] == [reference.push(i) for i in ids]


def test_incremental_text_decodes_a_bounded_number_of_ids_per_token(tokenizer):
    ids = tokenizer(PARAGRAPH, add_special_tokens=False)["input_ids"]  # one long line: no newline restarts
    assert len(ids) >= 512
    per_token = {}
    for n in (32, 512):
        text = IncrementalText(tokenizer)
        for i in ids[:n]:
            text.push(i)
        per_token[n] = text.ids_decoded / n
    # the whole-line decode read ~n/2 ids per token (256 at 512 tokens); this reads ≤ ~1.5 windows
    assert per_token[512] <= 3 * CONTEXT_TOKENS
    assert per_token[512] <= 1.5 * per_token[32]


def test_answer_with_stop_strings_touches_a_bounded_tail(tokenizer):
    ids = tokenizer(PARAGRAPH, add_special_tokens=False)["input_ids"][:512]
    answer = Answer(tokenizer, SamplingOptions(max_new_tokens=512, stop=("Observation:", "\n\n")),
                    tokenizer.eos_token_id)
    hold = answer._stop.hold
    longest = 0
    for i in ids:
        piece_in = len(answer._stop.buffer)
        answer.accept(i)
        longest = max(longest, piece_in)
    assert longest <= hold  # what a push searches is the held tail plus the new piece, never the answer so far
    assert answer.finish_reason == "length" and answer.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_filter_finds_a_stop_string_split_over_pieces():
    stop = StopFilter(("Observation:",))
    out = "".join(stop.push(p) for p in ["Thought: x ", "Obser", "vat", "ion: y"])
    assert stop.found and out == "Thought: x "


FUNCTIONS = [{"name": "search", "parameters": {"type": "object"}}]


def _call(words: int) -> str:
    query = " ".join(f"w{i} {{x}}" for i in range(words))  # braces inside the string: the scan must skip them
    return '<tool_call>{"name": "search", "arguments": {"query": "' + query + '", "k": [1, {"a": 2}]}}</tool_call>'


@pytest.mark.parametrize("words", [16, 256])
def test_call_stream_scans_each_argument_character_once(words):
    call = _call(words)
    pieces = [call[i:i + 4] for i in range(0, len(call), 4)]
    stream = CallStream(FUNCTIONS, GENERIC)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    scan = stream.scan  # the call closed: the stream is back to "undecided" and dropped its scan
    assert scan is None and stream.called
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
    assert json.loads(args) == {"query": " ".join(f"w{i} {{x}}" for i in range(words)), "k": [1, {"a": 2}]}

    stream = CallStream(FUNCTIONS, GENERIC)
    for p in pieces[:-3]:  # stop inside the arguments, before they close
        stream.feed(p)
    assert stream.mode == "args"
    assert stream.scan.chars_scanned <= len(call)  # the whole-text reparse read ~len²/8 characters


def test_held_call_is_looked_at_until_it_starts_for_good():
    assert generic_tools.call_started('  <tool_call>{"na', GENERIC)
    assert generic_tools.call_started('```json\n {', GENERIC)
    assert not generic_tools.call_started("<tool_c", GENERIC) and generic_tools.may_be_call("<tool_c", GENERIC)
    assert not generic_tools.call_started("```json\n ", GENERIC)
    # started → every continuation may be a call
    for text in ('<tool_call>', '{', '```json {'):
        assert generic_tools.call_started(text, GENERIC)
        assert all(generic_tools.may_be_call(text + more, GENERIC) for more in ("", "x", " }</tool_call> hi"))
