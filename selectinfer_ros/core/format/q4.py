"""4-bit rows in blocks of 32 (llama.cpp's Q4_0 values): the quantizer and the product.

A row of ``K`` weights (``K`` a multiple of 32) is stored as ``K / 2`` bytes of nibbles and
``K / 32`` float16 scales: per block, ``w ~= q * d`` with ``q`` in ``[-8, 7]`` and ``d`` the
block's largest-magnitude weight over -8 (so that weight is exact). Byte ``j`` of a block holds
``q[j] + 8`` in its low nibble and ``q[j + 16] + 8`` in its high one. 4.5 bits per weight.

The product runs in the C kernel (``si_linear_q4``: activations quantized per block of 32 to
int8, integer block dot products with the CPU's instructions), else on the dequantized rows.
4-bit neuron records (:func:`.pack.q4_records`) hold gate row, up row and down column as
such rows; :func:`records_linear` and :func:`records_down` are their products (the decode
step of a 4-bit model runs them inside the kernel's ``si_decode_layers``).
"""
from __future__ import annotations

import torch
from torch import nn

from . import kernel as _kernel

QK = 32


FIT_FACTORS = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1)  # candidate scales, times the peak's


def _fit_scales(b: torch.Tensor, d0: torch.Tensor) -> torch.Tensor:
    """Per block (``b`` ``[n, nb, 32]`` float32), the float16 scale of least squared error among
    the peak scale ``d0`` ``[n, nb]`` and, for each of :data:`FIT_FACTORS`, the least-squares
    scale of the values rounded at ``d0 * factor`` (as llama.cpp's ``make_qx_quants``)."""
    def err(d: torch.Tensor) -> torch.Tensor:
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(b * inv[..., None]).clamp_(-8, 7)
        return (b - q * d[..., None]).square().sum(-1)
    best, best_err = d0, err(d0)
    for f in FIT_FACTORS:
        d = d0 * f
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(b * inv[..., None]).clamp_(-8, 7)
        den = q.square().sum(-1)
        d = torch.where(den > 0, (b * q).sum(-1) / den.clamp_min(1e-30), d).half().float()
        e = err(d)
        better = e < best_err
        best, best_err = torch.where(better, d, best), torch.where(better, e, best_err)
    return best


