"""Text metrics for evaluation: exact match, chrF, ROUGE-L (no external dependencies)."""
from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, squeeze spaces (SQuAD-style)."""
    text = text.lower().strip()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize(prediction) == normalize(reference))


def contains(prediction: str, reference: str) -> float:
    """1.0 when the normalised reference appears as whole words in the normalised prediction."""
    ref = normalize(reference)
    return float(bool(ref) and f" {ref} " in f" {normalize(prediction)} ")


def _char_ngrams(text: str, n: int) -> Counter:
    text = "".join(text.split())
    return Counter(text[i:i + n] for i in range(len(text) - n + 1))


def chrf(predictions: list[str], references: list[str], max_n: int = 6, beta: float = 2.0) -> float:
    """Corpus chrF (character n-grams 1..6, whitespace removed, F-beta with beta=2), 0..100."""
    match = [0] * max_n
    pred_total = [0] * max_n
    ref_total = [0] * max_n
    for p, r in zip(predictions, references):
        for n in range(1, max_n + 1):
            pc, rc = _char_ngrams(p, n), _char_ngrams(r, n)
            match[n - 1] += sum((pc & rc).values())
            pred_total[n - 1] += sum(pc.values())
            ref_total[n - 1] += sum(rc.values())
    precision = sum(m / t for m, t in zip(match, pred_total) if t) / max_n
    recall = sum(m / t for m, t in zip(match, ref_total) if t) / max_n
    if precision + recall == 0:
        return 0.0
    b2 = beta * beta
    return 100.0 * (1 + b2) * precision * recall / (b2 * precision + recall)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over lowercase word tokens."""
    p, r = normalize(prediction).split(), normalize(reference).split()
    if not p or not r:
        return 0.0
    prev = [0] * (len(r) + 1)
    for x in p:
        cur = [0]
        for j, y in enumerate(r):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)
