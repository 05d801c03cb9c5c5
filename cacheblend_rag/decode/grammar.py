"""Constrained decoding: a grammar (a JSON schema, any JSON object, or a Lark grammar) masks each step's logits.

The grammar engine is llguidance (chosen over xgrammar on this repo's CPU with SmolLM2's 49152-token vocabulary:
a mask in ~0.01 ms median against xgrammar's ~0.004 ms, both far below a decode step, but a JSON schema compiles
in ~3 ms against ~14 ms, and every tool-calling request brings a new schema; its Lark dialect embeds JSON schemas
(`%json {...}`), which the tool-call grammar needs). A `Grammar` is a plain, hashable value that `SamplingOptions`
carries; a `GrammarState` is one sequence's matcher, built from it by a `GrammarCompiler` (one per tokenizer: the
tokenizer conversion costs ~0.5 s once).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError

KINDS = ("json_schema", "json_object", "lark")

# Natural JSON spacing, and no free whitespace: a small model left free to emit whitespace can loop on it until
# max_tokens. `lenient`: schema keywords llguidance does not implement (rare ones, e.g. some `format`s) are
# ignored rather than failing the request; the parsed output is still valid JSON of the schema's shape.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
# Objects and arrays a schema may nest, counted as JSON nests them (an object property is two: the object and its
# `properties`); deeper ones are refused before anything walks them recursively (a RecursionError otherwise).
# Real schemas nest a few levels and share the rest through $defs/$ref.
MAX_SCHEMA_DEPTH = 128


class GrammarError(ConfigError):
    """A grammar or schema llguidance cannot compile."""


class GrammarDecodeError(GrammarError):
    """A grammar that compiled but failed while decoding (a pattern or a recursion past llguidance's limits, an
    unsatisfiable schema): the answer ends with this error, never with a silent, empty "stop"."""


def first_line(message: str) -> str:
    """The first line of an llguidance error: the rest is parser state (and the grammar), for the log only."""
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


WARM_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
               "required": ["name"]}  # what `GrammarCompiler.warm_up` compiles: llguidance's JSON path, once
COMPILED_KEPT = 64  # compiled grammars a compiler keeps: a server's queue and batch, and an agent's repeated tools


def _llguidance():
    """The llguidance module, or a ConfigError saying how to install it."""
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (registers the HF tokenizer bridge)
    except ImportError as e:  # a hard dependency, but name the fix if an environment lacks it
        raise ConfigError("constrained decoding needs llguidance: pip install 'llguidance>=1.9,<2'") from e
    return llguidance


def check_schema_depth(schema: Any, what: str = "the JSON schema") -> None:
    """GrammarError when `schema` nests objects and arrays deeper than MAX_SCHEMA_DEPTH (walked without recursion)."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{what} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep (the "
                               "limit); share repeated parts through $defs and $ref, or flatten it")
        stack.extend((child, depth + 1) for child in children)


