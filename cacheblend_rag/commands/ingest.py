"""`cacheblend-rag ingest`: files (or an existing Chroma collection) into chunks and their KV."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import settings
from ..arguments import positive_int
from ..errors import ConfigError
from .common import (MAX_LISTED, add_data_arguments, check_device, chunk_tokens_arg, engine_and_store, open_engine,
                     print_skipped, shown)


def add_ingest(subparsers) -> None:
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
    p.add_argument("--chunk-tokens", type=chunk_tokens_arg, default=512, help="chunk size in model tokens (default 512)")
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

    from ..ingest.corpus import IngestError, ingest_paths

    if args.from_chroma is not None or args.chroma_path is not None:
        return _run_ingest_from_chroma(args)
    if not args.paths:
        raise ConfigError("give files or folders to ingest, or --from-chroma COLLECTION to warm an existing one")
    for path in args.paths:  # before the model loads
        if not os.path.lexists(Path(path).expanduser()):
            raise ConfigError(f"{path}: no such file or folder")
    engine, store = engine_and_store(args)
    failure: IngestError | None = None
    try:
        report = ingest_paths(args.paths, engine, store, chunk_tokens=args.chunk_tokens,
                              show_progress=not (args.quiet or args.json), follow_symlinks=args.follow_symlinks)
    except IngestError as e:
        failure, report = e, e.report
    print_skipped(report.skipped)
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
    from ..retrieval.warm import iter_chroma_documents, open_chroma_collection, warm_texts

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
    for s in report.skipped[:MAX_LISTED]:
        print(f"skipped document {shown(s.doc_id)}: {shown(s.reason)}", file=sys.stderr)
    if len(report.skipped) > MAX_LISTED:
        print(f"skipped {len(report.skipped) - MAX_LISTED} more documents (see --json)", file=sys.stderr)
    if args.json:
        print(json.dumps({**report.as_dict(), "collection": args.from_chroma, "chroma": store.location,
                          "home": str(settings.home_dir(args.home)),
                          **({"neighbor_variants": variants} if variants is not None else {})}))
    else:
        print(f"warmed from Chroma collection {args.from_chroma!r} ({store.location}): {report.summary()}")
        if variants is not None:
            print(f"neighbour variants stored: {variants}")
    return 0
