"""`bench agent`: a retrieval agent over the dev corpus, step by step, and what constrained decoding costs.

Per question, the agent loop of LangChain's RAG tutorial in the package's generic tool format (`cacheblend_rag.tools`):

    step 1  the question and a `retrieve` tool, tool_choice "required": the grammar forces a well-formed call
    tool    the bench runs it: the question's passages, joined verbatim as the tool's result (so its stored chunks
            are found in the ToolMessage, as docs/langchain.md says a retriever tool should return them)
    step 2  the history with the call and its result, tool_choice "auto": a plain answer or one more call

Per step: TTFT, rows from a stored prefix / stored chunks / computed, tokens, whether the call parsed. The cost of
constrained decoding is timed on the same prompts, interleaved: each step's answer decoded with its grammar, then
without one under the constrained run's length as budget (a free run may stop earlier at EOS; only runs of more
than one token count), as decode ms per token after the first.
"""

from __future__ import annotations

import statistics
from typing import Any

from tqdm.auto import tqdm

from cacheblend_rag import tools
from .datasets import passages_of

RATIO = 0.15
RETRIEVE = {"type": "function", "function": {
    "name": "retrieve",
    "description": "Retrieve passages that help answer a question.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                   "required": ["query"]}}}
SYSTEM = "You answer questions. Use the retrieve tool to find passages, then answer briefly."


def _timed(engine, messages: list[dict], grammar, max_new_tokens: int):
    """One generation and its decode ms per token after the first (None with fewer than two tokens): the engine's
    own decode time (mask and forward steps), not wall time, which would add detokenizing the answer."""
    out = engine.generate_prompt(messages, "cacheblend", RATIO, max_new_tokens=max_new_tokens, grammar=grammar)
    n = len(out.token_ids)
    per_token = out.stats.timing["decode_s"] / (n - 1) * 1000 if n > 1 else None
    return out, per_token


def run_agent(engine, items: list[dict], *, num_chunks: int = 6, max_new_tokens: int = 48,
              show_progress: bool = True) -> dict[str, Any]:
    """Every question through the two-step agent loop; records per step and a summary."""
    functions = tools.functions_of([RETRIEVE])
    for item in items:  # untimed: the corpus ingested, as a deployment has it
        engine.ingest(passages_of(item, num_chunks), show_progress=False)
    # first-call costs (kernels; the grammar engine's tokenizer tables), on a prompt no step starts with
    engine.generate_prompt([{"role": "user", "content": "Say hello."}], max_new_tokens=2)
    engine.generate_prompt([{"role": "user", "content": "Say hello."}], max_new_tokens=2,
                           grammar=tools.tool_grammar(functions, "required"))
    records = []
    for n, item in enumerate(tqdm(items, desc="agent questions", unit="question", disable=not show_progress)):
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["question"]}]
        for step, choice in enumerate(("required", "auto"), start=1):
            prompt = tools.with_tools_prompt(history, functions)
            grammar = tools.tool_grammar(functions, choice)
            out, constrained_ms = _timed(engine, prompt, grammar, max_new_tokens)
            free_ms = _timed(engine, prompt, None, max(len(out.token_ids), 2))[1]  # the same prompt, no grammar
            content, calls = tools.parse_tool_calls(out.text, functions)
            s = out.stats
            records.append({
                "question": n, "step": step, "tool_choice": choice, "num_tokens": s["num_tokens"],
                "prefix_rows": s["num_prefix_rows"], "chunk_rows": s["num_chunk_rows"],
                "computed_rows": s["num_tokens"] - s["num_prefix_rows"] - s["num_chunk_rows"],
                "chunk_hits": len(s["chunk_hits"]), "ttft_s": out.ttft_s, "new_tokens": len(out.token_ids),
                "called": bool(calls), "finish_reason": out.finish_reason, "text": out.text,
                "ms_per_token": {"constrained": constrained_ms, "free": free_ms},
            })
            if step == 1:
                call = calls[0] if calls else tools.ToolCall("retrieve", {"query": item["question"]})
                result = "\n\n".join(passages_of(item, num_chunks))  # the documents' text verbatim
                history = history + [{"role": "assistant", "content": tools.render_call(call.name, call.arguments)},
                                     tools.render_result(result)]
    return {"records": records, "summary": summarize(records)}


def summarize(records: list[dict]) -> dict[str, Any]:
    """Per step: medians of TTFT, rows by source, chunk hits, calls made; the constrained decoding overhead."""
    med = statistics.median
    steps: dict[int, dict] = {}
    for step in sorted({r["step"] for r in records}):
        rs = [r for r in records if r["step"] == step]
        steps[step] = {
            "n": len(rs), "tool_choice": rs[0]["tool_choice"], "tokens": med(r["num_tokens"] for r in rs),
            "ttft_s": med(r["ttft_s"] for r in rs), "chunk_hits": med(r["chunk_hits"] for r in rs),
            "rows": {k: med(r[k] for r in rs) for k in ("prefix_rows", "chunk_rows", "computed_rows")},
            "calls": sum(r["called"] for r in rs),
        }
        pairs = [r["ms_per_token"] for r in rs if None not in r["ms_per_token"].values()]
        if pairs:
            steps[step]["ms_per_token"] = {k: med(p[k] for p in pairs) for k in ("constrained", "free")}
    pairs = [r["ms_per_token"] for r in records if None not in r["ms_per_token"].values()]
    summary: dict[str, Any] = {"steps": steps}
    if pairs:  # the median of each pair's ratio: steps differ in prompt length, so their ms/token do too
        summary["ms_per_token"] = {"constrained": med(p["constrained"] for p in pairs),
                                   "free": med(p["free"] for p in pairs),
                                   "overhead": med(p["constrained"] / p["free"] for p in pairs) - 1}
    return summary


def format_agent(summary: dict[str, Any]) -> str:
    """The per-step table and the constrained decoding overhead."""
    lines = ["| step | tool_choice | n | tokens | prefix / chunk / computed rows | chunk hits | TTFT | calls "
             "| ms/token constrained | ms/token free |", "|---|---|---|---|---|---|---|---|---|---|"]
    for step, s in summary["steps"].items():
        rows, ms = s["rows"], s.get("ms_per_token", {})
        lines.append(f"| {step} | {s['tool_choice']} | {s['n']} | {s['tokens']:.0f} | {rows['prefix_rows']:.0f} / "
                     f"{rows['chunk_rows']:.0f} / {rows['computed_rows']:.0f} | {s['chunk_hits']:.0f} | "
                     f"{s['ttft_s']:.3f} s | {s['calls']}/{s['n']} | {ms.get('constrained', float('nan')):.2f} | "
                     f"{ms.get('free', float('nan')):.2f} |")
    if "ms_per_token" in summary:
        ms = summary["ms_per_token"]
        lines.append("")
        lines.append(f"constrained decoding costs {ms['overhead']:+.1%} ms/token over free decoding (median of "
                     f"the paired ratios; medians {ms['constrained']:.2f} vs {ms['free']:.2f} ms/token)")
    return "\n".join(lines)
