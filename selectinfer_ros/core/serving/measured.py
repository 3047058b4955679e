"""The model's measured frontier: ``selectinfer frontier``'s rows of ours, kept beside the task
profiles as ``frontier.json``. Per records format, gamma and phi: next-token agreement with the
dense model on one set of held-out tokens (general profile) and decode speed on a named CPU.

The point choice (:mod:`.choice`) reads from it the speed of the point it runs, the agreement of
a point when the task profiles carry no curve for it (:meth:`MeasuredFrontier.floor`), and the
agreement gap between a records format without its own task curves and the format whose curve stands in
(``int8-q4emb`` against ``int8``: what its 4-bit output layer costs at that gamma and phi). A
tiered row (4-bit records with an int8 tier, ``int8_ratio`` > 0) is a format of its own here,
keyed ``<weights>+int8:<ratio>`` (:func:`tier_key`); the random-ranking ablation rows are left
out (no node runs them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FRONTIER_FILE = "frontier.json"


def tier_key(weights: str, int8_ratio: float) -> str:
    """The frontier's name of ``weights`` records with an int8 tier of ``int8_ratio``."""
    return f"{weights}+int8:{int8_ratio:g}" if int8_ratio > 0 else weights


@dataclass(frozen=True)
class MeasuredPoint:
    weights: str  # tier_key of the records format and int8 tier
    load_ratio: float
    compute_ratio: float
    agreement: float
    tokens: int  # held-out tokens the agreement counts
    decode_tokens_per_second: float
    threads: int
    cpu: str
    int8_ratio: float = 0.0


class MeasuredFrontier:
    """The rows of one model's ``frontier.json`` (ours only), looked up by nearest point."""

    def __init__(self, points: list[MeasuredPoint], path: Path):
        self.points, self.path = points, path

    @classmethod
    def load(cls, profiles_dir: str | Path | None, model_id: str) -> "MeasuredFrontier | None":
        """``<profiles_dir>/frontier.json`` (None without one). A file that is not a frontier of
        ``model_id`` is refused with the reason (ValueError)."""
        if profiles_dir is None:
            return None
        path = Path(profiles_dir) / FRONTIER_FILE
        if not path.is_file():
            return None
        try:
            rows = json.loads(path.read_text())
            if not isinstance(rows, list):
                raise ValueError("not a list of rows")
            points = [MeasuredPoint(tier_key(str(r["weights"]), float(r.get("int8_ratio", 0.0))),
                                    float(r["load_ratio"]),
                                    float(r["compute_ratio"]), float(r["agreement"]),
                                    int(r.get("tokens", 0)), float(r["decode_tokens_per_second"]),
                                    int(r.get("threads", 1)), str(r.get("cpu", "")),
                                    float(r.get("int8_ratio", 0.0)))
                      for r in rows if r.get("source") == "selectinfer"
                      and r.get("compute_mode", "prompt") == "prompt"  # the curves' own mode
                      and r.get("ranking", "profile") == "profile"]
            models = {r.get("model") for r in rows if r.get("source") == "selectinfer"}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a `selectinfer frontier` file ({e})") from e
        if models and models != {model_id}:
            raise ValueError(f"{path}: measured on {', '.join(sorted(map(str, models)))}, "
                             f"not {model_id}")
        bad = [p for p in points if not (0 < p.compute_ratio <= p.load_ratio <= 1
                                         and 0 <= p.agreement <= 1
                                         and 0 <= p.int8_ratio < p.load_ratio)]
        if bad:
            raise ValueError(f"{path}: row {bad[0]} out of range")
        return cls(points, path)

    def tiers(self, weights: str) -> list[float]:
        """The int8 tiers measured for ``weights`` records (their int8_ratio values > 0)."""
        return sorted({p.int8_ratio for p in self.points
                       if p.int8_ratio > 0 and p.weights == tier_key(weights, p.int8_ratio)})

    def nearest(self, weights: str, load_ratio: float, compute_ratio: float
                ) -> MeasuredPoint | None:
        """The measured point of ``weights`` records closest to (gamma, phi)."""
        same = [p for p in self.points if p.weights == weights]
        return min(same, key=lambda p: abs(p.load_ratio - load_ratio)
                   + abs(p.compute_ratio - compute_ratio), default=None)

    def floor(self, weights: str, load_ratio: float, compute_ratio: float
              ) -> MeasuredPoint | None:
        """The best measured point of ``weights`` records holding no more neurons than
        (gamma, phi): agreement rises with both, so its figure is a floor for the point (None when
        every measured point holds more: an extrapolation would flatter it)."""
        under = [p for p in self.points if p.weights == weights
                 and p.load_ratio <= load_ratio + 1e-6 and p.compute_ratio <= compute_ratio + 1e-6]
        return max(under, key=lambda p: (p.agreement, p.load_ratio, p.compute_ratio),
                   default=None)

    def of(self, weights: str) -> list[MeasuredPoint]:
        """The measured points of ``weights`` records (a tier_key)."""
        return [p for p in self.points if p.weights == weights]

    def gap(self, weights: str, other: str, load_ratio: float, compute_ratio: float
            ) -> float | None:
        """Agreement of ``weights`` minus that of ``other`` records at the measured point
        nearest to (gamma, phi) that both have (None when they share none)."""
        mine = {(p.load_ratio, p.compute_ratio): p for p in self.points if p.weights == weights}
        theirs = {(p.load_ratio, p.compute_ratio): p for p in self.points if p.weights == other}
        both = sorted(set(mine) & set(theirs),
                      key=lambda k: abs(k[0] - load_ratio) + abs(k[1] - compute_ratio))
        if not both:
            return None
        return mine[both[0]].agreement - theirs[both[0]].agreement

    def curve_gap(self, curve_weights: str, weights: str, load_ratio: float,
                  compute_ratio: float) -> float:
        """What to add to a quality curve measured on ``curve_weights`` records to predict
        ``weights`` records (0 for the same format or without a shared measured point)."""
        own, theirs = weights or "float", curve_weights or "float"
        if own == theirs:
            return 0.0
        return self.gap(own, theirs, load_ratio, compute_ratio) or 0.0

    def speed_note(self, weights: str, load_ratio: float, compute_ratio: float) -> str:
        """A sentence for the log: the measured decode speed of the nearest point."""
        p = self.nearest(weights, load_ratio, compute_ratio)
        if p is None:
            return f"decode speed of {weights} records not in {self.path}"
        at = "" if (abs(p.load_ratio - load_ratio) < 1e-6 and abs(p.compute_ratio - compute_ratio)
                    < 1e-6) else f" at the nearest measured point {p.load_ratio:g}/{p.compute_ratio:g}"
        return (f"measured decode {p.decode_tokens_per_second:.1f} tok/s{at} ({p.threads} "
                f"thread{'s' if p.threads != 1 else ''}, {p.cpu or 'CPU not recorded'}; "
                f"{self.path.name})")
