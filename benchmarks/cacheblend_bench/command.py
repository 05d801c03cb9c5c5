"""`cacheblend-rag bench STUDY`: the one command line of the benchmarks (registered by `cli`).

    cacheblend-rag bench methods --limit 20 --chunks 6 --out bench-results  # every method, chains included
    cacheblend-rag bench methods --limit 20 --methods full_prefill,prefix_cache,full_reuse,cacheblend   # engine only
    cacheblend-rag bench sweep --limit 20 --out bench-sweep                 # quality vs recompute ratio
    cacheblend-rag bench methods --limit 20 --chunk-tokens 256 --out bench-256   # chunk length sensitivity
    cacheblend-rag bench methods --limit 10 --concurrency 4 --out bench-load     # + throughput under load
    cacheblend-rag bench breakdown --limit 3 --out bench-breakdown          # where the prefill time goes
    cacheblend-rag bench loading --limit 6 --dtype bfloat16                 # KV in memory vs on disk, "auto"
    cacheblend-rag bench trace --limit 20 --repeats 3 --k 6 --guard 0.05    # chunks recurring in new company
    cacheblend-rag bench decode --limit 8 --out bench-decode                # decode ms/token: ours vs HF generate
    cacheblend-rag bench serve-load --limit 8 --requests 16 --out bench-serve    # the server under HTTP load
    cacheblend-rag bench faults --limit 4 --chunks 3 --max-new-tokens 8     # 2 replicas + Redis under faults
    cacheblend-rag bench shared-tier --limit 9                              # Redis hit vs memory hit; codecs at 1 Gbit/s
    cacheblend-rag bench frames --limit 20 --dtype bfloat16                 # KL vs the model's own forward, per frame
    cacheblend-rag bench faq --limit 40 --k 4 --max-new-tokens 16           # answer accuracy on made-up FAQ chunks
    cacheblend-rag bench conversation --limit 10 --dtype bfloat16           # 4-turn chats: stored prefixes vs not
    cacheblend-rag bench conversation --rss --limit 100 --prefix-budget-mb 64    # prefix tier bytes and RSS
    cacheblend-rag bench agent --limit 10 --dtype bfloat16                  # retrieval agent: steps, constrained cost

Each study takes the data, engine and output options, and its own (`cacheblend-rag bench STUDY -h`). The data:
DATASET or --data PATH, else $CACHEBLEND_RAG_MUSIQUE, else ../shared/data/musique_dev.json from the working folder.
`methods` writes results.json (every record + summary), results.md (the table) and quality_vs_ttft.png under --out;
the other studies write <study>.md/json (and trace_kl_vs_ttft.png for trace).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_OUT = "bench-results"
DEFAULT_LOAD_METHODS = "full_prefill,cacheblend@0.15"
LOADING_RATIO = 0.15


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must be within [0, 1], got {text!r}")
    return values


def _common_options() -> list[argparse.ArgumentParser]:
    """The data, engine and output options every study takes (argparse parents)."""
    from cacheblend_rag import settings
    from .datasets import FALLBACK_DATASET

    parent = argparse.ArgumentParser(add_help=False)
    data = parent.add_argument_group("data")
    data.add_argument("dataset", nargs="?", metavar="DATASET", help="the same as --data PATH")
    data.add_argument("--data", metavar="PATH", help="MuSiQue-style JSON [{ctxs: [{title, text}], question, answers}] "
                      f"(default: ${settings.ENV_MUSIQUE}, else {FALLBACK_DATASET} from the working folder)")
    data.add_argument("--limit", type=int, default=20, help="questions to run (default 20; 0 = all)")
    data.add_argument("--shuffle", action="store_true", help="take a seeded random sample of questions")
    data.add_argument("--skip", type=int, default=0, metavar="N",
                      help="leave out the first N questions (e.g. keep 0-39 for tuning and run 40-49 for the record)")
    data.add_argument("--chunks", type=int, default=6, help="passages (chunks) per question (default 6)")
    data.add_argument("--chunk-tokens", type=int, default=None, metavar="N",
                      help="re-cut each question's passages into --chunks chunks of about N tokens (model tokenizer)")

    engine = parent.add_argument_group("engine")
    engine.add_argument("--model", default="smollm2-135m", help="packaged model alias, local model folder or hub id org/name")
    engine.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    engine.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    engine.add_argument("--lead-in", default="prefix", choices=("prefix", "bos", "none"), help="chunk KV lead-in")
    engine.add_argument("--kv-store", default=None, metavar="DIR",
                        help="on-disk KV store (memory tier over it; loading: its disk); default: in memory only "
                        "(loading: a temporary folder)")
    engine.add_argument("--home", default=None, help="package home (converted models, profiles)")
    engine.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per answer (default 32)")
    engine.add_argument("--seed", type=int, default=0, help="seed for sampling/shuffling (decoding is greedy)")
    engine.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice); on a shared CPU, fewer threads than "
                        "cores avoids oversubscription")

    output = parent.add_argument_group("output")
    output.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"write the results here (default {DEFAULT_OUT}; '' for none)")
    output.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return [parent]


def _methods(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default=None,
                   help="comma-separated: full_prefill, prefix_cache, full_reuse, cacheblend[@r][/opt=v...], stuff, "
                   "map_reduce, map_rerank, hf_pipeline (default: all; a bare 'cacheblend' means each of --ratios)")


def _ratios(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--ratios", type=_floats, default=None, help=f"CacheBlend recompute ratios (default {default})")


def _repeats(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--repeats", type=int, default=None, metavar="R", help=what)


def _no_warmup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of the chain methods")


def _methods_study(p: argparse.ArgumentParser) -> None:
    _methods(p)
    _ratios(p, "0.05,0.15,0.30")
    p.add_argument("--concurrency", type=int, default=0, metavar="C",
                   help="also replay the questions from C client threads: queries/min and TTFT under load")
    p.add_argument("--load-methods", default=DEFAULT_LOAD_METHODS,
                   help=f"methods for --concurrency (default {DEFAULT_LOAD_METHODS})")
    _no_warmup(p)


def _sweep_study(p: argparse.ArgumentParser) -> None:
    _methods(p)
    _ratios(p, "0.05 … 1.0")
    _no_warmup(p)


def _breakdown_study(p: argparse.ArgumentParser) -> None:
    _methods(p)
    _ratios(p, "0.05,0.15,0.30")
    _repeats(p, "timed rounds per question (default 2)")


def _serve_load_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=8, metavar="C", help="openai SDK clients (default 8)")
    p.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    p.add_argument("--conversations", type=int, default=None, metavar="N",
                   help="instead: the server's RSS over N distinct two-turn chats, with its stored prefixes' bytes")


def _trace_study(p: argparse.ArgumentParser) -> None:
    _methods(p)
    _repeats(p, "requests per question (default 3)")
    p.add_argument("--k", type=int, default=6, help="passages per trace request (default 6)")
    p.add_argument("--trace-modes", default="warm,cold",
                   help="corpus modes: warm (every passage precomputed), cold (caches from live requests only), "
                   "neighbors (warm, plus cachecraft's variants of each passage after its 2 nearest passages); "
                   "default warm,cold")
    p.add_argument("--guard", type=float, default=None, metavar="THRESHOLD",
                   help="evaluate the quality guard: methods that take one compute it (flag only), and a twin "
                   "escalates flagged requests to --guard-ratio")
    p.add_argument("--guard-ratio", type=float, default=None, metavar="R",
                   help="the ratio flagged requests escalate to (default: twice the method's ratio)")


def _faults_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fault-requests", type=int, default=24, metavar="N", help="requests per scenario (default 24)")
    p.add_argument("--clients", type=int, default=4, metavar="C", help="client threads (default 4)")
    p.add_argument("--fault-scenarios", default=None, metavar="NAMES",
                   help="comma-separated scenarios to run (default: all; faults.SCENARIOS)")


def _behind(p: argparse.ArgumentParser) -> None:
    p.add_argument("--behind", choices=("lead_in", "neighbor"), default="lead_in",
                   help="what each chunk's stored KV is computed behind: the lead-in (default) or its nearest "
                   "neighbour among the chunks ingested with it (`ingest(behind=\"neighbor\")`)")


def _faq_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=int, default=6, help="chunks per question (default 6)")
    p.add_argument("--methods", default=None, metavar="M[@R],...",
                   help="methods, each with its recompute ratio if it has one (default: full_prefill,"
                   "cacheblend@0.15,full_reuse; e.g. full_prefill,cacheblend@0.15,relevance@0.15)")
    _behind(p)


def _answers_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default="full_reuse,relevance@0.15,relevance@0.3,cacheblend@0.15,default",
                   metavar="ARM,...", help="what runs beside full prefill: method[@ratio][+links] or default (no "
                   "ratio named: the fidelity gate's choice, with the engine's links); default: full_reuse,"
                   "relevance@0.15,relevance@0.3,cacheblend@0.15,default")
    p.add_argument("--passage-words", type=int, default=None,
                   help="cut each passage to this many words (default: as they are)")
    p.add_argument("--links", default="auto", metavar="PATH",
                   help="the engine's links: auto (trained on this machine or shipped), a links file, or none")


def _method_ratios(text: str | None) -> tuple[tuple[str, float | None], ...]:
    """`--methods` of `faq`: "method[@ratio],..." → ((method, ratio or None), ...); a bad entry is a usage error."""
    from cacheblend_rag.fuse.policies import POLICIES

    from .frames import FRAME_METHODS

    if text is None:
        return FRAME_METHODS
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        method, _, ratio = entry.partition("@")
        if method not in POLICIES:
            raise ValueError(f"--methods: unknown method {method!r} (one of {', '.join(POLICIES)})")
        try:
            out.append((method, float(ratio) if ratio else None))
        except ValueError:
            raise ValueError(f"--methods: {entry!r}: the ratio after @ must be a number") from None
    return tuple(out)


def _conversation_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", default=None, metavar="NAMES",
                   help="also time these engines on the same turns: kvboost, llama.cpp (optional: pip install -e "
                   "'benchmarks[peers]'; a missing one is skipped)")
    p.add_argument("--rss", action="store_true",
                   help="instead of the timing arms: --limit 2-turn chats on a prefix tier of --prefix-budget-mb; "
                   "its bytes vs budget and the process RSS every 10 chats (writes conversation_rss.md)")
    p.add_argument("--prefix-budget-mb", type=float, default=64.0, metavar="MB",
                   help="the prefix tier's byte budget with --rss (default 64)")


def _ratio_study(p: argparse.ArgumentParser) -> None:
    _ratios(p, f"{LOADING_RATIO}: the first value is used")


def _decode_study(p: argparse.ArgumentParser) -> None:
    _repeats(p, "timed rounds per prompt length (default: decode_bench's)")


def _nothing(p: argparse.ArgumentParser) -> None:
    pass


# study name: (one line of help, its own options)
STUDIES: dict[str, tuple[str, object]] = {
    "methods": ("every method side by side (engine, chains, HuggingFacePipeline): TTFT, quality, agreement; the "
                "table and plot", _methods_study),
    "sweep": ("quality vs recompute ratio: full prefill, full reuse and CacheBlend at 0.05 … 1.0", _sweep_study),
    "breakdown": ("where the prefill time goes: per-layer times, rows, attention pairs, op shares", _breakdown_study),
    "decode": ("decode ms/token of the engine's decoder vs HF generate after fused prompts, and batched steps",
               _decode_study),
    "serve-load": ("`cacheblend-rag serve` driven over HTTP by openai SDK clients: continuous batching vs one at a "
                   "time, then an overload run", _serve_load_study),
    "loading": ("TTFT with the KV in memory vs on disk, and recompute_ratio='auto' vs fixed ratios", _ratio_study),
    "trace": ("chunks recurring with different companions (warm/cold corpus, the quality guard): TTFT, recompute, "
              "KL and agreement vs full prefill", _trace_study),
    "faults": ("2 serve replicas sharing a redis-server under load while Redis or a replica is killed, Redis is "
               "full, stored bytes are flipped; schema bombs and failing grammars against one server",
               _faults_study),
    "shared-tier": ("a replica's TTFT on a Redis hit vs a memory hit; per codec behind a paced 1 Gbit/s link",
                    _ratio_study),
    "frames": ("fidelity per entry point: first-token KL vs the model's own forward of each frame's prompt", _behind),
    "faq": ("answer accuracy on a generated FAQ set (one fact per question) in the chat, string and tool (after a retriever tool) frames",
            _faq_study),
    "answers": ("do right answers stay right: answerable NQ-style (or MuSiQue-style) questions scored against gold, "
                "each arm (methods, ratios, links, the gate's default) side by side with full prefill",
                _answers_study),
    "tools": ("tool choice left to the model (auto): the right tool on 6 prompts that need one, none on 3 that "
              "don't; seconds per call", _nothing),
    "conversation": ("4-turn chats: per turn TTFT with stored prefixes, without them, full prefill (and peers)",
                     _conversation_study),
    "agent": ("a retrieval agent per question: per step TTFT, chunk hits in tool results, constrained vs free "
              "decode ms/token", _nothing),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subcommand per study on the `cacheblend-rag bench` parser, each with the common options and its own."""
    parents = _common_options()
    studies = parser.add_subparsers(dest="study", required=True, metavar="STUDY",
                                    title="studies (cacheblend-rag bench STUDY -h for each one's options)")
    own_options = {}
    for name, (help_text, add_own) in STUDIES.items():
        p = studies.add_parser(name, parents=parents, help=help_text, description=help_text + ".")
        common = set(vars(p.parse_args([])))
        add_own(p.add_argument_group(f"{name} options"))
        own_options[name] = (p, set(vars(p.parse_args([]))) - common)
    every_option = set().union(*(dests for _, dests in own_options.values()))
    for p, dests in own_options.values():  # another study's option reads as None in the code the studies share
        p.set_defaults(**dict.fromkeys(every_option - dests))


