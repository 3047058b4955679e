"""4-bit rows in super-blocks of 256 (llama.cpp's Q4_K values): the quantizer and the product.

A row of ``K`` weights (``K`` a multiple of 64) is stored as ``K / 2`` bytes of nibbles and,
per super-block of up to 256 weights, a 16-byte head: float16 ``d`` and ``dmin``, then 12 bytes
holding a 6-bit scale ``sc`` and a 6-bit minimum ``m`` for each of its sub-blocks of 32
(llama.cpp's packing, :func:`pack_scales`). Weight ``i`` of sub-block ``j`` is
``d * sc[j] * q[i] - dmin * m[j]`` with ``q`` in ``[0, 15]``: an asymmetric block (a scale and
an offset), whose error is about a fifth below a symmetric one (Q4_0) of the same size, 4.5 bits
per weight. Nibbles: byte ``j`` of the 32 bytes of each 64 weights holds weight ``j`` in its low
nibble and weight ``j + 32`` in its high one (sub-block ``2c`` in the low, ``2c + 1`` in the
high nibbles of chunk ``c``), so both line up with activations in their natural order. A last
super-block of fewer than 256 weights (H = 640, 896) has fewer sub-blocks; its head is whole.

The quantizer (:func:`quantize`) is llama.cpp's ``make_qkx2_quants`` search: per sub-block the
scale and offset of least weighted squared error among 21 candidate scales (weights ``|w| +
rms``, or with ``importance`` per column, e.g. the mean square of the activations a row meets,
``importance * sqrt(sigma^2 + w^2)``), then the sub-block scales and offsets rounded to 6 bits
against the super-block's largest. The product runs in the C kernel (``si_linear_q4``:
activations quantized per block of 32 to int8, each sub-block's integer dot product with the
nibbles, ``d * sc`` and ``dmin * m * sum(x)`` applied per sub-block), else on the dequantized
rows. 4-bit neuron records (:func:`.pack.q4_records`) hold gate row, up row and down column as
such rows; :func:`records_linear` and :func:`records_down` are their products (the decode step
of a 4-bit model runs them inside the kernel's ``si_decode_layers``). On the x86 vector paths a
prompt-mode model holds them in groups of 32 slots, each group one stream in the order the
products read it (:func:`groups_pay`, :func:`group_io`, :func:`grouped_linear`,
:func:`grouped_down`; kernels/rows_q4g.c).
"""
from __future__ import annotations

import torch
from torch import nn

from . import kernel as _kernel

QK = 32  # weights per sub-block (and per block of the quantized activations)
QS = 256  # weights per super-block (one head)
HEAD = 16  # bytes of a super-block's head: d, dmin (float16), 12 bytes of 6-bit scales / mins
SEARCH_STEPS = 20  # candidate scales per sub-block beyond the first (make_qkx2_quants)


def row_bytes(k: int) -> tuple[int, int]:
    """(nibble bytes, head bytes) of one row of ``k`` weights."""
    return k // 2, -(-k // QS) * HEAD


def check_width(k: int) -> None:
    if k % (2 * QK):
        raise ValueError(f"4-bit rows need a multiple of {2 * QK} columns, got {k}")


