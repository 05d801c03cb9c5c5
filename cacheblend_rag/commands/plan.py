"""`cacheblend-rag plan`: size a corpus's KV for a model before ingesting it (per codec, per tier)."""

from __future__ import annotations

import argparse
import json
import os

from .. import settings
from ..arguments import parse_size, positive_int
from ..errors import ConfigError
from .common import DEFAULT_MEMORY_BUDGET, add_model_arguments, chunk_tokens_arg, model_options, print_skipped

PLAN_CODECS = ("fp16", "int8", "cachegen")
MAX_PLAN_TOKENS = 10**15  # ~10x the text of the whole public web: a larger --tokens is a typo


def _corpus_tokens(text: str) -> int:
    """`plan --tokens N`: a whole number of tokens, from 1 to MAX_PLAN_TOKENS."""
    value = positive_int(text)
    if value > MAX_PLAN_TOKENS:
        raise argparse.ArgumentTypeError(f"{value:,} tokens is more than any corpus (at most {MAX_PLAN_TOKENS:.0e}); "
                                         "give the corpus's size in model tokens")
    return value


def add_plan(subparsers) -> None:
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
    p.add_argument("--chunk-tokens", type=chunk_tokens_arg, default=512, help="chunk size in model tokens (default 512)")
    p.add_argument("--memory-budget", type=parse_size, default=DEFAULT_MEMORY_BUDGET, metavar="SIZE",
                   help=f"the memory tier's budget (default {DEFAULT_MEMORY_BUDGET}, as ingest and ask)")
    p.add_argument("--disk-budget", type=parse_size, default=None, metavar="SIZE",
                   help="the disk tier's LRU budget (default 20GiB, open_store's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_plan)


def _corpus_size(paths: list[str], tokenizer, chunk_tokens: int) -> tuple[int, int]:
    """(chunks, tokens) of the chunks ingest would make of these files (read and split, nothing stored)."""
    from ..ingest.loaders import load_paths_report, split_texts

    for path in paths:
        if not os.path.lexists(os.path.expanduser(path)):
            raise ConfigError(f"{path}: no such file or folder")
    loaded = load_paths_report([os.path.expanduser(p) for p in paths])
    print_skipped(loaded.skipped)
    records = split_texts(loaded.texts, tokenizer, chunk_tokens=chunk_tokens)
    return len(records), sum(len(tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in records)


def plan_figures(layout, *, chunk_tokens: int, corpus: tuple[int, int] | None, memory_budget: int,
                 disk_budget: int) -> dict:
    """Per codec: KV bytes per token, per full chunk, the corpus's total, and the chunks each tier holds.

    `corpus` is (chunks, tokens): a chunk's bytes are linear in its tokens, so the corpus's total is its tokens'."""
    from dataclasses import asdict

    from ..store.sizing import CODEC_NOTES, TOKEN_ID_BYTES, chunk_bytes, chunks_that_fit, kv_bytes_per_token

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
    from ..models.loader import load_config_and_tokenizer
    from ..store import DEFAULT_DISK_BYTES
    from ..store.sizing import KVLayout

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