def _dataset(args: argparse.Namespace) -> Path:
    """The dataset the options name (--data or the positional DATASET, not two different ones)."""
    from .datasets import resolve_dataset

    if args.data and args.dataset and Path(args.data) != Path(args.dataset):
        raise ValueError(f"two datasets given: --data {args.data} and {args.dataset}; pass one")
    return resolve_dataset(args.data or args.dataset)


def _questions_and_engine(args: argparse.Namespace, dataset: Path):
    """The questions to run and the engine to run them on, as the options say (threads set first)."""
    from .datasets import load_dataset

    engine = _engine(args, kv_store=None if args.study == "loading" else args.kv_store)
    items = load_dataset(dataset, args.limit or None, shuffle=args.shuffle, seed=args.seed, skip=args.skip)
    return items, engine


def _engine(args: argparse.Namespace, kv_store: str | None):
    """The engine the options describe (torch's threads set first)."""
    from cacheblend_rag.engine import CacheBlendEngine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # Methods are compared on the same prompts: a stored prefix of one method's request would hand the next its KV
    # exactly. Only conversation (its own arm without them included) and agent (a loop) keep stored prefixes.
    return CacheBlendEngine.from_pretrained(args.model, kv_store=kv_store, device=args.device, dtype=args.dtype,
                                            home=args.home, lead_in=args.lead_in,
                                            prefix_reuse=args.study in ("conversation", "agent"))


