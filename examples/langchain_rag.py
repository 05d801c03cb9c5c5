"""LangChain RAG on CacheBlend: Chroma → ChunkIdRetriever → CacheBlendPromptTemplate → CacheBlendLLM.

    python examples/langchain_rag.py [--home DIR] [--question "..."]

Ingests examples/data (idempotent), answers with the LCEL stuff chain through CacheBlend, then runs the very
same chain with `HuggingFacePipeline` (langchain-huggingface, same local model folder) swapped in for the
LLM, and compares the time to the first streamed token.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from langchain_cacheblend import (  # noqa: E402
    CacheBlendLLM,
    ChromaRetriever,
    ChunkIdRetriever,
    StatsCallbackHandler,
    create_stuff_chain,
)

from cacheblend_rag import CacheBlendEngine, settings  # noqa: E402
from cacheblend_rag.models.loader import model_folder  # noqa: E402
from cacheblend_rag.ingest import ingest_paths  # noqa: E402
from cacheblend_rag.retrieval.chroma import DEFAULT_COLLECTION, ChromaChunkStore  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def timed_stream(chain, question: str, callbacks=()) -> tuple[str, float]:
    """(answer, seconds to the first non-empty piece) of a streamed chain run."""
    started = time.perf_counter()
    first = None
    pieces = []
    for piece in chain.stream(question, config={"callbacks": list(callbacks)}):
        if piece and first is None:
            first = time.perf_counter() - started
        pieces.append(piece)
    return "".join(pieces).strip(), first if first is not None else time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", help="package home (default: $CACHEBLEND_RAG_HOME or ~/.cache/cacheblend-rag)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--collection", default=DEFAULT_COLLECTION)
    parser.add_argument("--question", default="How many eyes does a honeybee have?")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true", help="skip the HuggingFacePipeline comparison")
    args = parser.parse_args()

    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=settings.kv_dir(args.home), home=args.home)
    store = ChromaChunkStore(args.home, args.collection)
    print("ingest:", ingest_paths([args.data], engine, store, show_progress=False).summary())

    retriever = ChunkIdRetriever(base=ChromaRetriever(store=store, k=args.k))
    llm = CacheBlendLLM(engine=engine, max_new_tokens=args.max_new_tokens)
    chain = create_stuff_chain(retriever, llm)

    stats = StatsCallbackHandler()
    answer = chain.invoke(args.question, config={"callbacks": [stats]})
    info = stats.last
    print(f"\nQ: {args.question}\nA (CacheBlend): {answer}")
    print(f"   chunks {info['chunk_ids']}\n   hits {len(info['chunk_hits'])}/{len(info['chunk_ids'])}, "
          f"recomputed {info['num_recomputed']} tokens, TTFT {info['ttft_s']:.3f} s (first call, cold)")
    _, cacheblend_ttft = timed_stream(chain, args.question)

    if args.skip_hf:
        return
    from langchain_huggingface import HuggingFacePipeline

    hf = HuggingFacePipeline.from_model_id(
        model_id=str(model_folder(args.model, args.home)), task="text-generation", device=-1,
        model_kwargs={"local_files_only": True},
        pipeline_kwargs={"max_new_tokens": args.max_new_tokens, "do_sample": False, "return_full_text": False},
    )
    hf_chain = create_stuff_chain(retriever, hf)  # the same chain, another LLM
    timed_stream(hf_chain, args.question)  # warm-up, as the CacheBlend chain had one above
    hf_answer, hf_ttft = timed_stream(hf_chain, args.question)
    print(f"A (HuggingFacePipeline): {hf_answer}")
    print(f"\ntime to first token (retrieval + prefill): CacheBlend {cacheblend_ttft:.3f} s, "
          f"HuggingFacePipeline {hf_ttft:.3f} s")


if __name__ == "__main__":
    main()
