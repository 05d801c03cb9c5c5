"""`cacheblend-rag bench [DATASET]`: every method on the same model, prompts and token sequences, in one run.

    cacheblend-rag bench --limit 20 --chunks 6 --out bench-results
    cacheblend-rag bench --limit 20 --sweep --out bench-sweep              # quality vs recompute ratio
    cacheblend-rag bench --limit 20 --chunk-tokens 256 --out bench-256     # chunk length sensitivity
    cacheblend-rag bench --limit 10 --concurrency 4 --out bench-load       # + throughput under load
    cacheblend-rag bench --limit 3 --breakdown --out bench-breakdown        # where the prefill time goes

Writes results.json (every record + summary), results.md (the table) and quality_vs_ttft.png under --out.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

DEFAULT_OUT = "bench-results"


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must be within [0, 1], got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser, *, default_out: str | None = DEFAULT_OUT) -> None:
    """The bench options (shared by `cacheblend-rag bench` and `python -m cacheblend_rag.bench.engine_bench`)."""
    from .datasets import DATASET_ENV, DEFAULT_DATASET

    parser.add_argument("dataset", nargs="?", metavar="DATASET",
                        help="MuSiQue-style JSON [{ctxs: [{title, text}], question, answers}] (default: "
                        f"${DATASET_ENV}, else {DEFAULT_DATASET} when present)")
    parser.add_argument("--limit", type=int, default=20, help="questions to run (default 20; 0 = all)")
    parser.add_argument("--chunks", type=int, default=6, help="passages (chunks) per question (default 6)")
    parser.add_argument("--chunk-tokens", type=int, default=None, metavar="N",
                        help="re-cut each question's passages into --chunks chunks of about N tokens (model tokenizer)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated: full_prefill, prefix_cache, full_reuse, cacheblend[@r][/opt=v...], "
                        "stuff, map_reduce, map_rerank, hf_pipeline (default: all; a bare 'cacheblend' means each of "
                        "--ratios)")
    parser.add_argument("--ratios", type=_floats, default=None,
                        help="CacheBlend recompute ratios (default 0.05,0.15,0.30; with --sweep 0.05 … 1.0)")
    parser.add_argument("--sweep", action="store_true",
                        help="quality vs recompute ratio: full prefill, full reuse and CacheBlend at 0.05 … 1.0; "
                        "also writes quality_vs_ratio.png")
    parser.add_argument("--model", default="smollm2-135m", help="packaged model alias or local model folder")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--lead-in", default="prefix", choices=("prefix", "bos", "none"), help="chunk KV lead-in")
    parser.add_argument("--kv-store", default=None, metavar="DIR",
                        help="on-disk KV store (memory tier over it); default: in memory only")
    parser.add_argument("--home", default=None, help="package home (converted models)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per answer (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling/shuffling (decoding is greedy)")
    parser.add_argument("--shuffle", action="store_true", help="take a seeded random sample of questions")
    parser.add_argument("--concurrency", type=int, default=0, metavar="C",
                        help="also replay the questions from C client threads: queries/min and TTFT under load")
    parser.add_argument("--load-methods", default="full_prefill,cacheblend@0.15",
                        help="methods for --concurrency (default full_prefill,cacheblend@0.15)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice); on a shared CPU, fewer threads than "
                        "cores avoids oversubscription")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of the benchmark, time and profile each engine method's prefill: per-layer "
                        "times, rows and attention pairs, and attention / matmul / other shares (breakdown.md)")
    parser.add_argument("--repeats", type=int, default=2, metavar="R",
                        help="timed rounds per question with --breakdown (default 2)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of the chain methods")
    parser.add_argument("--out", default=default_out, metavar="DIR",
                        help="write results.json, results.md and quality_vs_ttft.png here"
                        + (f" (default {default_out})" if default_out else ""))
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def resolve_dataset(value: str | None) -> Path:
    """The dataset path: the argument, else the default; a clear error when there is none."""
    from .datasets import DATASET_ENV, default_dataset

    if value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"dataset {path} not found")
        return path
    path = default_dataset()
    if path is None:
        raise FileNotFoundError(f"no DATASET given and no default found (set ${DATASET_ENV} or pass a path to a "
                                "MuSiQue-style JSON file)")
    return path


def _questions_and_engine(args: argparse.Namespace, dataset: Path):
    """The questions to run and the engine to run them on, as the options say (threads set first)."""
    from ..engine import CacheBlendEngine
    from .datasets import load_dataset

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    items = load_dataset(dataset, args.limit or None, shuffle=args.shuffle, seed=args.seed)
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=args.kv_store, device=args.device,
                                              dtype=args.dtype, home=args.home, lead_in=args.lead_in)
    return items, engine


def execute(args: argparse.Namespace, *, default_engine_only: bool = False) -> dict:
    """Run the benchmark described by parsed args; prints the table, writes outputs; returns the result."""
    from . import engine_bench as eb
    from .datasets import question_passages
    from .load import format_load_table, run_load
    from .report import write_outputs

    dataset = resolve_dataset(args.dataset)
    if args.breakdown:
        return _execute_breakdown(args, dataset)
    ratios = args.ratios or (eb.SWEEP_RATIOS if args.sweep else eb.DEFAULT_RATIOS)
    methods = args.methods or (None if args.sweep or not default_engine_only else ",".join(eb.DEFAULT_METHODS))
    needs_hf = methods is None and not args.sweep
    hf = False
    if needs_hf or (methods and "hf_pipeline" in methods):
        from .chains import hf_available

        hf = hf_available()
        if methods and "hf_pipeline" in methods and not hf:
            raise ValueError("hf_pipeline needs langchain-huggingface: pip install --no-deps langchain-huggingface")
    specs = eb.parse_methods(methods, ratios, sweep=args.sweep, hf_available=hf)
    load_specs = [eb.MethodSpec.parse(m) for m in args.load_methods.split(",") if m.strip()] if args.concurrency else []

    items, engine = _questions_and_engine(args, dataset)
    show = not args.quiet
    result = eb.run(engine, items, specs, num_chunks=args.chunks, max_new_tokens=args.max_new_tokens,
                    show_progress=show, chunk_tokens=args.chunk_tokens, seed=args.seed, warmup=not args.no_warmup)
    if load_specs:
        questions = []
        for item in items:
            ids = engine.ingest(question_passages(item, args.chunks, args.chunk_tokens, engine.tokenizer),
                                show_progress=False)
            questions.append((ids, item["question"]))
        result["throughput"] = run_load(engine, questions, load_specs, concurrency=args.concurrency,
                                        max_new_tokens=args.max_new_tokens, seed=args.seed, show_progress=show)
    else:
        result["throughput"] = None
    result["meta"] = {
        "dataset": str(dataset), "dataset_name": dataset.stem, "questions": len(items), "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens, "methods": [s.label for s in specs], "ratios": list(ratios),
        "sweep": args.sweep, "model": args.model, "dtype": str(engine.adapter.dtype).removeprefix("torch."),
        "device": str(engine.adapter.device), "lead_in": args.lead_in, "kv_store": args.kv_store,
        "max_new_tokens": args.max_new_tokens, "seed": args.seed, "shuffle": args.shuffle,
        "concurrency": args.concurrency, "warmup": not args.no_warmup, "machine": eb.machine(),
    }
    result = {"meta": result.pop("meta"), **result}

    ing = result["ingest"]
    print(f"\n{len(items)} questions × {args.chunks} chunks, {result['meta']['dtype']}, lead-in {args.lead_in}; "
          f"{eb.machine()}")
    print(f"ingestion: {ing['tokens']} tokens in {ing['seconds']:.1f} s"
          + (f" ({ing['tokens_per_s']:.0f} tokens/s)" if ing["tokens_per_s"] else ""))
    print(eb.format_table(result["summary"]))
    if result["throughput"]:
        print(format_load_table(result["throughput"]))
    if args.out:
        paths = write_outputs(result, args.out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return result


def _execute_breakdown(args: argparse.Namespace, dataset: Path) -> dict:
    """`bench --breakdown`: per-layer times and op shares of each engine method; prints and writes them."""
    import json

    from . import engine_bench as eb
    from .breakdown import format_breakdown
    from .breakdown import run as run_breakdown

    specs = eb.parse_methods(args.methods or ",".join(eb.DEFAULT_METHODS), args.ratios or eb.DEFAULT_RATIOS)
    chains = [s.label for s in specs if s.is_chain]
    if chains:
        raise ValueError(f"--breakdown times the engine's prefill; chains have no layers: {', '.join(chains)}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be ≥ 1, got {args.repeats}")
    items, engine = _questions_and_engine(args, dataset)
    summary = run_breakdown(engine, items, specs, num_chunks=args.chunks, chunk_tokens=args.chunk_tokens,
                            repeats=args.repeats, show_progress=not args.quiet)
    table = format_breakdown(summary)
    header = (f"{len(items)} questions × {args.chunks} chunks, {str(engine.adapter.dtype).removeprefix('torch.')}, "
              f"{args.repeats} timed rounds each; {eb.machine()}")
    print(f"\n{header}\n{table}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "breakdown.md").write_text(f"{header}\n\n{table}\n")
        finite = {label: {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
                  for label, row in summary.items()}  # strict JSON has no NaN
        (out / "breakdown.json").write_text(json.dumps({"meta": {"dataset": str(dataset), "questions": len(items),
                                                                  "chunks": args.chunks, "machine": eb.machine()},
                                                         "summary": finite}, indent=1))
        print(f"wrote {out / 'breakdown.md'}, {out / 'breakdown.json'}")
    return summary


def main(argv: list[str] | None = None, *, default_engine_only: bool = False, prog: str | None = None) -> int:
    """Stand-alone entry (argparse of its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(parser, default_out=None if default_engine_only else DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        execute(args, default_engine_only=default_engine_only)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return 0


def run_cli(args: argparse.Namespace) -> int:
    """`cacheblend-rag bench` handler: exit code 0, or 2 with a message on bad input."""
    try:
        execute(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
