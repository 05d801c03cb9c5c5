"""ChatCacheBlend and CacheBlendLLM in the chains users already write, on the real model and real Chroma."""

from __future__ import annotations

from langchain_cacheblend_testing import embeddings, engine  # noqa: F401 (fixtures; first: sets the offline environment)
import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.vectorstores import InMemoryVectorStore

from cacheblend_rag import CacheBlendEngine, ConfigError, chunk_id
from cacheblend_rag.ingest import ingest_paths
from cacheblend_rag.retrieval.chroma import ChromaChunkStore
from langchain_cacheblend import (
    CacheBlendLLM,
    ChatCacheBlend,
    ChromaRetriever,
    ChunkIdRetriever,
    StatsCallbackHandler,
    to_chat_messages,
)


pytestmark = pytest.mark.model

DATA = Path(__file__).resolve().parents[3] / "examples" / "data"
QUESTION = "How many eyes does a honeybee have?"


@pytest.fixture(scope="module")
def chroma(engine, tmp_path_factory):
    """examples/data in a real Chroma collection, their KV warm in the engine."""
    store = ChromaChunkStore(tmp_path_factory.mktemp("lc-home"), "langchain_cacheblend_tests")
    ingest_paths([DATA], engine, store, show_progress=False)
    return store


def format_docs(docs: list[Document]) -> str:
    """The tutorial's own formatting: passages joined by blank lines."""
    return "\n\n".join(d.page_content for d in docs)


@pytest.fixture(scope="module")
def tutorial_chain(chroma, engine):
    """LangChain's RAG tutorial chain with the user's own system prompt; only the model is ours."""
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                   "context to answer the question. Keep the answer short.\n\n{context}"),
        ("human", "{question}"),
    ])
    retriever = ChromaRetriever(store=chroma, k=3)
    return {"context": retriever | format_docs, "question": lambda q: q} | prompt | ChatCacheBlend(
        engine=engine, max_tokens=4)


def test_tutorial_chain_answers_with_stats(tutorial_chain):
    reply = tutorial_chain.invoke(QUESTION)
    assert isinstance(reply, AIMessage) and reply.content
    stats = reply.response_metadata["cacheblend"]
    for key in ("chunk_hits", "chunk_misses", "recomputed_share", "ttft_s"):
        assert key in stats
    assert reply.usage_metadata["output_tokens"] <= 4
    assert reply.usage_metadata["input_tokens"] == stats["num_tokens"]


def test_tutorial_chain_reports_chunk_hits_on_warm_chunks(tutorial_chain, chroma):
    reply = tutorial_chain.invoke(QUESTION)
    hits = reply.response_metadata["cacheblend"]["chunk_hits"]
    assert sorted(hits) == sorted(h.chunk_id for h in chroma.query(QUESTION, 3))
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0


def test_users_own_string_prompt_template_reuses_kv(chroma, engine):
    llm = CacheBlendLLM(engine=engine, max_new_tokens=4)
    chain = ({"context": ChromaRetriever(store=chroma, k=2) | format_docs, "question": lambda q: q}
             | PromptTemplate.from_template("Use the context.\nContext:\n{context}\n\nQ: {question}\nA:") | llm)
    stats = StatsCallbackHandler()
    chain.invoke(QUESTION, config={"callbacks": [stats]})
    assert stats.last["chunks_from"] == "prompt" and len(stats.last["chunk_hits"]) == 2


