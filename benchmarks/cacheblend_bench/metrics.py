"""Answer-quality metrics: SQuAD token F1, ROUGE-L, first-token KL and match."""

from __future__ import annotations

import re
import string
from collections import Counter

from cacheblend_rag.fuse.fidelity import first_token_kl  # noqa: F401 - the package's own measure, re-exported for the bench


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 between two answers after SQuAD normalization."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: list[str]) -> float:
    """Max token F1 over the gold answers."""
    return max((token_f1(prediction, r) for r in references), default=0.0)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (longest common subsequence of normalized tokens)."""
    a, b = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)




def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
