"""What the subcommands share: argument types (a bad value is a usage error, exit 2, never a traceback), the
data and model arguments, and opening the engine and the chunk store they name."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .. import settings
from ..arguments import parse_size, positive_int
from ..errors import ConfigError
from ..models.loader import DEFAULT_MODEL

DEFAULT_COLLECTION = "cacheblend_chunks"  # same as retrieval.chroma.DEFAULT_COLLECTION, without importing chromadb
DEFAULT_MEMORY_BUDGET = "512MiB"  # the KV store's memory tier in a CLI process (ingest writes through to disk)
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LISTED = 20  # skipped files listed one per line; the rest are counted


def policy_option(text: str) -> tuple[str, object]:
    """`--option KEY=VALUE`: VALUE read as JSON (a list becomes a tuple), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.strip(), tuple(parsed) if isinstance(parsed, list) else parsed


def ratio_arg(text: str) -> float:
    """`--ratio`: a fraction in [0, 1], refused at parse time by the default method's own constructor (the one
    check of a recompute ratio), so a bad one is a usage error before the model loads."""
    from ..fuse.policies import DEFAULT_METHOD, make_policy  # lazily: it brings torch

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction in [0, 1]") from None
    try:
        make_policy(DEFAULT_METHOD, value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{e} (a fraction of the reused tokens)") from None
    return value


_TIER_STARTS = ("memory", "disk:", "redis://", "rediss://", "unix://")


def kv_tier(text: str) -> str:
    """One `--kv-store` tier: "memory", "disk:PATH" or a redis://, rediss:// or unix:// URL (checked, not opened)."""
    spec = text.strip()
    if spec == "memory" or (spec.startswith("disk:") and len(spec) > 5):
        return spec
    if spec.startswith(_TIER_STARTS[2:]):
        if any(part.strip().startswith(_TIER_STARTS) for part in spec.split(",")[1:]):
            raise argparse.ArgumentTypeError(f"{text!r} holds several tiers; give one tier per --kv-store, "
                                             "fastest first (--kv-store memory --kv-store redis://HOST:6379/0)")
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(spec)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a Redis URL ({e}); write "
                                             "redis://HOST:PORT/DB[?prefix=NAME]") from None
        if parts.scheme != "unix" and not parts.hostname:
            raise argparse.ArgumentTypeError(f"{text!r} names no host; write redis://HOST:PORT/DB[?prefix=NAME]")
        return spec
    if "," in spec:
        raise argparse.ArgumentTypeError(f"{text!r}: give one tier per --kv-store, fastest first "
                                         "(--kv-store memory --kv-store disk:PATH --kv-store redis://HOST:6379/0)")
    raise argparse.ArgumentTypeError(f"{text!r} is not a KV tier; use memory, disk:PATH or redis://HOST:PORT/DB"
                                     "[?prefix=NAME]")


def add_kv_store_argument(parser: argparse.ArgumentParser) -> None:
    """`--kv-store SPEC`, repeatable: the KV tiers, fastest first (default: memory over the disk under --home)."""
    parser.add_argument("--kv-store", action="append", type=kv_tier, metavar="SPEC",
                        help="a KV store tier, fastest first; repeat for a chain, e.g. --kv-store memory "
                        "--kv-store disk:/var/cache/kv --kv-store redis://127.0.0.1:6379/0?prefix=tenant1 "
                        "(default: memory over the disk store under --home)")


def kv_store_spec(args: argparse.Namespace):
    """What to give open_store: the --kv-store tiers, or the disk store under --home when none is given."""
    return list(args.kv_store) if getattr(args, "kv_store", None) else settings.kv_dir(args.home)


MAX_CHUNK_TOKENS = 2**20  # past every packaged model's context window (32k at most) by far


def chunk_tokens_arg(text: str) -> int:
    """`--chunk-tokens N`: 16 to MAX_CHUNK_TOKENS tokens."""
    value = positive_int(text)
    if value < 16:
        raise argparse.ArgumentTypeError(f"must be at least 16 tokens, got {value}")
    if value > MAX_CHUNK_TOKENS:
        got = f"{value:,}" if value < 10**15 else f"a number of {len(str(value))} digits"
        raise argparse.ArgumentTypeError(f"must be at most {MAX_CHUNK_TOKENS:,} tokens (longer than any model's "
                                         f"context window), got {got}")
    return value


