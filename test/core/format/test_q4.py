"""4-bit rows in blocks of 32: the quantizer's error bound and layout, the kernel's product
against the float product of the dequantized rows, and the fallback without the kernel."""
from __future__ import annotations

import pytest
import torch

from selectinfer_ros.core.format import kernel, q4


def test_quantize_round_trips_within_half_a_step_and_keeps_each_block_peak():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 96, generator=g) * torch.rand(37, 1, generator=g)
    packed, d = q4.quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 48)
    assert d.dtype == torch.float16 and d.shape == (37, 3)
    back = q4.dequantize(packed, d)
    step = d.float().abs().repeat_interleave(32, dim=1)
    err = (back - w).abs()
    # half a step, but for weights opposite the peak beyond 7 steps: clamped, within one step
    assert bool((err <= step + 1e-7).all())
    assert float((err <= step / 2 + 1e-3 * step + 1e-7).float().mean()) > 0.99
    peak = w.reshape(37, 3, 32).abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.reshape(37, 3, 32).gather(-1, peak),
                          w.reshape(37, 3, 32).gather(-1, peak), rtol=1e-3)  # float16 scale
    # 4.5 bits per weight: 16 bytes of nibbles and a 2-byte scale per 32 weights
    assert packed.nbytes + d.nbytes == 37 * 96 * 4.5 / 8
    # layout: byte j of a block holds weight j (low nibble) and j + 16 (high), as q + 8
    one = torch.zeros(1, 32)
    one[0, 3], one[0, 19] = -8.0, 7.0
    p, s = q4.quantize(one)
    assert float(s[0, 0]) == 1.0 and int(p[0, 3]) == 0 + (15 << 4) and int(p[0, 0]) == 8 | (8 << 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4.quantize(torch.zeros(2, 40))


@pytest.mark.parametrize("n,k,m", [(7, 64, 3), (300, 640, 1), (130, 2048, 5), (33, 32, 2)])
def test_kernel_matches_the_float_product_of_the_dequantized_rows(n, k, m):
    assert kernel.kernel() is not None, kernel.status()
    g = torch.Generator().manual_seed(n + k)
    packed, d = q4.quantize(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    y, ref = q4.linear(x, packed, d), x @ q4.dequantize(packed, d).T
    # activations quantized per block of 32 to 8 bits: well under 1% of the output range
    assert float((y - ref).abs().max() / ref.abs().max()) < 0.01
    layer = q4.Q4Linear.from_float(torch.randn(n, k, generator=g))
    assert torch.allclose(layer(x.view(m, 1, k)).view(m, n),
                          x @ q4.dequantize(layer.weight, layer.scale).T,
                          atol=0.01 * float(ref.abs().max()) + 1e-3, rtol=0.05)


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates()])
def test_every_path_of_this_cpu_equals_the_plain_c_path(isa):
    plain, k = kernel.load(isa="plain"), kernel.load(isa=isa)
    g = torch.Generator().manual_seed(3)
    for n, kk, m in [(7, 64, 3), (64, 640, 1), (33, 96, 2), (130, 2048, 2)]:
        packed, d = q4.quantize(torch.randn(n, kk, generator=g))
        x = torch.randn(m, kk, generator=g)
        out = {}
        for name, lib, threads in (("plain", plain, 1), (isa, k, 1), (isa + "/2", k, 2)):
            y = torch.empty(m, n)
            assert lib.lib.si_linear_q4(x.data_ptr(), m, kk, packed.data_ptr(), d.data_ptr(), n,
                                        packed.stride(0), d.stride(0), y.data_ptr(), threads) == 0
            out[name] = y
        want = out["plain"]
        for name, y in out.items():
            assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), name


def test_coarse_fine_output_layer_is_exact_on_its_candidates():
    from selectinfer_ros.core.format import int8
    g = torch.Generator().manual_seed(9)
    exact = int8.Int8Linear(500, 64)
    exact.weight, exact.scale = int8.quantize_rows(torch.randn(500, 64, generator=g))
    head = q4.CoarseFineLinear(exact, candidates=16)
    x = torch.randn(3, 1, 64, generator=g)
    got, want = head(x), exact(x)
    coarse = head.coarse(x)
    assert got.shape == want.shape == (3, 1, 500)
    for r in range(3):
        top = torch.topk(coarse[r, 0], 16).indices
        assert torch.equal(got[r, 0, top], want[r, 0, top])  # the candidates: the int8 rows
        rest = torch.ones(500, dtype=torch.bool)
        rest[top] = False
        assert torch.equal(got[r, 0, rest], coarse[r, 0, rest])  # the others: the 4-bit rows
        assert int(got[r, 0].argmax()) == int(want[r, 0].argmax())
    every = q4.CoarseFineLinear(exact, candidates=500)
    assert torch.equal(every(x), want)
