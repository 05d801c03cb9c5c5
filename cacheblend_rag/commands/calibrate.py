"""`cacheblend-rag calibrate`: the fidelity gate's ratio for a model (`gate.py`), or Cache-Craft's alpha."""

from __future__ import annotations

import argparse
import json
import math

from ..errors import ConfigError
from .common import add_model_run_arguments, check_device, model_options


def add_calibrate(subparsers) -> None:
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
    from ..fuse.policies import DEFAULT_METHOD, POLICIES, takes_ratio

    method = args.method or DEFAULT_METHOD
    if method not in POLICIES or not (method == "cachecraft" or takes_ratio(POLICIES[method])):
        raise ConfigError(f"--method must be a method with a recompute ratio, or cachecraft; got {method!r}")
    target = args.target_kl if args.target_kl is not None else (0.06 if method == "cachecraft" else 0.05)
    if not (target > 0 and math.isfinite(target)):
        raise ConfigError(f"--target-kl must be a positive number, got {target}")
    if method == "cachecraft":
        return _calibrate_alpha(args, target)
    from .. import gate
    from ..engine import CacheBlendEngine

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
        kept = "" if row.get("kept") is None else f"  right answers kept {row['kept']:.0%}"
        print(f"  ratio {row['ratio']:<5}{' + links' if row.get('links') else ''} mean KL {row['mean_kl']:.4f}  "
              f"max {row['max_kl']:.4f}  top token as full prefill {row['agreement']:.0%}{kept}  "
              f"{row['speedup']:.2f}x full prefill")
    if decision.met:
        verdict = (f"ratio {decision.ratio}{' with links' if decision.links else ''} meets mean KL ≤ {target} with "
                   f"{decision.agreement:.0%} agreement" + ("" if decision.kept is None else
                                                            f" and keeps {decision.kept:.0%} of right answers")
                   + ": requests that name no ratio run at it")
    else:
        verdict = (f"no ratio tried meets mean KL ≤ {target} with ≥ {agreement:.0%} agreement: requests that name "
                   f"no ratio run at {decision.ratio} (full prefill's answers); name a ratio to trade fidelity "
                   "for speed, or use method prefix_cache")
    print(verdict + (f"; stored in {path}" if path else " (dry run: not stored)"))
    return 0


def _calibrate_alpha(args: argparse.Namespace, target: float) -> int:
    from ..datasets import load_dataset, passages_of, resolve_dataset
    from ..engine import CacheBlendEngine
    from ..cachecraft_calibration import ALPHAS, calibrate, store_calibration

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
