"""`bench conversation`: multi-turn chats over the same passages, where each turn re-sends the whole history.

Per conversation: turn 1 asks the dataset's question over its passages (chat messages); turns 2–4 append the
answer and a follow-up the bench writes from the passages ("Which passage says so?", "Answer in one word.", ...).
The history is the prefix-reuse engine's own answers, so every arm sees the same prompt at every turn:

    prefix      CacheBlend with stored prefixes (the default engine): a turn starts from the previous turn's KV
    no_prefix   CacheBlend without them (prefix_reuse=False, the behaviour before): every turn fuses every chunk
    full        full prefill of the same prompt: the reference for first-token KL
    peers       with --peers: kvboost and llama.cpp's prompt cache on the same turn's text (bench/peers.py)

Arms run interleaved per turn, so load on the machine falls on all of them alike; read the ratios.

`--rss` (run_rss) checks the other target, memory: many short 2-turn chats, each over passages no other chat
sends, on an engine whose prefix tier has a small byte budget; every `every` chats it prints the tier's bytes vs
its budget, its evictions and the process's resident memory, which should flatten once the tier is full.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from .datasets import passages_of
from .frames import first_token_kl
from .peers import Peer, chat_text

ARMS = ("prefix", "no_prefix", "full")
RATIO = 0.15


def follow_ups(item: dict, num_chunks: int) -> list[str]:
    """Turns 2–4 of a conversation, written from its passages."""
    titles = [c.get("title") or f"passage {i + 1}" for i, c in enumerate(item["ctxs"][:num_chunks])]
    return ["Which passage says so?", "Answer in one word.", f"What does the passage about {titles[-1]} say?"]


def _first_turn(passages: list[str], question: str) -> list[dict[str, str]]:
    context = "\n\n".join(passages)
    return [{"role": "system", "content": "Answer briefly, using the passages."},
            {"role": "user", "content": f"Passages:\n{context}\n\nQuestion: {question}"}]


def run_conversation(engine, items: list[dict], *, num_chunks: int = 6, max_new_tokens: int = 32,
                     show_progress: bool = True, peers: Sequence[Peer] = ()) -> dict[str, Any]:
    """Every conversation, turn by turn, in the three arms (and each peer); records and a per-turn summary."""
    from cacheblend_rag.engine import CacheBlendEngine

    if not engine.prefix_reuse:
        raise ValueError("bench conversation needs an engine with prefix_reuse=True for its prefix arm")
    plain = CacheBlendEngine(engine.model, engine.tokenizer, kv_store=None, lead_in=engine.lead_in,
                             prefix_reuse=False)
    for item in items:  # untimed: chunk KV stored in both engines, as after ingestion
        for e in (engine, plain):
            e.ingest(passages_of(item, num_chunks), show_progress=False)
        for peer in peers:
            peer.warm(passages_of(item, num_chunks))
    for e in (engine, plain):  # first-call costs (kernels, tables), on a prompt no conversation starts with
        e.generate_prompt([{"role": "user", "content": "Say hello."}], max_new_tokens=2)
    for peer in peers:  # theirs too, so a peer's first turn is not charged for its first call
        peer.first_token(chat_text(engine.tokenizer, [{"role": "user", "content": "Say hello."}]))
    records = []
    for n, item in enumerate(tqdm(items, desc="conversations", unit="chat", disable=not show_progress)):
        messages = _first_turn(passages_of(item, num_chunks), item["question"])
        for turn, follow in enumerate([None, *follow_ups(item, num_chunks)], start=1):
            if follow is not None:
                messages = messages + [{"role": "user", "content": follow}]
            out = engine.generate_prompt(messages, "cacheblend", RATIO, max_new_tokens=max_new_tokens)
            without = plain.prefill_prompt(messages, "cacheblend", RATIO)
            full = plain.prefill_prompt(messages, "full_prefill")
            s = out.stats
            records.append({
                "conversation": n, "turn": turn, "num_tokens": s["num_tokens"],
                "prefix_rows": s["num_prefix_rows"], "chunk_rows": s["num_chunk_rows"],
                "computed_rows": s["num_tokens"] - s["num_prefix_rows"] - s["num_chunk_rows"],
                "ttft_s": {"prefix": out.ttft_s, "no_prefix": without.stats.ttft_s, "full": full.stats.ttft_s},
                "kl": {"prefix": first_token_kl(full.logits, out.logits),
                       "no_prefix": first_token_kl(full.logits, without.logits)},
            })
            if peers:
                records[-1]["peers"] = _peer_turns(peers, chat_text(engine.tokenizer, messages), full.logits)
            messages = messages + [{"role": "assistant", "content": out.text}]
    return {"records": records, "summary": summarize(records)}


def _peer_turns(peers: Sequence[Peer], text: str, reference: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Each peer on one turn's text: TTFT, prompt and cached tokens, first-token KL vs full prefill if it says."""
    turns = {}
    for peer in peers:
        t = peer.first_token(text)
        turns[peer.name] = {"ttft_s": t.ttft_s, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                            "kl": None if t.logits is None else first_token_kl(reference, t.logits)}
    return turns


