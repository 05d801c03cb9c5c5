"""Constrained decoding (decode.grammar): every step's logits are masked by llguidance, on every decode path."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ConfigError, Grammar, GrammarError
from cacheblend_rag.decode.generate import SamplingOptions

from conftest import tiny_model

# Bounded strings, numbers and arrays: a random-weight model never closes an unbounded string on its own
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["person", "robot"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON.", "Who built the first robot?", "Give me a record for Ada, aged 36."]
MAX = 160  # enough for the schema's longest answer


@pytest.fixture(scope="module")
def engine(tokenizer) -> CacheBlendEngine:
    """A random-weight llama with the real SmolLM2 tokenizer (so the grammar sees a real 49k vocabulary)."""
    return CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_greedy_output_parses_and_validates(engine):
    for prompt in PROMPTS:
        out = engine.generate_prompt([{"role": "user", "content": prompt}], max_new_tokens=MAX, grammar=SCHEMA)
        _valid(out.text)
        assert out.finish_reason == "stop" and out.grammar_satisfied is True


def test_sampled_output_parses_and_validates(engine):
    texts = set()
    for seed in range(6):
        out = engine.generate_prompt(PROMPTS[0], max_new_tokens=MAX, temperature=1.5, seed=seed,
                                     grammar=Grammar.json_schema(SCHEMA))
        _valid(out.text)
        texts.add(out.text)
    assert len(texts) > 1  # sampling still varies within the grammar


def test_streamed_pieces_are_the_generated_text(engine):
    stats: dict = {}
    options = dict(max_new_tokens=MAX, temperature=0.8, seed=3, grammar=SCHEMA)
    text = "".join(engine.stream_prompt(PROMPTS[1], stats=stats, **options))
    assert text.strip() == engine.generate_prompt(PROMPTS[1], **options).text
    _valid(text)
    assert stats["finish_reason"] == "stop" and stats["grammar_satisfied"] is True


def test_batched_advance_masks_each_sequence_with_its_own_grammar(engine):
    other = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    a, _ = engine.start_prompt(PROMPTS[0], max_new_tokens=MAX, grammar=SCHEMA)
    b, _ = engine.start_prompt(PROMPTS[2], max_new_tokens=MAX, temperature=1.0, seed=1, grammar=other)
    texts = {id(a): a.first_piece, id(b): b.first_piece}
    while not (a.finished and b.finished):
        live = [s for s in (a, b) if not s.finished]
        for seq, piece in zip(live, engine.advance(live)):
            texts[id(seq)] += piece
    _valid(texts[id(a)])
    jsonschema.validate(json.loads(texts[id(b)]), other)
    assert a.grammar_satisfied and b.grammar_satisfied


# Unbounded strings and arrays: a random-weight model never closes them on its own, so only closing within the
# budget makes its answers complete. Closed objects (as structured output and tool calls make them): in an open
# one, the keys a closing step can choose are free strings.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
                   "required": ["name", "born"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "author", "tags", "summary"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("budget", [32, 48, 96])
def test_unbounded_fields_close_within_max_tokens(engine, budget):
    for seed, prompt in enumerate(PROMPTS):
        out = engine.generate_prompt(prompt, max_new_tokens=budget, grammar=OPEN_SCHEMA, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(out.text), OPEN_SCHEMA)
        assert out.finish_reason == "stop" and out.grammar_satisfied is True
        assert len(out.token_ids) <= budget


def test_closing_starts_only_when_the_budget_is_tight(engine):
    # with room to spare, the first string runs on past what a closing walk needs (the model is never hurried)
    out = engine.generate_prompt(PROMPTS[0], max_new_tokens=64, grammar=OPEN_SCHEMA)
    assert len(json.loads(out.text)["title"]) > 10
    assert len(out.token_ids) > 40


def test_json_object_and_lark_grammars(engine):
    out = engine.generate_prompt(PROMPTS[0], max_new_tokens=24, grammar=Grammar.json_object())
    assert isinstance(json.loads(out.text), dict) and out.grammar_satisfied
    out = engine.generate_prompt(PROMPTS[0], max_new_tokens=8, grammar=Grammar.lark('start: "yes" | "no"'))
    assert out.text in ("yes", "no") and out.grammar_satisfied


def test_a_grammar_cut_by_max_tokens_ends_with_length_and_unsatisfied(engine):
    out = engine.generate_prompt(PROMPTS[0], max_new_tokens=3, grammar=SCHEMA)
    assert out.finish_reason == "length" and out.grammar_satisfied is False
    assert len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_no_grammar_leaves_decoding_unchanged(engine):
    free = engine.generate_prompt(PROMPTS[0], max_new_tokens=6)
    assert free.grammar_satisfied is None and free.finish_reason in ("stop", "length")


def test_bad_grammars_and_the_reference_decoder_are_config_errors(engine, tokenizer):
    with pytest.raises(GrammarError, match="does not compile"):
        engine.generate_prompt(PROMPTS[0], max_new_tokens=4, grammar=Grammar.lark("start: undefined_rule"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema("{not json")
    with pytest.raises(ConfigError, match="grammar must be"):
        SamplingOptions(grammar="a string")
    hf = CacheBlendEngine(engine.model, tokenizer, decoder="hf")
    with pytest.raises(ConfigError, match='needs decoder="kv"'):
        hf.generate_prompt(PROMPTS[0], max_new_tokens=4, grammar=SCHEMA)


def test_a_grammar_that_fails_while_decoding_ends_with_an_error_never_a_silent_stop(engine, tokenizer):
    from cacheblend_rag.decode.grammar import GrammarDecodeError
    from cacheblend_rag.decode.kv_decode import KVDecoder
    from cacheblend_rag.serve.runner import ActiveRequest
    from cacheblend_rag.serve.scheduler import Failed

    blown = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
             "required": ["a"]}
    with pytest.raises(GrammarDecodeError, match="failed while decoding, after 0 tokens"):  # before: text "", "stop"
        engine.generate_prompt(PROMPTS[0], max_new_tokens=8, grammar=blown)
    # "bee", then the model's choice: "s" ends it, "b" opens a recursion without end (past the parser's limits)
    grammar = Grammar.lark('start: "bee" ("s" | "b" x)\nx: "(" x ")"')
    bee, b = tokenizer.encode("bee"), tokenizer.encode("b")
    assert len(bee) == 1 and len(b) == 1
    pre = engine.prefill_prompt(PROMPTS[0], store_holes=False)
    seq = KVDecoder(engine.adapter, tokenizer).sequence(pre.token_ids, pre.keys, pre.values,
                                                        SamplingOptions(8, grammar=grammar))
    assert seq.accept(bee[0]) == "bee" and not seq.finished
    assert seq.accept(b[0]) == "b" and not seq.finished
    # the parser gives up computing the next mask, which then allows only EOS: before, a "stop" with text "beeb"
    assert seq.accept(seq.choose(torch.zeros(len(tokenizer)))) == "" and seq.finish_reason == "error"
    assert "after 2 tokens" in seq.error
    failed = ActiveRequest(None, seq, {}).done()  # what the server's batch hands its request: an error event
    assert isinstance(failed, Failed) and isinstance(failed.error, GrammarDecodeError)


def test_a_stop_string_inside_a_constrained_answer_is_ignored_until_the_grammar_can_end(engine):
    schema = {"type": "object", "properties": {"word": {"enum": ["bee, wasp"]}}, "required": ["word"],
              "additionalProperties": False}
    for stop in ([","], ['"}'], ["wasp"]):  # before: cut into '{"word": "bee' and finish_reason "stop"
        out = engine.generate_prompt(PROMPTS[0], max_new_tokens=24, grammar=schema, stop=stop)
        assert json.loads(out.text) == {"word": "bee, wasp"}, (stop, out.text)
        assert out.grammar_satisfied is True and out.finish_reason == "stop"
        seq, _ = engine.start_prompt(PROMPTS[0], max_new_tokens=24, grammar=schema, stop=stop)  # the server's path
        pieces = [seq.first_piece]
        while not seq.finished:
            pieces += engine.advance([seq])
        assert json.loads("".join(pieces)) == {"word": "bee, wasp"}, (stop, pieces)
    free = engine.generate_prompt(PROMPTS[0], max_new_tokens=24, grammar=Grammar.lark('start: "yes. " /[a-z ]+/'),
                                  stop=["."])  # cannot end before "yes. ": the stop there is part of the answer
    assert free.text.startswith("yes.") and free.grammar_satisfied


def test_warm_up_does_the_one_time_set_up_once_and_compiles_nothing_kept(tokenizer, monkeypatch):
    """`GrammarCompiler.warm_up` builds the tokenizer conversion and the token leads ahead of a first grammar (#41):
    on a background thread, started once; a grammar asked for meanwhile waits for it instead of building it twice;
    the warm-up's own schema is neither kept nor counted."""
    import threading
    import time

    import llguidance.hf

    from cacheblend_rag.decode.grammar import GrammarCompiler

    built = []
    original = llguidance.hf.from_tokenizer

    def slow_from_tokenizer(*args, **kwargs):
        built.append(threading.current_thread().name)
        time.sleep(0.3)  # a window in which the first grammar arrives
        return original(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", slow_from_tokenizer)
    compiler = GrammarCompiler(tokenizer)
    assert not compiler.warm
    thread = compiler.warm_up()
    assert thread is not None and thread.daemon and compiler.warm_up() is thread  # started once
    compiler.state(Grammar.json_schema({"type": "integer"}))  # meanwhile: waits for the conversion under way
    thread.join(timeout=60)
    assert compiler.warm and built == ["cacheblend-grammar-warm"]
    assert compiler.num_compiled == 1 and len(compiler._compiled) == 1  # only the real grammar
    assert compiler.warm_up() is None  # nothing left to do

    cold = GrammarCompiler(tokenizer)
    assert cold.warm_up(background=False) is None and cold.warm and cold.num_compiled == 0


def test_the_first_mask_is_computed_once_at_compile_time_not_again_for_each_sequence(tokenizer):
    """#50: a pattern whose lexer blows up (`^(a{1000}){1000}$`) cost its first mask twice: at admission (compile)
    and again on the worker's copy (0.31 s of the worker per request). The copy now starts from the compiled mask."""
    import time

    import numpy as np

    from cacheblend_rag.decode.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer)
    compiler.warm_up(background=False)
    blown = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "string",
                                                                       "pattern": "^(a{1000}){1000}$"}},
                                 "required": ["a"]})
    started = time.thread_time()
    compiler.compile(blown)
    compile_s = time.thread_time() - started
    state = compiler.state(blown)
    width = len(tokenizer)
    started = time.thread_time()
    first = state.allowed(width)
    first_s = time.thread_time() - started  # before: ~0.15-0.3 s of CPU, a fifth to a half of compile_s
    assert first_s < compile_s / 10, (first_s, compile_s)
    fresh = compiler.state(blown)
    computed = fresh.allowed(width, fresh.matcher.deep_copy())  # the same mask, computed on a copy
    assert np.array_equal(first, computed) and first.sum() >= 1
    # after the first token the masks are the matcher's own again
    token = int(np.flatnonzero(first)[0])
    state.consume(token)
    fresh.consume(token)
    assert state.error == fresh.error
