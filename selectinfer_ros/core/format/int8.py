"""int8 weights: per-row quantization, and the matrix products that read them.

A weight row (a gate or up row, a down column, an attention or output row) is stored as int8
with one float32 scale: ``w ~= q * scale``, ``|q| <= 127``. On CPUs the product runs in a small C
kernel of this package (``kernels/kernel.c``: activations quantized per block of 32 like
llama.cpp's Q8_0, int8 dot products with the best instructions the CPU has), built and checked
by :mod:`.kernel` and called through ctypes; the same library runs a whole decode step of an
int8 model (:class:`.decode.NativeInt8Step`). Where it cannot be built (no compiler) or breaks
the contract, and on accelerators, the fallback dequantizes the rows it needs and uses the
float matmul.
"""
from __future__ import annotations

import torch
from torch import nn

from . import kernel as _kernel


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(q [N, K] int8, scale [N] float32)`` with ``w ~= q * scale``."""
    w = w.float()
    scale = w.abs().amax(dim=-1).clamp_min(1e-30) / 127.0
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def kernel():
    """The compiled kernel library (ctypes), or None (the reason is in :func:`kernel_status`)."""
    k = _kernel.kernel()
    return k.lib if k is not None else None


def kernel_status() -> str:
    """Which int8 path CPU products take: the kernel and its instruction set, or the float
    fallback and why."""
    return _kernel.status()


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ (q [N, K] * scale [N, None]).T`` -> ``[..., N]`` in ``x``'s dtype. ``q`` may be
    a column prefix of wider rows (row stride > K): the kernel reads only those bytes."""
    K, N = q.shape[1], q.shape[0]
    lib = kernel() if x.device.type == "cpu" else None
    if lib is None or q.stride(1) != 1:
        w = q.to(x.dtype)
        y = nn.functional.linear(x, w)
        return y * scale.to(x.dtype) if scale is not None else y
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)
    rc = lib.si_linear_i8(x2.data_ptr(), x2.shape[0], K, q.data_ptr(), N, q.stride(0),
                          scale.data_ptr() if scale is not None else None, y.data_ptr(),
                          torch.get_num_threads())
    if rc != 0:
        raise MemoryError("int8 kernel: out of memory for the quantized activations")
    y = y.view(*x.shape[:-1], N)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def tiles_pay(device: torch.device | str) -> bool:
    """Whether int8 rows on ``device`` are held as the kernel's tiles (:func:`tiles_of`): on the
    CPU, where the kernel is built and its path gains from them (``si_tile_pays``)."""
    lib = kernel() if torch.device(device).type == "cpu" else None
    return lib is not None and bool(lib.si_tile_pays())


def empty_tiles(N: int, K: int) -> torch.Tensor:
    """Room for an ``[N, K]`` int8 matrix as tiles: ``uint8 [si_tile_bytes(N, K)]`` (16 rows
    interleaved four columns at a time, zero padded to whole tiles and blocks of 32)."""
    return torch.zeros(kernel().si_tile_bytes(N, K), dtype=torch.uint8)


def tiles_of(q: torch.Tensor) -> torch.Tensor | None:
    """``q [N, K]`` int8 rows in the kernel's tile layout (``si_tile_pack``), or None where the
    tiles do not pay (:func:`tiles_pay`)."""
    if not tiles_pay(q.device) or q.stride(1) != 1:
        return None
    N, K = q.shape
    tiles = empty_tiles(N, K)
    kernel().si_tile_pack(q.data_ptr(), N, K, q.stride(0), tiles.data_ptr(),
                          torch.get_num_threads())
    return tiles


