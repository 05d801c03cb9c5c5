"""Cache-Craft's speed point judged on questions the calibration never saw (#41): `cacheblend-rag calibrate`'s
protocol per question (a cold cachecraft request over a seeded subset leaves variants, every chunk is also
precomputed alone, then the measured request over another subset and order), with seeds the calibration does not
use; the measured request runs as full prefill (the KL reference), cacheblend@0.15 and cachecraft at each alpha,
interleaved (order reversed every other repeat), one torch thread. Prints per question the median prefill time and
first-token KL, then per arm the mean KL and its speed vs cacheblend@0.15 (a within-run ratio per question).
`--token-choice` is Cache-Craft's (ranking, hkvd, relevance; several, comma-separated, are arms of one run, named
`cachecraft[CHOICE]/alpha=A`); `--relevance R` adds the relevance policy at ratio R
for reference. With `--seed 0` on dev questions it is `cacheblend-rag calibrate`'s protocol (the same requests).

    python benchmarks/cachecraft_heldout.py --data HELD_OUT.json --alphas 0.1,0.3,0.5,0.8 --repeats 2
    python benchmarks/cachecraft_heldout.py --data HELD_OUT.json --alphas 0.3,0.5 --token-choice ranking,relevance \
        --relevance 0.15
"""

import argparse
import json
import statistics
import time

import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.datasets import passages_of
from cacheblend_rag.fuse.fidelity import first_token_kl
from cacheblend_rag.cachecraft_calibration import _requests

p = argparse.ArgumentParser()
p.add_argument("--data", required=True, help="MuSiQue-style JSON of held-out questions")
p.add_argument("--alphas", default="0.1,0.3,0.5,0.8")
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--model", default="smollm2-135m")
p.add_argument("--seed", type=int, default=1000, help="first request seed (calibrate uses 0, 1, 2, ...)")
p.add_argument("--token-choice", default="ranking", help="Cache-Craft's token_choice(s): ranking, hkvd, relevance")
p.add_argument("--relevance", default="", help="ratios of reference relevance arms, e.g. 0.15 (none by default)")
opts = p.parse_args()
torch.set_num_threads(1)
items = json.load(open(opts.data))
alphas = [float(a) for a in opts.alphas.split(",")]
engine = CacheBlendEngine.from_pretrained(opts.model, kv_store=None, dtype="bfloat16", prefix_reuse=False)
choices = opts.token_choice.split(",")
arms = (["cacheblend@0.15"] + [f"cachecraft[{c}]/alpha={a}" if len(choices) > 1 else f"cachecraft/alpha={a}"
                               for c in choices for a in alphas]
        + [f"relevance@{r}" for r in opts.relevance.split(",") if r])


def run(arm: str, passages: list[str], question: str):
    """One measured request of an arm."""
    if arm.startswith("cacheblend@") or arm.startswith("relevance@"):
        method, ratio = arm.split("@")
        return engine.prefill(passages, question, method, float(ratio))
    choice = arm[arm.index("[") + 1:arm.index("]")] if "[" in arm else choices[0]
    return engine.prefill(passages, question, "cachecraft", alpha=float(arm.split("=")[1]), store_variants=False,
                          token_choice=choice)


kl: dict[str, list[float]] = {a: [] for a in arms}
speed: dict[str, list[float]] = {a: [] for a in arms}
for n, item in enumerate(items):
    question, passages = item["question"], passages_of(item, None)
    first, second = _requests(passages, 6, opts.seed + n)
    engine.prefill(first, question, "cachecraft")
    engine.ingest(second, show_progress=False)
    full = engine.prefill(second, question, "full_prefill")
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(opts.repeats):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            started = time.perf_counter()
            got = run(arm, second, question)
            times[arm].append(time.perf_counter() - started)
            if r == 0:
                kl[arm].append(first_token_kl(full.logits, got.logits))
    base = statistics.median(times["cacheblend@0.15"])
    for arm in arms:
        speed[arm].append(base / statistics.median(times[arm]))
    print(f"q{n}: " + "  ".join(f"{a} {statistics.median(times[a]):.3f}s KL {kl[a][-1]:.4f}" for a in arms), flush=True)
for arm in arms:
    print(f"{arm}: mean KL {statistics.mean(kl[arm]):.4f}; speed vs cacheblend@0.15 per question "
          f"{', '.join(f'{x:.2f}x' for x in speed[arm])} (median {statistics.median(speed[arm]):.2f}x)")