def with_json_options(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with this package's JSON spacing options (`x-guidance`), the caller's own taking precedence."""
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


@dataclass(frozen=True)
class Grammar:
    """What the decoded text must match: `Grammar.json_schema(schema)`, `Grammar.json_object()` or
    `Grammar.lark(text)` (llguidance's Lark dialect, where `%json {schema}` embeds a JSON schema)."""

    kind: str
    source: str  # the schema as JSON text, or the Lark text

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ConfigError(f"grammar source must be a string, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """Text that is one JSON value valid against `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        check_schema_depth(schema)
        return cls("json_schema", json.dumps(schema))  # key order kept: properties are generated in it

    @classmethod
    def json_object(cls) -> Grammar:
        """Text that is any one JSON object (OpenAI's `response_format={"type": "json_object"}`)."""
        return cls("json_object", json.dumps({"type": "object"}))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Text matching a grammar in llguidance's Lark dialect."""
        return cls("lark", text)

    @classmethod
    def coerce(cls, value: Grammar | dict[str, Any] | None) -> Grammar | None:
        """A Grammar from what callers pass: a Grammar, a JSON schema dict, or None (no constraint)."""
        if value is None or isinstance(value, Grammar):
            return value
        if isinstance(value, dict):
            return cls.json_schema(value)
        raise ConfigError(f"grammar must be a Grammar, a JSON schema dict or None, got {type(value).__name__}")

    def serialized(self) -> str:
        """The grammar as llguidance takes it."""
        llg = _llguidance()
        try:
            if self.kind == "lark":
                return llg.LLMatcher.grammar_from_lark(self.source)
            return llg.LLMatcher.grammar_from_json_schema(with_json_options(json.loads(self.source)))
        except ValueError as e:  # llguidance's own: e.g. a bound past 64 bits ("Value is not JSON serializable")
            raise GrammarError(f"the {self.kind} grammar cannot be used: {first_line(str(e))}; a number in a "
                               "schema (minItems, maxLength, minimum, ...) must fit in 64 bits") from e


# Closing within the token budget: when the tokens left barely suffice to complete the grammar, each step keeps
# only the allowed punctuation tokens that close something (inside a string, those starting with its closing quote;
# outside, those starting with `}` or `]` or an empty `[]` / `{}` value, else with a quote that opens a required key
# or value), so a small model that repeats itself inside a string field still ends with text that parses. Objects
# are best closed (additionalProperties false, as structured output and tool calls make them): in an open one the
# keys are free.
QUOTE, BRACKET = 1, 2  # what a token starts with (after spaces), from `token_leads`
CLOSE_MARGIN = 2  # spare tokens for the model's own closing choices, which may be longer than the walk's
RECHECK_EVERY = 16  # steps between estimates while the budget is far from the estimate


@dataclass(frozen=True)
class TokenLeads:
    """Per token id of one tokenizer: its decoded text, what it starts with (QUOTE, BRACKET or 0), its length."""

    texts: tuple[str, ...]
    leads: np.ndarray
    lengths: np.ndarray


# A closing token holds nothing else: `"` or `"}` close, while `"Why` opens and writes on, and `", "` opens an
# optional key the model would then have to write
PUNCTUATION = set('"}] ')


def token_leads(tokenizer) -> TokenLeads:
    """Each token's text and, for tokens of punctuation only, its leading closer (~0.3 s for a 49k vocabulary)."""
    texts = tuple(tokenizer.decode([i]) for i in range(len(tokenizer)))
    leads = np.zeros(len(texts), dtype=np.int8)
    for token_id, text in enumerate(texts):
        body = text.lstrip()
        if body[:2] in ("[]", "{}") and set(body[2:]) <= PUNCTUATION:  # an empty array or object, whole
            leads[token_id] = BRACKET
        elif body and set(text) <= PUNCTUATION:
            leads[token_id] = QUOTE if body[0] == '"' else BRACKET if body[0] in ("}", "]") else 0
    return TokenLeads(texts, leads, np.array([max(len(t), 1) for t in texts], dtype=np.int32))


@dataclass
class StringScan:
    """Whether text so far ends inside a JSON string (and after a backslash there), scanned a token at a time."""

    in_string: bool = False
    escaped: bool = False

    def push(self, text: str) -> None:
        """Advance past `text`."""
        for ch in text:
            if self.escaped:
                self.escaped = False
            elif self.in_string and ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = not self.in_string


