"""4-bit rows in super-blocks (Q4_K values): the quantizer's error bound and layout, the kernel's product
against the float product of the dequantized rows, and the fallback without the kernel."""
from __future__ import annotations

import pytest
import torch

from selectinfer_ros.core.format import kernel, q4


def _steps(w: torch.Tensor) -> torch.Tensor:
    """Per sub-block of 32 of ``w`` ``[N, K]``, the step of a 4-bit grid over its range (with 0):
    ``(max - min(min, 0)) / 15`` ``[N, K / 32, 1]``."""
    b = w.reshape(w.shape[0], -1, 32)
    return (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True).clamp(max=0)) / 15


def test_quantize_round_trips_within_a_step_and_lays_out_llama_cpp_q4_k_values():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 640, generator=g) * torch.rand(37, 1, generator=g)  # 2.5 super-blocks
    packed, heads = q4.quantize(w)
    assert packed.dtype == heads.dtype == torch.uint8
    assert packed.shape == (37, 320) and heads.shape == (37, 3 * 16)
    err = (q4.dequantize(packed, heads) - w).abs().reshape(37, 20, 32)
    step = _steps(w)
    assert bool((err <= step + 1e-6).all())  # the fitted scale and offset: within one step
    assert float((err <= 0.5 * step + 1e-6).float().mean()) > 0.97
    # 4.5 bits per weight in whole super-blocks: 128 bytes of nibbles and a 16-byte head
    p2, h2 = q4.quantize(w[:, :512])
    assert p2.nbytes + h2.nbytes == 37 * 512 * 4.5 / 8
    # a row on a 4-bit grid (step 0.5 from -2) comes back exactly, nibbles in Q4_K's order: byte
    # j holds weight j (low nibble, sub-block 0) and weight j + 32 (high, sub-block 1)
    q = (torch.arange(64) * 7) % 16
    grid = (q.float() * 0.5 - 2.0).view(1, 64)
    p, h = q4.quantize(grid)
    assert torch.allclose(q4.dequantize(p, h), grid, atol=2e-3)
    assert torch.equal(p[0], (q[:32] | (q[32:] << 4)).to(torch.uint8))
    ls, lm = q4.unpack_scales(h[:, 4:])
    assert int(ls[0, :2].max()) == 63 and int(lm[0, 0]) == int(lm[0, 1]) == 63
    for sc in (torch.randint(0, 64, (50, 8), generator=g), torch.full((1, 8), 63)):
        mn = torch.randint(0, 64, sc.shape, generator=g)
        assert all(torch.equal(a, b) for a, b in zip(q4.unpack_scales(q4.pack_scales(sc, mn)),
                                                     (sc, mn)))
    with pytest.raises(ValueError, match="multiple of 64"):
        q4.quantize(torch.zeros(2, 96))


def test_the_search_beats_the_range_grid_and_importance_moves_the_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 256, generator=g) * torch.rand(300, 1, generator=g)
    w[::7, 5] *= 6.0  # some sub-blocks with an outlier
    packed, heads = q4.quantize(w)
    fitted = (q4.dequantize(packed, heads) - w).square().sum()
    # the plain grid: each sub-block's range in 15 steps from its minimum, nearest values
    b = w.reshape(300, -1, 32)
    lo, step = b.amin(-1, keepdim=True).clamp(max=0), _steps(w)
    grid = (torch.round((b - lo) / step).clamp(0, 15) * step + lo).reshape(300, 256)
    assert float(fitted) < 0.9 * float((grid - w).square().sum())
    # importance on the first 16 columns of every sub-block: their error falls, the rest's rises
    imp = torch.ones(256)
    imp.view(8, 32)[:, :16] = 100.0
    pi, hi = q4.quantize(w, imp)
    e0 = (q4.dequantize(packed, heads) - w).square().view(300, 8, 32)
    e1 = (q4.dequantize(pi, hi) - w).square().view(300, 8, 32)
    assert float(e1[..., :16].sum()) < 0.9 * float(e0[..., :16].sum())
    assert float(e1[..., 16:].sum()) > float(e0[..., 16:].sum())
    # chunked (rows beyond 2^21 weights) equals one piece
    big = torch.randn(40000, 64, generator=g)
    p1, d1 = q4.quantize(big)
    p2, d2 = q4.quantize(big[:20000])
    assert torch.equal(p1[:20000], p2) and torch.equal(d1[:20000], d2)