def test_messages_map_to_the_chat_template_roles(engine):
    messages = [SystemMessage("Be brief."), HumanMessage([{"type": "text", "text": "Hi"}]), AIMessage("Hello."),
                HumanMessage("Bye", name="someone")]
    assert to_chat_messages(messages) == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello."},
                                          {"role": "user", "content": "Bye"}]
    chat = ChatCacheBlend(engine=engine, max_tokens=3)
    reply = chat.invoke(messages)
    assert reply.content and reply.usage_metadata["input_tokens"] == chat.get_num_tokens_from_messages(messages)
    with pytest.raises(ConfigError, match="text only"):
        chat.invoke([HumanMessage([{"type": "image", "url": "http://example.com/x.png"}])])
    # tool calls and results are written in the generic tool format (cacheblend_rag.tools), results verbatim
    call = AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1", "type": "tool_call"}])
    assert to_chat_messages([HumanMessage("x"), call, ToolMessage("3", tool_call_id="c1")])[1:] == [
        {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'},
        {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}]


def test_unknown_kwargs_are_rejected_and_max_tokens_is_honoured(engine):
    """Defect 8: `llm.invoke(p, max_tokens=5)` generated the default 24 tokens; unknown names vanished."""
    llm = CacheBlendLLM(engine=engine, max_new_tokens=24)
    stats = StatsCallbackHandler()
    llm.invoke("Tell me about bees.", max_tokens=3, config={"callbacks": [stats]})
    assert stats.last["num_generated"] <= 3
    llm.invoke("Tell me about bees.", max_new_tokens=2, config={"callbacks": [stats]})
    assert stats.last["num_generated"] <= 2
    with pytest.raises(ConfigError, match="max_tokenz"):
        llm.invoke("Tell me about bees.", max_tokenz=5)
    chat = ChatCacheBlend(engine=engine, max_new_tokens=24)
    assert chat.max_tokens == 24 and chat.invoke("Tell me about bees.", max_tokens=2).usage_metadata["output_tokens"] <= 2
    with pytest.raises(ConfigError, match="temperatur\\b"):
        chat.invoke("Hi", temperatur=0.5)
    with pytest.raises(ValueError):
        ChatCacheBlend(engine=engine, api_base="http://x")  # no silently ignored constructor arguments either
    # a method's own option passed as a field says where it goes
    for cls in (ChatCacheBlend, CacheBlendLLM):
        with pytest.raises(ValueError, match=r"lookalike is a method's option.*policy_options=\{'lookalike': 0\}"):
            cls(engine=engine, lookalike=0)
    assert ChatCacheBlend(engine=engine, policy_options={"lookalike": 0}).policy_options == {"lookalike": 0}


def test_identity_is_the_engines_model(engine, tokenizer_and_tiny):
    """Defect 5: identifying params named the default alias whatever the engine held; an LLM cache then served
    one model's answer to another."""
    tiny = CacheBlendEngine(*tokenizer_and_tiny)
    ours, other = CacheBlendLLM(engine=engine), CacheBlendLLM(engine=tiny)
    assert ours._identifying_params["model_name"] == engine.model_name
    assert other._identifying_params["model_name"] == tiny.model_name != engine.model_name
    assert ChatCacheBlend(engine=tiny)._get_ls_params()["ls_model_name"] == tiny.model_name
    cache = InMemoryCache()
    ours.cache = other.cache = cache
    ours.invoke("Name a flower.", max_tokens=2)
    other.invoke("Name a flower.", max_tokens=2)  # another model: its own cache entry, not ours' answer
    assert len(cache._cache) == 2


@pytest.fixture(scope="module")
def tokenizer_and_tiny(engine):
    """A random-weight two-layer llama under a name of its own, with the real tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(engine.tokenizer), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=2048)
    config._name_or_path = "tiny-random-llama"
    return tf.LlamaForCausalLM(config).eval(), engine.tokenizer


def test_stream_carries_usage_and_stats_on_the_last_chunk(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=5)
    tokens: list[str] = []
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kwargs):
            tokens.append(token)

    chunks = list(chat.stream("Say hello.", config={"callbacks": [Tokens()]}))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert chunks[-1].chunk_position == "last" and [c.usage_metadata for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert full.usage_metadata["output_tokens"] == full.response_metadata["cacheblend"]["num_generated"] <= 5
    assert "".join(tokens) == full.content and full.content


def test_stop_and_async(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=12)
    whole = chat.invoke("Count from one to ten in words.").content
    cut = chat.invoke("Count from one to ten in words.", stop=["three"]).content
    assert "three" not in cut and whole.startswith(cut.strip()[:3])
    assert asyncio.run(chat.ainvoke("Count from one to ten in words.")).content == whole

    async def astream():
        return "".join([c.content async for c in chat.astream("Count from one to ten in words.")])

    assert asyncio.run(astream()) == whole


def test_built_from_a_model_name(tmp_path):
    chat = ChatCacheBlend(model="smollm2-135m", kv_store=str(tmp_path / "kv"), max_tokens=2, device="cpu",
                          dtype="float32")
    assert chat.engine is None  # built on first use
    assert chat.invoke("Hi").content
    assert chat.engine is not None and chat.model_name == chat.engine.model_name
    assert ChatCacheBlend(model="x", kv_store="~/kv").kv_store == os.path.expanduser("~/kv")


def test_token_ids_use_the_models_tokenizer(engine):
    chat = ChatCacheBlend(engine=engine)
    assert chat.get_token_ids("Bees make honey.") == engine.tokenizer("Bees make honey.",
                                                                      add_special_tokens=False)["input_ids"]


def test_chunk_id_retriever_honours_k(embeddings):
    """Defect 7: ChunkIdRetriever(base=retriever, k=2) returned the base's 4, and a per-call k was ignored."""
    store = InMemoryVectorStore(embeddings)
    store.add_texts([p.read_text() for p in sorted(DATA.iterdir())])
    retriever = ChunkIdRetriever(base=store.as_retriever(), k=2)
    docs = retriever.invoke(QUESTION)
    assert len(docs) == 2 and all(d.id == chunk_id(d.page_content) for d in docs)
    assert len(retriever.invoke(QUESTION, k=1)) == 1
    assert len(ChunkIdRetriever(base=store.as_retriever()).invoke(QUESTION, k=6)) == 6  # passed on to the base
    assert len(ChunkIdRetriever(base=store).invoke(QUESTION)) == 4
    with pytest.raises(ConfigError, match="k must be"):
        retriever.invoke(QUESTION, k=0)


def test_wrong_engines_seeds_and_string_retrievers_are_named(engine):
    """A wrong-typed engine raised a bare AttributeError, a huge per-call seed torch's ValueError, and a base
    retriever returning strings an AttributeError."""
    from langchain_core.runnables import RunnableLambda

    with pytest.raises(TypeError, match="CacheBlendEngine"):
        ChatCacheBlend(engine="smollm2-135m")
    with pytest.raises(TypeError, match="CacheBlendEngine"):
        CacheBlendLLM(engine=object())
    with pytest.raises(ConfigError, match="seed"):
        ChatCacheBlend(engine=engine, max_tokens=2).invoke("Hi", seed=2**80, temperature=0.7)
    texts = ["Bees have five eyes.", "Queens are fed royal jelly."]
    docs = ChunkIdRetriever(base=RunnableLambda(lambda q: texts)).invoke("eyes")
    assert [d.page_content for d in docs] == texts and [d.id for d in docs] == [chunk_id(t) for t in texts]
    with pytest.raises(ConfigError, match="returned a int"):
        ChunkIdRetriever(base=RunnableLambda(lambda q: [1, 2])).invoke("eyes")


@pytest.mark.slow
def test_a_script_that_stops_a_stream_and_exits_exits_cleanly():
    """Defect 1: a script that stopped reading a stream and exited aborted (exit 134) about half the time."""
    script = textwrap.dedent("""
        from cacheblend_rag import CacheBlendEngine
        from langchain_cacheblend import ChatCacheBlend
        chat = ChatCacheBlend(model="smollm2-135m", max_tokens=200, device="cpu", dtype="float32")
        for i, chunk in enumerate(chat.stream("Write a long story about bees.")):
            if i == 2:
                break
        print("done")
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
def test_chat_tutorial_example_runs(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    from cacheblend_rag import settings

    (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)  # no second conversion
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    example = Path(__file__).resolve().parents[3] / "examples" / "langchain_chat_tutorial.py"
    out = subprocess.run([sys.executable, str(example), "--home", str(home), "--max-tokens", "4"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "A: " in out.stdout and "chunk hits" in out.stdout and "input_tokens" in out.stdout


def test_warm_from_vectorstore_gives_the_tutorial_chain_hits(engine, embeddings, tmp_path):
    """A user's own langchain-chroma store: warming its documents turns the tutorial chain's misses into hits."""
    from langchain_chroma import Chroma

    from langchain_cacheblend import warm_from_vectorstore

    texts = [(DATA / name).read_text() for name in ("07_senses.txt", "04_honey.txt")]
    store = Chroma("users_own", embedding_function=embeddings, persist_directory=str(tmp_path / "db"))
    store.add_texts(texts, ids=["senses", "honey"])  # the user's ids, not chunk ids
    fresh = CacheBlendEngine(engine.model, engine.tokenizer, None)  # nothing stored yet
    prompt = ChatPromptTemplate.from_messages([("system", "Context:\n{context}"), ("human", "{question}")])
    chain = ({"context": store.as_retriever(search_kwargs={"k": 2}) | format_docs, "question": lambda q: q}
             | prompt | ChatCacheBlend(engine=fresh, max_tokens=1, learn_retrieved=False))  # warming alone
    assert chain.invoke(QUESTION).response_metadata["cacheblend"]["chunk_hits"] == []

    chat = ChatCacheBlend(engine=fresh)
    report = warm_from_vectorstore(chat, store.as_retriever())  # a retriever's store, a chat model's engine
    assert (report.documents, report.new_kv, report.skipped) == (2, 2, ())
    assert sorted(chain.invoke(QUESTION).response_metadata["cacheblend"]["chunk_hits"]) == sorted(map(chunk_id, texts))
    assert warm_from_vectorstore(fresh, store, ids=["honey"]).already_stored == 1
    with pytest.raises(ConfigError, match="CacheBlendEngine"):
        warm_from_vectorstore("engine", store)


def test_create_stuff_documents_chain_hits_warm_chunks(chroma, engine):
    """LangChain's own create_retrieval_chain + create_stuff_documents_chain (langchain-classic), unchanged."""
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the context.\n\n{context}"), ("human", "{input}")])
    chain = create_retrieval_chain(ChromaRetriever(store=chroma, k=2),
                                   create_stuff_documents_chain(ChatCacheBlend(engine=engine, max_tokens=2), prompt))
    stats = StatsCallbackHandler()
    out = chain.invoke({"input": QUESTION}, config={"callbacks": [stats]})
    assert out["answer"] and sorted(stats.last["chunk_hits"]) == sorted(d.id for d in out["context"])
    assert stats.last["per_chunk"] == {d.id: "hit" for d in out["context"]}


def test_the_tutorial_chain_learns_retrieved_passages_without_a_warm_step(engine, embeddings, tmp_path):
    """A user's own langchain-chroma store and LangChain's tutorial chain, nothing warmed: the first run learns
    what its retriever returned (after the answer, in the background), the second run reuses it."""
    from langchain_chroma import Chroma

    texts = [(DATA / name).read_text() for name in ("07_senses.txt", "04_honey.txt")]
    store = Chroma("users_learned", embedding_function=embeddings, persist_directory=str(tmp_path / "db"))
    store.add_texts(texts)
    fresh = CacheBlendEngine(engine.model, engine.tokenizer, None)  # nothing stored
    prompt = ChatPromptTemplate.from_messages([("system", "Context:\n{context}"), ("human", "{question}")])
    chain = ({"context": store.as_retriever(search_kwargs={"k": 2}) | format_docs, "question": lambda q: q}
             | prompt | ChatCacheBlend(engine=fresh, max_tokens=1))
    assert chain.invoke(QUESTION).response_metadata["cacheblend"]["chunk_hits"] == []
    assert fresh.learner.wait(timeout=300) and fresh.learner.learned == 2
    assert sorted(chain.invoke(QUESTION).response_metadata["cacheblend"]["chunk_hits"]) == sorted(map(chunk_id, texts))
    off = CacheBlendEngine(engine.model, engine.tokenizer, None)
    unlearned = chain.steps[0] | prompt | ChatCacheBlend(engine=off, max_tokens=1, learn_retrieved=False)
    unlearned.invoke(QUESTION)
    assert off.learner.learned == 0 and unlearned.invoke(QUESTION).response_metadata["cacheblend"]["chunk_hits"] == []


def test_learning_reads_the_retrieved_passages_on_the_runs_callback_manager():
    """The models learn what the `RetrievedPassages` handlers on their run's callback manager recorded for the run's
    tree (one passed in a run's callbacks serves that run alone), not what a module global holds."""
    from uuid import uuid4

    from langchain_core.callbacks import CallbackManagerForLLMRun
    from langchain_core.documents import Document

    from langchain_cacheblend._common import learn_retrieved
    from langchain_cacheblend.callbacks import RetrievedPassages

    own = RetrievedPassages()
    root, retriever, llm_run = uuid4(), uuid4(), uuid4()
    own.on_chain_start({}, {}, run_id=root)
    own.on_retriever_end([Document("Bees have five eyes."), Document("Wax comes from glands.")], run_id=retriever,
                         parent_run_id=root)
    own.on_llm_start({}, [], run_id=llm_run, parent_run_id=root)
    learned: list[list[str]] = []

    class Engine:
        def learn(self, texts):
            learned.append(texts)

    class Model:
        learn_retrieved = True

        def get_engine(self):
            return Engine()

    def manager(handlers):
        return CallbackManagerForLLMRun(run_id=llm_run, handlers=handlers, inheritable_handlers=handlers,
                                        parent_run_id=root)

    learn_retrieved(Model(), manager([own]), "Context: Bees have five eyes.\nHow many eyes?")
    assert learned == [["Bees have five eyes."]]  # retrieved in the run's tree and carried by the prompt
    learn_retrieved(Model(), manager([]), "Context: Bees have five eyes.\nHow many eyes?")
    assert learned == [["Bees have five eyes."]]  # no recorder on the run: nothing to learn


def test_each_run_tree_gets_its_own_retrieved_passages():
    """#37: a chain invoked with no callbacks gets a `RetrievedPassages` of its own at its root (LangChain's
    configure hook), which every run below it shares; no instance is shared between two invocations, nor kept by
    the module, and one passed in `callbacks` is used instead."""
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnableLambda, RunnableParallel

    import langchain_cacheblend.callbacks as callbacks
    from langchain_cacheblend.callbacks import RetrievedPassages

    class Retriever(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager):
            return [Document("Bees have five eyes.")]

    seen: list[tuple[list[RetrievedPassages], list[str]]] = []

    def model_step(value, config):  # where a chat model sits: after the retriever, in a sibling branch's tree
        manager = config["callbacks"]
        recorders = [h for h in manager.handlers if isinstance(h, RetrievedPassages)]
        seen.append((recorders, [t for h in recorders for t in h.texts_for(manager.parent_run_id)]))
        return value

    chain = RunnableParallel(context=Retriever(), question=lambda q: q) | RunnableLambda(model_step)
    chain.invoke("eyes?")
    chain.invoke("eyes?")
    (first, first_texts), (second, second_texts) = seen
    assert len(first) == len(second) == 1 and first[0] is not second[0]  # one per run tree, none shared
    assert first_texts == second_texts == ["Bees have five eyes."]
    own = RetrievedPassages()
    chain.invoke("eyes?", config={"callbacks": [own]})
    assert seen[-1][0] == [own] and seen[-1][1] == ["Bees have five eyes."]
    assert not [name for name, value in vars(callbacks).items() if isinstance(value, RetrievedPassages)]