def summarize_peers(records: list[dict]) -> dict[int, dict[str, Any]]:
    """Per turn: median TTFT of ours (three arms) and each peer, each as a ratio to ours with stored prefixes."""
    med = statistics.median
    names = sorted({p for r in records for p in r.get("peers", {})})
    turns: dict[int, dict[str, Any]] = {}
    for t in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == t and "peers" in r]
        if not rs:
            continue
        ttft = {a: med(r["ttft_s"][a] for r in rs) for a in ARMS}
        ttft |= {p: med(r["peers"][p]["ttft_s"] for r in rs) for p in names}
        kls = {p: [r["peers"][p]["kl"] for r in rs if r["peers"][p]["kl"] is not None] for p in names}
        cached = {p: [r["peers"][p]["cached_tokens"] for r in rs if r["peers"][p]["cached_tokens"] is not None]
                  for p in names}
        turns[t] = {"n": len(rs), "ttft_s": ttft, "vs_ours": {a: v / ttft["prefix"] for a, v in ttft.items()},
                    "prompt_tokens": {p: med(r["peers"][p]["prompt_tokens"] for r in rs) for p in names},
                    "cached_tokens": {p: med(c) for p, c in cached.items() if c},
                    "kl": {p: med(k) for p, k in kls.items() if k}}
    return turns


def format_peers(turns: dict[int, dict[str, Any]]) -> str:
    """The peers table: median TTFT per turn and its ratio to ours with stored prefixes (× > 1: slower than ours)."""
    if not turns:
        return ""
    arms = list(next(iter(turns.values()))["ttft_s"])
    labels = {"prefix": "ours (prefix reuse)", "no_prefix": "ours, no prefix reuse", "full": "full prefill"}
    lines = ["| turn | n | " + " | ".join(labels.get(a, a) for a in arms) + " | peers' cached tokens | peers' KL |",
             "|---|---|" + "---|" * len(arms) + "---|---|"]
    for t, s in turns.items():
        cells = [f"{s['ttft_s'][a]:.3f} s" + ("" if a == "prefix" else f" ({s['vs_ours'][a]:.1f}×)") for a in arms]
        cached = ", ".join(f"{p} {c:.0f}/{s['prompt_tokens'][p]:.0f}" for p, c in s["cached_tokens"].items())
        kl = ", ".join(f"{p} {k:.4f}" for p, k in s["kl"].items())
        lines.append(f"| {t} | {s['n']} | " + " | ".join(cells) + f" | {cached or '-'} | {kl or '-'} |")
    return "\n".join(lines)


def summarize(records: list[dict]) -> dict[str, Any]:
    """Per turn: median TTFT of each arm, median KL vs full prefill, median rows by source; and the targets."""
    med = statistics.median
    turns: dict[int, dict] = {}
    for t in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == t]
        turns[t] = {
            "n": len(rs), "tokens": med(r["num_tokens"] for r in rs),
            "ttft_s": {a: med(r["ttft_s"][a] for r in rs) for a in ARMS},
            "kl": {a: med(r["kl"][a] for r in rs) for a in ("prefix", "no_prefix")},
            "rows": {k: med(r[k] for r in rs) for k in ("prefix_rows", "chunk_rows", "computed_rows")},
        }
    later = [r for r in records if r["turn"] > 1]
    first = [r for r in records if r["turn"] == 1]
    summary: dict[str, Any] = {"turns": turns}
    if later and first:
        summary["turn1_cacheblend_ttft_s"] = med(r["ttft_s"]["prefix"] for r in first)
        summary["later_prefix_ttft_s"] = med(r["ttft_s"]["prefix"] for r in later)
        summary["later_speedup_vs_turn1"] = summary["turn1_cacheblend_ttft_s"] / summary["later_prefix_ttft_s"]
        summary["later_speedup_vs_no_prefix"] = (med(r["ttft_s"]["no_prefix"] for r in later)
                                                 / summary["later_prefix_ttft_s"])
        summary["later_kl_prefix"] = med(r["kl"]["prefix"] for r in later)
        summary["turn1_kl"] = med(r["kl"]["prefix"] for r in first)
    return summary


