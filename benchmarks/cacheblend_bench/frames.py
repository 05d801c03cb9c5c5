"""`bench frames` and `bench faq`: how close each entry point's answer stays to the model's own, and whether
the answers are right.

Every surface ends in `engine.prefill_prompt` with the prompt it builds: the package's chain (its own template),
chat messages of a user's wording, a plain string, LangChain's RAG tutorial prompt, LlamaIndex's default text-QA
prompt, and what the server's two routes pass on (chat messages; a string). Each frame's reference is one plain
forward of the model over that frame's whole prompt as the model tokenizes it (the user's own baseline). Per
frame and method: first-token KL against it, answer agreement with full prefill, the recomputed share, TTFT.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .datasets import question_passages
from .faq import FAQ_FRAMES, correct, faq_set

FRAMES = ("chain", "chat", "string", "langchain", "llama_index")
FRAME_METHODS = (("full_prefill", None), ("cacheblend", 0.15), ("full_reuse", None))


def _langchain_messages(context: str, question: str) -> list[dict[str, str]]:
    """LangChain's RAG tutorial prompt (system instructions with the context, the question as the human turn)."""
    from langchain_core.prompts import ChatPromptTemplate

    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                   "context to answer the question. If you don't know the answer, say that you don't know. Use three "
                   "sentences maximum and keep the answer concise.\n\n{context}"),
        ("human", "{question}"),
    ])
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    return [{"role": roles[m.type], "content": m.content}
            for m in prompt.invoke({"context": context, "question": question}).to_messages()]


def _llama_index_messages(context: str, question: str) -> list[dict[str, str]]:
    """LlamaIndex's default text-QA prompt as a chat model gets it (its system prompt, then the template)."""
    from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT

    return [{"role": m.role.value, "content": m.content}
            for m in CHAT_TEXT_QA_PROMPT.format_messages(context_str=context, query_str=question)]


def frame_prompts(passages: list[str], question: str) -> dict[str, Any]:
    """The prompt each frame sends for these passages and question (None: the package's chain, by chunk)."""
    context = "\n\n".join(passages)
    return {
        "chain": None,
        "chat": [{"role": "system", "content": "Answer briefly, using the passages."},
                 {"role": "user", "content": f"Passages:\n{context}\n\nQuestion: {question}"}],
        "string": f"You are a helpful assistant. Use the passages to answer.\n\n{context}\n\nQuestion: {question}\n"
                  "Answer:",
        "langchain": _langchain_messages(context, question),
        "llama_index": _llama_index_messages(context, question),
    }


def first_token_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference ‖ logits) of the next-token distributions."""
    p = F.log_softmax(reference.float(), -1)
    return float((p.exp() * (p - F.log_softmax(logits.float(), -1))).sum())


def entropy(logits: torch.Tensor) -> float:
    """Entropy (nats) of the next-token distribution: how uncertain the model's own first token is."""
    p = F.log_softmax(logits.float(), -1)
    return float(-(p.exp() * p).sum())


def _reference_logits(engine, token_ids: torch.Tensor) -> torch.Tensor:
    """One plain forward of the model over the prompt's tokens: the logits a user would compare against."""
    with torch.inference_mode():
        return engine.model(token_ids[None].to(engine.adapter.device)).logits[0, -1].float().cpu()


def run_frames(engine, items: list[dict], *, num_chunks: int = 6, max_new_tokens: int = 16,
               frames: tuple[str, ...] = FRAMES, show_progress: bool = True, behind: str = "lead_in",
               chunk_tokens: int | None = None) -> dict:
    """Every frame × method on every question: records and a per-frame summary (each question's passages
    ingested together, computed behind `behind`; re-cut to `chunk_tokens` when given)."""
    records = []
    for item in tqdm(items, desc="frames", unit="question", disable=not show_progress):
        passages = question_passages(item, num_chunks, chunk_tokens, engine.tokenizer)
        ids = engine.ingest(passages, show_progress=False, behind=behind)
        prompts = frame_prompts(passages, item["question"])
        for frame in frames:
            prompt = prompts[frame]
            run: Callable = ((lambda m, r: engine.generate(ids, item["question"], m, r, max_new_tokens=max_new_tokens))
                             if prompt is None else
                             (lambda m, r, p=prompt: engine.generate_prompt(p, m, r, max_new_tokens=max_new_tokens)))
            outs = {}
            # untimed warm-ups: the first method (first-call costs), and CacheBlend once, after which the chunks of
            # a prompt of a recurring opening are stored behind it (every chunk behind a plain string's, the first
            # behind a chat's), as they are for an app that sends its template again (fuse.placement.every_chunk)
            for method, ratio in [FRAME_METHODS[0], FRAME_METHODS[1], *FRAME_METHODS]:
                outs[(method, ratio)] = run(method, ratio)
            full = outs[("full_prefill", None)]
            token_ids = (engine.prefill(ids, item["question"], "full_prefill") if prompt is None else
                         engine.prefill_prompt(prompt, "full_prefill")).token_ids
            reference = _reference_logits(engine, token_ids)
            reference_entropy = entropy(reference)
            for (method, ratio), out in outs.items():
                records.append({
                    "frame": frame, "method": method if ratio is None else f"{method}@{ratio:g}",
                    "kl_vs_model": first_token_kl(reference, out.logits), "reference_entropy": reference_entropy,
                    "agrees": out.text == full.text, "ttft_s": out.ttft_s,
                    "recomputed_share": out.stats["recompute_ratio_effective"],
                    "num_tokens": out.stats["num_tokens"], "chunk_hits": len(out.stats["chunk_hits"]),
                })
    return {"records": records, "summary": _summary(records)}


