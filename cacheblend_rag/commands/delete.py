"""`cacheblend-rag delete` and `prune`: remove the chunks (and KV) of files, or of files gone."""

from __future__ import annotations

import argparse
import json
import sys

from .common import add_data_arguments, engine_and_store


def add_delete(subparsers) -> None:
    p = subparsers.add_parser("delete", help="remove the chunks (and KV) of files or folders from the corpus",
                              description="Delete the Chroma records that came from these files (or from any file "
                              "under these folders) and their stored KV. The files themselves are not touched.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders, as they were ingested")
    add_data_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_delete)


def add_prune(subparsers) -> None:
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
    from ..ingest.corpus import delete_sources

    engine, store = engine_and_store(args, create=False)
    report = delete_sources(args.paths, engine, store)
    _report_deleted(args, report, store, "deleted")
    if not report.sources:
        print(f"error: no chunk in collection {args.collection!r} came from {', '.join(args.paths)}", file=sys.stderr)
        return 1
    return 0


def _run_prune(args: argparse.Namespace) -> int:
    from ..ingest.corpus import prune_sources

    engine, store = engine_and_store(args, create=False)
    _report_deleted(args, prune_sources(engine, store), store, "pruned")
    return 0