def format_conversation(summary: dict[str, Any]) -> str:
    """The per-turn table and the two targets' figures."""
    lines = ["| turn | n | tokens | prefix / chunk / computed rows | TTFT prefix | TTFT no prefix | TTFT full "
             "| KL prefix | KL no prefix |", "|---|---|---|---|---|---|---|---|---|"]
    for t, s in summary["turns"].items():
        rows, ttft, kl = s["rows"], s["ttft_s"], s["kl"]
        lines.append(f"| {t} | {s['n']} | {s['tokens']:.0f} | {rows['prefix_rows']:.0f} / {rows['chunk_rows']:.0f} / "
                     f"{rows['computed_rows']:.0f} | {ttft['prefix']:.3f} s | {ttft['no_prefix']:.3f} s | "
                     f"{ttft['full']:.3f} s | {kl['prefix']:.4f} | {kl['no_prefix']:.4f} |")
    if "later_speedup_vs_turn1" in summary:
        lines.append("")
        lines.append(f"turns 2+: median TTFT {summary['later_prefix_ttft_s']:.3f} s with stored prefixes, "
                     f"{summary['later_speedup_vs_turn1']:.1f}x below turn 1's CacheBlend "
                     f"({summary['turn1_cacheblend_ttft_s']:.3f} s), {summary['later_speedup_vs_no_prefix']:.1f}x "
                     f"below CacheBlend without them; KL vs full prefill {summary['later_kl_prefix']:.4f} "
                     f"(turn 1: {summary['turn1_kl']:.4f})")
    return "\n".join(lines)


def distinct_chats(items: list[dict], count: int, num_chunks: int) -> list[dict]:
    """`count` chats from the items: past the last item, the items again over their next `num_chunks` passages
    (rotated), so every chat's prompt is new (the dev set has 50 questions × 10 passages)."""
    out = []
    for n in range(count):
        item, shift = items[n % len(items)], (n // len(items)) * num_chunks
        ctxs = item["ctxs"][shift % len(item["ctxs"]):] + item["ctxs"][:shift % len(item["ctxs"])]
        out.append({**item, "ctxs": ctxs})
    return out


def run_rss(engine, items: list[dict], *, budget_bytes: int, num_chunks: int = 6, max_new_tokens: int = 8,
            every: int = 10, show_progress: bool = True) -> dict[str, Any]:
    """Two-turn chats, one per item, on an engine over `engine`'s model whose prefix tier holds `budget_bytes`:
    the tier's bytes (the most seen after any request too), entries, evictions and the process's RSS every
    `every` chats. (`distinct_chats` makes more chats than the dataset has questions.)"""
    from cacheblend_rag.engine import CacheBlendEngine
    from cacheblend_rag.store.memory import MemoryStore
    from .faults import rss_bytes

    tier = MemoryStore(budget_bytes)
    # nothing ingested, no chunk store: the prefix tier is the only KV that can grow from chat to chat
    chat = CacheBlendEngine(engine.model, engine.tokenizer, kv_store=None, lead_in=engine.lead_in, prefix_store=tier)
    chat.generate_prompt([{"role": "user", "content": "Say hello."}], max_new_tokens=2)  # first-call costs
    rows, most, prefix_rows = [], 0, 0
    for n, item in enumerate(tqdm(items, desc="conversations", unit="chat", disable=not show_progress), start=1):
        messages = _first_turn(passages_of(item, num_chunks), item["question"])
        for follow in (None, follow_ups(item, num_chunks)[0]):
            if follow is not None:
                messages = messages + [{"role": "user", "content": follow}]
            out = chat.generate_prompt(messages, "cacheblend", RATIO, max_new_tokens=max_new_tokens)
            messages = messages + [{"role": "assistant", "content": out.text}]
            most = max(most, tier.stats()["bytes"])
            prefix_rows += out.stats["num_prefix_rows"]
        if n % every == 0 or n == len(items):
            st = tier.stats()
            rows.append({"conversations": n, "tier_bytes": st["bytes"], "max_tier_bytes": most,
                         "budget_bytes": budget_bytes, "entries": st["entries"], "evictions": st["evictions"],
                         "prefix_rows": prefix_rows, "rss_bytes": rss_bytes(os.getpid())})
    return {"rows": rows, "within_budget": most <= budget_bytes}


def format_rss(result: dict[str, Any]) -> str:
    """The memory table of run_rss: the prefix tier against its budget, and RSS, every few chats."""
    mb = 2 ** 20
    lines = ["| chats | tier MB | most MB | budget MB | entries | evictions | prefix rows (cum.) | RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['conversations']} | {r['tier_bytes'] / mb:.1f} | {r['max_tier_bytes'] / mb:.1f} | "
                     f"{r['budget_bytes'] / mb:.1f} | {r['entries']} | {r['evictions']} | {r['prefix_rows']} | "
                     f"{r['rss_bytes'] / mb:.0f} |")
    lines.append("")
    lines.append("the prefix tier stayed within its budget" if result["within_budget"]
                 else "the prefix tier went OVER its budget")
    return "\n".join(lines)
