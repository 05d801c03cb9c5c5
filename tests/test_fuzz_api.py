"""The Python API under a property-based fuzzer (issue #53): `Request.of` with any keywords, the policies' options,
the engine's own options and the store specs (the CLI's: tests/test_fuzz_cli.py).

The property: a value the package takes builds what was asked; any other is refused with one of the package's
errors (`CacheBlendError`: `ConfigError`, `ChunkError`, ...) whose message is not empty — never a TypeError,
KeyError, OverflowError or any other internal error. Profiles: tests/fuzzing.py.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cacheblend_rag import Request
from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.fuse.policies import POLICIES, make_policy

from fuzzing import fuzz

# a value of any type and range: what a caller could pass by mistake
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(2**63, 2**200), st.floats(allow_nan=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.sampled_from(["auto", "relevance", "cacheblend", "", "0.5", "neighbors", "attention"]), st.binary(max_size=4),
    st.lists(st.integers(-3, 40), max_size=4), st.tuples(st.integers(-3, 40)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.just(object()), st.just(Request),
)
PLAUSIBLE = st.one_of(st.floats(-0.5, 1.5), st.integers(-2, 40), st.booleans(),
                      st.lists(st.integers(-1, 5), max_size=3),
                      st.sampled_from(["auto", "relevance", "attention", "neighbors", "deviation"]))
OPTION_NAMES = sorted({f.name for cls in POLICIES.values() for f in dataclasses.fields(cls)} | {"bogus"})
SAMPLING_NAMES = ["max_new_tokens", "max_tokens", "temperature", "top_p", "stop", "seed", "grammar"]


def refused_cleanly(call) -> object:
    """What `call()` returns, or None when it raised one of the package's errors with a message."""
    try:
        return call()
    except CacheBlendError as e:
        assert str(e).strip(), repr(e)
        return None


@st.composite
def request_keywords(draw) -> dict:
    kw: dict = {}
    shape = draw(st.sampled_from(["chunks", "prompt", "chat", "anything"]))
    if shape == "chunks":
        kw["chunks"] = draw(st.one_of(st.lists(st.text(max_size=20), max_size=3), st.text(max_size=20), ANY))
        kw["question"] = draw(st.one_of(st.text(st.characters(exclude_categories=()), max_size=20), ANY))
    elif shape == "prompt":
        kw["prompt"] = draw(st.one_of(st.text(st.characters(exclude_categories=()), max_size=20), ANY))
    elif shape == "chat":
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]) | ANY,
                                         "content": st.text(max_size=10) | ANY},
                                        optional={"tool_calls": ANY | st.lists(ANY, max_size=2)})
        kw["prompt"] = draw(st.lists(message, max_size=3))
        if draw(st.booleans()):
            kw["tools"] = draw(st.one_of(ANY, st.lists(st.one_of(ANY, st.just(
                {"type": "function", "function": {"name": "f", "parameters": {}}})), max_size=2)))
    for name in draw(st.lists(st.sampled_from(["method", "recompute_ratio", "history", "template", "cache_salt",
                                               "calibrated_ratio", "sampling"]), max_size=3, unique=True)):
        kw[name] = draw(ANY | st.sampled_from(sorted(POLICIES)) if name == "method" else ANY)
    for name in draw(st.lists(st.sampled_from(SAMPLING_NAMES + OPTION_NAMES), max_size=3, unique=True)):
        kw[name] = draw(PLAUSIBLE | ANY)
    return kw


@fuzz(quick_examples=400, surface="Python API")
@given(kw=request_keywords())
def test_fuzzed_request_keywords_build_a_request_or_a_clear_error(kw):
    request = refused_cleanly(lambda: Request.of(**kw))
    assert request is None or isinstance(request, Request)


@fuzz(quick_examples=300, surface="Python API")
@given(method=st.sampled_from(sorted(POLICIES)) | ANY, ratio=st.floats(-1, 2) | ANY,
       options=st.dictionaries(st.sampled_from([n for n in OPTION_NAMES if n != "recompute_ratio"]), PLAUSIBLE | ANY,
                               max_size=3))
def test_fuzzed_policy_options_build_a_policy_or_a_clear_error(method, ratio, options):
    refused_cleanly(lambda: make_policy(method, ratio, **options))


