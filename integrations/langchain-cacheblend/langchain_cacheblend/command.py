"""`cacheblend-rag ask`: a question answered by a LangChain chain over the ingested chunks.

The core CLI finds this subcommand through the entry-point group `cacheblend_rag.commands` (this package's
pyproject.toml), so `cacheblend_rag` never imports LangChain for it. The chain modules are imported when the
command runs, not when the CLI builds its parser.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cacheblend_rag.arguments import positive_int
from cacheblend_rag.cli import (
    add_data_arguments,
    check_device,
    chunk_store,
    cpu_threads,
    open_engine,
    policy_option,
    process_age,
    ratio_arg,
)
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.policies import POLICIES, takes_ratio
from cacheblend_rag.request import DEFAULT_METHOD, DEFAULT_RECOMPUTE_RATIO

CHAINS = ("map_reduce", "map_rerank")


def add_ask(subparsers: argparse._SubParsersAction) -> None:
    """The `cacheblend-rag ask` parser (registered in the entry-point group `cacheblend_rag.commands`)."""
    p = subparsers.add_parser("ask", help="answer a question from the ingested chunks",
                              description="Retrieve the top-k chunks and answer through CacheBlend (or the chosen "
                              "prefill method, or a map-reduce / map-rerank chain).")
    p.add_argument("question", help="the question (must not be empty)")
    add_data_arguments(p)
    p.add_argument("--k", type=positive_int, default=6, help="chunks to retrieve (default 6)")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=(*POLICIES, *CHAINS),
                   help=f"prefill method (stuff chain) or chain; default {DEFAULT_METHOD}")
    p.add_argument("--option", action="append", type=policy_option, default=[], metavar="KEY=VALUE",
                   help="an option of the method's policy, e.g. --option check_layers=[1,2] --option guard=0.1 "
                        "(VALUE is JSON, else a string; repeatable)")
    p.add_argument("--ratio", type=ratio_arg, default=None,
                   help="recompute ratio in [0, 1] (default: the model's calibrated ratio, `cacheblend-rag "
                        f"calibrate`, else {DEFAULT_RECOMPUTE_RATIO})")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help='stop the answer at TEXT (repeatable; default: a blank line or a new "Question:" line; '
                        '--stop "" for none)')
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: one per core that other processes leave idle, at least 1)")
    p.add_argument("--compare", action="store_true",
                   help="also time a full prefill of the same prompt in this process (one token) and print the "
                        "speedup; the engine's TTFT is the prefill alone, start-up is printed beside it")
    p.add_argument("--json", action="store_true", help="print one JSON object: answer, chunks, stats")
    p.set_defaults(func=_run_ask)


def _merge_stats(requests: list[dict], chain: str) -> dict:
    """One stats dict for the run: the single call's stats, or a merge over map/reduce calls."""
    if not requests:
        return {"chain": chain, "llm_calls": 0}
    if len(requests) == 1:
        return {"chain": chain, "llm_calls": 1, **requests[0]}
    per_chunk: dict[str, str] = {}
    for r in requests:
        for cid, state in r.get("per_chunk", {}).items():
            per_chunk[cid] = "hit" if per_chunk.get(cid) == "hit" or state == "hit" else state
    return {
        "chain": chain, "llm_calls": len(requests), "method": requests[0].get("method"),
        "chunk_hits": [c for c, s in per_chunk.items() if s == "hit"],
        "chunk_misses": [c for c, s in per_chunk.items() if s != "hit"],
        "per_chunk": per_chunk,
        "num_recomputed": sum(r.get("num_recomputed", 0) for r in requests),
        "ttft_s": requests[0].get("ttft_s"), "total_ttft_s": sum(r.get("ttft_s", 0.0) for r in requests),
        "calls": requests,
    }


