"""What a benchmark runs: engine methods (the policy registry's names) and LangChain chains, as parsed specs."""

from __future__ import annotations

from dataclasses import dataclass, field

from cacheblend_rag.fuse.policies import METHODS

# The default run: the methods the main tables compare, the package's default (relevance) among them. Cache-Craft
# keeps per-chunk variants across requests, so it is measured where chunks recur with new companions
# (`bench trace`), or here when named.
NAMED_ONLY = frozenset({"cachecraft"})  # run when named (`--methods`)
ENGINE_METHODS = tuple(m for m in METHODS if m not in NAMED_ONLY)
CHAIN_METHODS = ("stuff", "tutorial", "stuff_documents", "llama_query", "map_reduce", "map_rerank", "hf_pipeline")
OPTIONAL_CHAINS = {"hf_pipeline": "langchain-huggingface", "stuff_documents": "langchain-classic",
                   "llama_query": "llama-index-vector-stores-chroma"}
"""Chain methods that need a package beyond the `langchain` extra (run only when named, or hf_pipeline when
installed), and that package."""
SWEEP_METHODS = ("full_prefill", "full_reuse", "cacheblend")
DEFAULT_RATIOS = (0.05, 0.15, 0.30)
SWEEP_RATIOS = (0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 0.75, 1.0)
REFERENCE = "full_prefill"


@dataclass(frozen=True)
class MethodSpec:
    """A method to run: an engine method or a chain, a ratio, and options."""

    label: str
    method: str
    ratio: float | None = None
    options: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """'cacheblend@0.15' → CacheBlend at 0.15; options follow as '/key=value' pairs.

        e.g. 'cacheblend@0.15/deviation=k/check_layers=1+2/candidate_factor=2/filter_layer=4' (tuples join with '+').
        Chains ('stuff', 'tutorial', 'stuff_documents', 'llama_query', 'map_reduce', 'map_rerank') run at
        cacheblend@0.15 unless told:
        'map_reduce@0.3', 'stuff/method=full_prefill'.
        """
        head, *opts = text.strip().split("/")
        name, _, ratio = head.partition("@")
        if name not in tuple(METHODS) + CHAIN_METHODS:
            raise ValueError(f"unknown method {name!r}; expected one of {', '.join(tuple(METHODS) + CHAIN_METHODS)}")
        return cls(text.strip(), name, float(ratio) if ratio else None, dict(_option(o) for o in opts))

    @property
    def is_chain(self) -> bool:
        """Whether this runs through a LangChain chain (TTFT = first streamed chunk)."""
        return self.method in CHAIN_METHODS

    @property
    def ratio_of_recompute(self) -> float | None:
        """Where the method sits on a recompute-ratio axis: full reuse 0, full prefill 1, CacheBlend its ratio."""
        return {"full_reuse": 0.0, "full_prefill": 1.0}.get(self.method, self.ratio if self.method == "cacheblend" else None)


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if key == "check_layers":
        return key, tuple(int(v) for v in value.split("+"))
    if key in ("chunk_head_tokens", "filter_layer"):
        return key, int(value)
    if key == "candidate_factor":
        return key, float(value)
    return key, value


def parse_methods(text: str | None, ratios: tuple[float, ...] = DEFAULT_RATIOS, *, sweep: bool = False,
                  hf_available: bool = False, chains: bool = True) -> list[MethodSpec]:
    """Method specs from '--methods'; a bare 'cacheblend' expands to one spec per ratio; full prefill first.

    With no text: every engine method, CacheBlend at each ratio, then (with `chains`) the chains, and
    hf_pipeline when available (`stuff_documents` and `llama_query` run when named); with `sweep`: full prefill, full reuse and CacheBlend at each ratio.
    """
    if text:
        names = [m for m in text.split(",") if m.strip()]
    elif sweep:
        names = list(SWEEP_METHODS)
    else:
        names = list(ENGINE_METHODS)
        if chains:
            names += [c for c in CHAIN_METHODS if c not in OPTIONAL_CHAINS or (c == "hf_pipeline" and hf_available)]
    specs: list[MethodSpec] = []
    for name in names:
        head, sep, rest = name.strip().partition("/")
        if head == "cacheblend":
            specs += [MethodSpec.parse(f"cacheblend@{ratio:.2f}{sep}{rest}") for ratio in ratios]
        else:
            specs.append(MethodSpec.parse(name))
    if REFERENCE not in [s.label for s in specs]:
        specs.insert(0, MethodSpec.parse(REFERENCE))
    labels = [s.label for s in specs]
    duplicates = {label for label in labels if labels.count(label) > 1}
    if duplicates:
        raise ValueError(f"methods given twice: {', '.join(sorted(duplicates))}")
    return specs