def tile_io(name: str, tiles: torch.Tensor, N: int, K: int, ids: torch.Tensor,
            rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows or columns ``ids`` of the ``[N, K]`` matrix held as ``tiles``: ``name`` "rows" /
    "cols" reads them (``[n, K]`` / ``[n, N]`` int8), "put_rows" / "put_cols" writes ``rows``
    there (and returns it)."""
    ids = ids.to(torch.int64).contiguous()
    put = name.startswith("put")
    if rows is None:
        rows = torch.empty(ids.numel(), K if name.endswith("rows") else N, dtype=torch.int8)
    rows = rows.contiguous()
    fn = getattr(kernel(), f"si_tile_{name}")
    if fn(tiles.data_ptr(), N, K, ids.data_ptr(), ids.numel(), rows.data_ptr()) != 0:
        raise IndexError(f"tiles {name}: an id out of range for an [{N}, {K}] matrix")
    return rows


def tile_linear(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor | None, N: int,
                ldk: int | None = None) -> torch.Tensor:
    """``x [..., K] @ (rows * scale).T`` -> ``[..., N]`` over the first ``N`` rows and ``K``
    columns of an ``[>= N, ldk]`` matrix held as :func:`tiles_of` (``ldk`` None: ``K``)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    # the kernel writes every output; with no columns the product is zero
    y = (torch.empty if K else torch.zeros)(x2.shape[0], N, dtype=torch.float32)
    lib = kernel()
    if K and x2.shape[0] and lib.si_tile_linear(
            x2.data_ptr(), x2.shape[0], K, tiles.data_ptr(), N, K if ldk is None else ldk,
            scale.data_ptr() if scale is not None else None, y.data_ptr(),
            torch.get_num_threads()) != 0:
        raise MemoryError("int8 kernel: out of memory for the quantized activations")
    y = y.view(*x.shape[:-1], N)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer over int8 rows and their scales (``weight`` ``[N, K]`` int8, ``scale``
    ``[N]`` float32), with an optional float ``bias`` ``[N]`` (Qwen2's q/k/v projections; None:
    none), stored as in the checkpoint under ``<name>.bias``."""

    def __init__(self, out_features: int, in_features: int, device: torch.device | str = "cpu",
                 bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8,
                                                   device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32, device=device)
                             if bias else None)

    tiled = False  # weight holds the rows as tiles (to_tiles), not [N, K]

    def to_tiles(self) -> bool:
        """Hold the rows in the kernel's tile layout from now on (in place: the rows' tensor is
        dropped), where that pays on this CPU; True if it did."""
        tiles = None if self.tiled else tiles_of(self.weight)
        if tiles is None:
            return False
        self.weight, self.tiled = tiles, True
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (tile_linear(x, self.weight, self.scale, self.out_features) if self.tiled
             else linear(x, self.weight, self.scale))  # [..., N], a fresh tensor
        return y.add_(self.bias) if self.bias is not None else y


class Int8Embedding(nn.Module):
    """Token embedding over int8 rows (``weight`` ``[V, H]`` int8, ``scale`` ``[V]`` float32);
    ``embed_scale`` multiplies it as Gemma's scaled embedding does. A tied output layer shares
    the rows (:meth:`as_linear`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 embed_scale: float | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.embed_scale = padding_idx, embed_scale
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8,
                                                   device=device))
        self.register_buffer("scale", torch.empty(num_embeddings, dtype=torch.float32, device=device))
        self.dtype = torch.float32

    def as_linear(self) -> Int8Linear:
        head = Int8Linear(0, self.embedding_dim, self.weight.device)
        head.out_features, head.weight, head.scale = self.num_embeddings, self.weight, self.scale
        return head

    tiled = False  # weight holds the rows as tiles (a tied output layer's, see tie_tiles)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T] -> [B, T, H]
        if self.tiled:
            q = tile_io("rows", self.weight, self.num_embeddings, self.embedding_dim,
                        ids.reshape(-1)).view(*ids.shape, self.embedding_dim)
        else:
            q = self.weight[ids]
        rows = q.to(self.dtype) * self.scale[ids].unsqueeze(-1).to(self.dtype)
        return rows * self.embed_scale if self.embed_scale is not None else rows


def tile_int8_layers(model: nn.Module) -> int:
    """Hold every int8 linear layer of ``model`` (the attention projections and the output
    layer: the neuron records stay rows, a task switch rewrites them) in the kernel's tile
    layout, and a token embedding tied to the output layer reads its rows back from the same
    tiles (one copy); the number of layers tiled (0 where the tiles do not pay). The output
    layer is the largest product of a decode step (Gemma 3 270M: 168 of 260 MB), read whole
    for every token: the tiles read it as one stream."""
    emb = model.get_input_embeddings()
    tied = getattr(model.get_output_embeddings(), "weight", None)
    n = 0
    for mod in model.modules():
        if isinstance(mod, Int8Linear):
            rows = mod.weight
            if mod.to_tiles():
                n += 1
                if isinstance(emb, Int8Embedding) and emb.weight is rows and rows is tied:
                    emb.weight, emb.tiled = mod.weight, True
    return n