def _print_and_write(args: argparse.Namespace, name: str, header: str, table: str, result: dict) -> None:
    """Print a study's table; write `<name>.md` / `<name>.json` under --out (unless '')."""
    from .report import write_table

    print(f"\n{header}\n{table}")
    if args.out:
        print("wrote " + ", ".join(str(p) for p in write_table(args.out, name, header, table, result)))


def _dtype(engine) -> str:
    return str(engine.adapter.dtype).removeprefix("torch.")


def execute(args: argparse.Namespace) -> dict:
    """Run the study the parsed args name; prints the tables, writes the outputs; returns the result."""
    if args.study == "faq":
        return _faq(args)
    if args.study == "tools":
        return _tools(args)
    if args.study == "answers":
        return _answers(args)
    run = {"methods": _benchmark, "sweep": _benchmark, "breakdown": _breakdown, "decode": _decode,
           "serve-load": _serve_load, "loading": _loading, "trace": _trace, "faults": _shared_tier,
           "shared-tier": _shared_tier, "frames": _frames, "conversation": _conversation, "agent": _agent}
    return run[args.study](args, _dataset(args))


def _benchmark(args: argparse.Namespace, dataset: Path) -> dict:
    """Every method on every question (and throughput with --concurrency): results.json/md and the plots."""
    from . import engine_bench
    from .datasets import question_passages
    from .load import run_load
    from .methods import DEFAULT_RATIOS, SWEEP_RATIOS, MethodSpec, parse_methods
    from .report import format_load_table, format_table, machine, write_outputs

    sweep = args.study == "sweep"
    ratios = args.ratios or (SWEEP_RATIOS if sweep else DEFAULT_RATIOS)
    hf = False
    if (args.methods is None and not sweep) or (args.methods and "hf_pipeline" in args.methods):
        from .chains import hf_available

        hf = hf_available()
        if args.methods and "hf_pipeline" in args.methods and not hf:
            raise ValueError("hf_pipeline needs langchain-huggingface: pip install --no-deps langchain-huggingface")
    specs = parse_methods(args.methods, ratios, sweep=sweep, hf_available=hf)
    load_specs = [MethodSpec.parse(m) for m in args.load_methods.split(",") if m.strip()] if args.concurrency else []

    items, engine = _questions_and_engine(args, dataset)
    show = not args.quiet
    result = engine_bench.run(engine, items, specs, num_chunks=args.chunks, max_new_tokens=args.max_new_tokens,
                              show_progress=show, chunk_tokens=args.chunk_tokens, seed=args.seed,
                              warmup=not args.no_warmup)
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
    meta = {
        "dataset": str(dataset), "dataset_name": dataset.stem, "questions": len(items), "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens, "methods": [s.label for s in specs], "ratios": list(ratios),
        "sweep": sweep, "model": args.model, "dtype": _dtype(engine), "device": str(engine.adapter.device),
        "lead_in": args.lead_in, "kv_store": args.kv_store, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
        "shuffle": args.shuffle, "concurrency": args.concurrency, "warmup": not args.no_warmup, "machine": machine(),
    }
    result = {"meta": meta, **result}

    ing = result["ingest"]
    print(f"\n{len(items)} questions × {args.chunks} chunks, {meta['dtype']}, lead-in {args.lead_in}; {machine()}")
    print(f"ingestion: {ing['tokens']} tokens in {ing['seconds']:.1f} s"
          + (f" ({ing['tokens_per_s']:.0f} tokens/s)" if ing["tokens_per_s"] else ""))
    print(format_table(result["summary"]))
    from .chains import ttft_ratios

    print(ttft_ratios(result["summary"], result["records"]))
    if result["throughput"]:
        print(format_load_table(result["throughput"]))
    if args.out:
        paths = write_outputs(result, args.out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return result


def _frames(args: argparse.Namespace, dataset: Path) -> dict:
    """`frames`: each entry point's prompt, KL vs the model's own forward of it; prints and writes frames.md."""
    from .frames import format_frames, run_frames
    from .report import machine

    items, engine = _questions_and_engine(args, dataset)
    result = run_frames(engine, items, num_chunks=args.chunks, max_new_tokens=args.max_new_tokens,
                        show_progress=not args.quiet, behind=args.behind, chunk_tokens=args.chunk_tokens)
    result["meta"] = {"questions": len(items), "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
                      "model": args.model, "dtype": _dtype(engine), "behind": args.behind, "machine": machine()}
    header = (f"{len(items)} questions × {args.chunks} passages, computed behind the {args.behind}, {args.model}, "
              f"{_dtype(engine)}; {machine()}")
    _print_and_write(args, "frames", header, format_frames(result["summary"]), result)
    return result


def _conversation(args: argparse.Namespace, dataset: Path) -> dict:
    """`conversation`: 4-turn chats, stored prefixes vs none vs full prefill; prints and writes conversation.md."""
    from .conversation import RATIO, format_conversation, format_peers, run_conversation, summarize_peers
    from cacheblend_rag.models.loader import model_folder
    from .peers import open_peers, parse_peers
    from .report import machine

    names = parse_peers(args.peers)
    items, engine = _questions_and_engine(args, dataset)
    if args.rss:
        return _conversation_rss(args, items, engine)
    peers, skipped = open_peers(names, model=args.model, folder=model_folder(args.model, args.home),
                                dtype=engine.adapter.dtype, recompute_ratio=RATIO,
                                context_window=engine.context_window) if names else ([], [])
    for line in skipped:
        print(line)
    result = run_conversation(engine, items, num_chunks=args.chunks, max_new_tokens=args.max_new_tokens,
                              show_progress=not args.quiet, peers=peers)
    result["meta"] = {"conversations": len(items), "chunks": args.chunks, "model": args.model,
                      "dtype": _dtype(engine), "max_new_tokens": args.max_new_tokens, "machine": machine()}
    header = (f"{len(items)} conversations × 4 turns × {args.chunks} passages, {_dtype(engine)}, "
              f"max_new_tokens {args.max_new_tokens}; {machine()}")
    table = format_conversation(result["summary"])
    if peers:
        result["summary"]["peers"] = summarize_peers(result["records"])
        table += "\n\nPeers on the same turns (median TTFT; × = ratio to ours with stored prefixes):\n"
        table += format_peers(result["summary"]["peers"])
    result["meta"]["peers"] = {"ran": [p.name for p in peers], "skipped": skipped}
    _print_and_write(args, "conversation", header, table, result)
    return result


def _agent(args: argparse.Namespace, dataset: Path) -> dict:
    """`agent`: a two-step retrieval agent per question; prints and writes agent.md."""
    from .agent import format_agent, run_agent
    from .report import machine

    items, engine = _questions_and_engine(args, dataset)
    result = run_agent(engine, items, num_chunks=args.chunks, max_new_tokens=args.max_new_tokens,
                       show_progress=not args.quiet)
    result["meta"] = {"questions": len(items), "chunks": args.chunks, "model": args.model,
                      "dtype": _dtype(engine), "max_new_tokens": args.max_new_tokens, "machine": machine()}
    header = (f"{len(items)} questions × 2 agent steps × {args.chunks} passages in the tool result, "
              f"{_dtype(engine)}, max_new_tokens {args.max_new_tokens}; {machine()}")
    _print_and_write(args, "agent", header, format_agent(result["summary"]), result)
    return result


def _conversation_rss(args: argparse.Namespace, items: list[dict], engine) -> dict:
    """`conversation --rss`: the prefix tier's bytes vs its budget and the process RSS over many short chats."""
    from .conversation import distinct_chats, format_rss, run_rss
    from .report import machine

    budget = int(args.prefix_budget_mb * 2 ** 20)
    items = distinct_chats(items, max(args.limit or 0, len(items)), args.chunks)  # --limit 100 > 50 questions
    result = run_rss(engine, items, budget_bytes=budget, num_chunks=args.chunks, max_new_tokens=args.max_new_tokens,
                     show_progress=not args.quiet)
    result["meta"] = {"conversations": len(items), "chunks": args.chunks, "model": args.model,
                      "dtype": _dtype(engine), "budget_mb": args.prefix_budget_mb,
                      "max_new_tokens": args.max_new_tokens, "machine": machine()}
    header = (f"{len(items)} chats × 2 turns × {args.chunks} passages, prefix tier {args.prefix_budget_mb:g} MB, "
              f"{_dtype(engine)}, max_new_tokens {args.max_new_tokens}; {machine()}")
    _print_and_write(args, "conversation_rss", header, format_rss(result), result)
    return result


def _faq(args: argparse.Namespace) -> dict:
    """`faq`: accuracy on the generated FAQ set in the chat, string and tool frames; prints and writes faq.md."""
    from .frames import format_faq, run_faq
    from .report import machine

    methods = _method_ratios(args.methods)
    engine = _engine(args, kv_store=args.kv_store)
    result = run_faq(engine, num_questions=args.limit or 40, k=args.k, seed=args.seed, methods=methods,
                     max_new_tokens=args.max_new_tokens, show_progress=not args.quiet, behind=args.behind)
    header = (f"{args.limit or 40} FAQ questions, k = {args.k}, pages computed behind the {args.behind}, "
              f"{args.model}, {_dtype(engine)}; {machine()}")
    _print_and_write(args, "faq", header, format_faq(result["summary"]), result)
    return result


def _answers(args: argparse.Namespace) -> dict:
    """`answers`: accuracy against gold and kept right answers per arm; prints and writes answers.md/json."""
    from cacheblend_rag.engine import CacheBlendEngine
    from cacheblend_rag.links_training import examples_from_file

    from .answers import Arm, format_answers, run_answers
    from .report import machine

    arms = [Arm.parse(a) for a in args.arms.split(",") if a.strip()]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    links = None if args.links == "none" else args.links
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=args.kv_store, device=args.device,
                                              dtype=args.dtype, home=args.home, lead_in=args.lead_in,
                                              prefix_reuse=False, links=links)
    dataset = Path(args.data or args.dataset or "../shared/data/nq_rag_dev.json")
    examples = examples_from_file(dataset, start=args.skip, limit=args.limit or None, num_passages=args.chunks,
                                  passage_words=args.passage_words)
    result = run_answers(engine, examples, arms, max_new_tokens=args.max_new_tokens, show_progress=not args.quiet)
    links_note = (f"links {engine.links.source} ({engine.links.num_links})" if engine.links is not None
                  else "no links")
    header = (f"{len(examples)} questions of {dataset.name} from #{args.skip}, {args.chunks} passages, "
              f"{args.model}, {_dtype(engine)}, {links_note}, max_new_tokens {args.max_new_tokens}; {machine()}")
    _print_and_write(args, "answers", header, format_answers(result["summary"]), result)
    return result


