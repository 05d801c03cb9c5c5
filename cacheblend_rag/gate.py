"""The fidelity gate: per model, the recompute ratio at which reuse still gives full prefill's answers.

Reuse approximates the chunks' KV, and the error grows with the model: the same 15 % that keeps SmolLM2-135M's
first token leaves a 1.5B Qwen answering from the wrong passage. So the ratio a request runs at when it names none
is measured per model, not assumed: a small built-in calibration set (8 MuSiQue questions × 6 passages of 160
words, `data/calibration.json`) is run under full prefill and under the method at rising ratios, and the smallest
ratio that meets the target (mean first-token KL ≤ `target_kl` and the same top token as full prefill on ≥
`min_agreement` of the questions) becomes the model's ratio. A model that meets it at no ratio below 1 is served at
ratio 1 (full prefill's answers) and a warning says so; naming a ratio (or `"auto"`) always overrides the gate.

    decision = calibrate(engine)                  # one full prefill per question, then the method per ratio
    path = store(decision)                        # this machine's: settings.gates_dir()/<fingerprint>-<method>.json
    find(engine.fingerprint, engine.model_name)   # this machine's decision, else the one shipped for a packaged model
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from . import settings
from .errors import ConfigError
from .fuse.fidelity import first_token_kl
from .fuse.policies import DEFAULT_METHOD, POLICIES, takes_ratio

if TYPE_CHECKING:  # typing only: the engine imports this module
    from .engine import CacheBlendEngine

logger = logging.getLogger(__name__)

RATIOS = (0.15, 0.2, 0.3, 0.4, 0.5, 0.7)  # tried in order; the first that meets the target is the model's
TARGET_KL = 0.05  # mean first-token KL vs full prefill
MIN_AGREEMENT = 0.9  # share of questions whose top first token is full prefill's
MIN_KEPT = 0.95  # share of full prefill's right answers (the answerable part) a configuration must keep
ANSWER_TOKENS = 16  # tokens decoded per answerable question
FALLBACK_RATIO = 1.0  # a model that meets the target at no ratio tried: every reused row recomputed


@dataclass(frozen=True)
class GateDecision:
    """What the calibration measured for one model and method, and the ratio requests that name none run at."""

    model: str
    fingerprint: str
    method: str
    ratio: float  # the chosen ratio, or FALLBACK_RATIO when none tried met the target
    met: bool  # whether a ratio below 1 met the target
    target_kl: float
    min_agreement: float
    expected_kl: float  # mean first-token KL at `ratio` on the calibration set (0 at ratio 1: full prefill)
    agreement: float  # share of calibration questions with full prefill's top token at `ratio`
    table: tuple[dict, ...]  # per ratio tried: ratio, mean_kl, max_kl, agreement, speedup
    num_questions: int
    mean_tokens: float  # prompt length of the calibration requests
    device: str = "cpu"
    dtype: str = "bfloat16"
    created: float = 0.0
    source: str = "measured"  # "measured" on this machine, or "shipped" with the package for a packaged model
    links: str | None = None  # the learned links it runs with (their digest's first 16 hex), or None: without
    min_kept: float | None = None  # the answerable part's target (None: the decision had no answerable part)
    kept: float | None = None  # share of full prefill's right answers kept at `ratio` (with `links`)

    @property
    def key(self) -> str:
        """Its entry in a packaged model's shipped file: the method, the dtype, and links if it runs with them."""
        return f"{self.method}@{self.dtype}" + ("+links" if self.links else "")

    def stats(self) -> dict[str, Any]:
        """What a request's stats say of it (`stats["fidelity"]`)."""
        return {"ratio": self.ratio, "met": self.met, "target_kl": self.target_kl, "expected_kl": self.expected_kl,
                "agreement": self.agreement, "source": self.source, "dtype": self.dtype, "links": self.links,
                "kept": self.kept}

    def to_json(self) -> str:
        """The decision as JSON (what `store` writes), with a checksum of its fields (`from_json` checks it)."""
        fields = asdict(self)
        return json.dumps({**fields, CHECKSUM: _checksum(fields)}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> "GateDecision":
        """A stored decision; ValueError when it is not one: not a JSON object of this class's fields with their
        types, a checksum that does not match (a decision written since it was added has one; a damaged byte
        changes it), a method or ratio out of range."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        checksum = data.pop(CHECKSUM, None)
        if checksum is not None and checksum != _checksum(data):
            raise ValueError("its checksum does not match its fields (the file was damaged)")
        for f in fields(cls):
            if f.name in data and not _of_type(data[f.name], f.type):
                raise ValueError(f"{f.name} is {data[f.name]!r}, not {f.type}")
        data["table"] = tuple(data.get("table", ()))
        if not all(isinstance(row, dict) for row in data["table"]):
            raise ValueError("table is not a list of objects")
        if source is not None:
            data["source"] = source
        decision = cls(**data)
        if decision.method not in POLICIES or not (0 <= decision.ratio <= 1) or math.isnan(decision.ratio):
            raise ValueError(f"method {decision.method!r} or ratio {decision.ratio!r} out of range")
        return decision


CHECKSUM = "checksum"  # the key of a stored decision's checksum of its other fields


def _checksum(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


_FIELD_TYPES = {"str": (str,), "float": (int, float), "bool": (bool,), "int": (int,), "tuple[dict, ...]": (list, tuple),
                "None": (type(None),)}


def _of_type(value: Any, annotation: str) -> bool:
    """Whether a JSON value is of a decision field's type (the annotations are strings, `from __future__`: "float",
    "str | None", ...); a bool is no number."""
    kinds = tuple(k for part in annotation.split("|") for k in _FIELD_TYPES[part.strip()])
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def calibration_items() -> list[dict]:
    """The built-in calibration set's multi-hop part: [{"question", "passages"}] (first-token KL)."""
    text = resources.files("cacheblend_rag").joinpath("data/calibration.json").read_text(encoding="utf-8")
    return json.loads(text)["items"]