class GrammarCompiler:
    """Builds `GrammarState`s for one tokenizer; converts the tokenizer for llguidance once, on first use.

    A grammar is compiled once (and its first mask computed, which is where some grammars fail): the compiled
    matcher is kept (the last COMPILED_KEPT) and each sequence gets a copy, so a server that checks a request's
    grammar at admission hands the worker a compiled one, and an agent's tools that come back every step compile
    once. Thread-safe: admission threads and the engine's worker share it.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ll_tokenizer = None
        self._leads: TokenLeads | None = None
        # grammar → (a matcher that has consumed nothing, its first mask)
        self._compiled: OrderedDict[Grammar, tuple[Any, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()  # one build of the tokenizer conversion and the leads, whoever asks first
        self._warming: threading.Thread | None = None
        self.num_compiled = 0  # grammars compiled so far (a counter for /metrics)

    def leads(self) -> TokenLeads:
        """`token_leads` of this tokenizer, computed once."""
        if self._leads is None:
            with self._setup_lock:
                if self._leads is None:
                    self._leads = token_leads(self.tokenizer)
        return self._leads

    def ll_tokenizer(self):
        """The tokenizer as llguidance sees it (built once: ~0.4 s for SmolLM2's 49k vocabulary, ~1.5 s for
        Qwen2.5's 152k)."""
        if self._ll_tokenizer is None:
            with self._setup_lock:
                if self._ll_tokenizer is None:
                    llg = _llguidance()
                    try:
                        self._ll_tokenizer = llg.hf.from_tokenizer(self.tokenizer)
                    except ValueError as e:
                        raise ConfigError(f"constrained decoding needs a fast tokenizer (tokenizer.json): {e}") from e
        return self._ll_tokenizer

    @property
    def warm(self) -> bool:
        """Whether the one-time set-up (tokenizer conversion, token leads) is done."""
        return self._ll_tokenizer is not None and self._leads is not None

    def warm_up(self, *, background: bool = True) -> threading.Thread | None:
        """Do the one-time set-up a first grammar pays (the tokenizer conversion, the token leads, llguidance's
        JSON-schema path on a tiny schema) now: 0.5 s on SmolLM2, 1.9 s on Qwen2.5-Coder-0.5B on the project's CPU
        (issue #41), which a first tool call otherwise adds to its latency. `background`: on a daemon
        thread, started once (the thread is returned; later calls return it again); a grammar asked for meanwhile
        waits for the part it needs rather than building it twice. Failures are left for the first real grammar to
        report. Called at the first `bind_tools` / `with_structured_output` and when a server starts; an engine
        that never sees a grammar never pays it."""
        if self.warm:
            return None
        if not background:
            self._warm_now()
            return None
        with self._lock:
            if self._warming is None:
                self._warming = threading.Thread(target=self._warm_now, name="cacheblend-grammar-warm", daemon=True)
                self._warming.start()
            return self._warming

    def _warm_now(self) -> None:
        try:
            lltok = self.ll_tokenizer()
            self.leads()
            # compiled aside: not kept, not counted in num_compiled
            matcher = _llguidance().LLMatcher(lltok, Grammar.json_schema(WARM_SCHEMA).serialized(), log_level=0)
            words = torch.empty(((lltok.vocab_size + 31) // 32,), dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        except Exception:  # noqa: BLE001 (a warm-up: the first real grammar raises the same error, with context)
            pass

    def compile(self, grammar: Grammar):
        """The compiled matcher of the grammar (its first mask computed), compiled now unless it is kept; GrammarError
        if either fails. Runs on the caller's thread (llguidance drops the GIL while it builds). Copy it to use it."""
        return self._compile(grammar)[0]

    def _compile(self, grammar: Grammar) -> tuple[Any, torch.Tensor]:
        """(the compiled matcher, its first mask as llguidance's 32-bit words), kept for the next request."""
        with self._lock:
            kept = self._compiled.get(grammar)
            if kept is not None:
                self._compiled.move_to_end(grammar)
                return kept
        llg = _llguidance()
        lltok = self.ll_tokenizer()
        matcher = llg.LLMatcher(lltok, grammar.serialized(), log_level=0)  # never raises: errors are its state
        words = torch.empty(((lltok.vocab_size + 31) // 32,), dtype=torch.int32)
        if not matcher.is_error():  # the first mask: a grammar may compile and still fail here ({"$ref": "#"})
            matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        with self._lock:
            self.num_compiled += 1
        if matcher.is_error():
            raise GrammarError(f"the {grammar.kind} grammar does not compile: {first_line(matcher.get_error())}")
        with self._lock:
            self._compiled[grammar] = (matcher, words)
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return matcher, words

    def state(self, grammar: Grammar) -> GrammarState:
        """A fresh matcher for one sequence (a copy of the compiled one) with the first mask computed at compile
        time, so the decoding thread never computes it again (a pathological pattern's took 0.3 s of the worker);
        GrammarError if it does not compile."""
        compiled, first_words = self._compile(grammar)
        lltok = self.ll_tokenizer()
        return GrammarState(compiled.deep_copy(), lltok.vocab_size, int(lltok.eos_token), self.leads(),
                            first_words=first_words)

    def check(self, grammar: Grammar, token_ids: Sequence[int]) -> tuple[bool, bool]:
        """(whether these generated tokens form a complete match, whether the grammar allows nothing more);
        an EOS at the end is not part of the match."""
        state = self.state(grammar)
        ids = list(token_ids)
        if ids and ids[-1] == state.eos:
            ids.pop()
        ok = state.matcher.try_consume_tokens(ids) == len(ids)
        return ok and state.matcher.is_accepting(), ok and state.matcher.is_stopped()


class GrammarState:
    """One sequence's grammar matcher: the mask of allowed next tokens, and the tokens chosen so far."""

    def __init__(self, matcher, tokenizer_vocab: int, eos: int, leads: TokenLeads | None = None,
                 first_words: torch.Tensor | None = None) -> None:
        """`first_words`: the mask of a matcher that has consumed nothing, as computed when it compiled (read-only)."""
        self.matcher = matcher
        self._first_words = first_words  # used for the first step, then dropped
        self.eos = eos
        self.leads = leads
        self.scan = StringScan()
        self.closing = False  # once the budget is tight, every later step closes
        self._words = torch.full(((tokenizer_vocab + 31) // 32,), -1, dtype=torch.int32)
        self._estimate = 0  # tokens a closing walk needed at the last check
        self._since_check = RECHECK_EVERY  # check at the first step
        self._was_satisfied = False  # whether the last step's text was a complete match
        self._ending = False  # complete, and too few tokens left to complete anything longer: only EOS

    @property
    def satisfied(self) -> bool:
        """Whether the text so far is a complete match (ending here is allowed)."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> str:
        """The matcher's error message, empty when there is none."""
        return self.matcher.get_error()

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete and allows no further token (only ending)."""
        return self.matcher.is_stopped()

    def allowed(self, width: int, matcher=None) -> np.ndarray:
        """(width,) bool over the logits: the tokens the grammar (or `matcher`, a copy of it) allows next (only
        EOS once it is complete); logits wider than the tokenizer's vocabulary (padding rows) are never allowed."""
        if self._first_words is not None and matcher is None:  # nothing consumed yet: the compile-time mask
            self._words.copy_(self._first_words)
            self._first_words = None
        else:
            (self.matcher if matcher is None else matcher).unsafe_compute_mask_ptr(self._words.data_ptr(),
                                                                                  self._words.numel() * 4)
        # bit i of 32-bit word j is token 32j + i: the words' little-endian bytes unpacked low bit first
        bits = np.unpackbits(self._words.numpy().view(np.uint8), bitorder="little").view(np.bool_)
        out = np.zeros(width, dtype=np.bool_)
        n = min(width, bits.size)
        out[:n] = bits[:n]
        if not out.any():  # a matcher in error: only ending is left (the caller reports the text as unsatisfied)
            out[self.eos] = True
        return out

    def _closing(self, allowed: np.ndarray, scan: StringScan) -> np.ndarray:
        """The allowed tokens that close most directly, given where the text is (see QUOTE, BRACKET)."""
        n = min(allowed.size, self.leads.leads.size)
        leads = self.leads.leads[:n]
        if scan.escaped:
            return allowed
        order = (QUOTE,) if scan.in_string else (BRACKET, QUOTE)
        for lead in order:
            chosen = np.zeros_like(allowed)
            chosen[:n] = allowed[:n] & (leads == lead)
            if chosen.any():
                return chosen
        return allowed

    def steps_to_complete(self, limit: int, width: int, matcher=None) -> int:
        """Tokens a closing walk (the shortest of the tokens that close most directly) needs until the text is a
        complete match; `limit + 1` when it needs more. Runs on copies: the matcher itself does not move."""
        walk = (self.matcher if matcher is None else matcher).deep_copy()
        scan = StringScan(self.scan.in_string, self.scan.escaped)
        for steps in range(limit + 1):
            if walk.is_accepting():
                return steps
            if walk.is_error():
                break
            token_id = self._shortest(self._closing(self.allowed(width, walk), scan))
            walk.consume_token(token_id)
            scan.push(self.leads.texts[token_id])
        return limit + 1

    def steps_to_continue(self, limit: int, width: int) -> int:
        """From a complete match: tokens the shortest continuation (one more token, then a closing walk) needs to
        be complete again (1 for free text; a whole call for parallel calls); 0 when only ending is allowed."""
        allowed = self.allowed(width)
        allowed[self.eos] = False
        if not allowed[: self.leads.lengths.size].any():
            return 0
        walk = self.matcher.deep_copy()
        walk.consume_token(self._shortest(allowed))
        return 1 + self.steps_to_complete(limit, width, walk)

    def _shortest(self, candidates: np.ndarray) -> int:
        """The candidate token with the shortest text."""
        candidates = candidates[: self.leads.lengths.size]
        return int(np.argmin(np.where(candidates, self.leads.lengths[: candidates.size], np.iinfo(np.int32).max)))

    def update_closing(self, tokens_left: int, width: int) -> bool:
        """Whether this step must close: the text is not yet complete and the tokens left barely cover a closing
        walk. Estimated every RECHECK_EVERY steps, at every step once the budget nears the estimate, and at once
        when the text becomes or stops being a complete match. A complete match that could only continue into text the budget
        cannot complete (another parallel call) ends here (`_ending`: only EOS)."""
        if self.closing or self.leads is None:
            return self.closing
        satisfied = self.satisfied
        if satisfied != self._was_satisfied:  # a unit ended, or another began: estimate now, not steps later
            self._since_check, self._was_satisfied = RECHECK_EVERY, satisfied
        self._since_check += 1
        if self._since_check >= RECHECK_EVERY or tokens_left <= self._estimate + 2 * CLOSE_MARGIN:
            walk = self.steps_to_continue if satisfied else self.steps_to_complete
            self._estimate = walk(tokens_left, width)
            self._since_check = 0
        if satisfied:
            # free text continues one token at a time (never cut short); a longer unit needs its closing margin
            self._ending = tokens_left < self._estimate + (CLOSE_MARGIN if self._estimate > 1 else 0)
            return False
        self.closing = tokens_left <= self._estimate + CLOSE_MARGIN
        return self.closing

    def mask(self, logits: torch.Tensor, tokens_left: int | None = None) -> torch.Tensor:
        """A copy of the (vocab,) logits with every token the grammar forbids at -inf; given `tokens_left` (the
        budget), only closing tokens once it is tight.

        In numpy on purpose: these ops are ~50 us single-threaded, while torch splits a 49k-element op over its
        intra-op threads and, on a loaded CPU, waits ms for a descheduled one (measured 12-36 ms per op)."""
        values = logits.detach().to("cpu", torch.float32).numpy().copy()
        width = values.shape[-1]
        closing = tokens_left is not None and self.update_closing(tokens_left, width)
        allowed = self.allowed(width)
        if closing:
            allowed = self._closing(allowed, self.scan)
        elif self._ending:
            allowed = np.zeros_like(allowed)
            allowed[self.eos] = True
        np.putmask(values, ~allowed, -np.inf)
        return torch.from_numpy(values).to(logits.device)

    def consume(self, token_id: int) -> None:
        """Advance the matcher past the chosen token (EOS ends the text; it is not part of the match)."""
        self._first_words = None  # the matcher moves on: its masks are computed from here
        if token_id != self.eos:
            self.matcher.consume_token(token_id)
            if self.leads is not None and token_id < len(self.leads.texts):
                self.scan.push(self.leads.texts[token_id])
