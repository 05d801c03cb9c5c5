"""LangChain's RAG tutorial chain, unchanged but for the model: ChatCacheBlend reuses the retrieved chunks' KV.

    python examples/langchain_chat_tutorial.py [--home DIR] [--question "..."]

retriever | format_docs | ChatPromptTemplate (your own system prompt) | ChatCacheBlend — the chunks appear in the
prompt verbatim, so the engine finds them and fuses their cached KV. Prints the answer and the stats.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from cacheblend_rag import CacheBlendEngine, settings  # noqa: E402
from cacheblend_rag.ingest import ingest_paths  # noqa: E402
from cacheblend_rag.retrieval.chroma import ChromaChunkStore  # noqa: E402
from langchain_cacheblend import ChatCacheBlend, ChromaRetriever  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def format_docs(docs) -> str:
    """The tutorial's own: page contents joined by blank lines."""
    return "\n\n".join(d.page_content for d in docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", help="package home (default: $CACHEBLEND_RAG_HOME or ~/.cache/cacheblend-rag)")
    parser.add_argument("--collection", default="cacheblend_chat_tutorial")
    parser.add_argument("--question", default="How many eyes does a honeybee have?")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    engine = CacheBlendEngine.from_pretrained("smollm2-135m", kv_store=settings.kv_dir(args.home), home=args.home)
    store = ChromaChunkStore(args.home, args.collection)
    print("ingest:", ingest_paths([DATA], engine, store, show_progress=False).summary())  # embeddings + chunk KV

    llm = ChatCacheBlend(engine=engine, max_tokens=args.max_tokens)  # the only line that differs from the tutorial
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                   "context to answer the question. Keep the answer concise.\n\n{context}"),
        ("human", "{question}"),
    ])
    chain = {"context": ChromaRetriever(store=store, k=3) | format_docs, "question": RunnablePassthrough()} \
        | prompt | llm
    reply = chain.invoke(args.question)
    stats = reply.response_metadata["cacheblend"]
    print(f"Q: {args.question}\nA: {reply.content}")
    print(f"   chunk hits {len(stats['chunk_hits'])}, misses {len(stats['chunk_misses'])}, "
          f"recomputed share {stats['recomputed_share']:.2f}, TTFT {stats['ttft_s']:.3f} s")
    print(f"   tokens: {reply.usage_metadata}")


if __name__ == "__main__":
    main()