def calibration_answerable() -> list[dict]:
    """Its answerable part: [{"question", "passages", "answers"}], NQ-style (right answers kept)."""
    text = resources.files("cacheblend_rag").joinpath("data/calibration.json").read_text(encoding="utf-8")
    return json.loads(text).get("answerable", [])


def is_right(answer: str, golds: list[str]) -> bool:
    """A normalized gold answer is a substring of the normalized reply (the NQ-open convention)."""
    import re
    import string

    def norm(text: str) -> str:
        text = "".join(c for c in text.lower() if c not in string.punctuation)
        return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())

    return any(norm(g) and norm(g) in norm(answer) for g in golds)


def calibrate(engine: "CacheBlendEngine", method: str = DEFAULT_METHOD, *, target_kl: float = TARGET_KL,
              min_agreement: float = MIN_AGREEMENT, ratios: tuple[float, ...] = RATIOS,
              items: list[dict] | None = None, answerable: list[dict] | None = None, min_kept: float = MIN_KEPT,
              show_progress: bool = True) -> GateDecision:
    """Measure `method` against full prefill at each ratio in turn (without the engine's links, then with them),
    up to the first configuration that meets the target: on the multi-hop part, mean first-token KL and agreement;
    on the answerable part, the share of full prefill's right answers kept. Runs on a scratch engine over the same
    model (a memory store: nothing reaches the user's)."""
    from .request import Request

    if method not in POLICIES or not takes_ratio(POLICIES[method]):
        raise ConfigError(f"the fidelity gate calibrates a method with a recompute ratio, not {method!r}")
    if not (target_kl > 0 and math.isfinite(target_kl)) or not 0 < min_agreement <= 1 or not 0 < min_kept <= 1:
        raise ConfigError(f"target_kl must be > 0, min_agreement and min_kept within (0, 1], got {target_kl}, "
                          f"{min_agreement}, {min_kept}")
    items = calibration_items() if items is None else items
    answerable = calibration_answerable() if answerable is None else answerable
    scratch = type(engine)(engine.model, engine.tokenizer, None, template=engine.template, lead_in=engine.lead_in,
                           model_name=engine.model_name, prefix_reuse=False, links=engine.links)
    configs = [(r, links) for r in ratios for links in ((False, True) if engine.links is not None else (False,))]
    references, tokens, right = [], [], []
    progress = tqdm(total=(len(items) + len(answerable)) * (1 + len(configs)), desc=f"calibrating "
                    f"{engine.model_name}", unit="prefill", disable=not show_progress)
    with progress:
        for item in items:  # full prefill of each question once: the reference every ratio is held to
            ids = scratch.ingest(item["passages"], show_progress=False)
            started = time.perf_counter()
            full = scratch.prefill(ids, item["question"], "full_prefill")
            references.append((ids, item["question"], full.logits, time.perf_counter() - started))
            tokens.append(full.stats["num_tokens"])
            progress.update()
        for item in answerable:  # full prefill's right answers: the ones a configuration must keep
            ids = scratch.ingest(item["passages"], show_progress=False)
            answer = scratch.generate_request(Request.of(ids, item["question"], "full_prefill",
                                                         max_new_tokens=ANSWER_TOKENS))
            right.append((ids, item, is_right(answer.text, item["answers"])))
            progress.update()
        table: list[dict] = []
        chosen = None
        for ratio, links in configs:
            row = _measure(scratch, method, ratio, links, references, right, progress)
            table.append(row)
            logger.info("calibrate %s %s@%s%s: mean KL %.4f, agreement %.2f, kept %s", engine.model_name, method,
                        ratio, "+links" if links else "", row["mean_kl"], row["agreement"], row["kept"])
            if (row["mean_kl"] <= target_kl and row["agreement"] >= min_agreement
                    and (row["kept"] is None or row["kept"] >= min_kept)):
                chosen = row
                break
    adapter = engine.adapter
    return GateDecision(
        model=engine.model_name, fingerprint=engine.fingerprint, method=method,
        ratio=chosen["ratio"] if chosen else FALLBACK_RATIO, met=chosen is not None, target_kl=target_kl,
        min_agreement=min_agreement, expected_kl=chosen["mean_kl"] if chosen else 0.0,
        agreement=chosen["agreement"] if chosen else 1.0, table=tuple(table), num_questions=len(items),
        mean_tokens=statistics.fmean(tokens) if tokens else 0.0, device=adapter.device.type,
        dtype=str(adapter.dtype).removeprefix("torch."), created=time.time(),
        links=engine.links.digest[:16] if chosen and chosen["links"] else None,
        min_kept=min_kept if answerable else None, kept=(chosen["kept"] if chosen else 1.0) if answerable else None)


