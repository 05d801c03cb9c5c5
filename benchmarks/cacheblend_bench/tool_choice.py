"""`bench tools`: does the model call the right tool when left to choose (tool_choice "auto"), and not call one on
chit-chat; how long a call takes end to end.

Three tools (weather, multiply, stock price) bound as a user binds them, in the model's own tool format
(`ToolFormat.of`: its chat template's, else the generic one); six prompts that need one named tool and three that
need none. Each answer is parsed as LangChain's `bind_tools` and the server parse it (framed, bare or ```json-block
calls). Per prompt: the call made (or none), the wall time of the call (render, prefill, constrained decode,
detokenize, parse) and its decode ms per token.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from cacheblend_rag import Request, tools
from cacheblend_rag.tool_format import ToolFormat


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


TOOLS = [
    _tool("get_weather", "Get the current weather in a city.", {"city": {"type": "string"}}),
    _tool("multiply", "Multiply two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
    _tool("stock_price", "Get the latest stock price of a company by its ticker symbol.",
          {"ticker": {"type": "string"}}),
]
# (prompt, the tool it needs or None)
PROMPTS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo today?", "get_weather"),
    ("What is 37 times 12?", "multiply"),
    ("Multiply 123 by 456.", "multiply"),
    ("What is Apple's stock price (AAPL)?", "stock_price"),
    ("How much is one share of MSFT trading at?", "stock_price"),
    ("What is the capital of France?", None),
    ("Hi! How are you today?", None),
    ("Write a haiku about autumn.", None),
]


def run_tool_choice(engine, *, max_new_tokens: int = 64, choice: str = "auto") -> dict[str, Any]:
    """Every prompt with the three tools bound under `choice`; records and a summary."""
    fmt = ToolFormat.of(engine.tokenizer)
    turn0 = tools.tool_turn([{"role": "user", "content": "Say hello."}], TOOLS, choice, fmt=fmt)
    engine.generate_request(Request.of(prompt=turn0.messages, grammar=turn0.grammar, tools=turn0.tools,
                                       max_new_tokens=2))  # first-call costs: kernels, the grammar's tables
    records = []
    for prompt, wanted in PROMPTS:
        started = time.perf_counter()
        turn = tools.tool_turn([{"role": "user", "content": prompt}], TOOLS, choice, fmt=fmt)
        out = engine.generate_request(Request.of(prompt=turn.messages, grammar=turn.grammar, tools=turn.tools,
                                                 max_new_tokens=max_new_tokens))
        content, calls = tools.parse_tool_calls(out.text, turn.functions, fmt)
        seconds = time.perf_counter() - started
        n = len(out.token_ids)
        records.append({"prompt": prompt, "wanted": wanted, "called": [c.name for c in calls],
                        "arguments": [c.arguments for c in calls], "content": content, "seconds": seconds,
                        "ttft_s": out.ttft_s, "tokens": n,
                        "decode_ms_per_token": out.stats.timing["decode_s"] / (n - 1) * 1000 if n > 1 else None})
    needing = [r for r in records if r["wanted"]]
    chat = [r for r in records if not r["wanted"]]
    per_token = [r["decode_ms_per_token"] for r in records if r["decode_ms_per_token"] is not None]
    summary = {"format": "native" if fmt.native else "generic",
               "right_calls": sum(r["called"] == [r["wanted"]] for r in needing), "needing": len(needing),
               "spurious_calls": sum(bool(r["called"]) for r in chat), "chit_chat": len(chat),
               "seconds_per_call": statistics.median(r["seconds"] for r in records),
               "ttft_s": statistics.median(r["ttft_s"] for r in records),
               "decode_ms_per_token": statistics.median(per_token) if per_token else None}
    return {"records": records, "summary": summary}


def format_tool_choice(result: dict[str, Any]) -> str:
    """The per-prompt table and the summary line (markdown)."""
    lines = ["| prompt | wanted | called | s | TTFT s | decode ms/token |", "|---|---|---|---:|---:|---:|"]
    for r in result["records"]:
        ms = f"{r['decode_ms_per_token']:.1f}" if r["decode_ms_per_token"] is not None else "—"
        called = ", ".join(f"{n}({a})" for n, a in zip(r["called"], r["arguments"])) or "(answered)"
        lines.append(f"| {r['prompt']} | {r['wanted'] or '—'} | {called} | {r['seconds']:.2f} | {r['ttft_s']:.3f} "
                     f"| {ms} |")
    s = result["summary"]
    ms = f"{s['decode_ms_per_token']:.1f}" if s["decode_ms_per_token"] is not None else "—"
    lines.append(f"\n{s['format']} format: right tool on {s['right_calls']}/{s['needing']} prompts that need one, "
                 f"a call on {s['spurious_calls']}/{s['chit_chat']} that need none; median {s['seconds_per_call']:.2f} s "
                 f"a call (TTFT {s['ttft_s']:.3f} s, decode {ms} ms/token)")
    return "\n".join(lines)