def _summary(records: list[dict]) -> list[dict]:
    rows = []
    for frame in dict.fromkeys(r["frame"] for r in records):
        full_ttft = statistics.median(r["ttft_s"] for r in records
                                      if r["frame"] == frame and r["method"] == "full_prefill")
        for method in dict.fromkeys(r["method"] for r in records if r["frame"] == frame):
            rs = [r for r in records if r["frame"] == frame and r["method"] == method]
            ttft = statistics.median(r["ttft_s"] for r in rs)
            rows.append({"frame": frame, "method": method, "n": len(rs),
                         "kl_vs_model": statistics.fmean(r["kl_vs_model"] for r in rs),
                         "reference_entropy": statistics.fmean(r["reference_entropy"] for r in rs),
                         "agreement": statistics.fmean(r["agrees"] for r in rs),
                         "recomputed_share": statistics.fmean(r["recomputed_share"] for r in rs),
                         "chunk_hits": statistics.fmean(r["chunk_hits"] for r in rs),
                         "ttft_s": ttft, "speedup": full_ttft / ttft if ttft else float("nan")})
    return rows


def format_frames(summary: list[dict]) -> str:
    """The per-frame table (markdown)."""
    # the entropy of the model's own first token: the same KV error moves a flat distribution further (KL)
    lines = ["| frame | method | n | first-token KL vs the model's own forward | its first-token entropy (nats) | "
             "agreement with full prefill | recomputed share | chunk hits | TTFT s (median) | "
             "speedup vs full prefill |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary:
        lines.append(f"| {r['frame']} | {r['method']} | {r['n']} | {r['kl_vs_model']:.4f} | "
                     f"{r['reference_entropy']:.2f} | {r['agreement']:.2f} | "
                     f"{r['recomputed_share']:.3f} | {r['chunk_hits']:.1f} | {r['ttft_s']:.3f} | "
                     f"{r['speedup']:.2f}× |")
    return "\n".join(lines)


def run_faq(engine, *, num_questions: int = 40, k: int = 4, seed: int = 0, max_new_tokens: int = 32,
            methods: tuple[tuple[str, float | None], ...] = FRAME_METHODS, show_progress: bool = True,
            behind: str = "lead_in") -> dict:
    """The FAQ answer-correctness set in the chat, string and tool frames (`FAQ_FRAMES`): accuracy per frame and method (the pages
    ingested as one corpus, each computed behind `behind`: the lead-in, or its nearest neighbour page)."""
    questions = faq_set(num_questions, k=k, seed=seed)
    engine.ingest(list(dict.fromkeys(c for q in questions for c in q.chunks)), show_progress=False, behind=behind)
    records = []
    started = time.perf_counter()
    for q in tqdm(questions, desc="faq", unit="question", disable=not show_progress):
        for frame, prompt in ((name, make(q)) for name, make in FAQ_FRAMES.items()):
            for method, ratio in methods:
                # each method under its own salt: a prompt whose opening recurs (here: the same question asked of
                # every method) has its first page learned behind that opening, exact for the methods after it
                out = engine.generate_prompt(prompt, method, ratio, max_new_tokens=max_new_tokens,
                                             cache_salt=f"faq:{method}@{ratio}")
                records.append({"frame": frame, "method": method if ratio is None else f"{method}@{ratio:g}",
                                "question": q.question, "expected": q.answer, "answer": out.text,
                                "correct": correct(out.text, q.answer), "ttft_s": out.ttft_s})
    summary = []
    for frame in FAQ_FRAMES:
        for method in dict.fromkeys(r["method"] for r in records):
            rs = [r for r in records if r["frame"] == frame and r["method"] == method]
            summary.append({"frame": frame, "method": method, "n": len(rs),
                            "accuracy": statistics.fmean(r["correct"] for r in rs),
                            "ttft_s": statistics.median(r["ttft_s"] for r in rs)})
    return {"records": records, "summary": summary, "seconds": time.perf_counter() - started, "k": k}


def format_faq(summary: list[dict]) -> str:
    """The FAQ accuracy table (markdown)."""
    lines = ["| frame | method | n | accuracy (the answer's first line states the fact) | TTFT (median) |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['frame']} | {r['method']} | {r['n']} | {r['accuracy']:.2f} | {r['ttft_s']:.3f} s |"
              for r in summary]
    return "\n".join(lines)
