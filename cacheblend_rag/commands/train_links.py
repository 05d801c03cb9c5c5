"""`cacheblend-rag train-links`: learned links for a model, distilled from its own full prefill (links_training.py)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import settings
from ..errors import ConfigError
from .common import add_model_run_arguments, check_device, model_options, positive_int

FALLBACK_DATA = (Path("..") / "shared" / "data" / "nq_rag_dev.json",
                 Path("..") / "shared" / "data" / "musique_dev.json")


def add_train_links(subparsers) -> None:
    p = subparsers.add_parser(
        "train-links", help="train learned links for a model (the model frozen; distilled from its full prefill)",
        description="Train m link embeddings that sit after the last reused passage and are computed with the "
        "question, so that reuse answers as the model's own full prefill does. Each step: one training prompt "
        "fused from its passages' stored KV with the links, teacher-forced on full prefill's greedy answer; the KL "
        "to full prefill's next-token distributions flows back to the links alone. The result is written to "
        "--out (default: this machine's links folder, where engines on this model load it automatically); "
        "checkpoints go there too, so a stopped run resumes with --resume.")
    p.add_argument("--data", action="append", metavar="FILE",
                   help="training questions: NQ-style ({'items': [{question, passages, answers}]}) or MuSiQue-style "
                   "([{question, ctxs, answers}]) JSON; repeatable (default: ../shared/data/nq_rag_dev.json and "
                   "musique_dev.json from the working folder, when they exist)")
    p.add_argument("--start", type=int, default=0, help="first item of each file to train on (default 0)")
    p.add_argument("--limit", type=positive_int, default=200, help="items of each file to train on (default 200)")
    p.add_argument("--passages", type=positive_int, default=6, help="passages per prompt (default 6)")
    p.add_argument("--passage-words", type=positive_int, default=None,
                   help="cut each passage to this many words (default: as they are; MuSiQue's are ~400)")
    p.add_argument("--eval", type=int, default=0, metavar="N",
                   help="also report the mean KL before and after on N held-out items (default 0)")
    p.add_argument("--eval-start", type=int, default=None, metavar="N",
                   help="the first held-out item of each file (default: right after the training ones)")
    p.add_argument("--num-links", type=positive_int, default=16, help="link embeddings m (1-64, default 16)")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps, one prompt each (default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default 3e-3)")
    p.add_argument("--answer-tokens", type=positive_int, default=8,
                   help="first answer tokens distilled, teacher-forced (default 8)")
    from ..links_training import TRAINING_METHOD

    p.add_argument("--method", default=TRAINING_METHOD, help="the reuse method the links are trained under "
                   "(default full_reuse: every passage row stays stale, the hardest case)")
    p.add_argument("--recompute-ratio", type=float, default=None, help="that method's ratio, if it takes one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the links file to write (default: this machine's links folder, by the model's "
                   f"weights fingerprint; ${settings.ENV_LINKS} moves it)")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint when it exists")
    p.add_argument("--work-dir", help="where the passages' KV and full prefill's answers are kept between runs "
                   "(default: <home>/train-links/<fingerprint>)")
    add_model_run_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(func=_train_links)


def _data_files(given: list[str] | None) -> list[Path]:
    if given:
        paths = [Path(g).expanduser() for g in given]
        for path in paths:
            if not path.is_file():
                raise ConfigError(f"--data {path}: no such file")
        return paths
    found = [Path.cwd() / f for f in FALLBACK_DATA if (Path.cwd() / f).is_file()]
    if not found:
        raise ConfigError("no training data: pass --data FILE (NQ-style or MuSiQue-style JSON); "
                          f"{', '.join(map(str, FALLBACK_DATA))} do not exist from {Path.cwd()}")
    return found


def _train_links(args: argparse.Namespace) -> int:
    from ..engine import CacheBlendEngine
    from ..fuse.links import trained_path
    from ..fuse.policies import make_policy
    from ..links_training import distill_loss, examples_from_file, initial_links, load_checkpoint, student_logits, train

    if not 1 <= args.num_links <= 64:
        raise ConfigError(f"--num-links must be within 1..64, got {args.num_links}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError(f"--lr must be a positive number, got {args.lr}")
    if args.start < 0 or args.eval < 0:
        raise ConfigError("--start and --eval must be ≥ 0")
    make_policy(args.method, args.recompute_ratio)  # a bad method or ratio fails here, before the model loads
    files = _data_files(args.data)
    check_device(args.device)
    # the passages' KV and full prefill's answers are kept in a folder of the model's, for reruns and --resume
    # (the store's namespace and the answers' keys tell models, dtypes and prompts apart)
    work = Path(args.work_dir).expanduser() if args.work_dir else (
        settings.home_dir(args.home) / "train-links" / "".join(c if c.isalnum() or c in "-._" else "_"
                                                              for c in str(args.model)))
    work.mkdir(parents=True, exist_ok=True)
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=work / "kv", device=args.device, dtype=args.dtype,
                                              home=args.home, calibrate=False, prefix_reuse=False, links=None,
                                              **model_options(args))
    out = Path(args.out).expanduser() if args.out else trained_path(engine.weights_fingerprint)

    def examples(start: int, limit: int):
        items = []
        for path in files:
            items += examples_from_file(path, start=start, limit=limit, num_passages=args.passages,
                                        passage_words=args.passage_words)
        return items

    train_ex = examples(args.start, args.limit)
    eval_start = args.start + args.limit if args.eval_start is None else args.eval_start
    if args.eval and eval_start < args.start + args.limit and eval_start + args.eval > args.start:
        raise ConfigError(f"--eval-start {eval_start}: the held-out items overlap the training ones "
                          f"({args.start}..{args.start + args.limit - 1})")
    eval_ex = examples(eval_start, args.eval) if args.eval else []
    teachers = _teachers(engine, train_ex + eval_ex, args.answer_tokens, work)
    train_t, eval_t = teachers[:len(train_ex)], teachers[len(train_ex):]
    start_step, state = 0, None
    if args.resume and out.is_file():
        links, state, start_step = load_checkpoint(out)
        links = links.for_model(engine.weights_fingerprint, links.vocab_size, links.hidden_size)
        print(f"resuming {out} at step {start_step}")
    else:
        links = initial_links(engine, args.num_links, args.seed)
    links = dataclasses.replace(links, recipe=dict(
        links.recipe, model=engine.model_name, data=[p.name for p in files], start=args.start, limit=args.limit,
        passages=args.passages, passage_words=args.passage_words, lr=args.lr, answer_tokens=args.answer_tokens,
        method=args.method, recompute_ratio=args.recompute_ratio, dtype=str(engine.adapter.dtype).split(".")[-1],
        device=str(engine.adapter.device), num_links=links.num_links))

    def mean_kl(lk) -> float | None:
        if not eval_t:
            return None
        with torch.no_grad():
            return sum(float(distill_loss(student_logits(engine, lk, t, args.method, args.recompute_ratio), t))
                       for t in eval_t) / len(eval_t)

    before = mean_kl(links)
    started = time.perf_counter()
    if start_step >= args.steps:
        trained, log = links, {"losses": [], "step_s": []}
    else:
        trained, log = train(engine, train_t, links=links, steps=args.steps, lr=args.lr, method=args.method,
                             recompute_ratio=args.recompute_ratio, seed=args.seed, checkpoint=out,
                             start_step=start_step, optimizer_state=state)
    trained.save(out)
    result = {"out": str(out), "model": engine.model_name, "fingerprint": engine.weights_fingerprint,
              "num_links": trained.num_links, "steps": args.steps, "train_examples": len(train_t),
              "train_s": round(time.perf_counter() - started, 1),
              "step_s": round(sum(log["step_s"]) / len(log["step_s"]), 3) if log["step_s"] else None,
              "final_train_kl": (round(sum(log["losses"][-25:]) / len(log["losses"][-25:]), 4)
                                 if log["losses"] else None),
              "eval_kl_before": before, "eval_kl_after": mean_kl(trained), "bytes": os.path.getsize(out)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"links for {engine.model_name} ({trained.num_links} × {trained.hidden_size}, {result['bytes']} bytes) "
              f"written to {out}; {result['steps']} steps in {result['train_s']} s ({result['step_s']} s/step)")
        if eval_t:
            print(f"held-out mean KL to full prefill over the first {args.answer_tokens} answer tokens: "
                  f"{before:.4f} before → {result['eval_kl_after']:.4f} after ({len(eval_t)} prompts)")
    return 0


def _teachers(engine, examples, answer_tokens: int, work: Path):
    """Full prefill's answers of the examples, kept in `work` (keyed by prompt and answer length) for reruns."""
    from ..links_training import Teacher, teach

    out = []
    for ex in tqdm(examples, desc="full prefill answers", unit="prompt"):
        engine.ingest(list(ex.passages), show_progress=False)
        key = hashlib.sha256(json.dumps([ex.passages, ex.question, answer_tokens]).encode()).hexdigest()[:24]
        path = work / "teachers" / f"{key}.pt"
        if path.is_file():
            try:
                saved = torch.load(path, weights_only=True)
                out.append(Teacher(ex, saved["answer_ids"], saved["logprobs"]))
                continue
            except (OSError, RuntimeError, KeyError, EOFError):
                pass  # unreadable: computed again below
        teacher = teach(engine, ex, answer_tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"answer_ids": teacher.answer_ids, "logprobs": teacher.logprobs}, tmp)
        os.replace(tmp, path)
        out.append(teacher)
    return out