def _tools(args: argparse.Namespace) -> dict:
    """`tools`: tool choice left to the model; prints and writes tools.md."""
    from .report import machine
    from .tool_choice import format_tool_choice, run_tool_choice

    engine = _engine(args, kv_store=None)
    result = run_tool_choice(engine, max_new_tokens=args.max_new_tokens)
    header = f"tool_choice auto, {args.model}, {_dtype(engine)}, max_new_tokens {args.max_new_tokens}; {machine()}"
    _print_and_write(args, "tools", header, format_tool_choice(result), result)
    return result


def _breakdown(args: argparse.Namespace, dataset: Path) -> dict:
    """`breakdown`: per-layer times and op shares of each engine method; prints and writes them."""
    from . import breakdown
    from .methods import DEFAULT_RATIOS, parse_methods
    from .report import format_breakdown, machine, write_table

    specs = parse_methods(args.methods, args.ratios or DEFAULT_RATIOS, chains=False)
    chains = [s.label for s in specs if s.is_chain]
    if chains:
        raise ValueError(f"breakdown times the engine's prefill; chains have no layers: {', '.join(chains)}")
    args.repeats = 2 if args.repeats is None else args.repeats
    if args.repeats < 1:
        raise ValueError(f"--repeats must be ≥ 1, got {args.repeats}")
    items, engine = _questions_and_engine(args, dataset)
    summary = breakdown.run(engine, items, specs, num_chunks=args.chunks, chunk_tokens=args.chunk_tokens,
                            repeats=args.repeats, show_progress=not args.quiet)
    table = format_breakdown(summary)
    header = (f"{len(items)} questions × {args.chunks} chunks, {_dtype(engine)}, {args.repeats} timed rounds each; "
              f"{machine()}")
    print(f"\n{header}\n{table}")
    if args.out:
        meta = {"dataset": str(dataset), "questions": len(items), "chunks": args.chunks, "machine": machine()}
        paths = write_table(args.out, "breakdown", header, table, {"meta": meta, "summary": summary})
        print("wrote " + ", ".join(str(p) for p in paths))
    return summary


