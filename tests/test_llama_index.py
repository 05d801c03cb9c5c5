"""LlamaIndex integration on the real default model and the example corpus."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from llama_index.llms.cacheblend import (  # noqa: E402
    CacheBlendLLM,
    ChunkIdTransform,
    LocalEmbedding,
    as_query_engine,
    build_index,
    load_documents,
)
from llama_index.postprocessor.cacheblend import KVAwareNodePostprocessor  # noqa: E402
from llama_index.core import Settings  # noqa: E402
from llama_index.core.schema import NodeRelationship, NodeWithScore, TextNode  # noqa: E402

from cacheblend_rag import chunk_id  # noqa: E402
from cacheblend_rag.retrieval import render_prompt  # noqa: E402
from cacheblend_rag.store import KVKey  # noqa: E402

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
QUESTION = "How long does a queen take to develop?"
MAX_NEW = 8


@pytest.fixture(scope="module")
def home(integrations_home):
    return integrations_home


@pytest.fixture(scope="module")
def engine(integrations_engine):
    return integrations_engine


@pytest.fixture(scope="module")
def llm(engine):
    llm = CacheBlendLLM(engine=engine, max_new_tokens=MAX_NEW)
    Settings.llm, Settings.embed_model = llm, LocalEmbedding()  # never the OpenAI defaults
    return llm


@pytest.fixture(scope="module")
def index(engine, llm):
    return build_index(load_documents([DATA]), engine)


def test_node_ids_are_stable_chunk_ids(index, engine):
    ids = sorted(index.docstore.docs)
    again = build_index(load_documents([DATA]), engine)  # new Document UUIDs, same content
    assert sorted(again.docstore.docs) == ids and len(ids) == 8
    for node in index.docstore.docs.values():
        assert node.id_ == chunk_id(node.get_content(metadata_mode="none"))
        assert engine.kv_store.contains(KVKey(engine.namespace, node.id_))


def test_transform_repoints_relationships():
    a, b = TextNode(text="first part"), TextNode(text="second part")
    a.relationships[NodeRelationship.NEXT] = b.as_related_node_info()
    b.relationships[NodeRelationship.PREVIOUS] = a.as_related_node_info()
    out = ChunkIdTransform()([a, b, TextNode(text="first part")])
    assert [n.id_ for n in out] == [chunk_id("first part"), chunk_id("second part")]
    assert out[0].relationships[NodeRelationship.NEXT].node_id == chunk_id("second part")
    assert out[1].relationships[NodeRelationship.PREVIOUS].node_id == chunk_id("first part")


def test_query_engine_answers_from_cached_chunks(index, llm):
    qe = as_query_engine(index, llm=llm, similarity_top_k=3)
    response = qe.query(QUESTION)
    assert str(response).strip()
    ids = [n.node.id_ for n in response.source_nodes]
    kv = qe._node_postprocessors[0].last_stats
    assert kv["chunk_ids"] == ids and kv["hits"] == ids and kv["misses"] == []


def test_streaming_and_aquery(index, llm):
    streaming = as_query_engine(index, llm=llm, similarity_top_k=3, streaming=True)
    pieces = list(streaming.query(QUESTION).response_gen)
    assert len(pieces) >= 2 and "".join(pieces).strip()
    sync = str(as_query_engine(index, llm=llm, similarity_top_k=3).query(QUESTION))
    assert str(asyncio.run(as_query_engine(index, llm=llm, similarity_top_k=3).aquery(QUESTION))) == sync

    async def astream():
        response = await streaming.aquery(QUESTION)
        return [p async for p in response.async_response_gen()]

    assert "".join(asyncio.run(astream())).strip() == sync


def test_llm_complete_and_stream(llm, engine):
    texts = [p.read_text() for p in sorted(DATA.iterdir())[:2]]
    ids = [chunk_id(t) for t in texts]
    by_kwarg = llm.complete("ignored", chunks=ids, question=QUESTION)
    assert by_kwarg.additional_kwargs["chunk_ids"] == ids == by_kwarg.additional_kwargs["chunk_hits"]
    responses = list(llm.stream_complete(render_prompt(texts, QUESTION)))  # any prompt: engine.stream_prompt
    assert len(responses) >= 2 and "".join(r.delta for r in responses) == responses[-1].text
    assert llm.metadata.num_output == MAX_NEW and llm.metadata.is_chat_model  # the model's chat template


def test_llm_finds_the_chunks_in_a_prompt(llm):
    texts = [p.read_text() for p in sorted(DATA.iterdir())[:2]]
    by_prompt = llm.complete(render_prompt(texts, QUESTION))
    assert sorted(by_prompt.additional_kwargs["chunk_hits"]) == sorted(chunk_id(t) for t in texts)


def test_postprocessor_dedups_warms_and_orders(engine):
    fresh = TextNode(text="Drones have no sting and die after mating.")
    fresh.id_ = chunk_id(fresh.text)
    cached_text = (DATA / "01_colony.md").read_text()
    engine.ingest([cached_text], show_progress=False)
    cached = TextNode(text=cached_text, id_=chunk_id(cached_text))
    nodes = [NodeWithScore(node=fresh, score=0.9), NodeWithScore(node=cached, score=0.8),
             NodeWithScore(node=cached, score=0.7)]
    ordered = KVAwareNodePostprocessor(engine=engine, warm=False, reorder_cached_first=True).postprocess_nodes(nodes)
    assert [n.node.id_ for n in ordered] == [cached.id_, fresh.id_]
    pp = KVAwareNodePostprocessor(engine=engine)
    out = pp.postprocess_nodes(nodes)
    assert [n.node.id_ for n in out] == [fresh.id_, cached.id_]  # retrieval order kept by default
    stats = pp.last_stats
    assert stats["misses"] == [fresh.id_] and stats["hits"] == [cached.id_] and stats["duplicates"] == 1
    assert stats["warmed"] == [fresh.id_] and engine.kv_store.contains(KVKey(engine.namespace, fresh.id_))
    pp.postprocess_nodes(nodes)
    assert pp.last_stats["misses"] == []


@pytest.mark.slow
def test_example_runs(home):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(REPO / "examples" / "llamaindex_query_engine.py"), "--home", str(home),
                          "--max-new-tokens", str(MAX_NEW)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "A (streamed):" in out.stdout and "A (aquery):" in out.stdout and "misses 0" in out.stdout
