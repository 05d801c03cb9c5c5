"""Ingest a corpus: split into ~512-token chunks, embed into Chroma, precompute every chunk's KV on disk.

    python examples/ingest_corpus.py [PATH ...] [--home DIR] [--model NAME]

Run it twice: the second run finds every chunk already stored (same content-hash ids) and adds nothing.
The same as `cacheblend-rag ingest PATH...`, written out with the library API.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from cacheblend_rag import CacheBlendEngine, settings  # noqa: E402
from cacheblend_rag.ingest import ingest_paths  # noqa: E402
from cacheblend_rag.retrieval.chroma import DEFAULT_COLLECTION, ChromaChunkStore  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", default=[str(DATA)], help="files or folders (default: examples/data)")
    parser.add_argument("--home", help="package home (default: $CACHEBLEND_RAG_HOME or ~/.cache/cacheblend-rag)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--collection", default=DEFAULT_COLLECTION)
    args = parser.parse_args()

    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=settings.kv_dir(args.home), home=args.home)
    store = ChromaChunkStore(args.home, args.collection)
    for attempt in ("first", "second"):
        report = ingest_paths(args.paths, engine, store)
        print(f"{attempt} ingestion: {report.summary()}")
    print(f"Chroma: {store.count()} chunks at {store.location}; KV store: {settings.kv_dir(args.home)}")


if __name__ == "__main__":
    main()
