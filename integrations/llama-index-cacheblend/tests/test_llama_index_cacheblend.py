"""LlamaIndex the standard way (`Settings.llm`, `index.as_query_engine()`, `as_chat_engine()`) over real Chroma."""

from __future__ import annotations

from llama_index_cacheblend_testing import li_engine, settings_llm  # noqa: F401 (fixtures; first: sets the offline environment)
import shutil
from pathlib import Path

import chromadb
import pytest
from llama_index.core import Settings, SimpleDirectoryReader, StorageContext, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.vector_stores.chroma import ChromaVectorStore

from cacheblend_rag import ConfigError, chunk_id
from llama_index.llms.cacheblend import (
    CacheBlendLLM,
    ChunkIdTransform,
    LocalEmbedding,
    as_query_engine,
    build_index,
    load_documents,
)
from llama_index.postprocessor.cacheblend import KVAwareNodePostprocessor


pytestmark = pytest.mark.model

DATA = Path(__file__).resolve().parents[3] / "examples" / "data"
QUESTION = "How long does a queen take to develop?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The example corpus (three files) plus an empty file, as a user's folder often has."""
    folder = tmp_path_factory.mktemp("li-data")
    for src in sorted(DATA.iterdir())[:3]:
        shutil.copy(src, folder / src.name)
    (folder / "empty.txt").write_text("")
    return folder


@pytest.fixture(scope="module")
def chroma_index(folder, tmp_path_factory):
    """A VectorStoreIndex over a real ChromaVectorStore, built with LlamaIndex's own reader and splitter."""
    client = chromadb.PersistentClient(path=str(tmp_path_factory.mktemp("li-chroma")))
    collection = client.get_or_create_collection("llama_index_cacheblend_tests",
                                                 configuration={"hnsw": {"space": "cosine"}})
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
    documents = SimpleDirectoryReader(str(folder)).load_data()
    return VectorStoreIndex.from_documents(documents, storage_context=storage, embed_model=LocalEmbedding(),
                                           transformations=[SentenceSplitter(chunk_size=512), ChunkIdTransform()])


def test_standard_query_engine_over_chroma_carries_stats(chroma_index, settings_llm):
    qe = chroma_index.as_query_engine(similarity_top_k=2, node_postprocessors=[KVAwareNodePostprocessor()])
    response = qe.query(QUESTION)
    assert str(response).strip() and len(response.source_nodes) == 2
    stats = response.metadata["cacheblend"]
    for key in ("chunk_hits", "chunk_misses", "ttft_s", "recomputed_share"):
        assert key in stats
    assert stats is settings_llm.last_stats
    warmed = qe._node_postprocessors[0].last_stats  # the postprocessor found the engine through Settings.llm
    assert all(settings_llm.engine.has_kv(cid) for cid in warmed["chunk_ids"])


def test_standard_query_engine_hits_warm_chunks(chroma_index, settings_llm):
    qe = chroma_index.as_query_engine(similarity_top_k=2, node_postprocessors=[KVAwareNodePostprocessor()])
    qe.query(QUESTION)  # warms what it retrieves
    response = qe.query(QUESTION)
    assert sorted(response.metadata["cacheblend"]["chunk_hits"]) == sorted(n.node.id_ for n in response.source_nodes)


def test_streaming_query_stats_fill_as_it_streams(chroma_index, settings_llm):
    response = chroma_index.as_query_engine(similarity_top_k=2, streaming=True).query(QUESTION)
    text = "".join(response.response_gen)
    assert text.strip() and response.metadata["cacheblend"]["num_generated"] >= 1


def test_chat_engine_the_standard_way(chroma_index, settings_llm):
    chat = chroma_index.as_chat_engine(similarity_top_k=2)
    assert str(chat.chat("What does a queen eat?")).strip()
    assert str(chat.chat("And how long does she take to develop?")).strip()  # a second turn, condensed
    assert settings_llm.last_stats["num_generated"] >= 1


def test_metadata_is_the_models_own(li_engine):
    """Defect 5: the LLM reported "smollm2-135m" and a 2048 window whatever the engine held."""
    llm = CacheBlendLLM(engine=li_engine, max_new_tokens=7)
    meta = llm.metadata
    assert meta.context_window == li_engine.context_window == li_engine.model.config.max_position_embeddings
    assert meta.model_name == llm.model_name == li_engine.model_name and meta.num_output == 7
    assert CacheBlendLLM(engine=li_engine, context_window=1024).metadata.context_window == 1024
    with pytest.raises(ConfigError, match="max_tokenz"):
        llm.complete("Hi", max_tokenz=3)
    assert llm.complete("Tell me about bees.", max_tokens=2).additional_kwargs["num_generated"] <= 2