@pytest.mark.parametrize("n,k,m", [(7, 64, 3), (300, 640, 1), (130, 2048, 5), (33, 128, 2),
                                   (9, 448, 2), (5, 192, 3)])  # partial super-blocks
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


def test_q4_linear_with_a_bias_adds_it_to_the_product():
    """Qwen2's q/k/v projections as 4-bit rows: the product of the dequantized rows plus the
    float bias, a buffer named ``bias`` (the checkpoint's ``<name>.bias``)."""
    g = torch.Generator().manual_seed(12)
    w, b = torch.randn(40, 128, generator=g), torch.randn(40, generator=g) * 5.0
    layer = q4.Q4Linear.from_float(w, b)
    assert set(layer.state_dict()) == {"weight", "scale", "bias"}
    assert set(q4.Q4Linear(40, 128).state_dict()) == {"weight", "scale"}
    empty = q4.Q4Linear(40, 128, bias=True)
    assert empty.bias.shape == (40,) and empty.bias.dtype == torch.float32
    x = torch.randn(3, 1, 128, generator=g)
    ref = x.view(3, 128) @ q4.dequantize(layer.weight, layer.scale).T  # [3, 40]
    want = ref + b
    y = layer(x)
    assert y.shape == (3, 1, 40)
    tol = 0.01 * float(want.abs().max())  # activations quantized per block of 32 to 8 bits
    assert float((y.view(3, 40) - want).abs().max()) < tol
    assert float((y.view(3, 40) - ref).abs().max()) > 10 * tol  # the bias is there


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates()])
def test_every_path_of_this_cpu_equals_the_plain_c_path(isa):
    plain, k = kernel.load(isa="plain"), kernel.load(isa=isa)
    g = torch.Generator().manual_seed(3)
    # sub-blocks: 2 (a partial super-block alone), 20 (two whole ones and a partial one), 6,
    # 64, 14, 10, and a tiny model's rows against 24 activation rows
    for n, kk, m in [(7, 64, 3), (64, 640, 1), (33, 192, 2), (130, 2048, 2), (9, 448, 3),
                     (11, 320, 2), (64, 64, 24)]:
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


# -- 4-bit neuron records (pack --weights q4) ----------------------------------------------
def test_down_product_quantizes_the_coefficients_and_sums_exactly():
    """The down columns of 4-bit records: integer sums over groups of 32 neurons of int8
    coefficients (per group and sub-block of H) times the 4-bit weights, less the sub-blocks'
    minimums, so equal to that computation written in torch (``q4.down_reference``) to float
    rounding, within 1.5 % of the float64 product of the dequantized columns (3 % beside an
    outlier coefficient), on 1 and 2 threads, from a prefix of the records read in place."""
    from selectinfer_ros.core.format.pack import q4_record_rows, q4_records
    g = torch.Generator().manual_seed(5)
    H, I = 320, 80  # a partial super-block
    rec = q4_records(torch.randn(I, H, generator=g), torch.randn(I, H, generator=g),
                     torch.randn(H, I, generator=g))
    assert rec.shape == (I, 3 * (H // 2 + 2 * 16))
    rows = q4_record_rows(rec, H)  # [I, 3, H]
    a = torch.randn(3, 70, generator=g)  # two groups of 32 and a partial one
    a[0, 40] = 50.0  # one large coefficient: the others of its group lose precision, not more
    exact = a.double() @ rows[:70, 2].double()
    want = q4.down_reference(a, *q4.record_parts(rec[:70], H, 2))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got = q4.records_down(a, rec[:70], H)
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
        err = (got.double() - exact).abs().amax(1) / exact.abs().amax(1)
        assert float(err[0]) < 0.03 and float(err[1:].max()) < 0.015, err  # row 0: the outlier
    torch.set_num_threads(1)
    assert q4.records_linear(torch.randn(3, 1, H, generator=g), rec[:50], H).shape == (3, 1, 50, 2)
    x = torch.randn(2, H, generator=g)
    for r in (0, 1):  # the gate and up rows, read in place, equal their rows on their own
        nib, d = (t.contiguous() for t in q4.record_parts(rec[:50], H, r))
        assert torch.equal(q4.dequantize(nib, d), rows[:50, r])
        assert torch.equal(q4.records_linear(x, rec[:50], H)[..., r], q4.linear(x, nib, d))


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates()])
def test_every_path_of_this_cpu_computes_the_down_product_as_the_plain_c_path(isa):
    plain, k = kernel.load(isa="plain"), kernel.load(isa=isa)
    g = torch.Generator().manual_seed(4)
    # neurons: partial groups of 32, eight whole ones (a tiny model's 256 against 24 rows);
    # sub-blocks of H: 2, 20 (two super-blocks and a partial one), 6, 8, 48
    for n, H, m in [(7, 64, 3), (130, 640, 1), (33, 192, 2), (256, 64, 24), (70, 256, 2),
                    (40, 1536, 2)]:
        packed, d = q4.quantize(torch.randn(n, H, generator=g))
        a = torch.randn(m, n, generator=g)
        out = {}
        for name, lib, threads in (("plain", plain, 1), (isa, k, 1), (isa + "/2", k, 2)):
            y = torch.empty(m, H)
            assert lib.lib.si_axpy_q4(a.data_ptr(), m, n, packed.data_ptr(), d.data_ptr(),
                                      packed.stride(0), d.stride(0), H, y.data_ptr(), threads) == 0
            out[name] = y
        for name, y in out.items():
            assert torch.allclose(y, out["plain"], rtol=1e-5, atol=1e-5 * float(y.abs().max())), name