def _decode(args: argparse.Namespace, dataset: Path) -> dict:
    """`decode`: ms/token of both decoders per prompt length, and batched steps; prints and writes them."""
    from . import decode_bench
    from .report import machine, write_table

    items, engine = _questions_and_engine(args, dataset)
    result = decode_bench.run(engine, items, new_tokens=args.max_new_tokens, repeats=args.repeats)
    table = decode_bench.format_table(result)
    header = f"greedy decode after a CacheBlend prefill, {args.max_new_tokens} new tokens, best of {args.repeats}; {machine()}"
    print(f"\n{header}\n{table}")
    if args.out:
        paths = write_table(args.out, "decode", header, table, {"meta": {"dataset": str(dataset), "machine": machine()},
                                                                **result})
        print("wrote " + ", ".join(str(p) for p in paths))
    return result


def _serve_load(args: argparse.Namespace, dataset: Path) -> dict:
    """`serve-load`: the server under load over HTTP; prints and writes the tables."""
    from .datasets import load_dataset
    from .load import format_serve_load, run_serve_load
    from .report import machine, write_table

    items = load_dataset(dataset, args.limit or None, shuffle=args.shuffle, seed=args.seed, skip=args.skip)
    if args.conversations is not None:
        return _serve_memory(args, dataset, items)
    result = run_serve_load(items, model=args.model, dtype=args.dtype, num_chunks=args.chunks,
                            concurrency=args.concurrency, num_requests=args.requests,
                            max_tokens=args.max_new_tokens)
    table = format_serve_load(result)
    header = (f"{result['requests']} requests from {result['concurrency']} openai SDK clients over loopback HTTP, "
              f"{args.chunks} passages each, {args.max_new_tokens} new tokens; {machine()}")
    print(f"\n{header}\n{table}")
    if args.out:
        paths = write_table(args.out, "serve_load", header, table, {"meta": {"dataset": str(dataset)}, **result})
        print("wrote " + ", ".join(str(p) for p in paths))
    return result