def test_constructor_fields_engine_and_chunks_are_checked(li_engine):
    """Unknown fields, a wrong-typed engine and a bad window were accepted; a chunks string became characters."""
    with pytest.raises(ValueError, match="recompute_rato"):
        CacheBlendLLM(engine=li_engine, recompute_rato=0.9)
    with pytest.raises(ValueError, match="context_window"):
        CacheBlendLLM(engine=li_engine, context_window=-5)
    with pytest.raises(TypeError, match="CacheBlendEngine"):
        CacheBlendLLM(engine="smollm2-135m")
    with pytest.raises(ConfigError, match=r"lookalike is a method's option.*policy_options=\{'lookalike': 0\}"):
        CacheBlendLLM(engine=li_engine, lookalike=0)
    llm = CacheBlendLLM(engine=li_engine, max_new_tokens=2)
    passage = "Honeybees have five eyes: two large compound eyes and three small ocelli."
    out = llm.complete("ignored", chunks=passage, question="How many eyes does a honeybee have?")
    assert out.additional_kwargs["chunk_ids"] == [chunk_id(passage)]  # one chunk, not one per character
    with pytest.raises(ConfigError, match="chunks must be"):
        llm.complete("Hi", chunks=42)


def test_as_query_engine_uses_settings_llm(folder, li_engine, settings_llm, monkeypatch):
    """Defect 4: as_query_engine(index) ignored Settings.llm and loaded a second model."""
    index = build_index(load_documents([folder]), li_engine)
    qe = as_query_engine(index, similarity_top_k=2)
    assert qe._response_synthesizer._llm is settings_llm
    assert qe._node_postprocessors[0].engine is li_engine
    assert str(qe.query(QUESTION)).strip()
    monkeypatch.setattr(Settings, "_llm", None)
    with pytest.raises(ConfigError, match="Settings.llm"):
        as_query_engine(index)


def test_empty_files_and_nodes_never_crash(folder, li_engine):
    """Defect 3: an empty file crashed index building (ChunkError: empty chunk), an empty node the postprocessor."""
    docs = load_documents([folder])
    assert len(docs) == 3  # the empty file is skipped
    index = build_index(docs + [type(docs[0])(text="  \n")], li_engine)
    assert len(index.docstore.docs) == 3
    pp = KVAwareNodePostprocessor(engine=li_engine)
    text = (DATA / "01_colony.md").read_text()
    nodes = [NodeWithScore(node=TextNode(text=""), score=1.0), NodeWithScore(node=TextNode(text=text), score=0.5)]
    out = pp.postprocess_nodes(nodes)
    assert [n.node.text for n in out] == [text] and pp.last_stats["empty"] == 1
    assert pp.last_stats["chunk_ids"] == [chunk_id(text)]


def test_async_streaming_query_stats(chroma_index, settings_llm):
    import asyncio

    async def run():
        response = await chroma_index.as_query_engine(similarity_top_k=2, streaming=True).aquery(QUESTION)
        text = "".join([t async for t in response.async_response_gen()])
        return text, response.metadata["cacheblend"]

    text, stats = asyncio.run(run())
    assert text.strip() and stats["num_generated"] >= 1


def test_warm_from_index_gives_a_users_chroma_index_hits(folder, li_engine, tmp_path):
    """A user's own index (LlamaIndex's default splitter, ChromaVectorStore, no docstore): warming its nodes turns
    the standard query engine's misses into hits."""
    from cacheblend_rag import CacheBlendEngine
    from llama_index.llms.cacheblend import warm_from_index

    collection = chromadb.PersistentClient(path=str(tmp_path)).get_or_create_collection("users_own")
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
    index = VectorStoreIndex.from_documents(SimpleDirectoryReader(str(folder)).load_data(), storage_context=storage,
                                            embed_model=LocalEmbedding())
    saved = Settings._llm, Settings._embed_model
    try:
        fresh = CacheBlendEngine(li_engine.model, li_engine.tokenizer, None)  # nothing stored yet
        llm = CacheBlendLLM(engine=fresh, max_new_tokens=1, learn_retrieved=False)  # warming alone
        Settings.llm, Settings.embed_model = llm, LocalEmbedding()
        qe = index.as_query_engine(similarity_top_k=2)
        assert qe.query(QUESTION).metadata["cacheblend"]["chunk_hits"] == []

        report = warm_from_index(index)  # Settings.llm's engine; the nodes come from the ChromaVectorStore
        assert report.new_kv == report.chunks == collection.count() - len(report.skipped) > 0
        assert all("empty" in s.reason for s in report.skipped)  # the folder's empty file, if it made a node
        response = qe.query(QUESTION)
        hits = response.metadata["cacheblend"]["chunk_hits"]
        assert len(hits) == 2 and sorted(hits) == sorted(chunk_id(n.node.text) for n in response.source_nodes)
        assert warm_from_index(index.vector_store, fresh).already_stored == report.chunks
    finally:
        Settings._llm, Settings._embed_model = saved


