"""Benchmark outputs: the markdown tables, results.json, results.md and the quality-vs-TTFT (and
quality-vs-ratio) plots; breakdown.md/json and loading.md/json for `bench breakdown` and `bench loading`."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import torch

NOTES = """\
- TTFT: engine methods — the prefill of the fused prompt up to the first token's logits (KV already ingested);
  chain methods (marked `*`) — `.stream(question)` to the first non-empty chunk: retrieval, prompt, every LLM
  call before the last, the last prefill and its first decoded word (map_rerank's last step does not stream,
  so its first chunk is its whole answer).
- latency: engine methods — prefill + decode; chain methods — a separate `.invoke(question)`.
- speedup: median TTFT of full_prefill / median TTFT of the method, in this run.
- gold F1: SQuAD token F1, max over the gold answers. Agreement: token F1 and ROUGE-L of the answer vs this
  question's full_prefill answer; 1st-token match and KL(full ‖ method) of the first-token distribution
  (engine methods only; `–` where not observable).
- recomputed: share of reused chunk tokens recomputed per layer (chains: over all their calls).
  KV loaded: bytes of stored KV placed into the prompt (engine methods)."""


def machine() -> str:
    """One line about where this ran."""
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


# ---- tables -----------------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


TABLE_HEAD = ("| method | TTFT median (s) | p90 (s) | latency (s) | speedup | gold F1 | agreement F1 | ROUGE-L | "
              "1st-token match | KL | recomputed | KV loaded (MB) |")


def format_table(summary: dict[str, dict]) -> str:
    """A markdown table of the summary; '–' where a metric is unavailable. Chain TTFTs are marked with '*'."""
    lines = [TABLE_HEAD, "|" + "---|" * TABLE_HEAD.count(" | ") + "---|"]
    for label, s in summary.items():
        star = "*" if s.get("ttft_kind", "prefill") != "prefill" else ""
        kv = s.get("kv_bytes_loaded")
        lines.append(
            f"| {label} | {s['ttft_median_s']:.3f}{star} | {s['ttft_p90_s']:.3f} | "
            f"{_fmt(s.get('latency_median_s'))} | {_fmt(s.get('speedup'), '.2f', '×')} | {s['f1']:.3f} | "
            f"{s['agreement_f1']:.3f} | {_fmt(s.get('agreement_rouge_l'))} | {_fmt(s.get('first_token_match'), '.2f')} | "
            f"{_fmt(s.get('kl'))} | {_fmt(s.get('recompute_ratio_effective'))} | "
            f"{_fmt(None if kv is None else kv / 1e6, '.1f')} |")
    return "\n".join(lines)


def format_load_table(load: dict[str, dict]) -> str:
    """A markdown table of the throughput run."""
    head = ("| method | clients | requests | queries/min | TTFT under load median (s) | p90 (s) | "
            "prefill alone median (s) | latency median (s) | requests with KV misses |")
    lines = [head, "|" + "---|" * 9]
    for label, s in load.items():
        lines.append(f"| {label} | {s['concurrency']} | {s['requests']} | {s['queries_per_min']:.1f} | "
                     f"{s['ttft_median_s']:.3f} | {s['ttft_p90_s']:.3f} | {s['service_ttft_median_s']:.3f} | "
                     f"{s['latency_median_s']:.3f} | {s.get('requests_with_misses', 0)} |")
    return "\n".join(lines)


def format_breakdown(summary: dict[str, dict]) -> str:
    """Two markdown tables: per-layer milliseconds with rows and pairs, then op shares per request."""
    ms = lambda s: f"{1000 * s:.1f}" if s == s else "–"  # noqa: E731 (nan: no such layers)
    lines = ["| method | TTFT (ms) | × full | layer 0 | layers until settled | deep layer (median) | deep layers | "
             "last layer | deep rows | deep attention pairs |", "|" + "---|" * 10]
    for label, s in summary.items():
        speedup = f"{s['speedup']:.2f}×" if "speedup" in s else "–"
        lines.append(f"| {label} | {ms(s['ttft_s'])} | {speedup} | {ms(s['layer0_s'])} | {ms(s['until_settled_s'])} | "
                     f"{ms(s['deep_layer_s'])} | {s['num_deep_layers']} | {ms(s['last_layer_s'])} | "
                     f"{100 * s['deep_rows_share']:.1f}% | {100 * s['deep_pairs_share']:.1f}% |")
    lines += ["", "| method (per request, profiled) | attention (ms) | matmuls (ms) | everything else (ms) | "
              "of all that: placing cached KV | selecting rows | attention plans | outside the layers (timed) |",
              "|" + "---|" * 8]
    for label, s in summary.items():
        lines.append(f"| {label} | {ms(s['attention_s'])} | {ms(s['matmul_s'])} | {ms(s['other_s'])} | "
                     f"{ms(s['place_cached_kv_s'])} | {ms(s['select_rows_s'])} | {ms(s['plan_attention_s'])} | "
                     f"{ms(s['outside_layers_s'])} |")
    return "\n".join(lines)


def format_loading(result: dict) -> str:
    """Two markdown tables of `bench loading`: TTFT per KV location, then "auto" vs fixed ratios; the profiles."""
    lines = ["| KV location | TTFT median (s) | × memory tier | loop waited for KV (median s) |", "|---|---|---|---|"]
    for name, row in result["tiers"].items():
        lines.append(f"| {name} | {row['ttft_median_s']:.3f} | {row['vs_memory']:.3f} | {row['kv_wait_median_s']:.4f} |")
    lines += ["", "| ratio | TTFT median (s) | first-token KL vs full prefill | mean ratio used |", "|---|---|---|---|"]
    for name, row in result["ratios"].items():
        lines.append(f"| {name} | {row['ttft_median_s']:.3f} | {row['kl']:.4f} | {row['ratio_mean']:.3f} |")
    p, t = result["profile"], result["tier_profiles"]
    lines += ["", f"profile: layer = {p['layer_fixed_s'] * 1e3:.2f} ms + {p['layer_per_row_s'] * 1e6:.2f} µs/row at "
              f"{p['num_tokens']} tokens; tiers: "
              + ", ".join(f"{k} {v['read_bytes_per_s'] / 1e9:.2f} GB/s" for k, v in t.items())]
    return "\n".join(lines)


# ---- plots ------------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _style(label: str, summary_row: dict) -> tuple[str, str]:
    """Marker and colour of a method's point: chains orange squares, CacheBlend blue, other engine methods grey."""
    if summary_row.get("kind") == "chain":
        return "s", "tab:orange"
    return "o", "tab:blue" if label.startswith("cacheblend") else "tab:gray"