def _measure(scratch, method: str, ratio: float, links: bool, references, right, progress) -> dict:
    """One configuration's row: KL, agreement and speed-up on the multi-hop part, right answers kept on the other."""
    from .request import Request

    kls, same, speedups = [], [], []
    for ids, question, reference, full_s in references:
        started = time.perf_counter()
        got = scratch.prefill_request(Request.of(ids, question, method, ratio, links=links))
        speedups.append(full_s / (time.perf_counter() - started))
        kls.append(first_token_kl(reference, got.logits))
        same.append(int(got.logits.argmax()) == int(reference.argmax()))
        progress.update()
    kept = None
    wanted = [(ids, item) for ids, item, ok in right if ok]
    if right:
        held = 0
        for ids, item in wanted:
            answer = scratch.generate_request(Request.of(ids, item["question"], method, ratio, links=links,
                                                         max_new_tokens=ANSWER_TOKENS))
            held += is_right(answer.text, item["answers"])
            progress.update()
        progress.update(len(right) - len(wanted))
        kept = held / len(wanted) if wanted else 1.0
    return {"ratio": ratio, "links": links, "mean_kl": statistics.fmean(kls) if kls else 0.0,
            "max_kl": max(kls, default=0.0), "agreement": sum(same) / len(same) if same else 1.0,
            "speedup": statistics.fmean(speedups) if speedups else 1.0, "kept": kept}


def gate_path(fingerprint: str, method: str) -> Path:
    """Where this machine keeps a model's decision for `method` (beside the converted models)."""
    return settings.gates_dir() / f"{fingerprint}-{method}.json"


def store(decision: GateDecision) -> Path:
    """Write the decision for this machine (atomically); the engine reads it on its next start."""
    path = gate_path(decision.fingerprint, decision.method)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(decision.to_json())
    os.replace(tmp, path)
    return path


def find(fingerprint: str, model_name: str, method: str = DEFAULT_METHOD, *, dtype: str | None = None,
         links: str | None = None) -> GateDecision | None:
    """The decision for a model: measured on this machine (by fingerprint, which binds the dtype), else shipped with
    the package for a packaged model (by its alias and `dtype`: a decision holds for the dtype it was measured in);
    one measured with learned links only for an engine with those links (`links`: their digest's first 16 hex).
    None when there is none. An unreadable file is logged and skipped."""
    from .models.loader import PACKAGED_GGUF

    fits = lambda d: d.links is None or d.links == links  # noqa: E731 - links it was not measured with: not it
    path = gate_path(fingerprint, method)
    try:
        if path.is_file():
            decision = GateDecision.from_json(path.read_text(encoding="utf-8"))
            if (decision.fingerprint, decision.method) != (fingerprint, method):
                raise ValueError(f"it is the decision of {decision.fingerprint}/{decision.method}, not this model's")
            if fits(decision):
                return decision
    except (OSError, ValueError, TypeError) as e:
        logger.warning("the fidelity gate's decision %s is unreadable (%s); skipping it", path, e)
    if model_name not in PACKAGED_GGUF:
        return None
    shipped = resources.files("cacheblend_rag").joinpath(f"data/gates/{model_name}.json")
    try:
        if not shipped.is_file():
            return None
        entries = json.loads(shipped.read_text(encoding="utf-8"))
        others = []
        for key in ([f"{method}@{dtype}+links"] if links else []) + [f"{method}@{dtype}", method]:
            entry = entries.get(key)
            if entry is None:
                continue
            decision = GateDecision.from_json(json.dumps(entry), "shipped")
            if (dtype is None or decision.dtype == dtype) and fits(decision):
                return decision
            others.append(decision)
        # none for this dtype: another dtype's verdict of full prefill still holds (ratio 1 is exact in any dtype),
        # a ratio below 1 does not (it is measured again, or the method's own ratio runs)
        return next((d for d in others if not d.met and d.ratio == FALLBACK_RATIO and d.links is None), None)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("the fidelity gate's decision %s is unreadable (%s); skipping it", shipped, e)
    return None


def ship_into(decision: GateDecision, path: str | os.PathLike[str]) -> Path:
    """Add a decision to a packaged model's shipped file (`data/gates/<alias>.json`: decisions by method, dtype and
    links, `GateDecision.key`; the other entries kept)."""
    path = Path(path)
    entries = json.loads(path.read_text()) if path.is_file() else {}
    entries[decision.key] = {**asdict(decision), "source": "shipped"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1) + "\n")
    return path