def check_device(device: str) -> None:
    """A ConfigError (exit 2) when `device` is not one this machine has: caught before the model loads."""
    if device == "auto":
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {device!r} is not a device; use auto, cpu or cuda[:N]") from None
    if d.type == "cpu":
        return
    if d.type != "cuda":
        raise ConfigError(f"--device {device!r} is not supported; use auto, cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is available to torch here "
                          "(torch.cuda.is_available() is False); use --device cpu, or auto")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model`, `--revision` and `--trust-remote-code`: which model an engine loads."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged model alias, local model folder or Hugging "
                        f"Face hub id org/name, read from the HF cache (default {DEFAULT_MODEL}); use the same one "
                        "for ingest and ask")
    parser.add_argument("--revision", help="branch, tag or commit of a hub id (default: main)")
    parser.add_argument("--trust-remote-code", action="store_true", help="run a hub repo's own modelling code "
                        "(off by default: it is code from the repo's authors)")


def model_options(args: argparse.Namespace) -> dict:
    """The from_pretrained keywords the model arguments name."""
    return {"revision": args.revision, "trust_remote_code": args.trust_remote_code}


def add_model_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of a subcommand that loads the model and runs it: --home, the model, --device and --dtype."""
    parser.add_argument("--home", help=f"package home; overrides ${settings.ENV_HOME}")
    add_model_arguments(parser)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto, float32, bfloat16 or float16")


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every data subcommand shares."""
    parser.add_argument("--home", help=f"package home (models, KV store, Chroma); overrides ${settings.ENV_HOME}")
    add_model_arguments(parser)
    parser.add_argument("--collection", default=DEFAULT_COLLECTION, help="Chroma collection (3-512 characters)")
    parser.add_argument("--host", help="Chroma server host (default: the embedded database under --home)")
    parser.add_argument("--port", type=positive_int, help="Chroma server port")
    parser.add_argument("--chroma-token", metavar="TOKEN", help="token for a Chroma server that requires one "
                        f"(sent as 'Authorization: Bearer TOKEN'); prefer ${settings.ENV_CHROMA_TOKEN}, which "
                        "other users cannot read in the process list")
    parser.add_argument("--chroma-ssl", action="store_true", default=None,
                        help=f"talk https to the Chroma server (or set ${settings.ENV_CHROMA_SSL}=1)")
    parser.add_argument("--chroma-ca-bundle", metavar="PEM", help="CA certificates that verify the server's "
                        f"certificate, for a private CA (or ${settings.ENV_CHROMA_CA}); default: the system's")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto, float32, bfloat16 or float16")
    parser.add_argument("--memory-budget", type=parse_size, default=DEFAULT_MEMORY_BUDGET, metavar="SIZE",
                        help="bytes of KV the store keeps in memory (LRU, in front of the disk store), e.g. "
                        f"256MiB, 2GiB, 0; default {DEFAULT_MEMORY_BUDGET}")
    add_kv_store_argument(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages to stderr")


def chunk_store(args: argparse.Namespace, *, create: bool = True):
    """The Chroma chunk store the data arguments name."""
    from ..retrieval.chroma import ChromaChunkStore

    return ChromaChunkStore(args.home, args.collection, host=args.host, port=args.port, token=args.chroma_token,
                            ssl=args.chroma_ssl, ca_bundle=args.chroma_ca_bundle, create=create)


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc; else None), interpreter start-up and imports included."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def cpu_threads(requested: int | None) -> int:
    """Torch's CPU threads for one latency-bound request: `requested`, else torch's choice (one per core) capped at
    the cores other processes leave idle (1-minute load average), at least 1. On a busy CPU torch's threads wait
    on each other at every op: on the project's 2-core machine at load ~4, one prefill took 0.21-0.31 s with one
    thread and 0.74-12.5 s with two (benchmarks/ask_threads.py, issue #41)."""
    import torch

    if requested is not None:
        return requested
    threads = torch.get_num_threads()
    try:
        idle = (os.cpu_count() or threads) - os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return threads
    return max(1, min(threads, math.floor(idle + 0.5)))


def open_engine(args: argparse.Namespace):
    """The engine (model, KV store tiers) the data arguments name; the device is checked first."""
    from ..engine import CacheBlendEngine
    from ..store import open_store

    check_device(args.device)
    kv_store = open_store(kv_store_spec(args), memory_bytes=args.memory_budget,
                          codec=getattr(args, "kv_codec", "fp16"))
    return CacheBlendEngine.from_pretrained(args.model, kv_store=kv_store, device=args.device, dtype=args.dtype,
                                            home=args.home, **model_options(args))


def engine_and_store(args: argparse.Namespace, *, create: bool = True):
    check_device(args.device)
    store = chunk_store(args, create=create)  # first: a server that cannot be reached fails before the model loads
    return open_engine(args), store


def shown(text: str) -> str:
    """`text` as one safe line of terminal output: quoted and escaped (repr) when it holds a newline, an ANSI escape
    or any other non-printable character, so a file's name cannot forge or recolour lines."""
    return text if text.isprintable() else repr(text)


def print_skipped(skipped) -> None:
    for s in skipped[:MAX_LISTED]:
        print(f"skipped {shown(s.path)}: {shown(s.reason)}", file=sys.stderr)
    if len(skipped) > MAX_LISTED:
        print(f"skipped {len(skipped) - MAX_LISTED} more files (see --json for the full list)", file=sys.stderr)
