"""`cacheblend-rag`: ingest files (Chroma + precomputed KV) and ask questions over them.

    cacheblend-rag ingest PATH... [--home DIR] [--model NAME] [--kv-codec fp16|int8|cachegen]
    cacheblend-rag ask "question" [--home DIR] [--k 6] [--method cacheblend] [--ratio 0.15] [--json]
    cacheblend-rag serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--home DIR] [--model NAME]

Subcommands are added by the functions in `REGISTRARS`; each takes the argparse subparsers object, adds its
parser and sets `func` (called with the parsed args, returning an exit code). To add one (e.g. `bench`),
write `_add_bench(subparsers)` and append it to `REGISTRARS`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from . import settings
from .errors import CacheBlendError
from .fuse.policies import METHODS
from .models.loader import DEFAULT_MODEL

CHAINS = ("map_reduce", "map_rerank")
DEFAULT_COLLECTION = "cacheblend_chunks"  # same as retrieval.chroma.DEFAULT_COLLECTION, without importing chromadb


def _common(parser: argparse.ArgumentParser) -> None:
    """Options every data subcommand shares."""
    parser.add_argument("--home", help=f"package home (models, KV store, Chroma); overrides ${settings.ENV_HOME}")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged model alias or local model folder "
                        f"(default {DEFAULT_MODEL}); use the same one for ingest and ask")
    parser.add_argument("--collection", default=DEFAULT_COLLECTION, help="Chroma collection (3-512 characters)")
    parser.add_argument("--host", help="Chroma server host (default: the embedded database under --home)")
    parser.add_argument("--port", type=int, help="Chroma server port")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages to stderr")


def _engine_and_store(args: argparse.Namespace):
    from .engine import CacheBlendEngine
    from .retrieval.chroma import ChromaChunkStore

    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=settings.kv_dir(args.home), device=args.device,
                                              dtype=args.dtype, home=args.home,
                                              kv_codec=getattr(args, "kv_codec", "fp16"))
    store = ChromaChunkStore(args.home, args.collection, host=args.host, port=args.port)
    return engine, store


# ---- ingest -------------------------------------------------------------------------------


def _add_ingest(subparsers) -> None:
    p = subparsers.add_parser("ingest", help="embed files into Chroma and precompute their chunks' KV",
                              description="Load .txt/.md/.json/.jsonl files or folders, split them into chunks of "
                              "~512 model tokens, upsert them into Chroma and precompute their KV. Idempotent.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders")
    _common(p)
    p.add_argument("--chunk-tokens", type=int, default=512, help="chunk size in model tokens (default 512)")
    p.add_argument("--kv-codec", default="fp16", metavar="NAME",
                   help="how new chunk KV is stored on disk: fp16 (exact, default), int8 (~2x smaller) or cachegen "
                        "(~5x smaller); stores may mix codecs, every file names its own")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_run_ingest)


def _run_ingest(args: argparse.Namespace) -> int:
    from .retrieval.pipeline import ingest_paths

    engine, store = _engine_and_store(args)
    report = ingest_paths(args.paths, engine, store, chunk_tokens=args.chunk_tokens, show_progress=not args.quiet)
    if args.json:
        print(json.dumps({**report.as_dict(), "collection": args.collection, "home": str(settings.home_dir(args.home)),
                          "stored_chunks": store.count()}))
    else:
        status = "nothing new" if report.new_chunks == 0 else f"{report.new_chunks} new chunks"
        print(f"ingested: {report.summary()} — {status}; collection {args.collection!r} now holds "
              f"{store.count()} chunks ({store.location})")
    return 0


# ---- ask ----------------------------------------------------------------------------------


def _add_ask(subparsers) -> None:
    p = subparsers.add_parser("ask", help="answer a question from the ingested chunks",
                              description="Retrieve the top-k chunks and answer through CacheBlend (or the chosen "
                              "prefill method, or a map-reduce / map-rerank chain).")
    p.add_argument("question")
    _common(p)
    p.add_argument("--k", type=int, default=6, help="chunks to retrieve (default 6)")
    p.add_argument("--method", default="cacheblend", choices=METHODS + CHAINS,
                   help="prefill method (stuff chain) or chain; default cacheblend")
    p.add_argument("--ratio", type=float, default=0.15, help="CacheBlend recompute ratio (default 0.15)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help='stop the answer at TEXT (repeatable; default: a blank line; --stop "" for none)')
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
    from .integrations.langchain import (
        CacheBlendLLM,
        ChromaRetriever,
        ChunkIdRetriever,
        StatsCallbackHandler,
        create_map_reduce_chain,
        create_map_rerank_chain,
        create_stuff_chain,
    )

    engine, store = _engine_and_store(args)
    if store.count() == 0:
        print(f"error: collection {args.collection!r} at {store.location} is empty; run `cacheblend-rag ingest PATH` "
              "with the same --home/--collection first", file=sys.stderr)
        return 1
    method = args.method if args.method in METHODS else "cacheblend"
    stop = [s for s in (args.stop if args.stop is not None else ["\n\n"]) if s]  # one paragraph by default
    llm = CacheBlendLLM(engine=engine, model=args.model, method=method, recompute_ratio=args.ratio,
                        max_new_tokens=args.max_new_tokens, stop=stop or None)
    retriever = ChunkIdRetriever(base=ChromaRetriever(store=store, k=args.k))
    make = {"map_reduce": create_map_reduce_chain, "map_rerank": create_map_rerank_chain}.get(args.method,
                                                                                             create_stuff_chain)
    handler = StatsCallbackHandler()
    answer = make(retriever, llm).invoke(args.question, config={"callbacks": [handler]})
    chunk_ids = handler.retrieved[-1] if handler.retrieved else []
    stats = _merge_stats(handler.requests, args.method if args.method in CHAINS else "stuff")
    if args.json:
        print(json.dumps({"answer": answer, "chunks": chunk_ids, "stats": stats}))
        return 0
    print(answer)
    per_chunk = stats.get("per_chunk", {})
    hits = sum(1 for s in per_chunk.values() if s == "hit")
    line = f"[{stats.get('method')}, {stats['chain']} chain, {stats['llm_calls']} LLM call(s)] " \
           f"chunks: {len(chunk_ids)} retrieved, {hits} KV hits, {len(per_chunk) - hits} misses"
    if stats.get("method") == "cacheblend" and "recompute_ratio_effective" in stats:
        line += f"; recomputed {100 * stats['recompute_ratio_effective']:.1f}% of reused tokens"
    if stats.get("ttft_s") is not None:
        line += f"; TTFT {stats['ttft_s']:.3f} s"
    print(line)
    return 0


# ---- entry point --------------------------------------------------------------------------

# ---- profile ------------------------------------------------------------------------------


def _add_profile(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure (once) and print the compute and storage profiles",
                              description="Per-layer recompute time and read throughput of each storage tier, "
                              "as the loading controller (recompute_ratio='auto') uses them.")
    p.add_argument("--home", help=f"package home; overrides ${settings.ENV_HOME}")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--remeasure", action="store_true", help="measure again instead of reading the cache")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .engine import CacheBlendEngine
    from .loading.profile import load_or_measure, profile_path

    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=settings.kv_dir(args.home), device=args.device,
                                              dtype=args.dtype, home=args.home)
    compute, tiers = load_or_measure(engine, settings.kv_dir(args.home), remeasure=args.remeasure, home=args.home,
                                     strict=True)  # a tier that cannot be measured is an error here
    if args.json:
        print(json.dumps({"compute": asdict(compute), "tiers": {k: asdict(v) for k, v in tiers.items()},
                          "path": str(profile_path(engine, args.home))}))
        return 0
    a = engine.adapter
    print(f"model {args.model} ({a.num_layers} layers) on {a.device}, {a.dtype}; cached in {profile_path(engine, args.home)}")
    print(f"full prefill of {compute.num_tokens} tokens: {compute.full_prefill_s:.2f} s "
          f"({compute.full_prefill_s / (compute.num_tokens * a.num_layers) * 1e6:.1f} µs per token per layer)")
    print(f"selective layer: {compute.layer_fixed_s * 1e3:.2f} ms + {compute.layer_per_row_s * 1e6:.2f} µs per "
          f"recomputed token (at a {compute.num_tokens}-token context)")
    for name, tier in tiers.items():
        print(f"tier {name}: {tier.read_bytes_per_s / 1e9:.2f} GB/s")
    return 0


REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [_add_ingest, _add_ask, _add_profile]
"""Subcommand registrars, in help order; append one to add a subcommand (e.g. bench)."""


# ---- bench --------------------------------------------------------------------------------


def _add_bench(subparsers) -> None:
    from .bench.command import add_arguments, run_cli

    p = subparsers.add_parser("bench", help="benchmark every method (TTFT, quality, agreement) on MuSiQue-style data",
                              description="Run full prefill, prefix cache, full reuse, CacheBlend at several ratios, "
                              "the LangChain stuff / map-reduce / map-rerank chains and HuggingFacePipeline on the "
                              "same model and prompts; write results.json, results.md and quality_vs_ttft.png. "
                              "--breakdown: where the prefill time goes; --loading: KV in memory vs on disk.")
    add_arguments(p)
    p.set_defaults(func=run_cli)


REGISTRARS.append(_add_bench)


# ---- serve --------------------------------------------------------------------------------


def _add_serve(subparsers) -> None:
    from .serve.command import add_arguments, run_cli

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (chat/completions with documents)",
                              description="Serve the engine over HTTP: OpenAI-compatible /v1/chat/completions and "
                              "/v1/completions (with documents, chunk_ids, retrieval and cacheblend options), "
                              "/v1/models, /health and Prometheus /metrics. Binds 127.0.0.1 by default.")
    add_arguments(p)
    p.set_defaults(func=run_cli)


REGISTRARS.append(_add_serve)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="cacheblend-rag", description=__doc__.split("\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in REGISTRARS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except CacheBlendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