def test_plain_completions_get_the_instruct_models_chat_template(li_engine):
    """#25: complete() sent a bare string to an instruct model, which answered '' (a condense step's empty
    question then crashed the chat engine)."""
    llm = CacheBlendLLM(engine=li_engine, max_new_tokens=12)
    prompt = "Rewrite as a standalone question: and how long does she take to develop?"
    templated = li_engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=True)
    response = llm.complete(prompt)
    assert response.text.strip() and response.additional_kwargs["num_tokens"] == len(templated["input_ids"])
    raw = llm.complete(prompt, formatted=True)  # the caller formatted it: sent as is
    assert raw.additional_kwargs["num_tokens"] == len(li_engine.tokenizer(prompt)["input_ids"])
    own = CacheBlendLLM(engine=li_engine, max_new_tokens=2, completion_to_prompt=lambda p: f"Q: {p}\nA:")
    own_tokens = li_engine.tokenizer(f"Q: {prompt}\nA:")["input_ids"]
    assert own.complete(prompt).additional_kwargs["num_tokens"] == len(own_tokens)


def test_the_default_chat_engine_runs_four_turns(chroma_index, li_engine):
    saved = Settings._llm, Settings._embed_model
    try:
        Settings.llm, Settings.embed_model = CacheBlendLLM(engine=li_engine, max_new_tokens=24), LocalEmbedding()
        chat = chroma_index.as_chat_engine()  # LlamaIndex's default chat mode, condensing each follow-up
        for turn in ("What does a queen eat?", "And how long does she take to develop?", "Who feeds her?",
                     "Say that again in one sentence."):
            assert str(chat.chat(turn)).strip()
        assert len(chat.chat_history) == 8
    finally:
        Settings._llm, Settings._embed_model = saved


def test_as_query_engine_learns_retrieved_passages_without_a_warm_step(chroma_index, li_engine):
    """The README's way — `Settings.llm = CacheBlendLLM(...)`, `index.as_query_engine()`, no postprocessor, no
    warm step: the first query learns what it retrieved (after its answer), the second one reuses it."""
    from cacheblend_rag import CacheBlendEngine

    fresh = CacheBlendEngine(li_engine.model, li_engine.tokenizer, None)  # nothing stored
    saved = Settings._llm, Settings._embed_model
    Settings.llm, Settings.embed_model = CacheBlendLLM(engine=fresh, max_new_tokens=2), LocalEmbedding()
    try:
        qe = chroma_index.as_query_engine(similarity_top_k=2)
        first = qe.query(QUESTION)
        assert first.metadata["cacheblend"]["chunk_hits"] == []
        assert fresh.learner.wait(timeout=300) and fresh.learner.learned == 2
        second = qe.query(QUESTION)
        assert sorted(second.metadata["cacheblend"]["chunk_hits"]) == sorted(n.node.id_ for n in second.source_nodes)
        Settings.llm = CacheBlendLLM(engine=CacheBlendEngine(li_engine.model, li_engine.tokenizer, None),
                                     max_new_tokens=2, learn_retrieved=False)
        qe = chroma_index.as_query_engine(similarity_top_k=2)
        qe.query(QUESTION)
        assert Settings.llm.engine.learner.learned == 0 and qe.query(QUESTION).metadata["cacheblend"]["chunk_hits"] == []
    finally:
        Settings._llm, Settings._embed_model = saved


def test_a_request_learns_what_its_own_span_tree_retrieved(li_engine, monkeypatch):
    """#37: what a request retrieved lives on its span tree (kept by the root dispatcher's `QueryStatsHandler`),
    not in the thread's context: a later request on the same thread that retrieved nothing learns nothing, while
    its own tree's retrieval is learned even when the LLM is called after that tree's root span ended."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
    from llama_index.core.instrumentation.span import active_span_id

    learned: list[list[str]] = []
    monkeypatch.setattr(li_engine, "learn", lambda texts: learned.append(list(texts)))
    llm = CacheBlendLLM(engine=li_engine, max_new_tokens=1)
    passage = "Honeybees have five eyes: two large compound eyes and three small ocelli."
    prompt = f"{passage}\nHow many eyes does a honeybee have?"
    dispatcher = get_dispatcher()

    @dispatcher.span
    def retrieve() -> str | None:
        dispatcher.event(RetrievalEndEvent(str_or_query_bundle="eyes?",
                                           nodes=[NodeWithScore(node=TextNode(text=passage), score=1.0)]))
        return active_span_id.get()

    @dispatcher.span
    def retrieve_then_answer() -> None:
        retrieve()
        llm.complete(prompt)

    @dispatcher.span
    def answer() -> None:
        llm.complete(prompt)

    retrieve_then_answer()
    assert learned == [[passage]]
    answer()  # another request, which retrieved nothing
    assert learned == [[passage]]
    token = active_span_id.set(retrieve())  # a call its tree makes after the tree's root ended (a stream read late)
    try:
        llm.complete(prompt)
    finally:
        active_span_id.reset(token)
    assert learned == [[passage], [passage]]
