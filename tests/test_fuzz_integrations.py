"""The partner packages' keyword arguments under a property-based fuzzer (issue #53, the Python API surface):
LangChain's `ChatCacheBlend.invoke` / `CacheBlendLLM.invoke` and LlamaIndex's `CacheBlendLLM.complete` / `.chat`
with any per-call keywords (the settings, the policies' options, tool-calling keywords, names nobody accepts),
over a tiny random-weight Llama and the real tokenizer.

The property is the API fuzzer's: an answer, or one of the package's errors (`CacheBlendError`, a `ValueError`)
with a message; never a TypeError, AttributeError, KeyError or any other internal error. Profiles: tests/fuzzing.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cacheblend_rag.fuse.policies import POLICIES

from fuzzing import fuzz
from test_fuzz_api import ANY, OPTION_NAMES, PLAUSIBLE, refused_cleanly

pytest.importorskip("langchain_cacheblend")
pytest.importorskip("llama_index.llms.cacheblend")

QUESTION = "Which rivers meet in Lyon?"
SETTINGS = ["method", "recompute_ratio", "temperature", "top_p", "seed", "stop"]
TOOLING = ["tools", "tool_choice", "parallel_tool_calls", "response_format", "strict"]  # LangChain's chat model
LLAMA_INDEX = ["do_sample", "chunks", "question", "grammar", "tools", "formatted"]  # LlamaIndex's CacheBlendLLM
# a token budget: mostly a few tokens (never a long decode), now and then one no model takes
TOKENS = st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(-3, 0), st.sampled_from([2**63, 1.5, "4", None, True]))


@st.composite
def call_keywords(draw, extra: list[str]) -> dict:
    """Mostly plausible calls (a few settings or options of any value), now and then a name nobody accepts or both
    spellings of the token budget."""
    names = SETTINGS + OPTION_NAMES + extra
    kw = {}
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        kw[name] = draw(st.sampled_from(sorted(POLICIES)) | ANY if name == "method" else PLAUSIBLE | ANY)
    budget = draw(st.sampled_from([(), ("max_tokens",), ("max_new_tokens",), ("max_tokens", "max_new_tokens")]))
    kw.update({name: draw(TOKENS) for name in budget})
    if draw(st.integers(0, 9)) == 9:  # (not 0: Hypothesis leans towards the simplest value)
        kw[draw(st.sampled_from(["bogus", "model", "n"]))] = draw(ANY)
    return kw


@pytest.fixture(scope="module")
def engine(tokenizer):
    from cacheblend_rag import CacheBlendEngine
    from conftest import tiny_model

    return CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)


@fuzz(quick_examples=80, surface="Python API")
@given(kw=call_keywords(TOOLING), chat=st.booleans())
def test_fuzzed_langchain_call_keywords_answer_or_raise_a_clear_error(engine, kw, chat):
    from langchain_core.messages import AIMessage
    from langchain_cacheblend import CacheBlendLLM, ChatCacheBlend

    model = ChatCacheBlend(engine=engine, max_tokens=2) if chat else CacheBlendLLM(engine=engine, max_new_tokens=2)
    out = refused_cleanly(lambda: model.invoke(QUESTION, **kw))
    assert out is None or isinstance(out, AIMessage if chat else str)


@fuzz(quick_examples=80, surface="Python API")
@given(kw=call_keywords(LLAMA_INDEX), chat=st.booleans())
def test_fuzzed_llama_index_call_keywords_answer_or_raise_a_clear_error(engine, kw, chat):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.cacheblend import CacheBlendLLM

    llm = CacheBlendLLM(engine=engine, max_new_tokens=2)
    if chat:
        out = refused_cleanly(lambda: llm.chat([ChatMessage(role="user", content=QUESTION)], **kw))
        assert out is None or isinstance(out.message.content, str)
    else:
        out = refused_cleanly(lambda: llm.complete(QUESTION, **kw))
        assert out is None or isinstance(out.text, str)


# ---- the defects the fuzzer found, as regression tests -----------------------------------------------------------


@pytest.mark.parametrize("temperature", ["auto", [], object()])
def test_a_call_temperature_that_is_not_a_number_is_a_config_error_on_both(engine, temperature):
    """LangChain's call settings ran float() on it (ValueError, TypeError); LlamaIndex's compared it with 0."""
    from cacheblend_rag.errors import ConfigError
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    with pytest.raises(ConfigError, match="temperature"):
        ChatCacheBlend(engine=engine, max_tokens=2).invoke(QUESTION, temperature=temperature)
    with pytest.raises(ConfigError, match="temperature"):
        CacheBlendLLM(engine=engine, max_new_tokens=2).complete(QUESTION, temperature=temperature)
    with pytest.raises(ConfigError, match="do_sample must be True or False"):
        CacheBlendLLM(engine=engine, max_new_tokens=2).complete(QUESTION, do_sample="yes")


@pytest.mark.parametrize("temperature", [2**64, 10**400])
def test_a_call_temperature_too_large_for_a_float_decodes_or_is_a_config_error_on_both(engine, temperature):
    """make fuzz: an int temperature past torch's int64 scalars (2**64) was an OverflowError where the logits were
    divided by it; one past float64 (10**400) too. It is taken as a float, or refused as not finite."""
    from cacheblend_rag.errors import ConfigError
    from langchain_cacheblend import CacheBlendLLM as LangChainLLM
    from llama_index.llms.cacheblend import CacheBlendLLM

    finite = temperature < 2**1024
    for call in (lambda: LangChainLLM(engine=engine, max_tokens=2).invoke(QUESTION, temperature=temperature),
                 lambda: CacheBlendLLM(engine=engine, max_new_tokens=2).complete(QUESTION, temperature=temperature)):
        if finite:
            assert str(call())
        else:
            with pytest.raises(ConfigError, match="temperature must be a finite number"):
                call()


@pytest.mark.parametrize("tools", [True, 3, object(), {"type": "function"}])
def test_call_tools_that_are_not_tool_specs_are_a_config_error_on_both(engine, tools):
    """A call's own tools= went to the tool turn unchecked: TypeError ('bool' object is not iterable)."""
    from cacheblend_rag.errors import ConfigError
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.cacheblend import CacheBlendLLM

    with pytest.raises(ConfigError, match="tools must be a list"):
        ChatCacheBlend(engine=engine, max_tokens=2).invoke(QUESTION, tools=tools)
    with pytest.raises(ConfigError, match="tools must be a list"):
        CacheBlendLLM(engine=engine, max_new_tokens=2).chat([ChatMessage(role="user", content=QUESTION)], tools=tools)
