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

Subcommands are added by the functions in `REGISTRARS`; each takes the argparse subparsers object, adds its
parser and sets `func` (called with the parsed args, returning an exit code). Other distributions add theirs
the same way through the entry-point group `cacheblend_rag.commands` (name = subcommand, object = registrar):
(1) `ask` (a LangChain chain) comes with langchain-cacheblend, `bench` and `codec-bench` with the benchmarks
(benchmarks/); without them the subcommand says in one line what to install.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence

from . import settings
from .arguments import parse_size, positive_int
from .errors import CacheBlendError, ConfigError
from .models.loader import DEFAULT_MODEL

DEFAULT_COLLECTION = "cacheblend_chunks"  # same as retrieval.chroma.DEFAULT_COLLECTION, without importing chromadb
DEFAULT_MEMORY_BUDGET = "512MiB"  # the KV store's memory tier in a CLI process (ingest writes through to disk)
DTYPES = ("auto", "float32", "bfloat16", "float16")
_MAX_LISTED = 20  # skipped files listed one per line; the rest are counted


# ---- argument types: a bad value is a usage error (exit 2), never a traceback --------------


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
    from .fuse.policies import DEFAULT_METHOD, make_policy  # lazily: it brings torch

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction in [0, 1]") from None
    try:
        make_policy(DEFAULT_METHOD, value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{e} (a fraction of the reused tokens)") from None
    return value


class _Parser(argparse.ArgumentParser):
    """Bad usage: one `error:` line naming the command and where its options are listed, exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


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


def _chunk_tokens(text: str) -> int:
    value = positive_int(text)
    if value < 16:
        raise argparse.ArgumentTypeError(f"must be at least 16 tokens, got {value}")
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
    from .retrieval.chroma import ChromaChunkStore

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
    from .engine import CacheBlendEngine
    from .store import open_store

    check_device(args.device)
    kv_store = open_store(kv_store_spec(args), memory_bytes=args.memory_budget,
                          codec=getattr(args, "kv_codec", "fp16"))
    return CacheBlendEngine.from_pretrained(args.model, kv_store=kv_store, device=args.device, dtype=args.dtype,
                                            home=args.home, **model_options(args))


def _engine_and_store(args: argparse.Namespace, *, create: bool = True):
    check_device(args.device)
    store = chunk_store(args, create=create)  # first: a server that cannot be reached fails before the model loads
    return open_engine(args), store


def shown(text: str) -> str:
    """`text` as one safe line of terminal output: quoted and escaped (repr) when it holds a newline, an ANSI escape
    or any other non-printable character, so a file's name cannot forge or recolour lines."""
    return text if text.isprintable() else repr(text)


def _print_skipped(skipped) -> None:
    for s in skipped[:_MAX_LISTED]:
        print(f"skipped {shown(s.path)}: {shown(s.reason)}", file=sys.stderr)
    if len(skipped) > _MAX_LISTED:
        print(f"skipped {len(skipped) - _MAX_LISTED} more files (see --json for the full list)", file=sys.stderr)


# ---- ingest -------------------------------------------------------------------------------


def _add_ingest(subparsers) -> None:
    p = subparsers.add_parser("ingest", help="embed files into Chroma and precompute their chunks' KV",
                              description="Load .txt/.md/.json/.jsonl/.html/.pdf files or folders, split them into "
                              "chunks of ~512 model tokens, upsert them into Chroma and precompute their KV. "
                              "Idempotent; a re-ingested file's chunks that it no longer has are deleted with "
                              "their KV, and so are those of files gone from a re-ingested folder. Files that "
                              "cannot be read (not UTF-8, empty, not a regular file, ...) are skipped and listed.")
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or folders")
    add_data_arguments(p)
    p.add_argument("--from-chroma", metavar="COLLECTION",
                   help="instead of files: precompute the KV of every document of this existing Chroma collection "
                        "(read only, no re-embedding), at --chroma-path or on the server at --host/--port")
    p.add_argument("--chroma-path", metavar="DIR",
                   help="with --from-chroma: the folder of a local (persistent) Chroma database; default: the "
                        "package's own under --home")
    p.add_argument("--chunk-tokens", type=_chunk_tokens, default=512, help="chunk size in model tokens (default 512)")
    p.add_argument("--follow-symlinks", action="store_true",
                   help="read symbolic links inside a folder that point outside it (refused by default)")
    p.add_argument("--kv-codec", default="fp16", metavar="NAME",
                   help="how new chunk KV is stored on disk: fp16 (exact, default), int8 (~2x smaller) or cachegen "
                        "(~4.3x smaller); stores may mix codecs, every file names its own")
    p.add_argument("--neighbor-variants", type=positive_int, default=None, metavar="K",
                   help="also store each chunk's KV as computed after its K most similar chunks of this ingestion "
                        "(Cache-Craft variants, reused by --method cachecraft; costs ~K+1 chunk prefills each)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_run_ingest)


def _neighbor_variants(args: argparse.Namespace, engine, chunk_ids) -> int | None:
    """`--neighbor-variants K`: Cache-Craft variants of the ingested chunks after their K nearest; how many."""
    if not args.neighbor_variants:
        return None
    return engine.ingest_variants(chunk_ids, k=args.neighbor_variants, show_progress=not (args.quiet or args.json))


def _run_ingest(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .ingest.corpus import IngestError, ingest_paths

    if args.from_chroma is not None or args.chroma_path is not None:
        return _run_ingest_from_chroma(args)
    if not args.paths:
        raise ConfigError("give files or folders to ingest, or --from-chroma COLLECTION to warm an existing one")
    for path in args.paths:  # before the model loads
        if not os.path.lexists(Path(path).expanduser()):
            raise ConfigError(f"{path}: no such file or folder")
    engine, store = _engine_and_store(args)
    failure: IngestError | None = None
    try:
        report = ingest_paths(args.paths, engine, store, chunk_tokens=args.chunk_tokens,
                              show_progress=not (args.quiet or args.json), follow_symlinks=args.follow_symlinks)
    except IngestError as e:
        failure, report = e, e.report
    _print_skipped(report.skipped)
    variants = _neighbor_variants(args, engine, report.chunk_ids) if failure is None else None
    if failure is None and report.files == 0:
        failure = IngestError(f"no file could be ingested ({len(report.skipped)} skipped, listed above)", report)
    if args.json:
        print(json.dumps({**report.as_dict(), "collection": args.collection, "home": str(settings.home_dir(args.home)),
                          "stored_chunks": store.count(), **({"error": str(failure)} if failure else {}),
                          **({"neighbor_variants": variants} if variants is not None else {})}))
    else:
        status = "nothing new" if report.new_chunks == 0 else f"{report.new_chunks} new chunks"
        print(f"ingested: {report.summary()} — {status}; collection {args.collection!r} now holds "
              f"{store.count()} chunks ({store.location})")
        if variants is not None:
            print(f"neighbour variants stored: {variants}")
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


def _run_ingest_from_chroma(args: argparse.Namespace) -> int:
    """`ingest --from-chroma COLLECTION`: the KV of the documents a Chroma collection already holds."""
    from .retrieval.warm import iter_chroma_documents, open_chroma_collection, warm_texts

    if args.from_chroma is None:
        raise ConfigError("--chroma-path goes with --from-chroma COLLECTION")
    if args.paths:
        raise ConfigError("--from-chroma reads a collection: give no files or folders with it")
    if args.chroma_path is not None and (args.host is not None or args.port is not None):
        raise ConfigError("--chroma-path is a local database; --host/--port a server: give one of them")
    if args.chroma_path is not None and not os.path.isdir(os.path.expanduser(args.chroma_path)):
        raise ConfigError(f"--chroma-path {args.chroma_path}: no such folder")
    check_device(args.device)
    path = os.path.expanduser(args.chroma_path) if args.chroma_path is not None else None
    # The collection first: a server that cannot be reached, or a missing collection, fails before the model loads.
    store = open_chroma_collection(args.from_chroma, path=path, home=args.home, host=args.host, port=args.port,
                                   token=args.chroma_token, ssl=args.chroma_ssl, ca_bundle=args.chroma_ca_bundle)
    engine = open_engine(args)
    report = warm_texts(engine, iter_chroma_documents(store.collection), show_progress=not (args.quiet or args.json))
    variants = _neighbor_variants(args, engine, report.chunk_ids)
    for s in report.skipped[:_MAX_LISTED]:
        print(f"skipped document {shown(s.doc_id)}: {shown(s.reason)}", file=sys.stderr)
    if len(report.skipped) > _MAX_LISTED:
        print(f"skipped {len(report.skipped) - _MAX_LISTED} more documents (see --json)", file=sys.stderr)
    if args.json:
        print(json.dumps({**report.as_dict(), "collection": args.from_chroma, "chroma": store.location,
                          "home": str(settings.home_dir(args.home)),
                          **({"neighbor_variants": variants} if variants is not None else {})}))
    else:
        print(f"warmed from Chroma collection {args.from_chroma!r} ({store.location}): {report.summary()}")
        if variants is not None:
            print(f"neighbour variants stored: {variants}")
    return 0


# ---- delete / prune -----------------------------------------------------------------------


def _add_delete(subparsers) -> None:
    p = subparsers.add_parser("delete", help="remove the chunks (and KV) of files or folders from the corpus",
                              description="Delete the Chroma records that came from these files (or from any file "
                              "under these folders) and their stored KV. The files themselves are not touched.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders, as they were ingested")
    add_data_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_delete)


def _add_prune(subparsers) -> None:
    p = subparsers.add_parser("prune", help="remove the chunks (and KV) of files that no longer exist",
                              description="Delete the Chroma records whose source file is gone, and their KV.")
    add_data_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_prune)


def _report_deleted(args: argparse.Namespace, report, store, what: str) -> None:
    if args.json:
        print(json.dumps({**report.as_dict(), "collection": args.collection, "stored_chunks": store.count()}))
        return
    for source in report.sources:
        print(f"{what} {source}")
    print(f"{report.removed_chunks} chunks removed, {report.dropped_kv} KV entries dropped; collection "
          f"{args.collection!r} now holds {store.count()} chunks")


def _run_delete(args: argparse.Namespace) -> int:
    from .ingest.corpus import delete_sources

    engine, store = _engine_and_store(args, create=False)
    report = delete_sources(args.paths, engine, store)
    _report_deleted(args, report, store, "deleted")
    if not report.sources:
        print(f"error: no chunk in collection {args.collection!r} came from {', '.join(args.paths)}", file=sys.stderr)
        return 1
    return 0


def _run_prune(args: argparse.Namespace) -> int:
    from .ingest.corpus import prune_sources

    engine, store = _engine_and_store(args, create=False)
    _report_deleted(args, prune_sources(engine, store), store, "pruned")
    return 0


# ---- profile ------------------------------------------------------------------------------


def _add_profile(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure (once) and print the compute and storage profiles",
                              description="Per-layer recompute time and read throughput of each storage tier, "
                              "as the loading controller (recompute_ratio='auto') uses them.")
    add_model_run_arguments(p)
    p.add_argument("--remeasure", action="store_true", help="measure again instead of reading the cache")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .engine import CacheBlendEngine
    from .loading.profile import load_or_measure, profile_path

    check_device(args.device)
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=settings.kv_dir(args.home), device=args.device,
                                              dtype=args.dtype, home=args.home, **model_options(args))
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
    _print_codec_choice(engine, compute, tiers)
    return 0


