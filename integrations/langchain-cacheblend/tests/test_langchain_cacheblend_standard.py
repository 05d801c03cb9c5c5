"""LangChain's standard suites (langchain-tests) for ChatCacheBlend and ChunkIdRetriever, on the real model.

Every skip comes from a capability property below, each saying why the model cannot do it.
"""

from __future__ import annotations

from langchain_cacheblend_testing import LocalEmbeddings, qwen_engine, shared_engine  # first: sets the offline environment
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_cacheblend import ChatCacheBlend, ChunkIdRetriever

pytestmark = pytest.mark.model

MAX_TOKENS = 48  # room for a tool call or a short structured answer, still fast on a CPU


class _Capabilities:
    """What SmolLM2-135M-Instruct behind CacheBlend can and cannot do, for both suites.

    Tool calling, tool choice and structured output are left at the suites' defaults (on): they run on the
    engine's constrained decoding."""

    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": shared_engine()}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # the suites' standard params (timeout, max_retries; api_key in the unit suite) over a smaller budget
        return {**super().standard_chat_model_params, "max_tokens": MAX_TOKENS}

    @property
    def supports_json_mode(self) -> bool:
        return True  # response_format={"type": "json_object"}: constrained to one JSON object

    @property
    def supports_image_inputs(self) -> bool:
        return False  # a text-only model; image blocks are rejected with a ConfigError

    @property
    def supports_image_urls(self) -> bool:
        return False  # a text-only model

    @property
    def supports_pdf_inputs(self) -> bool:
        return False  # a text-only model

    @property
    def supports_audio_inputs(self) -> bool:
        return False  # a text-only model

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine holds one loaded model; a per-call `model` cannot switch it

    @property
    def returns_usage_metadata(self) -> bool:
        return True  # input/output/total tokens, cache_read = prompt tokens whose KV came from the store

    # Left at the suites' defaults, each skipping one test: init_from_env_params (a local model reads no
    # environment variables), is_lc_serializable False (the engine holds a loaded model: nothing to serialize),
    # enable_vcr_tests False (no HTTP traffic to record), supports_anthropic_inputs False (text-only messages).


# Failures of the integration suite with the default flags (measured with max_tokens=48 on SmolLM2-135M), each
# for a reason of this small model; xfail, not skip, so a fix shows as XPASS. (Structured output and tool calls
# whose free-text fields SmolLM2 repeats until max_tokens pass: constrained decoding closes within the budget.)
KNOWN_FAILURES = {
    # the tutorial's agent leaves the first call to the model: P("<" as its first token) = 0.004 under the tools'
    # system text (0.013 under SmolLM2's own function-calling prompt); "The" = 0.20
    "test_agent_loop": "with tool_choice auto SmolLM2-135M answers in plain text instead of calling get_weather",
}


@pytest.fixture(autouse=True)
def _known_failures(request: pytest.FixtureRequest) -> None:
    reason = KNOWN_FAILURES.get(request.node.originalname)
    if reason and request.cls is TestChatCacheBlendIntegration:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False))


class TestChatCacheBlendUnit(_Capabilities, ChatModelUnitTests):
    """ChatModelUnitTests."""


class TestChatCacheBlendIntegration(_Capabilities, ChatModelIntegrationTests):
    """ChatModelIntegrationTests."""


class TestChatCacheBlendQwenIntegration(_Capabilities, ChatModelIntegrationTests):
    """ChatModelIntegrationTests on the packaged model that calls tools, every default capability on and no xfail:
    Qwen2.5-Coder-0.5B-Instruct, its chat template's own tool format."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": qwen_engine()}


TEXTS = ["Honeybees have five eyes: two compound eyes and three ocelli.",
         "A queen develops in sixteen days on royal jelly.",
         "Worker bees secrete wax from glands under the abdomen.",
         "Bees communicate the direction of food with the waggle dance.",
         "In winter bees cluster and shiver to keep warm."]


class TestChunkIdRetrieverIntegration(RetrieversIntegrationTests):
    """RetrieversIntegrationTests over a retriever whose own k (4) differs from the one asked for."""

    @property
    def retriever_constructor(self) -> type[ChunkIdRetriever]:
        return ChunkIdRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        store = InMemoryVectorStore(LocalEmbeddings())
        store.add_documents([Document(page_content=t) for t in TEXTS])
        return {"base": store.as_retriever()}

    @property
    def retriever_query_example(self) -> str:
        return "How many eyes does a bee have?"