def _fit_blocks(x: torch.Tensor, wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (``x``, ``wt`` ``[n, 32]``): the scale and the offset (>= 0, subtracted) of
    least weighted squared error with ``q`` in [0, 15] among ``SEARCH_STEPS + 1`` candidates
    around ``15 / (max - min)`` (llama.cpp's ``make_qkx2_quants``, rmin -1, rdelta 0.1)."""
    mn = x.amin(1).clamp(max=0.0)
    rng = x.amax(1) - mn
    flat = rng <= 0
    rng = torch.where(flat, torch.ones_like(rng), rng)
    sum_w, sum_x = wt.sum(1), (wt * x).sum(1)
    scale = rng / 15.0
    q = torch.round((x - mn[:, None]) / scale[:, None]).clamp_(0, 15)
    best_min = mn.clone()
    err = (wt * (scale[:, None] * q + mn[:, None] - x).square()).sum(1)
    for i in range(SEARCH_STEPS + 1):
        q = torch.round((x - mn[:, None]) * ((14.0 + 0.1 * i) / rng)[:, None]).clamp_(0, 15)
        sl, sl2, sxl = (wt * q).sum(1), (wt * q * q).sum(1), (wt * q * x).sum(1)
        det = sum_w * sl2 - sl * sl
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        ts = (sum_w * sxl - sum_x * sl) / det
        tm = (sl2 * sum_x - sl * sxl) / det
        pos = tm > 0  # an offset above zero: refit the scale alone
        ts = torch.where(pos, sxl / sl2.clamp_min(1e-30), ts)
        tm = torch.where(pos, torch.zeros_like(tm), tm)
        e = (wt * (ts[:, None] * q + tm[:, None] - x).square()).sum(1)
        better = ok & (e < err)
        err = torch.where(better, e, err)
        scale = torch.where(better, ts, scale)
        best_min = torch.where(better, tm, best_min)
    return torch.where(flat, torch.zeros_like(scale), scale), -best_min


def pack_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales and minimums ``[n, 8]`` -> ``[n, 12]`` bytes (llama.cpp's Q4_K packing:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 in the nibbles of bytes 8-11 and
    the top 2 bits of bytes 0-7)."""
    ls, lm = ls.to(torch.int32), lm.to(torch.int32)
    out = torch.zeros(ls.shape[0], 12, dtype=torch.int32)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 15) | ((lm[:, 4:8] & 15) << 4)
    return out.to(torch.uint8)


def unpack_scales(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 12]`` bytes -> 6-bit scales and minimums ``[n, 8]`` (int32)."""
    p = p.to(torch.int32)
    ls = torch.cat([p[:, 0:4] & 63, (p[:, 8:12] & 15) | ((p[:, 0:4] >> 6) << 4)], 1)
    lm = torch.cat([p[:, 4:8] & 63, (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)], 1)
    return ls, lm


def quantize(w: torch.Tensor, importance: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` -> ``(nibbles uint8 [N, K / 2], heads uint8 [N, ceil(K / 256) * 16])``;
    ``importance`` ``[K]`` (optional) weighs each column's squared error."""
    N, K = w.shape
    check_width(K)
    if N * K > 1 << 21:  # in row chunks: the search holds a few copies of the rows
        step = max(1, (1 << 21) // K)
        parts = [quantize(w[i:i + step], importance) for i in range(0, N, step)]
        return torch.cat([p for p, _ in parts]), torch.cat([h for _, h in parts])
    nsb = -(-K // QS)
    pad = nsb * QS - K
    wf = torch.nn.functional.pad(w.float(), (0, pad))  # [N, nsb * 256], a last partial one padded
    x = wf.reshape(-1, QK)  # sub-blocks
    if importance is None:
        wt = x.square().mean(1, keepdim=True).sqrt() + x.abs()
    else:
        imp = torch.nn.functional.pad(importance.float().clamp_min(0), (0, pad))
        xs = wf.view(N, nsb, QS)
        sigma2 = 2.0 * xs.square().sum(-1, keepdim=True) / QS
        wt = (imp.view(1, nsb, QS) * (sigma2 + xs.square()).sqrt()).reshape(-1, QK)
    sc, mn = _fit_blocks(x, wt)
    sc, mn = sc.view(N * nsb, 8), mn.view(N * nsb, 8)
    d = (sc.amax(1) / 63.0).half()
    dmin = (mn.amax(1) / 63.0).half()
    df, dmf = d.float()[:, None], dmin.float()[:, None]
    ls = torch.where(df > 0, torch.round(sc / torch.where(df > 0, df, 1.0)), 0.0).clamp_(0, 63)
    lm = torch.where(dmf > 0, torch.round(mn / torch.where(dmf > 0, dmf, 1.0)), 0.0).clamp_(0, 63)
    step = (df * ls).reshape(-1, 1)  # each sub-block's scale and offset as stored
    off = (dmf * lm).reshape(-1, 1)
    q = torch.where(step > 0, torch.round((x + off) / torch.where(step > 0, step, 1.0)), 0.0)
    q = q.clamp_(0, 15).to(torch.uint8).view(N, nsb * QS)[:, :K].reshape(N, K // 64, 2, 32)
    nib = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N, K // 2)
    head = torch.cat([torch.stack([d, dmin], 1).view(torch.uint8), pack_scales(ls, lm)], 1)
    return nib.contiguous(), head.reshape(N, nsb * HEAD).contiguous()


def dequantize(packed: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """The float32 rows ``[N, K]`` that :func:`quantize` stored."""
    N, K = packed.shape[0], packed.shape[1] * 2
    nsb = heads.shape[1] // HEAD
    h = heads.reshape(N * nsb, HEAD)
    dd = h[:, :4].contiguous().view(torch.float16).float()  # [N * nsb, 2]: d, dmin
    ls, lm = unpack_scales(h[:, 4:])
    step = (dd[:, :1] * ls).view(N, nsb * 8)[:, :K // QK]  # per sub-block
    off = (dd[:, 1:] * lm).view(N, nsb * 8)[:, :K // QK]
    p = packed.reshape(N, K // 64, 1, 32)
    q = torch.cat([p & 15, p >> 4], 2).reshape(N, K // QK, QK).float()
    return (q * step[..., None] - off[..., None]).reshape(N, K)


def linear(x: torch.Tensor, packed: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ dequantize(packed, heads).T`` -> ``[..., N]`` in ``x``'s dtype."""
    N, K = packed.shape[0], packed.shape[1] * 2
    k = _kernel.kernel() if x.device.type == "cpu" else None
    if k is None or packed.stride(1) != 1 or heads.stride(1) != 1:
        return nn.functional.linear(x, dequantize(packed, heads).to(x.dtype))
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)
    rc = k.lib.si_linear_q4(x2.data_ptr(), x2.shape[0], K, packed.data_ptr(), heads.data_ptr(),
                            N, packed.stride(0), heads.stride(0), y.data_ptr(),
                            torch.get_num_threads())
    if rc != 0:
        raise MemoryError("4-bit kernel: out of memory for the quantized activations")
    y = y.view(*x.shape[:-1], N)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


IL = 16  # rows per interleaved group (kernels/rows_q4il.c)
IL_PAYS = ("avx512vnni", "avx512bw", "avxvnni", "avx2")  # kernel paths with a vector il_group


def interleave(packed: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(nibbles [N, K / 2], heads [N, ceil(K / 256) * 16])`` -> the kernel's interleaved
    layout (rows_q4il.c), the same bytes: nibbles ``[N / 16, K / 64, 8, 16, 4]`` (group,
    sub-block pair, chunk, row, byte) as ``[N, K / 2]``, and per group and super-block the heads
    as planes: d[16], dmin[16] float16, then byte b of the 12 packed scale bytes of each row
    ``[12][16]``, as ``[N, ceil(K / 256) * 16]``."""
    N, K = packed.shape[0], packed.shape[1] * 2
    G, nsb = N // IL, heads.shape[1] // HEAD
    w = packed.reshape(G, IL, K // 64, 8, 4).permute(0, 2, 3, 1, 4).reshape(N, K // 2)
    h = heads.reshape(G, IL, nsb, 8, 2).permute(0, 2, 4, 3, 1)  # [g, s, byte of word, word, row]
    planes = torch.cat([h[:, :, :, :2].permute(0, 1, 3, 4, 2).reshape(G, nsb, 4 * IL),  # d, dmin
                        h[:, :, :, 2:].permute(0, 1, 3, 2, 4).reshape(G, nsb, 12 * IL)], 2)
    return w.contiguous(), planes.reshape(N, nsb * HEAD).contiguous()


def interleaved_rows(packed: torch.Tensor, heads: torch.Tensor, ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``ids`` of an interleaved matrix (:func:`interleave`) in the row layout (nibbles,
    heads)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    G, nsb = N // IL, heads.shape[1] // HEAD
    g, r = ids // IL, ids % IL
    nib = packed.view(G, K // 64, 8, IL, 4)[g, :, :, r].reshape(-1, K // 2)
    h = heads.view(G, nsb, HEAD, IL)[g]  # [n, nsb, 16 (byte of the row's head), 16 (row)]
    at = torch.arange(len(ids))
    dd = h[:, :, :4].view(-1, nsb, 2, IL, 2)[at, :, :, r].reshape(-1, nsb, 4)  # d, dmin bytes
    return nib, torch.cat([dd, h[at, :, 4:, r]], 2).reshape(-1, nsb * HEAD)


def interleaved_linear(x: torch.Tensor, packed: torch.Tensor, heads: torch.Tensor
                       ) -> torch.Tensor:
    """:func:`linear` over an interleaved matrix (:func:`interleave`; the CPU kernel)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    k = _kernel.kernel()
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)
    rc = k.lib.si_linear_q4il(x2.data_ptr(), x2.shape[0], K, packed.data_ptr(), heads.data_ptr(),
                              N, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("4-bit kernel: out of memory for the quantized activations")
    y = y.view(*x.shape[:-1], N)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


class Q4Linear(nn.Module):
    """A linear layer over 4-bit rows (``weight`` uint8 ``[N, K / 2]``, ``scale`` uint8 heads
    ``[N, ceil(K / 256) * 16]``), with an optional float ``bias`` ``[N]`` (Qwen2's q/k/v
    projections; None: none), stored as in the checkpoint under ``<name>.bias``."""

    def __init__(self, out_features: int, in_features: int, device: torch.device | str = "cpu",
                 bias: bool = False):
        super().__init__()
        check_width(in_features)
        self.in_features, self.out_features = in_features, out_features
        nib, head = row_bytes(in_features)
        self.register_buffer("weight", torch.empty(out_features, nib, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("scale", torch.empty(out_features, head, dtype=torch.uint8,
                                                  device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32, device=device)
                             if bias else None)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Q4Linear":
        """The 4-bit rows of ``w`` ``[N, K]`` (and ``bias`` ``[N]`` as it is)."""
        m = cls(w.shape[0], w.shape[1], w.device)
        m.weight, m.scale = quantize(w)
        m.bias = bias
        return m

    interleaved = False  # weight and scale in the kernel's interleaved layout (interleave_)

    def interleave_(self) -> bool:
        """Hold the rows in the CPU kernel's interleaved layout (:func:`interleave`) where it
        pays (an x86 vector path, rows a multiple of 16, on the CPU); whether they are."""
        k = _kernel.kernel() if self.weight.device.type == "cpu" else None
        if not self.interleaved and k is not None and k.isa in IL_PAYS \
                and self.out_features % IL == 0 and self.out_features > 0:
            self.weight, self.scale = interleave(self.weight, self.scale)
            self.interleaved = True
        return self.interleaved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (interleaved_linear(x, self.weight, self.scale) if self.interleaved
             else linear(x, self.weight, self.scale))  # [..., N], a fresh tensor
        return y.add_(self.bias) if self.bias is not None else y


class Q4Embedding(nn.Module):
    """Token embedding over 4-bit rows (``weight`` uint8 ``[V, H / 2]``, ``scale`` uint8 heads
    ``[V, ceil(H / 256) * 16]``); ``embed_scale`` multiplies it as Gemma's scaled embedding
    does. A tied output layer shares the rows (:meth:`as_linear`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 embed_scale: float | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        check_width(embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.embed_scale = padding_idx, embed_scale
        nib, head = row_bytes(embedding_dim)
        self.register_buffer("weight", torch.empty(num_embeddings, nib, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("scale", torch.empty(num_embeddings, head, dtype=torch.uint8,
                                                  device=device))
        self.dtype = torch.float32

    interleaved = False  # the rows of an interleaved tied output layer (interleave_q4_layers)

    def as_linear(self) -> Q4Linear:
        head = Q4Linear(0, self.embedding_dim, self.weight.device)
        head.out_features, head.weight, head.scale = self.num_embeddings, self.weight, self.scale
        head.interleaved = self.interleaved
        return head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T] -> [B, T, H]
        flat = ids.reshape(-1)
        nib, heads = (interleaved_rows(self.weight, self.scale, flat) if self.interleaved
                      else (self.weight[flat], self.scale[flat]))
        rows = dequantize(nib, heads).to(self.dtype)
        rows = rows.view(*ids.shape, self.embedding_dim)
        return rows * self.embed_scale if self.embed_scale is not None else rows


def interleave_q4_layers(model: nn.Module) -> int:
    """Hold every 4-bit linear layer of ``model`` (the attention projections and the output
    layer; the neuron records stay rows) in the kernel's interleaved layout where it pays
    (:meth:`Q4Linear.interleave_`), a token embedding tied to the output layer reading its rows
    back from the same bytes (one copy); the number of layers interleaved. The output layer is
    the largest product of a decode step (Qwen2.5 1.5B: 131 of ~950 MB)."""
    emb = model.get_input_embeddings()
    n = 0
    for mod in model.modules():
        if isinstance(mod, Q4Linear):
            rows = mod.weight
            if mod.interleave_():
                n += 1
                if isinstance(emb, Q4Embedding) and emb.weight is rows:
                    emb.weight, emb.scale, emb.interleaved = mod.weight, mod.scale, True
    return n


def record_parts(rec: torch.Tensor, hidden: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``r`` (0 gate, 1 up, 2 down column) of 4-bit neuron records ``rec`` (layout of
    :func:`.pack.q4_records`) as views: (nibbles ``[k, H / 2]``, heads ``[k, nsb * 16]``)."""
    nib, head = row_bytes(hidden)
    return (rec[:, r * nib:(r + 1) * nib],
            rec[:, 3 * nib + r * head:3 * nib + (r + 1) * head])


def records_linear(x: torch.Tensor, rec: torch.Tensor, hidden: int) -> torch.Tensor:
    """The gate and up products of 4-bit neuron records (``rec`` uint8 ``[k, record bytes]``,
    layout of :func:`.pack.q4_records`): ``x [..., H]`` -> ``[..., k, 2]`` (gate, up)."""
    k = rec.shape[0]
    out = [linear(x, *record_parts(rec, hidden, r)) for r in (0, 1)]  # row views, read in place
    return torch.stack(out, dim=-1).view(*x.shape[:-1], k, 2)


def down_reference(a: torch.Tensor, nib: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """The kernel's down product (``si_axpy_q4``) written in torch, its definition: for each
    group of 32 neurons (in order) and sub-block ``b`` of H, the coefficients ``a[n] * d[n] *
    sc[n, b]`` quantized to int8 (a float32 scale per group and sub-block, as the kernel rounds
    them) times the nibbles, summed exactly; then ``- sum_n a[n] * dmin[n] * m[n, b]`` per
    sub-block. ``a [m, k]``, ``nib [k, H / 2]``, ``heads [k, nsb * 16]`` -> ``[m, H]``
    float64."""
    k, H = nib.shape[0], nib.shape[1] * 2
    nsb = heads.shape[1] // HEAD
    h = heads.reshape(k * nsb, HEAD)
    dd = h[:, :4].contiguous().view(torch.float16).float()
    ls, lm = unpack_scales(h[:, 4:])
    step = (dd[:, :1] * ls).view(k, nsb * 8)[:, :H // QK]  # [k, nb] float32
    off = (dd[:, 1:] * lm).view(k, nsb * 8)[:, :H // QK]
    p = nib.reshape(k, H // 64, 1, 32).to(torch.int64)
    q = torch.cat([p & 15, p >> 4], 2).reshape(k, H // QK, QK).double()  # [k, nb, 32]
    c = a.float()[:, :, None] * step[None]  # [m, k, nb]
    pad = -k % QK
    c = torch.cat([c, c.new_zeros(c.shape[0], pad, c.shape[2])], 1)
    c = c.view(c.shape[0], -1, QK, c.shape[2])  # [m, G, 32, nb]
    sc = c.abs().amax(2) / 127.0  # [m, G, nb]
    inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
    cq = torch.round(c * inv[:, :, None]).double()  # ties to even, like the kernel
    qg = torch.cat([q, q.new_zeros(pad, H // QK, QK)]).view(-1, QK, H // QK, QK)  # [G, 32, nb, 32]
    sums = torch.einsum("mgib,gibj->mgbj", cq, qg)  # exact integers
    mins = (a.double() @ off.double())  # [m, nb]
    y = (sc.double()[..., None] * sums).sum(1) - mins[..., None]
    return y.reshape(a.shape[0], H)


def records_down(a: torch.Tensor, rec: torch.Tensor, hidden: int) -> torch.Tensor:
    """The down product of 4-bit neuron records: ``a [..., k]`` (the neurons' activations) ->
    ``[..., H]`` = ``sum_n a[..., n] * down column n``: with the CPU kernel its integer product
    (:func:`down_reference`), without it (no compiler, CUDA) in float over the dequantized
    columns."""
    H, k = hidden, rec.shape[0]
    nib, heads = record_parts(rec, hidden, 2)
    kern = _kernel.kernel() if a.device.type == "cpu" else None
    if kern is None or rec.stride(1) != 1:
        return (a.float() @ dequantize(nib, heads)).to(a.dtype)
    a2 = a.reshape(-1, k)
    if a2.dtype != torch.float32 or not a2.is_contiguous():
        a2 = a2.float().contiguous()
    y = torch.empty(a2.shape[0], H, dtype=torch.float32)
    rc = kern.lib.si_axpy_q4(a2.data_ptr(), a2.shape[0], k, nib.data_ptr(), heads.data_ptr(),
                             nib.stride(0), heads.stride(0), H, y.data_ptr(),
                             torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"4-bit down product: hidden size {H} is not a multiple of 64")
    y = y.view(*a.shape[:-1], H)
    return y if a.dtype == torch.float32 else y.to(a.dtype)


GS = 32  # slots per group of grouped records (kernels/rows_q4g.c)


def groups_pay(device: torch.device | str) -> bool:
    """Whether 4-bit neuron records on ``device`` are held in the kernel's groups of 32 slots
    (:class:`..selection.selective_mlp.Slots` ``grouped``; kernels/rows_q4g.c): on the CPU, where
    the kernel is built and its path gains from them (``si_q4g_pays``: the x86 vector paths)."""
    k = _kernel.kernel() if torch.device(device).type == "cpu" else None
    return k is not None and bool(k.lib.si_q4g_pays())


def empty_groups(k: int, hidden: int) -> torch.Tensor:
    """Room for ``k`` records in groups: ``uint8 [si_q4g_bytes(k, H)]``, zero (a partial last
    group's unused slots compute 0)."""
    return torch.zeros(_kernel.kernel().lib.si_q4g_bytes(k, hidden), dtype=torch.uint8)


def group_io(name: str, groups: torch.Tensor, k: int, hidden: int, ids: torch.Tensor,
             recs: torch.Tensor | None = None) -> torch.Tensor:
    """Slots ``ids`` of ``k`` records held in groups: ``name`` "get" reads them as records
    (uint8 ``[n, record bytes]``, :func:`.pack.q4_records`' layout, the bytes exactly), "put"
    writes ``recs`` there (and returns it)."""
    ids = ids.to(device="cpu", dtype=torch.int64).contiguous()
    nib, head = row_bytes(hidden)
    if recs is None:
        recs = torch.empty(ids.numel(), 3 * (nib + head), dtype=torch.uint8)
    recs = recs.contiguous()
    if ids.numel() and getattr(_kernel.kernel().lib, f"si_q4g_{name}")(
            groups.data_ptr(), k, hidden, ids.data_ptr(), ids.numel(), recs.data_ptr()) != 0:
        raise IndexError(f"grouped records {name}: an id out of range for {k} slots")
    return recs


def grouped_linear(x: torch.Tensor, groups: torch.Tensor, k: int, hidden: int) -> torch.Tensor:
    """:func:`records_linear` over the first ``k`` slots of grouped records: ``x [..., H]`` ->
    ``[..., k, 2]`` (gate, up)."""
    x2 = x.reshape(-1, hidden)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    out = torch.empty(x2.shape[0], k, 2, dtype=torch.float32)
    if k and x2.shape[0] and _kernel.kernel().lib.si_q4g_linear(
            x2.data_ptr(), x2.shape[0], hidden, groups.data_ptr(), k, out.data_ptr(),
            torch.get_num_threads()) != 0:
        raise MemoryError("4-bit kernel: out of memory for the quantized activations")
    out = out.view(*x.shape[:-1], k, 2)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def grouped_down(a: torch.Tensor, groups: torch.Tensor, k: int, hidden: int) -> torch.Tensor:
    """:func:`records_down` over the first ``k`` slots of grouped records (the same sums): ``a
    [..., k]`` -> ``[..., H]``."""
    a2 = a.reshape(-1, k)
    if a2.dtype != torch.float32 or not a2.is_contiguous():
        a2 = a2.float().contiguous()
    y = torch.zeros(a2.shape[0], hidden, dtype=torch.float32)
    if k and a2.shape[0] and _kernel.kernel().lib.si_q4g_down(
            a2.data_ptr(), a2.shape[0], k, groups.data_ptr(), hidden, y.data_ptr(),
            torch.get_num_threads()) != 0:
        raise ValueError(f"4-bit down product: hidden size {hidden} is not a multiple of 64")
    y = y.view(*a.shape[:-1], hidden)
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
