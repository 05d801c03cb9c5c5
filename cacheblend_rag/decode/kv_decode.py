"""Decoding over the fused KV through the model adapter, without copying or growing a cache per step.

Each sequence owns one preallocated K and one V buffer, (layers, kv_heads, prompt + max_new_tokens, d): head-major,
so each KV head's filled rows are one contiguous (n, d) block that a matmul reads in place (a (n, kv_heads, d)
layout made SDPA copy the whole cache per layer per step, ~25x slower than the bytes it reads in bf16). They are
filled once from the prefill's per-layer keys (after RoPE) and values. A step runs the model one token per sequence:

    embed ─▶ per layer: project_qkv ─▶ rope at each row's position ─▶ write k, v at the sequence's next slot
            ─▶ attend over the sequence's filled rows ─▶ finish_layer            ─▶ logits (B, vocab)

Projections, MLP and LM head run batched over the B rows of the step (one per sequence); attention runs per
sequence over its own rows, so sequences of different lengths advance together (continuous batching). Attention
goes through a small C kernel (cacheblend_rag/kernels/decode_step.c: keys split over the threads, fp32 softmax) where the
machine can build it, else through torch's SDPA or per-KV-head matmuls (`attend_torch`, the reference).

The first token comes from the prefill's own logits when they are given (`first_logits`: the engine's path), so
the first text piece is out one decode step sooner and every prompt row goes into the buffer. Without them, as
HF `generate` over the prefill's cache does (the reference path, `decode.generate.decode`), the buffer gets the
first N-1 prompt rows and the first step recomputes the last prompt token; greedy tokens are then the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..kernels.decode_step import decode_attention
from .generate import SamplingOptions
from .grammar import GrammarCompiler, GrammarDecodeError
from .text import Answer

# Below this many keys a bf16 step attends through SDPA's fused CPU kernel: each bf16 matmul of the grouped path
# costs ~20 us of fixed oneDNN overhead (6 a layer), while SDPA's flash kernel converts bf16 blocks to fp32 and
# falls behind over longer caches (on an AVX512-BF16 EPYC: 121 vs 211 us a layer at 512 keys, 458 vs 356 at 2k,
# 1389 vs 730 at 7k). In fp32 the two are within a few percent at every length, so fp32 always takes SDPA.
GROUPED_MM_FROM_KEYS = 1280


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """One decode query per head, q (H, d), over head-major k, v (KVH, n, d) → out (H, d), written in place;
    through the C kernel where it is built (cacheblend_rag/kernels/decode_step.c), else `attend_torch`."""
    if decode_attention(q, k, v, scale, out) is not None:
        return out
    return attend_torch(q, k, v, scale, out)


def attend_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """`attend` on torch's ops: whichever of SDPA or the grouped matmuls is faster for this dtype and length."""
    if q.dtype == torch.float32 or k.shape[1] < GROUPED_MM_FROM_KEYS:
        kv_heads = k.shape[0]
        # the G query heads of a KV head are G query rows of that head: no K/V expansion, no GQA flag
        grouped = q.view(1, kv_heads, q.shape[0] // kv_heads, q.shape[-1])
        # the output's layout is the kernel's (CUDA kernels may not return it contiguous): copy into out's shape
        attn = F.scaled_dot_product_attention(grouped, k[None], v[None], scale=scale)
        out.view(attn.shape).copy_(attn)
        return out
    return attend_grouped_mm(q, k, v, scale, out)


def attend_grouped_mm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out: torch.Tensor) -> torch.Tensor:
    """`attend` as per-KV-head matmuls that read the cache in place.

    Grouped-query attention without expanding K/V: the G = H / KVH query heads that share a KV head are the rows
    of one (G, d) @ (d, n) matmul over that head's contiguous rows (a batched matmul would copy the sliced
    buffer, whose head stride is the capacity, not n). Softmax runs in fp32; probabilities go back to the cache
    dtype for the @ V matmul, as SDPA's CPU kernel does.
    """
    kv_heads = k.shape[0]
    group = q.shape[0] // kv_heads
    qg = (q * scale).view(kv_heads, group, q.shape[-1])
    scores = torch.empty((kv_heads, group, k.shape[1]), dtype=q.dtype, device=q.device)
    for h in range(kv_heads):
        torch.mm(qg[h], k[h].t(), out=scores[h])
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype)
    og = out.view(kv_heads, group, v.shape[-1])
    for h in range(kv_heads):
        torch.mm(probs[h], v[h], out=og[h])
    return out