def test_several_activation_rows_at_once_give_each_rows_own_result():
    """A prefill's tokens share each super-block's unpacking (rows) and each group's heads (the
    down product): every token's result equals its product alone, bit for bit."""
    k = kernel.load()
    g = torch.Generator().manual_seed(6)
    for n, kk, m in [(37, 640, 7), (70, 1536, 5), (9, 64, 9)]:
        packed, d = q4.quantize(torch.randn(n, kk, generator=g))
        x = torch.randn(m, kk, generator=g)
        y = torch.empty(m, n)
        assert k.lib.si_linear_q4(x.data_ptr(), m, kk, packed.data_ptr(), d.data_ptr(), n,
                                  packed.stride(0), d.stride(0), y.data_ptr(), 1) == 0
        for i in range(m):
            one = torch.empty(1, n)
            xi = x[i:i + 1].clone()
            k.lib.si_linear_q4(xi.data_ptr(), 1, kk, packed.data_ptr(), d.data_ptr(), n,
                               packed.stride(0), d.stride(0), one.data_ptr(), 1)
            assert torch.equal(one[0], y[i])
        a = torch.randn(m, n, generator=g)
        z = torch.empty(m, kk)
        assert k.lib.si_axpy_q4(a.data_ptr(), m, n, packed.data_ptr(), d.data_ptr(),
                                packed.stride(0), d.stride(0), kk, z.data_ptr(), 2) == 0
        for i in range(m):
            one = torch.empty(1, kk)
            ai = a[i:i + 1].clone()
            k.lib.si_axpy_q4(ai.data_ptr(), 1, n, packed.data_ptr(), d.data_ptr(),
                             packed.stride(0), d.stride(0), kk, one.data_ptr(), 1)
            assert torch.equal(one[0], z[i])


@pytest.fixture(scope="module")
def q4_packed(tiny_models, tmp_path_factory):
    from selectinfer_ros.core.format.pack import pack
    hf, float_packed = tiny_models["tiny-llama"]
    out = pack(hf, tmp_path_factory.mktemp("q4") / "packed", weights="q4", log=lambda s: None)
    return out.path, float_packed


