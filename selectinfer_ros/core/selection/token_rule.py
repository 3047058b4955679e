"""Per-token neuron selection: the thresholds, calibrated offline, and how a share maps to them.

A decode token computes, per layer, the gate rows of every loaded neuron; a neuron is a
*candidate* when ``|act(gate)|`` clears the layer's gate threshold, and is *computed* (its up
and down read) when also ``|act(gate) * up|`` clears the layer's activation threshold. The
thresholds are quantiles of those magnitudes over calibration tokens (the profiling records),
pooled over tokens and neurons: ``gate[l, j]`` is the value that a share ``(j + 1) / SHARES`` of
layer ``l``'s neurons clear on average, likewise ``act[l, j]``. A target share ``s`` of neurons
computed per token takes ``act`` at ``s`` and ``gate`` at the candidate share
``min(1, CANDIDATES * s)``; every loaded gate row is read, up rows for the candidates only.

Why two stages (Qwen2.5-Coder-1.5B-Instruct int8, top half of each layer's neurons per token,
504 held-out tokens, agreement with all neurons): by ``|act(gate)|`` alone 0.800; by
``|act(gate) * up|`` over all neurons (every up row read) 0.929; the measured rows of this rule
are in the frontier files (``profiles/<model>/frontier.json``, rows named ``... token``).
"""
from __future__ import annotations

import torch

SHARES = 100  # thresholds stored for shares 0.01 .. 1.00
CANDIDATES = 1.5  # candidate share per computed share (up rows read for the candidates)
GATE_KEY, ACT_KEY = "token_gate_thresholds", "token_act_thresholds"  # profile tensors [L, SHARES]
_LO, _OCTAVES, _PER_OCTAVE = -30, 48, 32  # histogram of log2 |v| from 2^-30 on, 1/32 octave bins
_BINS = _OCTAVES * _PER_OCTAVE


def candidate_share(share: float) -> float:
    return min(1.0, CANDIDATES * share)


class Calibration:
    """Histograms of ``|act(gate)|`` and ``|act(gate) * up|`` per layer, from which the threshold
    tables are read (``add`` per layer and batch of tokens, then ``tables``)."""

    def __init__(self, n_layers: int):
        self.hist = torch.zeros(2, n_layers, _BINS + 1, dtype=torch.float64)  # bin 0: below 2^-30

    @staticmethod
    def _bins(v: torch.Tensor) -> torch.Tensor:
        b = ((torch.log2(v.abs().float().clamp_min(2.0 ** _LO)) - _LO) * _PER_OCTAVE).long() + 1
        return b.clamp_(1, _BINS).masked_fill_(v.abs() < 2.0 ** _LO, 0)

    def add(self, layer: int, gate_act: torch.Tensor, act: torch.Tensor) -> None:
        """``gate_act``, ``act``: ``[n, I]`` (the counted tokens' values)."""
        for i, v in enumerate((gate_act, act)):
            self.hist[i, layer] += torch.bincount(self._bins(v).flatten().cpu(),
                                                  minlength=_BINS + 1).double()

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate [L, SHARES], act [L, SHARES])`` float32 thresholds."""
        # value of bin b's lower edge; bin 0 (below 2^-30) -> 0
        edges = torch.cat([torch.zeros(1, dtype=torch.float64),
                           2.0 ** (_LO + torch.arange(_BINS, dtype=torch.float64) / _PER_OCTAVE)])
        want = torch.arange(1, SHARES + 1, dtype=torch.float64) / SHARES  # [P]
        out = []
        for h in self.hist:  # [L, B+1]
            above = h.flip(-1).cumsum(-1).flip(-1)  # [L, B+1]: values in bins >= b
            share = above / above[:, :1].clamp_min(1.0)
            # the highest bin whose share of values at or above it reaches the wanted share
            idx = (share[:, None, :] >= want[None, :, None]).sum(-1) - 1  # [L, P]
            out.append(edges[idx.clamp_min(0)].float())
        return out[0], out[1]


def check_tables(gate: torch.Tensor, act: torch.Tensor, n_layers: int) -> str | None:
    """Why stored tables are unusable (None when they are fine)."""
    for name, t in ((GATE_KEY, gate), (ACT_KEY, act)):
        if tuple(t.shape) != (n_layers, SHARES):
            return f"{name} has shape {tuple(t.shape)}, expected ({n_layers}, {SHARES})"
        if not torch.isfinite(t).all() or (t < 0).any():
            return f"{name} holds negative, NaN or infinite values"
        if (t[:, 1:] > t[:, :-1] + 1e-12).any():
            return f"{name} is not non-increasing in the share"
    return None


def _at(table: torch.Tensor, share: float) -> torch.Tensor:
    """``[L]``: the table's thresholds at ``share``, linear between the stored shares."""
    x = min(max(share, 1.0 / SHARES), 1.0) * SHARES - 1.0
    lo = int(x)
    hi = min(lo + 1, SHARES - 1)
    w = x - lo
    return table[:, lo] * (1 - w) + table[:, hi] * w


def thresholds(gate: torch.Tensor, act: torch.Tensor, share: float) -> tuple[list[float], list[float]]:
    """Per layer ``(gate threshold, activation threshold)`` for ``share`` of all neurons computed
    per token (share 1: every loaded neuron, thresholds 0)."""
    if share >= 1.0:
        n = gate.shape[0]
        return [0.0] * n, [0.0] * n
    return _at(gate, candidate_share(share)).tolist(), _at(act, share).tolist()


def fuse(tables: list[tuple[torch.Tensor, torch.Tensor]], weights: list[float]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds of several tasks' calibrations in one (weighted geometric mean)."""
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    out = []
    for i in range(2):
        logs = torch.stack([t[i].double().clamp_min(2.0 ** _LO).log() for t in tables])
        out.append((logs * w[:, None, None]).sum(0).exp().float())
    return out[0], out[1]
