"""The selective FFN: loaded neurons as compact slot buffers, and per-request selection.

Slots hold loaded neurons; ``slot_ids[s]`` is the original neuron id in slot s. The first
``n_static`` slots hold the static (task base) neurons. A request computes the first
``n_active`` slots when decoding; at prefill it computes every loaded slot and, when
``n_active < n_loaded``, chooses the dynamic neurons and swaps them into slots
``[n_static, n_active)`` (only the rows that move are copied; nothing is reallocated).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


class SelectionState:
    """Shared by every layer of a model for the request in flight."""

    def __init__(self) -> None:
        self.prefill = True
        self.alpha = 0.2
        self.method = "frequency"  # or "norm" (GRIFFIN-style prompt-wide activation norms)
        self.token_weight: torch.Tensor | None = None  # [T] 1.0 for tokens that vote, 0.0 (BOS) not


class SelectiveMLP(nn.Module):
    """Gated MLP over a subset of neurons: ``down(act(gate(x)) * up(x))`` restricted to slots."""

    def __init__(self, hidden: int, act: str, state: SelectionState, layer: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.hidden, self.layer, self.state = hidden, layer, state
        self.act_fn = ACT2FN[act]
        self.dense = False  # a dense layer computes every loaded slot, also in decode
        self.n_static = 0
        self.n_active = 0
        self.register_buffer("gu", torch.empty(0, 2, hidden, dtype=dtype, device=device))  # [k, 2, H]
        # down_proj columns of the loaded neurons, [H, k]: F.linear reads it as dot products, which
        # on CPU ran as fast as a row layout in float32 and 7x faster in bfloat16 (h @ [k, H]).
        self.register_buffer("down", torch.empty(hidden, 0, dtype=dtype, device=device))  # [H, k]
        self.register_buffer("slot_ids", torch.empty(0, dtype=torch.long, device=device))  # [k]

    @property
    def n_loaded(self) -> int:
        return self.slot_ids.numel()

    def set_slots(self, gu: torch.Tensor, down: torch.Tensor, slot_ids: torch.Tensor,
                  n_static: int) -> None:
        """Install loaded neurons (``gu`` ``[k, 2, H]``, ``down`` ``[H, k]``, ids ``[k]``)."""
        self.gu, self.down, self.slot_ids = gu, down, slot_ids
        self.n_static = n_static
        self.n_active = slot_ids.numel()

    def set_active(self, n_active: int) -> None:
        """Neurons computed per decode step (static + dynamic), clamped to [n_static, n_loaded]."""
        self.n_active = self.n_loaded if self.dense else max(self.n_static, min(n_active, self.n_loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, H]
        k = self.n_loaded if self.state.prefill else self.n_active
        out = nn.functional.linear(x, self.gu[:k].view(2 * k, self.hidden))  # [B, T, 2k]
        out = out.view(*x.shape[:-1], k, 2)
        h = self.act_fn(out[..., 0]) * out[..., 1]  # [B, T, k]
        y = nn.functional.linear(h, self.down[:, :k])  # [B, T, H]
        if self.state.prefill and self.n_active < self.n_loaded:
            self._select(h)
        return y

    def _select(self, h: torch.Tensor) -> None:
        """Choose ``n_active - n_static`` dynamic neurons from the prompt and swap them in."""
        a = h.reshape(-1, h.shape[-1]).abs().float()  # [T, k]
        w = self.state.token_weight
        w = torch.ones(a.shape[0], device=a.device) if w is None or w.numel() != a.shape[0] else w
        k, s = self.n_loaded, self.n_static
        e = self.n_active - s
        if self.state.method == "norm":
            a = a / a.norm(dim=1, keepdim=True).clamp_min(1e-12)
            key = (a.square() * w[:, None]).sum(0)  # [k] GRIFFIN: prompt-wide norm per neuron
        else:
            k_alpha = max(1, int(self.state.alpha * k))
            top = torch.topk(a, k_alpha, dim=1, sorted=False).indices  # [T, k_alpha]
            counts = torch.zeros(k, device=a.device).index_add_(
                0, top.flatten(), w[:, None].expand_as(top).flatten())
            mass = (a * w[:, None]).sum(0)
            key = counts + 0.5 * mass / mass.max().clamp_min(1e-30)  # ties broken by summed |a|
        key[:s] = -1.0
        chosen = torch.topk(key, e, sorted=False).indices
        self._swap_in(chosen, s, e)

    def _swap_in(self, chosen: torch.Tensor, s: int, e: int) -> None:
        """Move the slots ``chosen`` into ``[s, s+e)`` by pairwise swaps, with no host sync."""
        k = self.n_loaded
        n_out = k - s - e
        if e == 0 or n_out == 0:
            return
        mark = torch.zeros(k, dtype=torch.int8, device=chosen.device)
        mark[chosen] = 1
        # Inside the window, unchosen slots first; outside it, chosen slots first.
        inside = s + torch.argsort(mark[s:s + e], stable=True)
        outside = s + e + torch.argsort(1 - mark[s + e:], stable=True)
        pairs = min(e, n_out)
        moving = mark[s + e:].sum()  # how many chosen slots lie outside the window
        a = inside[:pairs]
        if chosen.device.type == "cpu":  # a host read is free here: swap only the moving pairs
            pairs = int(moving)
            a, b = a[:pairs], outside[:pairs]
        else:  # no host sync on accelerators: surplus pairs swap a slot with itself
            b = torch.where(torch.arange(pairs, device=chosen.device) < moving, outside[:pairs], a)
        if pairs == 0:
            return
        dst, src = torch.cat([a, b]), torch.cat([b, a])
        self.gu.index_copy_(0, dst, self.gu.index_select(0, src))
        self.down.index_copy_(1, dst, self.down.index_select(1, src))
        self.slot_ids.index_copy_(0, dst, self.slot_ids.index_select(0, src))

    def weight_bytes(self) -> int:
        return self.gu.numel() * self.gu.element_size() + self.down.numel() * self.down.element_size()
