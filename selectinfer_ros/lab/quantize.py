"""Weight-only int8 / int4 quantization with PyTorch's own CPU kernels (the quantization baseline).

int8: per output channel symmetric scales, ``torch._weight_int8pack_mm`` (bf16 activations).
int4: per group (128) asymmetric, ``aten._weight_int4pack_mm_for_cpu`` (as gpt-fast does).
Every ``nn.Linear`` of the model is replaced (attention, FFN and the output layer).
"""
from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).to(torch.int8))
        # The kernel's float32 path ran 11x slower than its bfloat16 one here: compute in bf16.
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.scales)
        return y.to(dtype).view(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, groupsize: int = 128):
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        n, k = w.shape
        if k % groupsize:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {groupsize}")
        g = w.view(n, k // groupsize, groupsize)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15.0).clamp_min(1e-8)  # [N, K/g]
        zeros = lo + scales * 8.0
        q = torch.clamp(torch.round((g - lo[..., None]) / scales[..., None]), 0, 15)
        q = q.view(n, k).to(torch.int32)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
        sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.groupsize, self.out_features = groupsize, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.groupsize,
            self.scales_and_zeros)
        return y.to(dtype).view(*shape[:-1], self.out_features)


def quantize_model(model: nn.Module, bits: int) -> nn.Module:
    """Replace every ``nn.Linear`` (in place) with its int8 or int4 weight-only version."""
    cls = {8: Int8Linear, 4: Int4Linear}[bits]
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, child_name, cls(child))
    return model
