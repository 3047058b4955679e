"""4-bit rows in blocks of 32 (llama.cpp's Q4_0 values): the quantizer and the product.

A row of ``K`` weights (``K`` a multiple of 32) is stored as ``K / 2`` bytes of nibbles and
``K / 32`` float16 scales: per block, ``w ~= q * d`` with ``q`` in ``[-8, 7]`` and ``d`` the
block's largest-magnitude weight over -8 (so that weight is exact). Byte ``j`` of a block holds
``q[j] + 8`` in its low nibble and ``q[j + 16] + 8`` in its high one. 4.5 bits per weight.

The product runs in the C kernel (``si_linear_q4``: activations quantized per block of 32 to
int8, integer block dot products with the CPU's instructions), else on the dequantized rows.
"""
from __future__ import annotations

import torch
from torch import nn

from . import kernel as _kernel

QK = 32


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` -> ``(nibbles uint8 [N, K / 2], scales float16 [N, K / 32])``."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"4-bit rows need a multiple of {QK} columns, got {K}")
    b = w.float().reshape(N, K // QK, QK)
    idx = b.abs().argmax(dim=-1, keepdim=True)
    d = (b.gather(-1, idx) / -8.0).squeeze(-1).to(torch.float16)  # [N, nb]
    df = d.float()
    inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round(b * inv[..., None]).clamp_(-8, 7).to(torch.int16) + 8  # [N, nb, 32] in 0..15
    packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)  # [N, nb, 16]
    return packed.reshape(N, K // 2), d


def dequantize(packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 rows ``[N, K]`` that ``quantize`` stored."""
    N = packed.shape[0]
    nb = d.shape[1]
    p = packed.reshape(N, nb, 16).to(torch.int16)
    q = torch.cat([p & 15, p >> 4], dim=-1).float() - 8.0  # [N, nb, 32]
    return (q * d.float()[..., None]).reshape(N, nb * QK)


def linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ dequantize(packed, d).T`` -> ``[..., N]`` in ``x``'s dtype."""
    N, K = packed.shape[0], d.shape[1] * QK
    k = _kernel.kernel() if x.device.type == "cpu" else None
    if k is None or packed.stride(1) != 1 or d.stride(1) != 1:
        return nn.functional.linear(x, dequantize(packed, d).to(x.dtype))
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)
    rc = k.lib.si_linear_q4(x2.data_ptr(), x2.shape[0], K, packed.data_ptr(), d.data_ptr(), N,
                            packed.stride(0), d.stride(0), y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("4-bit kernel: out of memory for the quantized activations")
    y = y.view(*x.shape[:-1], N)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


class Q4Linear(nn.Module):
    """A bias-free linear layer over 4-bit rows (``weight`` uint8 ``[N, K / 2]``, ``scale``
    float16 ``[N, K / 32]``)."""

    def __init__(self, out_features: int, in_features: int, device: torch.device | str = "cpu"):
        super().__init__()
        if in_features % QK:
            raise ValueError(f"4-bit rows need a multiple of {QK} columns, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features // 2,
                                                   dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.empty(out_features, in_features // QK,
                                                  dtype=torch.float16, device=device))

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Q4Linear":
        m = cls(w.shape[0], w.shape[1], w.device)
        m.weight, m.scale = quantize(w)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scale)


class CoarseFineLinear(nn.Module):
    """An output layer read in two passes: every row in 4-bit (the coarse logits), then the
    ``candidates`` rows with the highest coarse logits again from the exact int8 rows. The
    returned logits are exact for the candidates (so the argmax is the int8 layer's whenever it
    is among them) and coarse elsewhere. Per token it reads the 4-bit rows plus ``candidates``
    int8 rows instead of every int8 row (Gemma 3 270M: 90 + 0.04 MiB instead of 161 MiB)."""

    def __init__(self, exact: nn.Module, candidates: int = 64):
        super().__init__()
        self.exact = exact  # an Int8Linear (weight int8 [N, K], scale [N])
        self.candidates = candidates
        self.coarse = Q4Linear.from_float(exact.weight.float() * exact.scale[:, None])
        self.in_features, self.out_features = self.coarse.in_features, self.coarse.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .int8 import linear as int8_linear
        logits = self.coarse(x)
        rows, xs = logits.view(-1, logits.shape[-1]), x.reshape(-1, x.shape[-1])
        k = min(self.candidates, rows.shape[1])
        for r, top in enumerate(torch.topk(rows, k, dim=-1, sorted=False).indices):
            rows[r, top] = int8_linear(xs[r:r + 1], self.exact.weight[top],
                                       self.exact.scale[top]).view(-1).to(rows.dtype)
        return logits