def _run_ask(args: argparse.Namespace) -> int:
    import torch
    from langchain_cacheblend.callbacks import StatsCallbackHandler
    from langchain_cacheblend.chains import create_map_reduce_chain, create_map_rerank_chain, create_stuff_chain
    from langchain_cacheblend.llms import CacheBlendLLM
    from langchain_cacheblend.retrievers import ChromaRetriever, ChunkIdRetriever

    if not args.question.strip():
        raise ConfigError('the question is empty; ask something, e.g. cacheblend-rag ask "How many eyes does a '
                          'honeybee have?"')
    check_device(args.device)
    torch.set_num_threads(cpu_threads(args.threads))
    store = chunk_store(args, create=False)
    if store.count() == 0:
        print(f"error: collection {args.collection!r} at {store.location} is empty: nothing to answer from; run "
              "`cacheblend-rag ingest PATH` with the same --home/--collection first", file=sys.stderr)
        return 1
    engine = open_engine(args)
    startup_s = process_age()  # process start → engine ready: interpreter, imports, Chroma, model load
    method = args.method if args.method in POLICIES else DEFAULT_METHOD
    # One paragraph by default; a base model (no chat template, e.g. gemma3-270m) answering the plain template's
    # "Question: ...\nAnswer:" goes on to write the next "Question:" after a single newline.
    stop = [s for s in (args.stop if args.stop is not None else ["\n\n", "\nQuestion:"]) if s]
    llm = CacheBlendLLM(engine=engine, model=args.model, method=method, recompute_ratio=args.ratio,
                        max_new_tokens=args.max_new_tokens, stop=stop or None, policy_options=dict(args.option))
    retriever = ChunkIdRetriever(base=ChromaRetriever(store=store, k=args.k))
    make = {"map_reduce": create_map_reduce_chain, "map_rerank": create_map_rerank_chain}.get(args.method,
                                                                                             create_stuff_chain)
    handler = StatsCallbackHandler()
    started = time.perf_counter()
    answer = make(retriever, llm).invoke(args.question, config={"callbacks": [handler]})
    answer_s = time.perf_counter() - started
    chunk_ids = handler.retrieved[-1] if handler.retrieved else []
    stats = _merge_stats(handler.requests, args.method if args.method in CHAINS else "stuff")
    stats.update(startup_s=startup_s, answer_s=answer_s, threads=torch.get_num_threads())
    if args.compare and args.method not in CHAINS and method != "full_prefill":
        # the same chain and prompt, fully prefilled, after the answer (any first-call cost was the answer's)
        base = CacheBlendLLM(engine=engine, model=args.model, method="full_prefill", max_new_tokens=1)
        baseline = StatsCallbackHandler()
        make(retriever, base).invoke(args.question, config={"callbacks": [baseline]})
        stats["full_prefill_ttft_s"] = baseline.requests[-1].get("ttft_s") if baseline.requests else None
    if args.json:
        print(json.dumps({"answer": answer, "chunks": chunk_ids, "stats": stats}))
        return 0
    print(answer)
    per_chunk = stats.get("per_chunk", {})
    hits = sum(1 for s in per_chunk.values() if s == "hit")
    line = f"[{stats.get('method')}, {stats['chain']} chain, {stats['llm_calls']} LLM call(s)] " \
           f"chunks: {len(chunk_ids)} retrieved, {hits} KV hits, {len(per_chunk) - hits} misses"
    if stats.get("method") in POLICIES and takes_ratio(POLICIES[stats["method"]]) \
            and "recompute_ratio_effective" in stats:
        line += f"; recomputed {100 * stats['recompute_ratio_effective']:.1f}% of reused tokens"
    print(line)
    print(_timing_line(stats))
    return 0


def _timing_line(stats: dict) -> str:
    """TTFT (the engine's prefill alone), the speedup over a full prefill when compared, then what came before and
    after it: start-up (process start → engine ready) and the whole answer."""
    parts = []
    ttft, full = stats.get("ttft_s"), stats.get("full_prefill_ttft_s")
    if ttft is not None:
        parts.append(f"TTFT {ttft:.3f} s (the engine's prefill of {stats.get('num_tokens', '?')} tokens)")
        if full:
            parts.append(f"full prefill of the same prompt {full:.3f} s: {full / ttft:.1f}x faster")
    parts.append(f"answer {stats['answer_s']:.1f} s")
    if stats.get("startup_s") is not None:
        parts.append(f"start-up {stats['startup_s']:.1f} s (process start → engine ready: imports, Chroma, model)")
    parts.append(f"{stats['threads']} torch thread(s)")
    return "; ".join(parts)
