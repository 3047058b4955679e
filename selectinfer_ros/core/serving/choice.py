"""Choosing the point to run at from the model's measured quality curves: the records (weights
format), gamma and phi together, under ``memory_budget_mb`` and ``min_agreement``.

Each candidate point is (records, gamma, phi/gamma). Its resident bytes and the bytes one decode
step reads are counted from the packed files; its agreement with the dense model is the lowest,
over the tasks the node may serve, of the stored curves (:class:`QualityCurve`, each figure with
its 95 % Wilson interval). Rules:

- ``min_agreement``: the points whose agreement holds at their gamma and every larger one
  (:meth:`QualityCurve.load_ratio_for`); run the one reading the fewest bytes per token (decode is
  bandwidth-bound: the fastest), then the smallest. Bound: min_agreement.
- ``memory_budget_mb``: the points that fit; run the one with the highest agreement (without a
  figure: phi = gamma and the most neurons), then the fastest. Bound: memory_budget.
- both: the fastest point meeting both; when none does, memory wins (weights that do not fit
  cannot run): the best agreement that fits, and the log says the target is not met.

With the model's measured frontier beside its profiles (:mod:`.measured`), "fastest" is the
measured decode speed of the nearest measured point (else the fewest bytes read), the log names
that speed and CPU, and a records format without task curves of its own takes the curve of
another format corrected by the agreement gap between the two formats measured there. A point
below a curve's measured gammas has no agreement figure (a clamped curve would flatter it).
When the task profiles carry no curve for some task (profiles measured without ``--heldout``),
the frontier's own rows stand in: a point's agreement is that of the best measured point of its
format holding no more neurons (:meth:`MeasuredFrontier.floor`; none below the measured points),
and min_agreement picks among the measured points that meet it.

Tiered records (a 4-bit pack with an int8 tier): each int8 tier the frontier measured for the
pack's format is a candidate, at the largest gamma its bytes allow (the int8 tier's records
counted at their own size), its agreement the format's curve plus the gap the frontier measured
between the tiered rows and the curve's format.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..options import ModelOptions
from ..selection.profiles import LoadRatioChoice, ProfileCatalog, QualityCurve, with_ci
from .measured import MeasuredFrontier, MeasuredPoint, tier_key


@dataclass(frozen=True)
class Point:
    weights: str
    path: str
    load_ratio: float
    share: float  # phi / gamma
    resident: int  # bytes of weights held
    read: int  # bytes of weights one decode step reads
    agreement: float | None  # lowest over the tasks (None: no curve)
    task: str = ""  # the task whose curve gave it
    curve: QualityCurve | None = None
    gap: float = 0.0  # frontier agreement gap added to another format's curve
    speed: float | None = None  # measured decode tok/s of the nearest measured point
    speed_note: str = ""
    int8_ratio: float = 0.0  # the int8 tier's share of each layer's neurons (0: one tier)
    row: MeasuredPoint | None = None  # frontier row giving the agreement (no task curve covers it)
    timing: tuple[int, str] | None = None  # (threads, CPU) the measured speed was taken with

    def describe(self) -> str:
        tier = f" with an int8 tier of {self.int8_ratio:g}" if self.int8_ratio else ""
        what = f"{self.weights or 'model'} records{tier}, load_ratio {self.load_ratio:.2f}, " \
               f"compute_ratio {self.load_ratio * self.share:.2f}"
        if self.curve is not None and self.agreement is not None:
            fixed = (f" {self.gap:+.3f} measured on the frontier between "
                     f"{tier_key(self.weights, self.int8_ratio)} and "
                     f"{self.curve.weights or 'float'} records" if self.gap else "")
            what += (f"; measured agreement with dense {with_ci(self.agreement, self.curve.tokens)}"
                     f" (95 % CI over {self.curve.tokens} held-out tokens, task {self.task}, "
                     f"{self.curve.weights or 'float'} curve{fixed})")
        elif self.curve is not None:
            what += f"; no agreement figure (below the {self.task} curve's measured gammas)"
        elif self.row is not None and self.agreement is not None:
            r = self.row
            at = "" if (abs(r.load_ratio - self.load_ratio) < 1e-6 and abs(
                r.compute_ratio - self.load_ratio * self.share) < 1e-6) else \
                " (fewer neurons than this point: a floor)"
            what += (f"; measured agreement with dense {with_ci(self.agreement, r.tokens)} (95 % CI "
                     f"over {r.tokens} held-out tokens, frontier row {r.weights} "
                     f"{r.load_ratio:g}/{r.compute_ratio:g}{at}; no quality curve in the "
                     f"{self.task} profile{'s' if ', ' in self.task else ''})")
        else:
            what += "; no agreement figure (no quality curve or measured frontier row holds it)"
        speed = self.speed_note or ("decode speed not measured for this point: `selectinfer "
                                    "frontier` or `selectinfer bench`")
        return (what + f"; {self.resident / 2**20:.0f} MiB of weights, {self.read / 2**20:.0f} MiB "
                f"read per token; {speed}")


def _sizes(path: str, opts: ModelOptions) -> tuple[int, int, int, "object"]:
    """(fixed bytes: non-FFN tensors and dense layers, bytes of one layer's full FFN, sparse
    layers, manifest) of a packed folder as ``opts`` would load it."""
    from ..format.pack import read_manifest
    from ..selection.loader import (activation_dtype, dense_layer_count, neuron_bytes,
                                    other_bytes_estimate)
    m = read_manifest(path)
    dtype = activation_dtype(opts.dtype or None, m, opts.device)
    layer = m.intermediate_size * neuron_bytes(m, dtype)
    dense = dense_layer_count(m.num_layers, opts.dense_layers)
    return other_bytes_estimate(m, dtype) + dense * layer, layer, m.num_layers - dense, m


def choose_point(opts: ModelOptions, packs: dict[str, str], profiles, log: Callable[[str], None]
                 ) -> LoadRatioChoice:
    """The point to run at (see the module doc) among ``packs`` (weights format -> packed folder);
    logs it. ValueError when no point can run."""
    from ..format.pack import int8_record_bytes
    from ..selection.loader import activation_dtype, load_ratio_for_budget
    budget = int(opts.memory_budget_mb * 2**20) if opts.memory_budget_mb > 0 else None
    target = opts.min_agreement if opts.min_agreement > 0 else None
    fixed_share = opts.compute_ratio / opts.load_ratio if opts.compute_ratio > 0 else None
    meeting: list[Point] = []  # meet min_agreement (at their smallest gamma), fit the budget
    fitting: list[Point] = []  # fit the budget (at its largest gamma)
    reasons: list[str] = []
    for weights, path in packs.items():
        fixed, layer, sparse, m = _sizes(path, opts)
        own = m.weights or "float"
        catalog = ProfileCatalog(profiles, m) if profiles else None
        measured = MeasuredFrontier.load(profiles, m.model_id)
        tasks = [opts.task] if opts.task else (catalog.tasks if catalog else [])
        curves = {t: catalog.quality_curve(t, m.weights) for t in tasks} if catalog else {}
        covered = bool(curves) and all(c is not None for c in curves.values())
        rows = [p for p in (measured.points if measured else [])
                if p.weights.split("+")[0] == own]  # no curve: the frontier's rows stand in
        if target is not None and not covered and not rows:
            missing = [t for t, c in curves.items() if c is None] or ["all"]
            reasons.append(f"{weights or m.weights}: no quality curve for {', '.join(missing)} "
                           f"and no measured frontier row")
            continue
        g_max = 1.0
        if budget is not None:
            try:
                g_max = load_ratio_for_budget(m, activation_dtype(opts.dtype or None, m,
                                                                  opts.device),
                                              budget, opts.dense_layers)
            except ValueError as e:
                reasons.append(f"{weights or m.weights}: {e}")
                continue
        shares = [fixed_share] if fixed_share else sorted(
            {s for c in curves.values() if c is not None for s in c.compute_shares} or {1.0})

        def gap(c: QualityCurve, g: float, share: float, key: str) -> float:
            """What this format costs against the format ``c`` was measured on (frontier)."""
            return measured.curve_gap(c.weights, key, g, g * share) if measured else 0.0

        def point(g: float, share: float, r8: float = 0.0) -> Point:
            key = tier_key(own if r8 else m.weights, r8)
            low, row = None, None
            if covered:
                low = min(((c.expected_agreement(g, g * share) + gap(c, g, share, key), t, c)
                           for t, c in curves.items()), key=lambda x: x[0])
            below = low is not None and g < min(low[2].load_ratios) - 1e-9
            if not covered and measured:
                row = measured.floor(tier_key(own, r8), g, g * share)
            near = measured.nearest(tier_key(own, r8), g, g * share) if measured else None
            ffn = layer * g + (hi_layer - layer) * r8  # one layer's resident records
            agreement = row.agreement if row else None if below or low is None else low[0]
            return Point(weights, path, g, share, int(fixed + sparse * ffn),
                         int(fixed + sparse * ffn * share), agreement,
                         low[1] if low else ", ".join(t for t, c in curves.items() if c is None)
                         or "task",
                         low[2] if low else None, gap(low[2], g, share, key) if low else 0.0,
                         near and near.decode_tokens_per_second,
                         measured.speed_note(tier_key(own, r8), g, g * share) if measured else "",
                         r8, row, (near.threads, near.cpu) if near else None)

        hi_layer = m.intermediate_size * int8_record_bytes(m.hidden_size) if m.high else layer
        for r8 in (measured.tiers(own) if measured and m.high == "int8" else []):
            room = ((budget - fixed) / sparse - (hi_layer - layer) * r8) / layer if budget else 1.0
            g_t = min(1.0, g_max if budget is None else room)
            if g_t <= r8:
                reasons.append(f"{own} with an int8 tier of {r8:g}: does not fit the budget")
                continue
            for share in shares:
                p = point(round(g_t, 6), share, r8)
                fitting.append(p)
                if target is not None and p.agreement is not None \
                        and p.agreement >= target - 1e-6:
                    meeting.append(p)

        for share in shares:
            fitting.append(point(g_max, share))
            if target is not None and covered:
                need = max((_smallest_gamma(c, target - gap(c, 1.0, share, m.weights), share) or 2.0)
                           for c in curves.values())
                if need <= g_max + 1e-9:
                    p = point(need, share)
                    if p.agreement is not None and p.agreement >= target - 1e-6:
                        meeting.append(p)
        if target is not None and not covered:  # the measured points of this format that meet it
            for r in rows:
                share = r.compute_ratio / r.load_ratio
                if r.int8_ratio == 0 and r.load_ratio <= g_max + 1e-9 and r.agreement >= \
                        target - 1e-6 and (fixed_share is None or abs(share - fixed_share) < 1e-6):
                    meeting.append(point(r.load_ratio, share))
    if target is not None and meeting:
        # the fastest measured (speeds taken with one thread count and CPU), else fewest bytes read
        timed = all(p.speed for p in meeting) and len({p.timing for p in meeting}) == 1
        best = min(meeting, key=lambda p: (-p.speed if timed else p.read, p.resident))
        room = f" (the memory budget would allow up to {g_max_of(fitting, best):.3f})" \
            if budget is not None else ""
        mixed = "" if timed or not all(p.speed for p in meeting) else \
            " (the measured speeds differ in threads or CPU: fewest bytes read)"
        return _done(best, "min_agreement", f"min_agreement {target:.2f} -> load_ratio "
                     f"{best.load_ratio:g}{room}{mixed}", log)
    if not fitting:
        raise ValueError("no point to run at: " + "; ".join(reasons))
    # the best agreement; without a figure, compute every loaded neuron (phi = gamma) and hold the
    # most (more neurons agree more, whatever the records); then the fastest
    best = max(fitting, key=lambda p: (-1.0 if p.agreement is None else p.agreement, p.share,
                                       p.load_ratio, p.speed or 0.0, -p.read))
    if target is not None:
        if budget is None:
            raise ValueError(f"min_agreement {target:.2f}: no load_ratio <= 1 reaches it"
                             + (f" ({'; '.join(reasons)})" if reasons else ""))
        return _done(best, "memory_budget", f"min_agreement {target:.2f} is not met within the "
                     f"memory budget of {opts.memory_budget_mb:g} MiB; running below the "
                     f"agreement target at the best point that fits", log)
    return _done(best, "memory_budget", f"memory budget {opts.memory_budget_mb:g} MiB -> "
                 f"load_ratio {best.load_ratio:.3f}", log)


def _smallest_gamma(c: QualityCurve, target: float, share: float) -> float | None:
    """The curve's smallest gamma meeting ``target`` (:meth:`QualityCurve.load_ratio_for`)."""
    return c.load_ratio_for(min(target, 1.0), share) if target > 0 else min(c.load_ratios)


def g_max_of(points: list[Point], like: Point) -> float:
    """The largest gamma that fits among ``points`` of ``like``'s records."""
    return max((p.load_ratio for p in points if p.weights == like.weights), default=1.0)


def _done(p: Point, bound: str, why: str, log: Callable[[str], None]) -> LoadRatioChoice:
    message = f"{why}: running {p.describe()}; bound: {bound}"
    log(f"[load] {message}")
    if p.curve is not None and p.curve.too_small:
        log(f"[load] warning: the {p.task} curve counts only {p.curve.tokens} held-out tokens: "
            f"the interval above is wide; re-measure it with more (`selectinfer profile --task "
            f"{p.task} --curve-only --heldout FILE`)")
    return LoadRatioChoice(p.load_ratio, bound, message, p.agreement, p.weights, p.share, p.path,
                           p.int8_ratio or None)