def _print_codec_choice(engine, compute, tiers) -> None:
    """Each codec's measured size and decode speed, and the codec (or recompute) each tier would choose."""
    from .loading.controller import LoadingController
    from .loading.profile import TierProfile, measure_codec_profiles, synthetic_kv

    a = engine.adapter
    kv = synthetic_kv(num_layers=4, num_tokens=512, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)
    codecs = measure_codec_profiles(kvs=[kv])
    for c in codecs.values():
        print(f"codec {c.name}: {c.size_ratio:.2f}x the fp16 bytes, decodes {c.decode_bytes_per_s / 1e6:.0f} MB/s "
              "(fp16-equivalent, synthetic KV)")
    links = {**tiers, "1 Gbit/s": TierProfile("1 Gbit/s", 125e6), "100 Mbit/s": TierProfile("100 Mbit/s", 12.5e6)}
    controller = LoadingController(compute, links)
    for name in links:
        choice = controller.choose_codec(name, codecs, 2 * 2 * a.num_kv_heads * a.head_dim)
        costs = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in choice.seconds_per_mb.items())
        print(f"KV on {name}: {choice.codec} (ms per fp16 MB: {costs})")


# ---- plan ---------------------------------------------------------------------------------

PLAN_CODECS = ("fp16", "int8", "cachegen")
MAX_PLAN_TOKENS = 10**15  # ~10x the text of the whole public web: a larger --tokens is a typo


