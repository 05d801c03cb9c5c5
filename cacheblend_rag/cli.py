"""`cacheblend-rag`: ingest files (Chroma + precomputed KV) and ask questions over them.

    cacheblend-rag ingest PATH... [--home DIR] [--model NAME] [--memory-budget 512MiB] [--follow-symlinks]
                          [--kv-codec fp16|int8|cachegen] [--neighbor-variants K]
    cacheblend-rag ingest --from-chroma COLLECTION [--chroma-path DIR | --host H --port P]  # your own Chroma
    cacheblend-rag ask "question" [--home DIR] [--k 6] [--method relevance] [--ratio 0.15] [--json]  # (1)
    cacheblend-rag serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--home DIR] [--model NAME]
    ... --kv-store memory --kv-store disk:PATH --kv-store redis://HOST:6379/0?prefix=NAME   # KV tiers, any command
    cacheblend-rag delete PATH...      # remove the chunks (and KV) of these files or folders
    cacheblend-rag prune               # remove the chunks (and KV) of files that no longer exist
    cacheblend-rag calibrate [--model NAME] [--method relevance] [--target-kl 0.05]  # the fidelity gate's ratio

Exit codes: 0 done; 1 failed (the `error:` line says why: a server that cannot be reached, KV that could not be
stored, an empty collection, ...); 2 bad usage (an option out of range, an empty question, no such device).

Subcommands are added by the functions in `REGISTRARS` (the core's: one module each under `commands/`); each
takes the argparse subparsers object, adds its parser and sets `func` (called with the parsed args, returning an
exit code). Other distributions add theirs the same way through the entry-point group `cacheblend_rag.commands`
(name = subcommand, object = registrar):
(1) `ask` (a LangChain chain) comes with langchain-cacheblend, `bench` and `codec-bench` with the benchmarks
(benchmarks/); without them the subcommand says in one line what to install.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Callable, Sequence

from .arguments import parse_size, positive_int
from .commands.calibrate import add_calibrate
from .commands.common import (
    DEFAULT_COLLECTION,
    DEFAULT_MEMORY_BUDGET,
    DTYPES,
    add_data_arguments,
    add_kv_store_argument,
    add_model_arguments,
    add_model_run_arguments,
    check_device,
    chunk_store,
    cpu_threads,
    kv_store_spec,
    kv_tier,
    model_options,
    open_engine,
    policy_option,
    process_age,
    ratio_arg,
    shown,
)
from .commands.delete import add_delete, add_prune
from .commands.ingest import add_ingest
from .commands.plan import add_plan, plan_figures
from .commands.profile import add_profile
from .commands.profile import print_codec_choice as _print_codec_choice
from .commands.serve import add_serve
from .commands.train_links import add_train_links
from .errors import CacheBlendError, ConfigError

__all__ = [  # the parser and its runners, and what plugins (ask, bench), benchmarks and tests import from here
    "DEFAULT_COLLECTION", "DEFAULT_MEMORY_BUDGET", "DTYPES", "PLUGIN_GROUP", "PLUGIN_HINTS", "REGISTRARS",
    "add_data_arguments", "add_kv_store_argument", "add_model_arguments", "add_model_run_arguments", "build_parser",
    "check_device", "chunk_store", "console_main", "cpu_threads", "kv_store_spec", "kv_tier", "main", "model_options",
    "open_engine", "parse_size", "plan_figures", "policy_option", "positive_int", "process_age", "ratio_arg",
    "run_parsed", "shown",
]


class _Parser(argparse.ArgumentParser):
    """Bad usage: one `error:` line naming the command and where its options are listed, exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [add_ingest, add_profile, add_delete, add_prune,
                                                                  add_plan, add_serve, add_calibrate,
                                                                  add_train_links]
"""Subcommand registrars (one module each under `commands/`), in help order; append one to add a subcommand."""


# ---- subcommands of other distributions (entry points) -----------------------------------


PLUGIN_GROUP = "cacheblend_rag.commands"
"""Entry-point group of subcommands other distributions add: name = the subcommand, object = a registrar."""

PLUGIN_HINTS = {
    "ask": "the LangChain integration: pip install -e integrations/langchain-cacheblend",
    "bench": "the benchmarks: pip install -e 'benchmarks[chains]'",
    "codec-bench": "the benchmarks: pip install -e 'benchmarks[chains]'",
}
"""Where the well-known plugin subcommands come from, said in one line when one is not installed."""


def _not_installed(name: str, hint: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"error: `cacheblend-rag {name}` comes with {hint}", file=sys.stderr)
        return 1

    return run


def _add_plugins(subparsers) -> None:
    """The subcommands registered in the entry-point group `cacheblend_rag.commands`, and a one-line install hint
    for a well-known one that is not installed. The core never imports a plugin by name: this is its only door."""
    from importlib.metadata import entry_points

    found = set()
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        if ep.name in subparsers.choices:
            logging.getLogger(__name__).warning("%s: %s is already a subcommand; %s is ignored", PLUGIN_GROUP,
                                                ep.name, ep.value)
            continue
        ep.load()(subparsers)
        found.add(ep.name)
    for name, hint in PLUGIN_HINTS.items():
        if name not in found:
            p = subparsers.add_parser(name, help=f"(not installed: {hint})", add_help=False)
            p.set_defaults(func=_not_installed(name, hint), any_arguments=True)  # its own options are unknown here


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand, those of installed plugins last."""
    parser = _Parser(prog="cacheblend-rag", description=__doc__.split("\n")[0])
    parser.set_defaults(any_arguments=False)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for register in REGISTRARS:
        register(subparsers)
    _add_plugins(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not args.any_arguments:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_parsed(args)


def run_parsed(args: argparse.Namespace) -> int:
    """Run a parsed subcommand's `func` with the CLI's logging and exit codes (shared by plugin scripts)."""
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ConfigError as e:  # bad usage: an argument the parser could not check alone
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CacheBlendError, OSError) as e:  # the package's own errors, a disk or a network that failed
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def console_main() -> int:
    """The `cacheblend-rag` script (and `python -m cacheblend_rag.cli`): `main`, then a cheap exit. After torch,
    transformers and Chroma are imported, the interpreter's last garbage collections walk millions of objects:
    1.2-2.0 s of every command's wall time on the project's 2-core CPU (issue #41). Freezing them
    first (`gc.freeze`) skips those walks; atexit handlers and reference-counted clean-up still run (only objects
    in reference cycles go unfinalized, which Python never promised at exit anyway)."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(console_main())