def _serve_memory(args: argparse.Namespace, dataset: Path, items: list[dict]) -> dict:
    """`serve-load --conversations N`: the server's RSS over many distinct chats; prints and writes the table."""
    from .load import format_serve_memory, run_serve_memory
    from .report import machine

    if args.conversations < 1:
        raise SystemExit(f"--conversations must be ≥ 1, got {args.conversations}")
    result = run_serve_memory(items, model=args.model, dtype=args.dtype, num_chats=args.conversations,
                              num_chunks=args.chunks, max_tokens=args.max_new_tokens)
    header = (f"{result['chats']} distinct two-turn chats over loopback HTTP (openai SDK), {args.chunks} passages "
              f"each, {args.max_new_tokens} new tokens a turn; {machine()}")
    _print_and_write(args, "serve_memory", header, format_serve_memory(result), {"meta": {"dataset": str(dataset)},
                                                                               **result})
    return result


def _loading(args: argparse.Namespace, dataset: Path) -> dict:
    """`loading`: TTFT per KV location and "auto" vs fixed ratios; prints and writes them."""
    import tempfile

    from . import loading_bench
    from .report import format_loading, machine, write_table

    ratio = args.ratios[0] if args.ratios else LOADING_RATIO
    items, engine = _questions_and_engine(args, dataset)
    with tempfile.TemporaryDirectory(prefix="cacheblend-loading-") as tmp:
        result = loading_bench.run(engine.model, engine.tokenizer, items, args.kv_store or tmp,
                                   num_chunks=args.chunks, chunk_tokens=args.chunk_tokens, ratio=ratio,
                                   lead_in=args.lead_in, home=args.home, show_progress=not args.quiet)
    table = format_loading(result)
    header = f"{len(items)} questions × {args.chunks} passages, CacheBlend r={ratio}, {_dtype(engine)}; {machine()}"
    print(f"\n{header}\n{table}")
    if args.out:
        meta = {"dataset": str(dataset), "questions": len(items), "chunks": args.chunks, "dtype": _dtype(engine),
                "machine": machine()}
        paths = write_table(args.out, "loading", header, table, {"meta": meta, **result})
        print("wrote " + ", ".join(str(p) for p in paths))
    return result