def _corpus_tokens(text: str) -> int:
    """`plan --tokens N`: a whole number of tokens, from 1 to MAX_PLAN_TOKENS."""
    value = positive_int(text)
    if value > MAX_PLAN_TOKENS:
        raise argparse.ArgumentTypeError(f"{value:,} tokens is more than any corpus (at most {MAX_PLAN_TOKENS:.0e}); "
                                         "give the corpus's size in model tokens")
    return value


def _add_plan(subparsers) -> None:
    p = subparsers.add_parser("plan", help="size a corpus's KV for a model before ingesting it (per codec, per tier)",
                              description="KV bytes per token and per chunk for the model (from its config: layers "
                              "x KV heads x head dims x 2 bytes for fp16), for each codec, the corpus's total and how "
                              "many chunks fit each tier's budget. Reads only the config (and, with --corpus, the "
                              "tokenizer): a hub model's weights are not downloaded.")
    p.add_argument("--home", help=f"package home; overrides ${settings.ENV_HOME}")
    add_model_arguments(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tokens", type=_corpus_tokens, metavar="N", help="the corpus's size in model tokens")
    size.add_argument("--corpus", nargs="+", metavar="PATH", help="files or folders to size: read and split as "
                      "ingest would, counted with the model's tokenizer (nothing is stored)")
    p.add_argument("--chunk-tokens", type=_chunk_tokens, default=512, help="chunk size in model tokens (default 512)")
    p.add_argument("--memory-budget", type=parse_size, default=DEFAULT_MEMORY_BUDGET, metavar="SIZE",
                   help=f"the memory tier's budget (default {DEFAULT_MEMORY_BUDGET}, as ingest and ask)")
    p.add_argument("--disk-budget", type=parse_size, default=None, metavar="SIZE",
                   help="the disk tier's LRU budget (default 20GiB, open_store's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_plan)


def _corpus_size(paths: list[str], tokenizer, chunk_tokens: int) -> tuple[int, int]:
    """(chunks, tokens) of the chunks ingest would make of these files (read and split, nothing stored)."""
    from .ingest.loaders import load_paths_report, split_texts

    for path in paths:
        if not os.path.lexists(os.path.expanduser(path)):
            raise ConfigError(f"{path}: no such file or folder")
    loaded = load_paths_report([os.path.expanduser(p) for p in paths])
    _print_skipped(loaded.skipped)
    records = split_texts(loaded.texts, tokenizer, chunk_tokens=chunk_tokens)
    return len(records), sum(len(tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in records)


def plan_figures(layout, *, chunk_tokens: int, corpus: tuple[int, int] | None, memory_budget: int,
                 disk_budget: int) -> dict:
    """Per codec: KV bytes per token, per full chunk, the corpus's total, and the chunks each tier holds.

    `corpus` is (chunks, tokens): a chunk's bytes are linear in its tokens, so the corpus's total is its tokens'."""
    from dataclasses import asdict

    from .store.sizing import CODEC_NOTES, TOKEN_ID_BYTES, chunk_bytes, chunks_that_fit, kv_bytes_per_token

    codecs = {}
    for codec in PLAN_CODECS:
        per_chunk = chunk_bytes(layout, codec, chunk_tokens)
        row = {"kv_bytes_per_token": kv_bytes_per_token(layout, codec), "chunk_bytes": per_chunk,
               "note": CODEC_NOTES[codec], "disk_chunks": chunks_that_fit(disk_budget, per_chunk)}
        if corpus is not None:
            row["corpus_bytes"] = chunk_bytes(layout, codec, corpus[1])
        codecs[codec] = row
    # The memory tier holds KV as computed (bf16/fp16: the fp16 size, without token ids; fp32 doubles it).
    in_memory = kv_bytes_per_token(layout, "fp16") * chunk_tokens
    return {"layout": asdict(layout), "chunk_tokens": chunk_tokens, "token_id_bytes": TOKEN_ID_BYTES,
            "corpus": None if corpus is None else {"chunks": corpus[0], "tokens": corpus[1]},
            "codecs": codecs, "memory": {"budget_bytes": memory_budget, "chunk_bytes": in_memory,
                                         "chunks": chunks_that_fit(memory_budget, in_memory)},
            "disk": {"budget_bytes": disk_budget}}


def _bytes(n: float) -> str:
    """A byte count in binary units, 3 significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


def _run_plan(args: argparse.Namespace) -> int:
    from .models.loader import load_config_and_tokenizer
    from .store import DEFAULT_DISK_BYTES
    from .store.sizing import KVLayout

    config, tokenizer = load_config_and_tokenizer(args.model, args.home, tokenizer=args.corpus is not None,
                                                  **model_options(args))
    layout = KVLayout.from_config(config)
    corpus = None
    if args.corpus is not None:
        corpus = _corpus_size(args.corpus, tokenizer, args.chunk_tokens)
    elif args.tokens is not None:
        corpus = (-(-args.tokens // args.chunk_tokens), args.tokens)  # full chunks and the rest
    disk_budget = DEFAULT_DISK_BYTES if args.disk_budget is None else args.disk_budget
    figures = plan_figures(layout, chunk_tokens=args.chunk_tokens, corpus=corpus,
                           memory_budget=args.memory_budget, disk_budget=disk_budget)
    if args.json:
        print(json.dumps({"model": args.model, **figures}))
        return 0
    n = args.chunk_tokens
    print(f"model {args.model}: {layout.num_layers} layers x {layout.num_kv_heads} KV heads x head_dim "
          f"{layout.head_dim} (keys and values)")
    if figures["corpus"] is not None:
        print(f"corpus: {figures['corpus']['chunks']:,} chunks, {figures['corpus']['tokens']:,} tokens "
              f"(chunks of at most {n} tokens)")
    print(f"{'codec':<9} {'KV/token':>11} {f'per {n}-token chunk':>20} {'corpus':>11} {'chunks in disk budget':>22}")
    for codec, row in figures["codecs"].items():
        mark = "~" if codec == "cachegen" else ""  # an estimate
        total = mark + _bytes(row["corpus_bytes"]) if "corpus_bytes" in row else "-"
        print(f"{codec:<9} {mark + _bytes(row['kv_bytes_per_token']):>11} {mark + _bytes(row['chunk_bytes']):>20} "
              f"{total:>11} {mark + format(row['disk_chunks'], ','):>22}  {row['note']}")
    mem = figures["memory"]
    print(f"chunks on disk add their token ids ({figures['token_id_bytes']} B/token) and a header of a few KiB; "
          f"disk budget {_bytes(disk_budget)} (--disk-budget)")
    print(f"memory tier: {_bytes(mem['budget_bytes'])} holds {mem['chunks']:,} chunks of {n} tokens "
          f"({_bytes(mem['chunk_bytes'])} each in bf16/fp16; fp32 halves the count)")
    return 0


REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [_add_ingest, _add_profile, _add_delete, _add_prune,
                                                                  _add_plan]
"""Subcommand registrars, in help order; append one to add a subcommand (e.g. bench)."""


# ---- serve --------------------------------------------------------------------------------


def _add_serve(subparsers) -> None:
    from .serve.command import add_arguments, run_cli

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (chat/completions with documents)",
                              description="Serve the engine over HTTP: OpenAI-compatible /v1/chat/completions and "
                              "/v1/completions (with documents, chunk_ids, retrieval and cacheblend options), "
                              "/v1/models, /health and Prometheus /metrics. Binds 127.0.0.1 by default.")
    add_arguments(p)
    add_kv_store_argument(p)
    p.set_defaults(func=run_cli)


REGISTRARS.append(_add_serve)


# ---- calibrate (the fidelity gate; Cache-Craft's α) ------------------------------------------


def _add_calibrate(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure the recompute ratio that keeps full prefill's answers on this model (stored)",
        description="The fidelity gate: run the built-in calibration set (8 MuSiQue questions × 6 passages) under "
        "full prefill and under --method at rising ratios; the smallest ratio whose mean first-token KL meets "
        "--target-kl and whose top token agrees with full prefill's on --min-agreement of the questions becomes "
        "the ratio every request that names none runs at on this model (stored per machine). A model that meets it "
        "at no ratio below 1 runs at 1 (full prefill's answers) and says so. With --method cachecraft: Cache-Craft's "
        "alpha for --target-kl on dev questions (--data), stored beside the model's profile.")
    p.add_argument("--method", default=None, help="the method to calibrate (default: the default method, "
                   "relevance; cachecraft: its alpha)")
    p.add_argument("--target-kl", type=float, default=None,
                   help="mean first-token KL to meet (default 0.05; cachecraft 0.06)")
    p.add_argument("--min-agreement", type=float, default=None,
                   help="share of questions whose top token must be full prefill's (default 0.9)")
    p.add_argument("--ratios", help="comma-separated ratios to try, ascending (default 0.15,0.2,0.3,0.4,0.5,0.7)")
    p.add_argument("--ship", metavar="FILE", help="also write the decision as the package ships it for a packaged "
                   "model (cacheblend_rag/data/gates/<alias>.json; other methods' entries kept)")
    p.add_argument("--limit", type=int, default=20, help="cachecraft: dev questions to use (default 20)")
    p.add_argument("--data", help="cachecraft: MuSiQue-style JSON (default: the bundled or cached dev set)")
    p.add_argument("--chunks", type=int, default=6, help="cachecraft: passages per request (default 6)")
    p.add_argument("--alphas", help="cachecraft: comma-separated alphas to try, ascending (default 0.1 to 2.0)")
    add_model_run_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_calibrate)


def _numbers(text: str, flag: str) -> tuple[float, ...]:
    """A comma-separated list of numbers ≥ 0, ascending, or a ConfigError naming the flag."""
    try:
        values = tuple(sorted(float(a) for a in text.split(",")))
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise ConfigError(f"{flag} must be numbers ≥ 0, got {text!r}")
    return values


def _calibrate(args: argparse.Namespace) -> int:
    from .fuse.policies import DEFAULT_METHOD, POLICIES, takes_ratio

    method = args.method or DEFAULT_METHOD
    if method not in POLICIES or not (method == "cachecraft" or takes_ratio(POLICIES[method])):
        raise ConfigError(f"--method must be a method with a recompute ratio, or cachecraft; got {method!r}")
    target = args.target_kl if args.target_kl is not None else (0.06 if method == "cachecraft" else 0.05)
    if not (target > 0 and math.isfinite(target)):
        raise ConfigError(f"--target-kl must be a positive number, got {target}")
    if method == "cachecraft":
        return _calibrate_alpha(args, target)
    from . import gate
    from .engine import CacheBlendEngine

    agreement = args.min_agreement if args.min_agreement is not None else gate.MIN_AGREEMENT
    if not 0 < agreement <= 1:
        raise ConfigError(f"--min-agreement must be within (0, 1], got {agreement}")
    ratios = _numbers(args.ratios, "--ratios") if args.ratios else gate.RATIOS
    if any(r > 1 for r in ratios):
        raise ConfigError(f"--ratios must be within [0, 1], got {args.ratios!r}")
    check_device(args.device)
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=None, device=args.device, dtype=args.dtype,
                                              home=args.home, calibrate=False, **model_options(args))
    decision = gate.calibrate(engine, method, target_kl=target, min_agreement=agreement, ratios=ratios)
    path = None if args.dry_run else gate.store(decision)
    if args.ship:
        gate.ship_into(decision, args.ship)
    if args.json:
        print(json.dumps({**json.loads(decision.to_json()), "path": str(path) if path else None}))
        return 0
    print(f"{engine.model_name}, {method}, {decision.num_questions} questions of ~{decision.mean_tokens:.0f} tokens "
          f"({decision.device}, {decision.dtype}):")
    for row in decision.table:
        print(f"  ratio {row['ratio']:<5} mean KL {row['mean_kl']:.4f}  max {row['max_kl']:.4f}  "
              f"top token as full prefill {row['agreement']:.0%}  {row['speedup']:.2f}x full prefill")
    if decision.met:
        verdict = (f"ratio {decision.ratio} meets mean KL ≤ {target} with {decision.agreement:.0%} agreement: "
                   "requests that name no ratio run at it")
    else:
        verdict = (f"no ratio tried meets mean KL ≤ {target} with ≥ {agreement:.0%} agreement: requests that name "
                   f"no ratio run at {decision.ratio} (full prefill's answers); name a ratio to trade fidelity "
                   "for speed, or use method prefix_cache")
    print(verdict + (f"; stored in {path}" if path else " (dry run: not stored)"))
    return 0


def _calibrate_alpha(args: argparse.Namespace, target: float) -> int:
    from .datasets import load_dataset, passages_of, resolve_dataset
    from .engine import CacheBlendEngine
    from .fuse.policies.cachecraft import ALPHAS, calibrate, store_calibration

    if args.limit < 1 or args.chunks < 2:
        raise ConfigError("--limit must be ≥ 1 and --chunks ≥ 2")
    alphas = _numbers(args.alphas, "--alphas") if args.alphas else ALPHAS
    check_device(args.device)
    items = load_dataset(resolve_dataset(args.data), args.limit)
    # a private memory store: the calibration's requests must not leave variants in the user's KV store
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=None, device=args.device, dtype=args.dtype,
                                              home=args.home, calibrate=False, **model_options(args))
    questions = [(item["question"], passages_of(item, None)) for item in items]
    result = calibrate(engine, questions, target, alphas=alphas, num_chunks=args.chunks)
    path = None if args.dry_run else store_calibration(engine, result, args.home)
    if args.json:
        print(json.dumps({**result, "path": str(path) if path else None}))
        return 0
    for row in result["table"]:
        print(f"alpha {row['alpha']:<4}  mean KL {row['mean_kl']:.4f}  recomputed {row['recomputed_share']:.1%}")
    blend = result["cacheblend_0.15"]
    print(f"cacheblend@0.15  mean KL {blend['mean_kl']:.4f}  recomputed {blend['recomputed_share']:.1%}")
    verdict = "meets" if result["met"] else "does NOT meet (largest alpha tried)"
    print(f"alpha = {result['alpha']} {verdict} mean KL ≤ {target} on {result['questions']} questions"
          + (f"; stored in {path}" if path else " (dry run: not stored)"))
    return 0


REGISTRARS.append(_add_calibrate)


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