def quantize(w: torch.Tensor, fit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` -> ``(nibbles uint8 [N, K / 2], scales float16 [N, K / 32])``. Each
    block's scale is its peak weight over -8 (that weight exact), or with ``fit`` the scale of
    least squared error found by :func:`_fit_scales` (the packs use it; same layout)."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"4-bit rows need a multiple of {QK} columns, got {K}")
    if fit and N * K > 1 << 22:  # in row chunks: the search holds a few copies of the rows
        step = max(1, (1 << 22) // K)
        parts = [quantize(w[i:i + step], fit=True) for i in range(0, N, step)]
        return torch.cat([p for p, _ in parts]), torch.cat([d for _, d in parts])
    b = w.float().reshape(N, K // QK, QK)
    idx = b.abs().argmax(dim=-1, keepdim=True)
    d = (b.gather(-1, idx) / -8.0).squeeze(-1).to(torch.float16)  # [N, nb]
    if fit:
        d = _fit_scales(b, d.float()).to(torch.float16)
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
    """A linear layer over 4-bit rows (``weight`` uint8 ``[N, K / 2]``, ``scale`` float16
    ``[N, K / 32]``), with an optional float ``bias`` ``[N]`` (Qwen2's q/k/v projections; None:
    none), stored as in the checkpoint under ``<name>.bias``."""

    def __init__(self, out_features: int, in_features: int, device: torch.device | str = "cpu",
                 bias: bool = False):
        super().__init__()
        if in_features % QK:
            raise ValueError(f"4-bit rows need a multiple of {QK} columns, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features // 2,
                                                   dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.empty(out_features, in_features // QK,
                                                  dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32, device=device)
                             if bias else None)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Q4Linear":
        """The 4-bit rows of ``w`` ``[N, K]`` (and ``bias`` ``[N]`` as it is)."""
        m = cls(w.shape[0], w.shape[1], w.device)
        m.weight, m.scale = quantize(w)
        m.bias = bias
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.scale)  # [..., N], a fresh tensor
        return y.add_(self.bias) if self.bias is not None else y


class Q4Embedding(nn.Module):
    """Token embedding over 4-bit rows (``weight`` uint8 ``[V, H / 2]``, ``scale`` float16
    ``[V, H / 32]``); ``embed_scale`` multiplies it as Gemma's scaled embedding does. A tied
    output layer shares the rows (:meth:`as_linear`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 embed_scale: float | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.embed_scale = padding_idx, embed_scale
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim // 2,
                                                   dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.empty(num_embeddings, embedding_dim // QK,
                                                  dtype=torch.float16, device=device))
        self.dtype = torch.float32

    def as_linear(self) -> Q4Linear:
        head = Q4Linear(0, self.embedding_dim, self.weight.device)
        head.out_features, head.weight, head.scale = self.num_embeddings, self.weight, self.scale
        return head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T] -> [B, T, H]
        flat = ids.reshape(-1)
        rows = dequantize(self.weight[flat], self.scale[flat]).to(self.dtype)
        rows = rows.view(*ids.shape, self.embedding_dim)
        return rows * self.embed_scale if self.embed_scale is not None else rows


def records_linear(x: torch.Tensor, rec: torch.Tensor, hidden: int) -> torch.Tensor:
    """The gate and up products of 4-bit neuron records (``rec`` uint8 ``[k, 27 * H / 16]``,
    layout of :func:`.pack.q4_records`): ``x [..., H]`` -> ``[..., k, 2]`` (gate, up)."""
    H, k = hidden, rec.shape[0]
    nib, ds = rec[:, :3 * H // 2], rec[:, 3 * H // 2:]
    out = []
    for r in (0, 1):  # gate, up: row views into the records, read in place
        d = ds[:, r * (H // 16):(r + 1) * (H // 16)].view(torch.float16)
        out.append(linear(x, nib[:, r * (H // 2):(r + 1) * (H // 2)], d))
    return torch.stack(out, dim=-1).view(*x.shape[:-1], k, 2)


def down_reference(a: torch.Tensor, nib: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The kernel's down product (``si_axpy_q4``) written in torch, its definition: the
    coefficients ``a[n] * d[n, b]`` quantized to int8 per group of 32 neurons (in order) and
    block ``b`` of H, as float32 like the kernel rounds them; integer sums with the 4-bit
    values; scaled per group and block (float64). ``a [m, k]``, ``nib [k, H / 2]``, ``d [k, H /
    32]`` float16 -> ``[m, H]`` float64."""
    k, H = nib.shape[0], nib.shape[1] * 2
    q = dequantize(nib, torch.ones_like(d)).double()  # [k, H] the 4-bit values
    c = a.float()[:, :, None] * d.float()[None]  # [m, k, nb]
    pad = -k % QK
    c = torch.cat([c, c.new_zeros(c.shape[0], pad, c.shape[2])], 1)
    c = c.view(c.shape[0], -1, QK, c.shape[2])  # [m, G, 32, nb]
    sc = c.abs().amax(2) / 127.0  # [m, G, nb]
    inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
    cq = torch.round(c * inv[:, :, None]).double()  # ties to even, like the kernel
    qg = torch.cat([q, q.new_zeros(pad, H)]).view(-1, QK, H // QK, QK)  # [G, 32, nb, 32]
    sums = torch.einsum("mgib,gibj->mgbj", cq, qg)  # exact integers
    return (sc.double()[..., None] * sums).sum(1).reshape(a.shape[0], H)


def records_down(a: torch.Tensor, rec: torch.Tensor, hidden: int) -> torch.Tensor:
    """The down product of 4-bit neuron records: ``a [..., k]`` (the neurons' activations) ->
    ``[..., H]`` = ``sum_n a[..., n] * down column n``: with the CPU kernel its integer product
    (:func:`down_reference`), without it (no compiler, CUDA) in float over the dequantized
    columns."""
    H, k = hidden, rec.shape[0]
    nib = rec[:, H:3 * H // 2]
    d = rec[:, 3 * H // 2 + H // 8:].view(torch.float16)  # [k, H / 32]
    kern = _kernel.kernel() if a.device.type == "cpu" else None
    if kern is None or rec.stride(1) != 1:
        return (a.float() @ dequantize(nib, d)).to(a.dtype)
    a2 = a.reshape(-1, k)
    if a2.dtype != torch.float32 or not a2.is_contiguous():
        a2 = a2.float().contiguous()
    y = torch.empty(a2.shape[0], H, dtype=torch.float32)
    rc = kern.lib.si_axpy_q4(a2.data_ptr(), a2.shape[0], k, nib.data_ptr(), d.data_ptr(),
                             nib.stride(0), d.stride(0), H, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"4-bit down product: hidden size {H} is not a multiple of {QK}")
    y = y.view(*a.shape[:-1], H)
    return y if a.dtype == torch.float32 else y.to(a.dtype)


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
