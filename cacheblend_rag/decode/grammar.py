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


class GrammarError(ConfigError):
    """A grammar or schema llguidance cannot compile."""


def _llguidance():
    """The llguidance module, or a ConfigError saying how to install it."""
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (registers the HF tokenizer bridge)
    except ImportError as e:  # a hard dependency, but name the fix if an environment lacks it
        raise ConfigError("constrained decoding needs llguidance: pip install 'llguidance>=1.9,<2'") from e
    return llguidance


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
        if self.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(self.source)
        return llg.LLMatcher.grammar_from_json_schema(with_json_options(json.loads(self.source)))


class GrammarCompiler:
    """Builds `GrammarState`s for one tokenizer; converts the tokenizer for llguidance once, on first use."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ll_tokenizer = None

    def ll_tokenizer(self):
        """The tokenizer as llguidance sees it (built once: ~0.5 s for a 49k vocabulary)."""
        if self._ll_tokenizer is None:
            llg = _llguidance()
            try:
                self._ll_tokenizer = llg.hf.from_tokenizer(self.tokenizer)
            except ValueError as e:
                raise ConfigError(f"constrained decoding needs a fast tokenizer (tokenizer.json): {e}") from e
        return self._ll_tokenizer

    def state(self, grammar: Grammar) -> GrammarState:
        """A fresh matcher for one sequence; GrammarError if the grammar does not compile."""
        llg = _llguidance()
        lltok = self.ll_tokenizer()
        serialized = grammar.serialized()
        error = llg.LLMatcher.validate_grammar(serialized, lltok)
        if error:
            raise GrammarError(f"the {grammar.kind} grammar does not compile: {error}")
        return GrammarState(llg.LLMatcher(lltok, serialized, log_level=0), lltok.vocab_size, int(lltok.eos_token))

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

    def __init__(self, matcher, tokenizer_vocab: int, eos: int) -> None:
        self.matcher = matcher
        self.eos = eos
        self._words = torch.full(((tokenizer_vocab + 31) // 32,), -1, dtype=torch.int32)

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

    def allowed(self, width: int) -> np.ndarray:
        """(width,) bool over the logits: the tokens the grammar allows next (only EOS once it is complete);
        logits wider than the tokenizer's vocabulary (padding rows) are never allowed."""
        self.matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        # bit i of 32-bit word j is token 32j + i: the words' little-endian bytes unpacked low bit first
        bits = np.unpackbits(self._words.numpy().view(np.uint8), bitorder="little").view(np.bool_)
        out = np.zeros(width, dtype=np.bool_)
        n = min(width, bits.size)
        out[:n] = bits[:n]
        if not out.any():  # a matcher in error: only ending is left (the caller reports the text as unsatisfied)
            out[self.eos] = True
        return out

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the (vocab,) logits with every token the grammar forbids at -inf.

        In numpy on purpose: these ops are ~50 us single-threaded, while torch splits a 49k-element op over its
        intra-op threads and, on a loaded CPU, waits ms for a descheduled one (measured 12-36 ms per op)."""
        values = logits.detach().to("cpu", torch.float32).numpy().copy()
        np.putmask(values, ~self.allowed(values.shape[-1]), -np.inf)
        return torch.from_numpy(values).to(logits.device)

    def consume(self, token_id: int) -> None:
        """Advance the matcher past the chosen token (EOS ends the text; it is not part of the match)."""
        if token_id != self.eos:
            self.matcher.consume_token(token_id)