@pytest.fixture(scope="module")
def tiny(tokenizer):
    from conftest import tiny_model

    return tiny_model("llama", len(tokenizer), num_hidden_layers=2), tokenizer


ENGINE_OPTIONS = {
    "lead_in": st.sampled_from(["prefix", "none", "bos"]) | ANY, "prefetch_depth": st.integers(-2, 4) | ANY,
    "quality_floor": st.floats(-1, 2) | ANY, "max_known_chunks": st.integers(-2, 10) | ANY,
    "kv_codec": st.sampled_from(["fp16", "int8", "cachegen", "auto"]) | ANY,
    "decoder": st.sampled_from(["kv", "hf"]) | ANY, "prefix_reuse": ANY,
    "calibrate": ANY.filter(lambda v: v is not True),  # True would run a calibration: seconds, not a check
    "model_name": ANY, "template": ANY,
    "kv_store": st.sampled_from(["memory", "memory?codec=int8", "memory?codec=nope", "disk:", "redis://",
                                 "redis://127.0.0.1:1/0?prefix=", "nope://x", "memory?codec="]) | ANY
    | st.lists(st.sampled_from(["memory", "memory?codec=int8", "bogus", ""]), max_size=3),
}


@pytest.mark.model
@fuzz(quick_examples=150, surface="Python API")
@given(options=st.fixed_dictionaries({}, optional=ENGINE_OPTIONS))
def test_fuzzed_engine_options_build_an_engine_or_a_clear_error(tiny, options):
    from cacheblend_rag import CacheBlendEngine

    model, tokenizer = tiny
    # a store spec naming a folder would write there: the fuzzer's own specs are tiers (or refused), never folders
    if isinstance(options.get("kv_store"), (str, bytes)) and not str(options["kv_store"]).startswith(
            ("memory", "redis", "nope", "disk:")):
        options["kv_store"] = None
    before = set(os.listdir())
    refused_cleanly(lambda: CacheBlendEngine(model, tokenizer, **options))
    assert set(os.listdir()) == before, f"{options.get('kv_store')!r} wrote {set(os.listdir()) - before}"


# ---- what the fuzzer found (#53), kept as examples -------------------------------------------------------------


def test_a_one_tier_store_spec_is_that_tier_never_a_folder_of_its_name(tmp_path, monkeypatch):
    from cacheblend_rag.errors import ConfigError
    from cacheblend_rag.store import DiskStore, MemoryStore, TieredStore, open_store

    monkeypatch.chdir(tmp_path)
    # "memory", "disk:" and "nope://x" each made a folder of that name in the working folder (found by the long
    # profile: three empty folders at the repository root)
    assert isinstance(open_store("memory"), MemoryStore)
    assert open_store("memory?codec=int8").codec.name == "int8"
    tiered = open_store(f"disk:{tmp_path / 'kv'}")
    assert isinstance(tiered, TieredStore) and isinstance(tiered.disk, DiskStore)
    assert tiered.disk.root == tmp_path / "kv"
    with pytest.raises(ConfigError, match="needs its folder"):
        open_store("disk:")
    with pytest.raises(ConfigError, match="unknown KV store URL 'nope://x'"):
        open_store("nope://x")
    assert sorted(os.listdir(tmp_path)) == ["kv"]


def test_wrong_types_of_request_and_engine_options_are_config_errors(tiny):
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.errors import ConfigError

    model, tokenizer = tiny
    # each raised an internal error: TypeError (dataclasses.replace, tuple(), `<`) or AttributeError
    with pytest.raises(ConfigError, match="sampling must be SamplingOptions"):
        Request.of(["bee"], "bee?", sampling=True)
    with pytest.raises(ConfigError, match="chunks must be a list"):  # found by the long profile
        Request.of(None, "0")
    with pytest.raises(ConfigError, match="tools must be a list"):
        Request.of(prompt=[{"role": "user", "content": "hi"}], tools=False)
    with pytest.raises(ConfigError, match="template must be a PromptTemplate"):
        CacheBlendEngine(model, tokenizer, template=3)
    with pytest.raises(ConfigError, match="prefetch_depth must be an integer"):
        CacheBlendEngine(model, tokenizer, prefetch_depth="2")
    with pytest.raises(ConfigError, match="model_name must be a string"):  # found by the long profile
        CacheBlendEngine(model, tokenizer, model_name=[0])
