"""Per-token work of the text path at 32 / 256 / 512 new tokens, counted, not timed (issue 41): ids decoded per
token by an `Answer` (with and without stop strings), characters `CallStream` hands the JSON parser per streamed
piece, and characters the chat models' tool-call hold-back re-checks per piece. Work per token that grows with n is
a cost that grows with the text so far.

    python benchmarks/text_work.py [smollm2-135m|qwen2.5-coder-0.5b]
"""

import sys

import torch

import cacheblend_rag.serve.tooling as tooling
from cacheblend_rag import load_model
from cacheblend_rag import tools as generic_tools
from cacheblend_rag.decode.generate import SamplingOptions
from cacheblend_rag.decode.text import Answer
from cacheblend_rag.tool_format import GENERIC

torch.set_num_threads(1)
name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
_, tok = load_model(name, device="cpu", dtype="bfloat16")
para = ("The honeybee has five eyes: two large compound eyes and three small ocelli on top of its head, "
        "which sense light and help it keep level in flight while it forages among the flowers of the meadow. ") * 60
ids = tok(para, add_special_tokens=False)["input_ids"]


class Counting:
    """The tokenizer, counting the ids passed to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, 0

    def decode(self, token_ids, **kw):
        self.ids += len(token_ids)
        return self.tokenizer.decode(token_ids, **kw)

    def __getattr__(self, key):
        return getattr(self.tokenizer, key)


for n in (32, 256, 512):
    for stop in ((), ("Observation:",)):
        counting = Counting(tok)
        answer = Answer(counting, SamplingOptions(max_new_tokens=n, stop=stop), tok.eos_token_id)
        pieces = [answer.accept(i) for i in ids[:n]]
        per_token = counting.ids / n
        assert "".join(pieces) == answer.text
        print(f"{name} Answer n={n} stop={bool(stop)}: {per_token:.1f} ids decoded per token")

functions = [{"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}]
real = tooling._DECODER
for n in (32, 256, 512):
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "' + " ".join(para.split()[:n]) + '"}}\n</tool_call>'
    pieces = [call[i:i + 5] for i in range(0, len(call), 5)]
    parsed = [0]

    class CountingDecoder:
        def raw_decode(self, s, i=0):
            parsed[0] += len(s) - i
            return real.raw_decode(s, i)

    tooling._DECODER = CountingDecoder()
    stream = tooling.CallStream(functions, GENERIC)
    for p in pieces:
        stream.feed(p)
    stream.finish()
    tooling._DECODER = real
    checked, held, started = 0, "", False  # chat_models._stream_turn's hold-back loop
    for p in pieces:
        if started or generic_tools.may_be_call(held + p, GENERIC):
            checked += 0 if started else len(held + p)
            held += p
            started = started or generic_tools.call_started(held, GENERIC)
    print(f"{name} tool call of {len(call)} chars in {len(pieces)} pieces: CallStream parsed {parsed[0] / len(pieces):.0f} "
          f"chars per piece, hold-back re-checked {checked / len(pieces):.1f} chars per piece")