class KVSequence:
    """One sequence's decode state: its K/V buffers, how many rows are filled, the next input token, sampling,
    and the answer so far (token ids, text pieces, stop strings, EOS)."""

    def __init__(self, decoder: "KVDecoder", token_ids: torch.Tensor, keys: Sequence[torch.Tensor],
                 values: Sequence[torch.Tensor], settings: SamplingOptions, tokenizer=None,
                 first_logits: torch.Tensor | None = None) -> None:
        n = int(token_ids.numel())
        capacity = n + settings.max_new_tokens
        shape = (decoder.num_layers, decoder.num_kv_heads, capacity, decoder.head_dim)
        self.k = torch.empty(shape, dtype=decoder.dtype, device=decoder.device)
        self.v = torch.empty(shape, dtype=decoder.dtype, device=decoder.device)
        rows = n if first_logits is not None else n - 1  # without the prefill's logits, a step recomputes row N-1
        for layer, (k, v) in enumerate(zip(keys, values)):  # the one copy of the prompt rows, to head-major
            self.k[layer, :, :rows].copy_(k[:rows].transpose(0, 1))
            self.v[layer, :, :rows].copy_(v[:rows].transpose(0, 1))
        self.length = rows  # filled rows; the next token is written at this row (its position)
        self.prompt_ids = token_ids
        self.next_token = int(token_ids[-1])
        self.settings = settings
        # built before the first token is chosen: that choice is masked too
        grammar = decoder.grammars.state(settings.grammar) if settings.grammar is not None else None
        # the answer so far, and how it ends (decode.text.Answer: the one place text is cut and finish decided)
        self.answer = Answer(decoder.tokenizer if tokenizer is None else tokenizer, settings, decoder.eos_token_id,
                             grammar, pieces=tokenizer is not None)
        self.generated = self.answer.token_ids  # the answer's token ids (one list)
        self.generator = None
        if settings.seed is not None and settings.samples:
            self.generator = torch.Generator(device=decoder.device).manual_seed(settings.seed)
        # the text of the token chosen from the prefill's logits, for the caller to hand out before any step
        self.first_piece = self.accept(self.choose(first_logits)) if first_logits is not None else ""

    def filled(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Token ids of the filled rows (the prompt, then the answer's tokens run so far), and per layer their K
        (after RoPE) and V, (rows, kv_heads, d) views of the buffers: what a stored prefix keeps."""
        ids = torch.cat([self.prompt_ids.cpu(), torch.tensor(self.generated, dtype=torch.long)])[: self.length]
        return ids, [k.transpose(0, 1) for k in self.k[:, :, : self.length]], \
            [v.transpose(0, 1) for v in self.v[:, :, : self.length]]

    @property
    def grammar(self):
        """This sequence's grammar state (None without a grammar)."""
        return self.answer.grammar

    @property
    def finish_reason(self) -> str | None:
        """"stop" (EOS, a stop string, a complete grammar), "length" or "error"; None while decoding."""
        return self.answer.finish_reason

    @property
    def error(self) -> str | None:
        """Why the grammar failed while decoding (finish_reason "error")."""
        return self.answer.error

    @property
    def finished(self) -> bool:
        """Whether the answer is complete."""
        return self.answer.finished

    @property
    def grammar_satisfied(self) -> bool | None:
        """Whether the text so far completes the grammar (None without one): False after "length" means the
        constrained text was cut before it was complete."""
        return self.answer.grammar_satisfied

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this sequence's (vocab,) logits: argmax, or sampled with temperature/top_p."""
        s = self.settings
        if self.grammar is not None:  # closes within max_new_tokens when the budget gets tight
            logits = self.grammar.mask(logits, tokens_left=s.max_new_tokens - len(self.generated))
        if not s.samples:
            return int(torch.argmax(logits))
        scores = logits.float() / s.temperature
        if s.top_p < 1.0:  # HF's TopPLogitsWarper: drop the low tail whose mass is ≤ 1 - top_p, keep ≥ 1 token
            sorted_scores, order = torch.sort(scores, descending=False)
            tail = sorted_scores.softmax(-1).cumsum(-1) <= (1 - s.top_p)
            tail[-1] = False
            scores = scores.masked_fill(tail.scatter(0, order, tail), float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def accept(self, token_id: int) -> str:
        """Record the chosen token; returns the text to hand out now (stop strings cut) and sets finish_reason."""
        self.next_token = token_id
        return self.answer.accept(token_id)


class KVDecoder:
    """The per-step forward of a batch of `KVSequence`s through the model adapter."""

    def __init__(self, adapter, tokenizer) -> None:
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.num_layers = adapter.num_layers
        self.num_heads = adapter.num_heads
        self.num_kv_heads = adapter.num_kv_heads
        self.head_dim = adapter.head_dim
        self.dtype = adapter.dtype
        self.device = adapter.device
        self.eos_token_id = tokenizer.eos_token_id
        self.grammars = GrammarCompiler(tokenizer)  # converts the tokenizer for llguidance on first use
        # per-layer facts, read once rather than every step
        self.scales = [adapter.scaling(i) for i in range(self.num_layers)]
        self.windows = [adapter.sliding_window(i) for i in range(self.num_layers)]

    def sequence(self, token_ids: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 settings: SamplingOptions, text: bool = True,
                 first_logits: torch.Tensor | None = None) -> KVSequence:
        """A sequence ready to decode after the prompt `token_ids` (N,) whose fused KV is given; with the
        prefill's `first_logits` (vocab,), its first token is already chosen (`first_piece` is its text)."""
        return KVSequence(self, token_ids, keys, values, settings, self.tokenizer if text else None, first_logits)

    @torch.inference_mode()
    def step(self, seqs: Sequence[KVSequence]) -> torch.Tensor:
        """Advance every sequence by its next token: their KV grows by one row; returns the (B, vocab) logits."""
        adapter = self.adapter
        device = self.device
        # oneDNN-packed weights for the one-row matmuls: an extra copy of the weights (~0.27 GB in bf16) that the
        # adapter builds (~0.3 s) at the first step of the process, so an ingest that never decodes never holds it
        packed = adapter.packed()
        ids = torch.tensor([s.next_token for s in seqs], device=device)
        positions = torch.tensor([s.length for s in seqs], device=device)
        for s in seqs:
            if s.length >= s.k.shape[2]:
                raise RuntimeError("a sequence decoded past its preallocated KV (max_new_tokens)")
        rope = adapter.rotary(positions)
        hidden = adapter.embed(ids)
        for layer in range(self.num_layers):
            q, k, v = adapter.project_qkv(layer, hidden, packed)
            q = adapter.rope(layer, q, rope)
            k = adapter.rope(layer, k, rope)
            scale, window = self.scales[layer], self.windows[layer]
            out = torch.empty_like(q)
            for i, s in enumerate(seqs):  # per sequence: each attends over its own filled rows
                row = s.length
                s.k[layer, :, row] = k[i]
                s.v[layer, :, row] = v[i]
                lo = max(0, row + 1 - window) if window else 0
                attend(q[i], s.k[layer, :, lo:row + 1], s.v[layer, :, lo:row + 1], scale, out[i])
            hidden = adapter.finish_layer(layer, hidden, out, packed)
        for s in seqs:
            s.length += 1
        return adapter.logits(hidden, packed).float()

    def advance(self, seqs: Sequence[KVSequence]) -> list[str]:
        """One step for every (unfinished) sequence: choose and accept its next token; the text pieces to hand
        out, one per sequence."""
        logits = self.step(seqs)
        return [s.accept(s.choose(logits[i])) for i, s in enumerate(seqs)]


@torch.inference_mode()
def kv_decode(adapter, tokenizer, token_ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              settings: SamplingOptions, streamer=None, cancel: threading.Event | None = None,
              first_logits: torch.Tensor | None = None, decoder: KVDecoder | None = None,
              on_done: Callable[[KVSequence], None] | None = None,
              on_piece: Callable[[str], None] | None = None) -> torch.Tensor:
    """New token ids after the prompt `token_ids` (N,), whose fused KV is given: `decode.generate.decode`'s
    contract (EOS, stop strings, `streamer.put`/`end`, stops early once `cancel` is set) on the adapter path;
    `first_logits`, the prefill's next-token logits, give the first token without a step. Pass the engine's
    `decoder` to reuse its state (the grammar compiler's converted tokenizer); `on_piece(text)` gets each text
    piece as the sequence hands it out (stop strings cut: `seq.answer`); `on_done(seq)` runs once decoding ended
    (finished or cancelled), after `streamer.end()`, e.g. to keep the sequence's KV or read `seq.answer`."""
    decoder = decoder or KVDecoder(adapter, tokenizer)
    text = bool(settings.stop) or on_piece is not None
    seq = decoder.sequence(token_ids, keys, values, settings, text=text, first_logits=first_logits)
    if streamer is not None:
        streamer.put(token_ids[None].cpu())  # the prompt, which the streamer skips
        if seq.generated:
            streamer.put(torch.tensor([seq.generated[-1]]))
    if on_piece is not None and seq.first_piece:
        on_piece(seq.first_piece)
    try:
        while not seq.finished and not (cancel is not None and cancel.is_set()):
            piece = decoder.advance([seq])[0]
            if streamer is not None:
                streamer.put(torch.tensor([seq.generated[-1]]))
            if on_piece is not None and piece:
                on_piece(piece)
        if not seq.finished:  # cancelled
            rest = seq.answer.end()
            if on_piece is not None and rest:
                on_piece(rest)
    finally:
        if streamer is not None:
            streamer.end()
    if on_done is not None:
        on_done(seq)
    if seq.error is not None:
        raise GrammarDecodeError(seq.error)
    return torch.tensor(seq.generated, dtype=torch.long)
