"""Python calls per decode token of a plain request (kv_decode, no text, EOS ignored), from the difference between
16 and 64 new tokens (issue 41): independent of machine load; run it on two checkouts to compare them.

    PYTHONPATH=CHECKOUT python benchmarks/decode_calls.py
"""
import cProfile, pstats, sys, torch
torch.set_num_threads(1)
from cacheblend_rag import CacheBlendEngine, load_model
from cacheblend_rag.decode.generate import SamplingOptions
from cacheblend_rag.decode.kv_decode import kv_decode, KVDecoder
import cacheblend_rag
print(cacheblend_rag.__file__)
model, tok = load_model("smollm2-135m", device="cpu", dtype="bfloat16")
try:
    engine = CacheBlendEngine(model, tok, None, prefix_reuse=False)
except TypeError:
    engine = CacheBlendEngine(model, tok, None)
text = "The honeybee has five eyes and lives in a colony with one queen. " * 60
pre = engine.prefill([text], "How many eyes does a honeybee have?", store_holes=False)
print("prompt", pre.token_ids.numel())
kv_decode(engine.adapter, tok, pre.token_ids, pre.keys, pre.values, SamplingOptions(max_new_tokens=2))  # warm
counts, funcs = {}, {}
_init = KVDecoder.__init__
def _no_eos(self, *a, **k):  # no EOS: every run decodes n tokens
    _init(self, *a, **k); self.eos_token_id = -1
KVDecoder.__init__ = _no_eos
for n in (16, 64):
    p = cProfile.Profile(); p.enable()
    out = kv_decode(engine.adapter, tok, pre.token_ids, pre.keys, pre.values, SamplingOptions(max_new_tokens=n))
    p.disable()
    st = pstats.Stats(p)
    counts[n] = (st.total_calls, out.numel())
    funcs[n] = {f"{k[0].split('/')[-1]}:{k[2]}": v[1] for k, v in st.stats.items()}
(c16, t16), (c64, t64) = counts[16], counts[64]
print(f"calls per token {(c64 - c16) / (t64 - t16):.1f} (tokens {t16}, {t64})")
diff = sorted(((funcs[64].get(k, 0) - funcs[16].get(k, 0)) / (t64 - t16), k) for k in funcs[64])
for d, k in reversed(diff[-40:]):
    print(f"  {d:6.1f}/token  {k}")
