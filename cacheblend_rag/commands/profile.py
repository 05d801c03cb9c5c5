"""`cacheblend-rag profile`: the compute and storage profiles the loading controller reads."""

from __future__ import annotations

import argparse
import json

from .. import settings
from .common import add_model_run_arguments, check_device, model_options


def add_profile(subparsers) -> None:
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

    from ..engine import CacheBlendEngine
    from ..loading.profile import load_or_measure, profile_path

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
    print_codec_choice(engine, compute, tiers)
    return 0


def print_codec_choice(engine, compute, tiers) -> None:
    """Each codec's measured size and decode speed, and the codec (or recompute) each tier would choose."""
    from ..loading.controller import LoadingController
    from ..loading.profile import TierProfile, measure_codec_profiles, synthetic_kv

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