def test_q4_pack_holds_4bit_records_and_the_same_fingerprint(q4_packed, tiny_models, tmp_path):
    from selectinfer_ros.core.format.pack import FFN_FILE, OTHER_FILE, read_manifest, verify
    from selectinfer_ros.core.format.safetensors_io import read_header
    from selectinfer_ros.core.selection.loader import load_dense
    path, float_packed = q4_packed
    m, f = read_manifest(path), read_manifest(float_packed)
    assert m.weights == "q4" and m.q4_ffn and m.fingerprint == f.fingerprint
    H = m.hidden_size
    assert m.record_bytes == 3 * (H // 2 + 16 * -(-H // 256))  # 4.5 bits per weight (H % 256 == 0)
    assert read_header(path / FFN_FILE)[0]["layers.0.neurons"].shape == (m.intermediate_size,
                                                                          m.record_bytes)
    tensors, _, _ = read_header(path / OTHER_FILE)  # attention and output: int8 rows
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert tensors["model.norm.weight"].dtype not in (torch.uint8, torch.int8)
    assert verify(path, log=lambda s: None) == []
    from selectinfer_ros.core.format.pack import pack
    every = pack(tiny_models["tiny-llama"][0], tmp_path / "all", weights="q4-all", log=lambda s: None)
    tensors, _, _ = read_header(every.path / OTHER_FILE)  # q4-all: those as 4-bit rows too
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    assert tensors["model.layers.0.self_attn.q_proj.scale"].dtype == torch.uint8  # heads
    assert verify(every.path, log=lambda s: None) == []
    q, _ = load_dense(path)
    fl, _ = load_dense(float_packed)
    for name in ("gate_proj", "down_proj"):  # near the float rows: within a step of the grid
        wq = getattr(q.model.layers[1].mlp, name).weight
        wf = getattr(fl.model.layers[1].mlp, name).weight.float()
        rows = wf.t() if name == "down_proj" else wf  # down: blocks along H of each column
        err = ((wq.t() if name == "down_proj" else wq) - rows).reshape(rows.shape[0], -1, 32)
        assert bool((err.abs() <= _steps(rows) + 1e-6).all()), name


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_int8_q4emb_pack_keeps_int8_records_and_attention_and_4bit_embedding(tiny_models,
                                                                            tmp_path, family):
    """``--weights int8-q4emb``: int8 neuron records and attention rows, the token embedding and
    a separate output layer as 4-bit rows; loaded, the embedding and the output layer are 4-bit
    modules whose rows are those of the float model within a 4-bit step."""
    from selectinfer_ros.core.format.pack import OTHER_FILE, pack, verify
    from selectinfer_ros.core.format.q4 import Q4Embedding, Q4Linear
    from selectinfer_ros.core.format.safetensors_io import read_header
    from selectinfer_ros.core.selection.loader import load_dense
    hf, float_packed = tiny_models[family]
    m = pack(hf, tmp_path / "p", weights="int8-q4emb", log=lambda s: None)
    assert m.int8_ffn and m.int8_other and not m.q4_ffn
    assert m.record_bytes == 3 * m.hidden_size + 12
    tensors, _, _ = read_header(m.path / OTHER_FILE)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert tensors["model.embed_tokens.weight"].dtype == torch.uint8
    assert tensors["model.embed_tokens.scale"].dtype == torch.uint8
    assert ("lm_head.weight" in tensors) == (family == "tiny-llama")  # Gemma ties them
    if "lm_head.weight" in tensors:
        assert tensors["lm_head.weight"].dtype == torch.uint8
    assert verify(m.path, log=lambda s: None) == []
    q, _ = load_dense(m.path)
    fl, _ = load_dense(float_packed)
    assert isinstance(q.model.embed_tokens, Q4Embedding) and isinstance(q.lm_head, Q4Linear)
    ids = torch.arange(3, 40)
    got = q.model.embed_tokens(ids).float()
    want = fl.model.embed_tokens(ids).float()
    err = (got - want).reshape(len(ids), -1, 32).abs()
    assert bool((err <= _steps(want) + 1e-6).all())


@pytest.mark.parametrize("gamma", [1.0, 0.6])
def test_q4_model_reads_only_its_records_and_switches_like_a_fresh_load(q4_packed, tiny_profiles,
                                                                         gamma):
    from selectinfer_ros.core.format.pack import OTHER_FILE, read_manifest
    from selectinfer_ros.core.format.safetensors_io import read_header
    from selectinfer_ros.core.selection.loader import SelectiveModel
    path, _ = q4_packed
    profiles = tiny_profiles["tiny-llama"]
    m = read_manifest(path)
    lines: list[str] = []
    sm = SelectiveModel(path, profiles, "alpha", load_ratio=gamma, static_ratio=0.3, log=lines.append)
    assert any(line.startswith("[load] 4-bit weights: int8 kernel") for line in lines), lines
    tensors, _, _ = read_header(path / OTHER_FILE)
    n = round(gamma * m.intermediate_size)
    assert sm.bytes_read == sum(t.nbytes for t in tensors.values()) + m.num_layers * n * m.record_bytes
    assert all(mlp.grouped == q4.groups_pay("cpu") for mlp in sm.mlps)
    held = (m.num_layers * q4.empty_groups(n, m.hidden_size).numel() if q4.groups_pay("cpu")
            else m.num_layers * n * m.record_bytes)  # grouped: the gate / up heads decoded
    assert sm.weight_bytes()["ffn"] == held
    report = sm.switch_task("beta")
    assert report.bytes_read == report.neurons_read * m.record_bytes
    fresh = SelectiveModel(path, profiles, "beta", load_ratio=gamma, static_ratio=0.3)
    for mlp, ref in zip(sm.mlps, fresh.mlps):  # the same records, base neurons in the prefix
        order, ref_order = torch.argsort(mlp.slot_ids), torch.argsort(ref.slot_ids)
        assert torch.equal(mlp.slot_ids[order], ref.slot_ids[ref_order])
        assert set(mlp.slot_ids[: mlp.n_static].tolist()) == set(ref.slot_ids[: ref.n_static].tolist())
        assert torch.equal(mlp.slots.records(order), ref.slots.records(ref_order))


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates()])
def test_interleaved_rows_give_the_row_product_on_every_path(isa):
    """16 rows interleaved (q4.interleave, rows_q4il.c): the product of the row layout to float
    rounding on every path of this CPU and the plain C one, whole and partial super-blocks,
    one thread and two; the rows read back exactly."""
    plain, k = kernel.load(isa="plain"), kernel.load(isa=isa)
    g = torch.Generator().manual_seed(11)
    for n, kk, m in [(16, 64, 1), (48, 896, 3), (32, 640, 2), (64, 1536, 1), (160, 2048, 4)]:
        packed, d = q4.quantize(torch.randn(n, kk, generator=g))
        wi, hi = q4.interleave(packed, d)
        assert wi.shape == packed.shape and hi.shape == d.shape  # the same bytes
        x = torch.randn(m, kk, generator=g)
        want = torch.empty(m, n)
        assert plain.lib.si_linear_q4(x.data_ptr(), m, kk, packed.data_ptr(), d.data_ptr(), n,
                                      packed.stride(0), d.stride(0), want.data_ptr(), 1) == 0
        for lib, threads in ((plain, 1), (k, 1), (k, 2)):
            y = torch.empty(m, n)
            assert lib.lib.si_linear_q4il(x.data_ptr(), m, kk, wi.data_ptr(), hi.data_ptr(), n,
                                          y.data_ptr(), threads) == 0
            assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), \
                (n, kk, lib.isa, threads)
        ids = torch.tensor([0, n - 1, 5, 15, n // 2])
        nib, heads = q4.interleaved_rows(wi, hi, ids)
        assert torch.equal(nib, packed[ids]) and torch.equal(heads, d[ids])
        y = torch.empty(1, 24)
        assert k.lib.si_linear_q4il(x.data_ptr(), 1, kk, wi.data_ptr(), hi.data_ptr(), 24,
                                    y.data_ptr(), 1) == -2  # not a whole number of groups


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates()])
def test_grouped_records_give_the_records_products_on_every_path(isa):
    """4-bit neuron records held in groups of 32 slots (rows_q4g.c), in the records' bytes:
    written in any slot order and read back exactly; the gate and up products the records' to float rounding, the down
    product the records' to the bit (the same coefficients and integer sums), on every path of
    this CPU and the plain C one, whole and partial groups and super-blocks, one activation row
    and several, one thread and two; an id out of range refused."""
    from selectinfer_ros.core.format.pack import q4_records
    plain, k = kernel.load(isa="plain"), kernel.load(isa=isa)
    g = torch.Generator().manual_seed(12)
    for n, H, M in [(32, 64, 1), (45, 896, 3), (77, 640, 2), (64, 1536, 1), (40, 1536, 5)]:
        rec = q4_records(torch.randn(n, H, generator=g), torch.randn(n, H, generator=g),
                         torch.randn(H, n, generator=g))
        slots = torch.randperm(n, generator=g)  # record i in slot slots[i]
        by_slot = torch.empty_like(rec)
        by_slot[slots] = rec
        x, a = torch.randn(M, H, generator=g), torch.randn(M, n, generator=g)
        want_gu = torch.empty(2, M, n)
        want_y = torch.empty(M, H)
        nib, hb = q4.row_bytes(H)
        for r in (0, 1):
            w, d = q4.record_parts(by_slot, H, r)
            assert plain.lib.si_linear_q4(x.data_ptr(), M, H, w.data_ptr(), d.data_ptr(), n,
                                          w.stride(0), d.stride(0), want_gu[r].data_ptr(), 1) == 0
        for lib in (plain, k):
            blk = torch.zeros(lib.lib.si_q4g_bytes(n, H), dtype=torch.uint8)
            assert blk.numel() == -(-n // 32) * 32 * rec.shape[1]  # the records' bytes
            ids = slots.to(torch.int64).contiguous()
            assert lib.lib.si_q4g_put(blk.data_ptr(), n, H, ids.data_ptr(), n, rec.data_ptr()) == 0
            back = torch.empty_like(rec)
            every = torch.arange(n, dtype=torch.int64)
            assert lib.lib.si_q4g_get(blk.data_ptr(), n, H, every.data_ptr(), n,
                                      back.data_ptr()) == 0
            assert torch.equal(back, by_slot), (n, H, lib.isa)
            bad = torch.tensor([n], dtype=torch.int64)
            assert lib.lib.si_q4g_get(blk.data_ptr(), n, H, bad.data_ptr(), 1, back.data_ptr()) == -1
            w, d = q4.record_parts(by_slot, H, 2)
            assert lib.lib.si_axpy_q4(a.data_ptr(), M, n, w.data_ptr(), d.data_ptr(), w.stride(0),
                                      d.stride(0), H, want_y.data_ptr(), 1) == 0
            for threads in (1, 2):
                gu = torch.empty(M, n, 2)
                assert lib.lib.si_q4g_linear(x.data_ptr(), M, H, blk.data_ptr(), n, gu.data_ptr(),
                                             threads) == 0
                for r in (0, 1):
                    assert torch.allclose(gu[..., r], want_gu[r], rtol=1e-5,
                                          atol=1e-5 * float(want_gu[r].abs().max())), (n, H, lib.isa)
                y = torch.empty(M, H)
                assert lib.lib.si_q4g_down(a.data_ptr(), M, n, blk.data_ptr(), H, y.data_ptr(),
                                           threads) == 0
                assert torch.equal(y, want_y), (n, H, M, lib.isa, threads)


def test_interleaved_output_layer_and_its_tied_embedding_keep_their_results():
    """interleave_q4_layers: the output layer interleaved where the CPU pays for it, one copy
    shared with the tied embedding (whose rows read back exactly), the same logits to float
    rounding; rows not a multiple of 16 stay rows; a second call changes nothing."""
    g = torch.Generator().manual_seed(5)
    emb = q4.Q4Embedding(1024, 256, embed_scale=2.0)
    emb.weight, emb.scale = q4.quantize(torch.randn(1024, 256, generator=g))
    odd = q4.Q4Linear.from_float(torch.randn(40, 256, generator=g))

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head, self.odd = emb, emb.as_linear(), odd

        def get_input_embeddings(self):
            return self.emb

    model = Tied()
    ids = torch.tensor([[0, 1023, 17], [5, 5, 400]])
    xs = [torch.randn(1, 1, 256, generator=g), torch.randn(2, 7, 256, generator=g)]
    rows, logits, odd_y = emb(ids), [model.head(x) for x in xs], odd(xs[0])
    pays = kernel.kernel() is not None and kernel.kernel().isa in q4.IL_PAYS
    assert q4.interleave_q4_layers(model) == int(pays)
    assert model.head.interleaved == emb.interleaved == pays and not odd.interleaved
    assert emb.weight is model.head.weight and emb.scale is model.head.scale
    assert torch.equal(emb(ids), rows) and torch.equal(odd(xs[0]), odd_y)
    for x, want in zip(xs, logits):
        got = model.head(x)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert q4.interleave_q4_layers(model) == int(pays) and emb.weight is model.head.weight
