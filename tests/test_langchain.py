"""LangChain integration on the real default model, real Chroma and the example corpus."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")

from langchain_cacheblend import (  # noqa: E402
    CacheBlendLLM,
    CacheBlendPromptTemplate,
    CacheBlendPromptValue,
    ChromaRetriever,
    ChunkIdRetriever,
    StatsCallbackHandler,
    create_map_reduce_chain,
    create_map_rerank_chain,
    create_stuff_chain,
    parse_scored_answer,
)
from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from cacheblend_rag import chunk_id  # noqa: E402
from cacheblend_rag.ingest import ingest_paths  # noqa: E402
from cacheblend_rag.fuse.policies import DEFAULT_METHOD  # noqa: E402
from cacheblend_rag.retrieval.chroma import ChromaChunkStore  # noqa: E402

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
QUESTION = "How many eyes does a honeybee have?"
MAX_NEW = 8


@pytest.fixture(scope="module")
def home(integrations_home):
    return integrations_home


@pytest.fixture(scope="module")
def engine(integrations_engine):
    return integrations_engine


@pytest.fixture(scope="module")
def store(engine, home):
    store = ChromaChunkStore(home)
    report = ingest_paths([DATA], engine, store, show_progress=False)
    assert report.files == 8 and report.chunks == report.new_chunks == 8  # new to this Chroma collection
    assert report.new_kv in (0, 8)  # 0 when another module of the session stored the same chunks' KV
    return store


@pytest.fixture(scope="module")
def retriever(store):
    return ChunkIdRetriever(base=ChromaRetriever(store=store, k=3))


@pytest.fixture(scope="module")
def llm(engine):
    return CacheBlendLLM(engine=engine, max_new_tokens=MAX_NEW)


def test_second_ingestion_adds_nothing(engine, store):
    again = ingest_paths([DATA], engine, store, show_progress=False)
    assert (again.chunks, again.new_chunks, again.new_kv, again.kv_bytes) == (8, 0, 0, 0)
    assert store.count() == 8


def test_chunk_ids_survive_retriever_prompt_llm(retriever, llm):
    docs = retriever.invoke(QUESTION)
    assert [d.id for d in docs] == [d.metadata["chunk_id"] for d in docs] == [chunk_id(d.page_content) for d in docs]
    stats = StatsCallbackHandler()
    answer = create_stuff_chain(retriever, llm).invoke(QUESTION, config={"callbacks": [stats]})
    assert isinstance(answer, str) and answer
    info = stats.last
    assert info["chunk_ids"] == [d.id for d in docs] == stats.retrieved[-1]
    assert info["chunk_hits"] == info["chunk_ids"] and info["chunk_misses"] == []
    assert set(info["per_chunk"].values()) == {"hit"} and info["chunks_from"] == "prompt_value"
    assert 0 < info["num_recomputed"] < info["num_reused"]


def test_every_path_finds_the_chunks(retriever, llm):
    docs = retriever.invoke(QUESTION)
    ids = [d.id for d in docs]
    value = CacheBlendPromptTemplate().invoke({"context": docs, "question": QUESTION})
    assert isinstance(value, CacheBlendPromptValue) and value.chunk_ids == ids
    by_value = llm.generate_prompt([value]).generations[0][0]
    by_kwarg = llm.generate([QUESTION], chunks=ids).generations[0][0]  # ids alone: text from the KV store
    plain = llm.generate(["Say hello."]).generations[0][0]  # any other string: engine.generate_prompt
    assert by_value.generation_info["chunks_from"] == "prompt_value"
    assert by_kwarg.generation_info["chunks_from"] == "kwarg"
    for gen in (by_value, by_kwarg):
        assert gen.generation_info["chunk_ids"] == ids and gen.generation_info["chunk_hits"] == ids
    assert by_value.text == by_kwarg.text  # the same request, whichever way it arrived
    assert plain.generation_info["chunks_from"] == "prompt" and plain.generation_info["chunk_ids"] == []


def test_a_prompt_string_finds_its_chunks(retriever, llm):
    docs = retriever.invoke(QUESTION)
    value = CacheBlendPromptTemplate().invoke({"context": docs, "question": QUESTION})
    by_string = llm.generate([value.to_string() + " "]).generations[0][0]  # an unseen string: matched by the engine
    assert by_string.generation_info["chunks_from"] == "prompt"
    assert sorted(by_string.generation_info["chunk_hits"]) == sorted(d.id for d in docs)


def test_settings_are_fields_and_per_call(llm, retriever):
    assert CacheBlendLLM.model_fields["recompute_ratio"].description
    assert llm._identifying_params["method"] == DEFAULT_METHOD
    with pytest.raises(ValueError, match="method"):
        CacheBlendLLM(engine=llm.engine, method="nope")
    docs = retriever.invoke(QUESTION)
    value = CacheBlendPromptTemplate().invoke({"context": docs, "question": QUESTION})
    result = llm.generate_prompt([value], method="full_reuse", max_new_tokens=2)
    info = result.generations[0][0].generation_info
    assert info["method"] == "full_reuse" and info["num_generated"] <= 2 and info["num_recomputed"] == 0
    assert result.llm_output["requests"][0]["chunk_ids"] == [d.id for d in docs]


def test_stop_field_is_the_default_and_a_call_overrides_it(llm, retriever):
    value = CacheBlendPromptTemplate().invoke({"context": retriever.invoke(QUESTION), "question": QUESTION})
    stopping = CacheBlendLLM(engine=llm.engine, max_new_tokens=16, stop=["e"])
    cut = stopping.invoke(value)
    whole = stopping.invoke(value, stop=[])  # a call's own stop list wins, even an empty one
    assert "e" not in cut and whole.startswith(cut) and len(whole) > len(cut)


def test_token_ids_use_the_models_tokenizer(llm, engine):
    text = "Bees make honey."
    assert llm.get_token_ids(text) == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert llm.get_num_tokens(text) > 0


def test_streaming_yields_tokens_and_fires_callbacks(retriever, llm):
    tokens: list[str] = []

    class Tokens(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kwargs):
            tokens.append(token)

    stats = StatsCallbackHandler()
    pieces = list(create_stuff_chain(retriever, llm).stream(QUESTION, config={"callbacks": [Tokens(), stats]}))
    assert len([p for p in pieces if p]) >= 2 and tokens == [p for p in pieces if p]
    assert stats.last["chunk_hits"] == stats.last["chunk_ids"] and len(stats.last["chunk_ids"]) == 3


def test_batch_and_async(retriever, llm):
    chain = create_stuff_chain(retriever, llm)
    questions = [QUESTION, "What do bees use to make wax?"]
    stats = StatsCallbackHandler()
    answers = chain.batch(questions, config={"callbacks": [stats]})
    assert len(answers) == 2 and all(isinstance(a, str) and a for a in answers)
    assert len(stats.requests) == 2 and all(r["chunk_misses"] == [] for r in stats.requests)
    assert asyncio.run(chain.ainvoke(QUESTION)) == answers[0]


def test_chunk_id_retriever_wraps_a_vector_store(engine):
    from cacheblend_rag.ingest.embeddings import embed

    class Local(Embeddings):
        def embed_documents(self, texts):
            return embed(texts)

        def embed_query(self, text):
            return embed([text])[0]

    texts = [p.read_text() for p in sorted(DATA.iterdir())[:4]]
    vs = InMemoryVectorStore(Local())
    vs.add_documents([Document(page_content=t) for t in texts + texts[:1]])  # one duplicate
    docs = ChunkIdRetriever(base=vs, k=5).invoke("queen larvae royal jelly")
    assert len(docs) == 4 and len({d.id for d in docs}) == 4  # the duplicate is dropped
    assert all(d.id == chunk_id(d.page_content) for d in docs)


def test_map_reduce_and_map_rerank_run(retriever, llm):
    for make, calls in ((create_map_reduce_chain, 4), (create_map_rerank_chain, 3)):
        stats = StatsCallbackHandler()
        answer = make(retriever, llm).invoke(QUESTION, config={"callbacks": [stats]})
        assert isinstance(answer, str)
        assert len(stats.requests) == calls  # one per chunk (+ the reduce)
        maps = [r for r in stats.requests if r["chunk_ids"]]
        assert [r["chunk_ids"][0] for r in maps] == stats.retrieved[-1]
        assert all(r["chunk_hits"] == r["chunk_ids"] for r in maps)


def test_parse_scored_answer():
    assert parse_scored_answer("Five eyes. Score: 87") == ("Five eyes", 87)
    assert parse_scored_answer("no score here") == ("no score here", 0)
    assert parse_scored_answer("x score=250")[1] == 100


def test_huggingface_pipeline_is_a_drop_in(retriever, default_model):
    pytest.importorskip("langchain_huggingface")
    from langchain_huggingface import HuggingFacePipeline
    from transformers import pipeline

    model, tokenizer = default_model
    hf = HuggingFacePipeline(pipeline=pipeline("text-generation", model=model, tokenizer=tokenizer,
                                               max_new_tokens=MAX_NEW, do_sample=False, return_full_text=False))
    answer = create_stuff_chain(retriever, hf).invoke(QUESTION)
    assert isinstance(answer, str) and answer.strip()


@pytest.mark.slow
def test_example_runs(home):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(REPO / "examples" / "langchain_rag.py"), "--home", str(home),
                          "--max-new-tokens", str(MAX_NEW), "--collection", "example_collection"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "A (CacheBlend):" in out.stdout and "A (HuggingFacePipeline):" in out.stdout
    assert "hits 4/4" in out.stdout and "time to first token" in out.stdout


def test_bench_chain_methods_report_hits_on_warm_chunks(engine, passages):
    """`bench --methods stuff_documents,llama_query`: LangChain's create_stuff_documents_chain and LlamaIndex's
    Settings.llm + as_query_engine over ChromaVectorStore both reuse the warm passages' KV."""
    from cacheblend_bench.chains import ChainRunner, ttft_ratios
    from cacheblend_bench.methods import MethodSpec

    chunks = passages[:2]
    engine.ingest(chunks, show_progress=False)
    runner = ChainRunner(engine, max_new_tokens=2)
    records = []
    for name in ("stuff_documents", "llama_query"):
        record = runner.run(MethodSpec.parse(name), chunks, "Who wrote the first passage?")
        assert (record["chunk_hits"], record["chunk_misses"]) == (2, 0), name
        assert record["ttft_s"] > 0 and record["num_tokens"] > 0 and record["answer"]
        records.append({**record, "method": name})
    summary = {name: {"kind": "chain", "ttft_median_s": r["ttft_s"]} for name, r in zip(("stuff", "llama_query"), records)}
    table = ttft_ratios({**summary, "cacheblend@0.15": {"kind": "engine", "ttft_median_s": 0.5}}, records)
    assert "| llama_query |" in table and "x engine (cacheblend@0.15)" in table and "2.0 / 0.0" in table
    # the query engine's own retrieval (embed + Chroma search) is timed apart: it is inside its TTFT
    assert records[1]["retrieve_s"] > 0 and f"| {records[1]['retrieve_s']:.3f} |" in table
