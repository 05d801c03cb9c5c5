"""The bench's command lines: `cacheblend-bench run|codecs ...`, and the `bench` / `codec-bench` subcommands it
registers in `cacheblend-rag` (entry-point group `cacheblend_rag.commands`, see benchmarks/pyproject.toml).

A registrar takes an argparse subparsers object, adds one parser and sets `func` (called with the parsed args,
returning an exit code), as the core CLI's own registrars do. Heavy imports wait until a command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

BENCH_HELP = "benchmark every method (TTFT, quality, agreement) on MuSiQue-style data"
BENCH_DESCRIPTION = ("One study per subcommand, on the same model and MuSiQue-style prompts: `methods` runs full "
                     "prefill, prefix cache, full reuse, CacheBlend at several ratios, the LangChain chains and "
                     "HuggingFacePipeline side by side (results.json, results.md, quality_vs_ttft.png); the others "
                     "each answer one question (where the time goes, loading, recurring chunks, fidelity per frame, "
                     "conversations, agents, the server under load and faults).")
CODECS_HELP = "KV codecs on real KV: size, error, speed and first-token KL"


def add_bench(subparsers: argparse._SubParsersAction, name: str = "bench") -> None:
    """The bench parser (`cacheblend-rag bench`, `cacheblend-bench run`)."""
    from .command import add_arguments, run_cli

    p = subparsers.add_parser(name, help=BENCH_HELP, description=BENCH_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run_cli)


def _run_codec_bench(args: argparse.Namespace) -> int:
    from .codec_bench import run

    run(args)
    return 0


def add_codec_bench(subparsers: argparse._SubParsersAction, name: str = "codec-bench") -> None:
    """The codec bench parser (`cacheblend-rag codec-bench`, `cacheblend-bench codecs`)."""
    from .codec_bench import add_arguments

    p = subparsers.add_parser(name, help=CODECS_HELP, description=CODECS_HELP + ".")
    add_arguments(p)
    p.set_defaults(func=_run_codec_bench)


def build_parser() -> argparse.ArgumentParser:
    """`cacheblend-bench` with its subcommands."""
    parser = argparse.ArgumentParser(prog="cacheblend-bench", description="Benchmarks of cacheblend-rag.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_bench(subparsers, "run")
    add_codec_bench(subparsers, "codecs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cacheblend-bench`; returns the exit code."""
    from cacheblend_rag.cli import run_parsed

    return run_parsed(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
