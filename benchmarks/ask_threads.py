"""One process, one prefill (`ask`'s: the top-k stored chunks and a question), torch threads alternated 1 / 2 / 1 /
2 ...: the TTFT of each (issue 41: on a busy CPU torch's threads wait on each other at every op).

    python benchmarks/ask_threads.py --home HOME [--k 4] [--repeats 3]   # HOME: after `cacheblend-rag ingest`
"""

import argparse
import os

import torch

from cacheblend_rag.cli import build_parser, chunk_store, open_engine
from cacheblend_rag.request import Request

p = argparse.ArgumentParser()
p.add_argument("--home", required=True)
p.add_argument("--k", type=int, default=4)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--question", default="How many eyes does a honeybee have?")
opts = p.parse_args()
args = build_parser().parse_args(["ask", opts.question, "--k", str(opts.k), "--home", opts.home])
store = chunk_store(args, create=False)
engine = open_engine(args)
chunks = [engine.resolve_chunk(c.chunk_id) for c in store.query(opts.question, opts.k)]
print("load average", os.getloadavg(), "cores", os.cpu_count())
ttft: dict[int, list[float]] = {1: [], 2: []}
for _ in range(opts.repeats):
    for n in ttft:
        torch.set_num_threads(n)
        ttft[n].append(engine.prefill_request(Request.of(chunks, opts.question), store_holes=False).stats.ttft_s)
for n, values in ttft.items():
    print(f"{n} thread(s): TTFT " + ", ".join(f"{v:.3f} s" for v in values))
print("load average", os.getloadavg())