def _trace(args: argparse.Namespace, dataset: Path) -> dict:
    """`trace`: every method over the interleaved trace, per corpus mode; prints and writes trace.md/json/png."""
    from . import trace
    from .report import machine

    if args.chunk_tokens:
        raise ValueError("trace runs its own workload of whole passages; drop --chunk-tokens")
    modes = [m.strip() for m in args.trace_modes.split(",") if m.strip()]
    if not modes or any(m not in trace.MODES for m in modes):
        raise ValueError(f"--trace-modes takes {', '.join(trace.MODES)} (comma-separated), got {args.trace_modes!r}")
    repeats = 3 if args.repeats is None else args.repeats
    if repeats < 1 or args.k < 1:
        raise ValueError(f"--repeats and --k must be ≥ 1, got {repeats} and {args.k}")
    specs = trace.parse_trace_methods(args.methods or trace.DEFAULT_METHODS)
    if args.guard is not None:
        specs = trace.with_guard(specs, args.guard, args.guard_ratio)
    items, engine = _questions_and_engine(args, dataset)
    results = []
    for mode in modes:
        result = trace.run(engine.model, engine.tokenizer, items, specs, mode=mode, repeats=repeats, k=args.k,
                           max_new_tokens=args.max_new_tokens, seed=args.seed, lead_in=args.lead_in,
                           show_progress=not args.quiet)
        results.append(result)
        print(f"\n{mode} corpus: {len(items)} questions × {repeats} requests, k={args.k}, {_dtype(engine)}; "
              f"{machine()}")
        print(trace.format_trace_table(result["summary"]))
        if result["guard"]:
            print(trace.format_guard_table(result["guard"]))
    meta = {"dataset": str(dataset), "questions": len(items), "repeats": repeats, "k": args.k, "modes": modes,
            "methods": [s.label for s in specs], "model": args.model, "dtype": _dtype(engine),
            "lead_in": args.lead_in, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "guard": args.guard, "guard_ratio": args.guard_ratio, "machine": machine(),
            "command": "cacheblend-rag bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else ""}
    if args.out:
        paths = trace.write_trace_outputs(meta, results, args.out)
        print("wrote " + ", ".join(str(p) for p in paths))
    return {"meta": meta, "results": results}
def _shared_tier(args: argparse.Namespace, dataset: Path) -> dict:
    """`faults` or `shared-tier`: real replicas and a real redis-server on loopback; prints and writes tables."""
    from .datasets import load_dataset, passages_of
    from .report import machine, write_table

    items = [(item["question"], passages_of(item, args.chunks))
             for item in load_dataset(dataset, args.limit or None, shuffle=args.shuffle, seed=args.seed,
                                      skip=args.skip)]
    if args.study == "faults":
        from . import faults

        scenarios = faults.SCENARIOS
        if args.fault_scenarios:
            scenarios = tuple(n.strip() for n in args.fault_scenarios.split(",") if n.strip())
            unknown = sorted(set(scenarios) - set(faults.SCENARIOS))
            if unknown or not scenarios:
                raise ValueError(f"--fault-scenarios: unknown {', '.join(unknown) or 'empty list'}; choose from "
                                 f"{', '.join(faults.SCENARIOS)}")
        result = faults.run(items, model=args.model, home=args.home, num_requests=args.fault_requests,
                            clients=args.clients, max_tokens=args.max_new_tokens, seed=args.seed,
                            scenarios=scenarios)
        name, tables = "faults", []
        if result["results"]:
            tables.append(f"{args.fault_requests} requests per scenario from {args.clients} clients over 2 "
                          f"replicas, {len(items)} questions × {args.chunks} passages, {args.max_new_tokens} new "
                          f"tokens:\n\n{faults.format_faults(result['results'])}")
        if result["grammar"]:
            tables.append("Grammar defects, one server with its defaults (--max-grammar-bytes 128 KiB, "
                          f"--grammar-timeout 10 s):\n\n{faults.format_grammar(result['grammar'])}")
        if result["privacy"]:
            tables.append("What client B learns of client A's requests, one server with keys A and B, "
                          f"--hide-cache-usage and --metrics-key:\n\n{faults.format_privacy(result['privacy'])}")
        header, table = f"model {args.model}; {machine()}", "\n\n".join(tables)
    else:
        from . import shared_tier

        ratio = args.ratios[0] if args.ratios else LOADING_RATIO
        device = dict(device="cpu" if args.device == "auto" else args.device,
                      dtype="float32" if args.dtype == "auto" else args.dtype)
        cross = shared_tier.cross_replica(items, model=args.model, home=args.home, ratio=ratio, **device)
        remote = shared_tier.remote_codecs(items, model=args.model, home=args.home, ratio=ratio, **device)
        result = {"cross_replica": cross, "remote": remote}
        name, table = "shared_tier", shared_tier.format_shared_tier(cross, remote)
        header = f"{len(items)} questions × {args.chunks} passages; {machine()}"
    print(f"\n{header}\n{table}")
    if args.out:
        paths = write_table(args.out, name, header, table, {"dataset": str(dataset), **result})
        print("wrote " + ", ".join(str(p) for p in paths))
    return result


def run_cli(args: argparse.Namespace) -> int:
    """`cacheblend-rag bench` handler: exit code 0, or 2 with a message on bad input."""
    try:
        execute(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