def plot_quality_vs_ttft(summary: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """One point per method: median TTFT on x; gold F1 (left) and agreement with full prefill (right) on y.

    Points carry a number and the key on the right names them: full labels next to the points overlap
    where methods sit close together (CacheBlend's ratios, prefix cache beside full prefill).
    """
    from matplotlib.lines import Line2D

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.6), sharex=True)
    panels = (("f1", "gold token F1"), ("agreement_f1", "agreement with full prefill (token F1)"))
    numbered = list(enumerate(summary.items(), start=1))
    for ax, (key, ylabel) in zip(axes, panels):
        points = [(n, label, s) for n, (label, s) in numbered if _finite(s.get(key)) and s["ttft_median_s"] > 0]
        xs = [s["ttft_median_s"] for _, _, s in points]
        if xs and max(xs) / min(xs) > 8:
            ax.set_xscale("log")
        for n, label, s in points:
            marker, color = _style(label, s)
            ax.scatter(s["ttft_median_s"], s[key], marker=marker, s=46, color=color, zorder=3)
            ax.annotate(str(n), (s["ttft_median_s"], s[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ys = [s[key] for _, _, s in points]
        top = max(ys, default=1.0)
        ax.set_ylim(-0.03 * max(top, 0.1), 1.05 if top > 0.5 else max(top, 0.1) * 1.3)  # gold F1 stays small here
        ax.set_xlabel("TTFT median (s)  [chains: first streamed chunk]")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], linestyle="", marker=_style(label, s)[0], color=_style(label, s)[1],
                      label=f"{n}  {label}  ({s['ttft_median_s']:.3g} s)") for n, (label, s) in numbered]
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False, handletextpad=0.3)
    fig.suptitle(title or "quality vs time to first token (one point per method)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.74, 1))
    return _save(plt, fig, path, layout=False)


def plot_quality_vs_ratio(summary: dict[str, dict], path: str | Path, title: str = "") -> Path | None:
    """Quality vs recompute ratio (full reuse at 0, full prefill at 1): the sweep plot; None without points."""
    points = sorted(((s["ratio"], s) for s in summary.values() if _finite(s.get("ratio")) and s.get("kind") != "chain"),
                    key=lambda p: p[0])
    if len(points) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [r for r, _ in points]
    for key, label, marker in (("f1", "gold F1", "o"), ("agreement_f1", "agreement F1", "s"),
                               ("first_token_match", "1st-token match", "^")):
        ys = [s.get(key) for _, s in points]
        if all(_finite(y) for y in ys):
            ax.plot(xs, ys, marker=marker, label=label)
    ax.set_xlabel("recompute ratio (0 = full reuse, 1 = full prefill)")
    ax.set_ylabel("quality")
    ax.set_ylim(-0.03, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "quality vs recompute ratio", fontsize=10)
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path, layout: bool = True) -> Path:
    """Lay out (unless the caller did), write as PNG and free the figure."""
    if layout:
        fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_markdown(result: dict) -> str:
    """results.md: what ran, ingestion, the summary table, throughput (if measured), how it was measured."""
    meta = result["meta"]
    ing = result["ingest"]
    lines = [
        f"# cacheblend-rag bench — {meta['dataset_name']}",
        "",
        f"{meta['questions']} questions × {meta['chunks']} chunks"
        + (f" of ~{meta['chunk_tokens']} tokens" if meta.get("chunk_tokens") else " (passages)")
        + f", model {meta['model']} ({meta['dtype']}), lead-in {meta['lead_in']}, max_new_tokens "
        f"{meta['max_new_tokens']}, seed {meta['seed']}; {meta['machine']}",
        "",
        f"ingestion (before timing): {ing['chunks']} chunks, {ing['tokens']} tokens in {ing['seconds']:.1f} s"
        + (f" ({ing['tokens_per_s']:.0f} tokens/s)" if ing.get("tokens_per_s") else ""),
        "",
        format_table(result["summary"]),
    ]
    if result.get("throughput"):
        lines += ["", "## Throughput", "", format_load_table(result["throughput"])]
    lines += ["", NOTES, ""]
    return "\n".join(lines)


def write_outputs(result: dict, out: str | Path) -> dict[str, Path]:
    """results.json, results.md, quality_vs_ttft.png (and quality_vs_ratio.png for a sweep) under `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    paths["json"].write_text(json.dumps(result, indent=1, default=str))
    paths["md"].write_text(format_markdown(result))
    meta = result["meta"]
    title = f"{meta['dataset_name']}: {meta['questions']} q × {meta['chunks']} chunks, {meta['model']}"
    paths["png"] = plot_quality_vs_ttft(result["summary"], out / "quality_vs_ttft.png", title)
    if meta.get("sweep"):
        ratio_png = plot_quality_vs_ratio(result["summary"], out / "quality_vs_ratio.png", title)
        if ratio_png:
            paths["ratio_png"] = ratio_png
    return paths


def _strict(value):
    """NaN as None, recursively: strict JSON has no NaN."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def write_table(out: str | Path, name: str, header: str, table: str, payload: dict) -> list[Path]:
    """`<name>.md` (header and table) and `<name>.json` (strict JSON) under `out`, for the studies."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{name}.md", out / f"{name}.json"
    md.write_text(f"{header}\n\n{table}\n")
    js.write_text(json.dumps(_strict(payload), indent=1))
    return [md, js]
