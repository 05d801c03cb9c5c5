"""LlamaIndex query engine on CacheBlend: stable chunk-id nodes, KV-aware postprocessing, one fused prompt.

    python examples/llamaindex_query_engine.py [--home DIR] [--question "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from llama_index.llms.cacheblend import (  # noqa: E402
    CacheBlendLLM,
    LocalEmbedding,
    as_query_engine,
    build_index,
    load_documents,
)
from llama_index.core import Settings  # noqa: E402

from cacheblend_rag import CacheBlendEngine, settings  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", help="package home (default: $CACHEBLEND_RAG_HOME or ~/.cache/cacheblend-rag)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--question", default="How long does a queen take to develop?")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=settings.kv_dir(args.home), home=args.home)
    llm = CacheBlendLLM(engine=engine, max_new_tokens=args.max_new_tokens)
    Settings.llm, Settings.embed_model = llm, LocalEmbedding()  # never the OpenAI defaults

    index = build_index(load_documents([args.data]), engine)
    query_engine = as_query_engine(index, llm=llm, similarity_top_k=args.k)
    response = query_engine.query(args.question)
    kv = query_engine._node_postprocessors[0].last_stats
    print(f"Q: {args.question}\nA: {response}")
    print(f"   nodes {[n.node.id_ for n in response.source_nodes]}\n   KV hits {len(kv['hits'])}, "
          f"misses {len(kv['misses'])}")

    streaming = as_query_engine(index, llm=llm, similarity_top_k=args.k, streaming=True)
    print("A (streamed): ", end="", flush=True)
    streaming.query(args.question).print_response_stream()
    print()
    print("A (aquery):", asyncio.run(query_engine.aquery(args.question)))


if __name__ == "__main__":
    main()
