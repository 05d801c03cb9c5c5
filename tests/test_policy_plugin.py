"""A policy registered from outside the package reaches every surface with its options, no surface edited: the
engine, LangChain (ChatCacheBlend, CacheBlendLLM), LlamaIndex, the server's `cacheblend` field and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from cacheblend_rag import CacheBlendEngine, ConfigError
from cacheblend_rag.fuse.policies import POLICIES, FullReuse, register_policy
from cacheblend_rag.fuse.policy import Policy, RowSelection
from conftest import tiny_model

pytestmark = pytest.mark.model  # the tiny model borrows the real SmolLM2 tokenizer

TEXTS = ["The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
         "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two."]
QUESTION = "Where does the river Lune reach the sea?"


@dataclass(frozen=True)
class ReuseButFirst(Policy):
    """A plugin's policy: full reuse, but the first `extra` reused rows are recomputed in every layer."""

    extra: int = 0
    name: ClassVar[str] = "reuse_but_first"

    def place(self, cache, request):
        """What full reuse places."""
        return FullReuse().place(cache, request)

    def start(self, adapter, seq, placed):
        """Uncached rows, and the first `extra` reused ones."""
        active = ~seq.cached
        active[seq.reused.nonzero().squeeze(1)[: self.extra]] = True
        return RowSelection(active)


@pytest.fixture()
def plugin():
    """The policy registered for one test (and taken out of the registry after it)."""
    register_policy(ReuseButFirst)
    yield ReuseButFirst
    POLICIES.pop(ReuseButFirst.name)


@pytest.fixture(scope="module")
def engine(tokenizer):
    # no stored prefixes: each call must fuse the chunks again for its own policy to show
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, prefix_reuse=False)
    engine.ingest(TEXTS, show_progress=False)
    return engine


def _prompt() -> list[dict[str, str]]:
    return [{"role": "system", "content": "Context:\n" + "\n\n".join(TEXTS)}, {"role": "user", "content": QUESTION}]


def test_register_policy_refuses_a_clash_and_a_non_policy(plugin):
    @dataclass(frozen=True)
    class Other:
        name: ClassVar[str] = "reuse_but_first"

    with pytest.raises(ConfigError, match="already registered"):
        register_policy(Other)
    with pytest.raises(ConfigError, match="dataclass with a `name`"):
        register_policy(object)

    @dataclass(frozen=True)
    class Undeclared:  # place and start, but not the Policy base that declares what the prefill asks of it
        name: ClassVar[str] = "undeclared"

        def place(self, cache, request):
            return FullReuse().place(cache, request)

    with pytest.raises(ConfigError, match="must subclass cacheblend_rag.fuse.policy.Policy"):
        register_policy(Undeclared)
    assert "undeclared" not in POLICIES


def test_the_engine_takes_the_method_and_its_option(plugin, engine):
    for extra in (0, 3):
        out = engine.generate(TEXTS, QUESTION, method="reuse_but_first", extra=extra, max_new_tokens=1)
        assert out.stats["method"] == "reuse_but_first" and out.stats["num_recomputed"] == extra
    with pytest.raises(ConfigError, match="has no option 'check_layers'"):
        engine.generate(TEXTS, QUESTION, method="reuse_but_first", check_layers=(1,), max_new_tokens=1)


def test_langchain_takes_it_as_a_field_and_per_call(plugin, engine):
    from langchain_cacheblend import CacheBlendLLM, ChatCacheBlend

    chat = ChatCacheBlend(engine=engine, max_tokens=1, method="reuse_but_first", policy_options={"extra": 3})
    assert chat.invoke(_prompt()).response_metadata["cacheblend"]["num_recomputed"] == 3
    assert chat.invoke(_prompt(), extra=2).response_metadata["cacheblend"]["num_recomputed"] == 2
    llm = CacheBlendLLM(engine=engine, max_new_tokens=1, method="reuse_but_first", policy_options={"extra": 1})
    result = llm.generate(["\n\n".join(TEXTS) + "\n\n" + QUESTION])
    assert result.generations[0][0].generation_info["num_recomputed"] == 1
    with pytest.raises(ValueError, match="has no option 'alpha'"):  # pydantic's ValidationError, naming it
        ChatCacheBlend(engine=engine, method="reuse_but_first", policy_options={"alpha": 0.5})


def test_llama_index_takes_it(plugin, engine):
    from llama_index.core.base.llms.types import ChatMessage

    from llama_index.llms.cacheblend import CacheBlendLLM

    llm = CacheBlendLLM(engine=engine, max_new_tokens=1, method="reuse_but_first", policy_options={"extra": 2})
    response = llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in _prompt()])
    assert response.additional_kwargs["num_recomputed"] == 2


def test_the_server_takes_it_in_its_cacheblend_field(plugin, engine):
    from fastapi.testclient import TestClient

    from cacheblend_rag.serve.app import ServeConfig, create_app

    with TestClient(create_app(engine, ServeConfig(model_name="tiny"))) as client:
        body = {"model": "tiny", "messages": _prompt(), "max_tokens": 1,
                "cacheblend": {"method": "reuse_but_first", "extra": 3}}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["cacheblend"]["recomputed_tokens"] == 3
        r = client.post("/v1/chat/completions", json={**body, "cacheblend": {"method": "reuse_but_first", "alpha": 1}})
        assert r.status_code == 400 and "has no option 'alpha'" in r.json()["error"]["message"]


def test_the_cli_takes_it(plugin):
    from cacheblend_rag.cli import build_parser, policy_option

    args = build_parser().parse_args(["ask", "q?", "--method", "reuse_but_first", "--option", "extra=3",
                                      "--option", "check_layers=[1,2]"])
    assert args.method == "reuse_but_first" and dict(args.option) == {"extra": 3, "check_layers": (1, 2)}
    assert policy_option("deviation=kv") == ("deviation", "kv")
