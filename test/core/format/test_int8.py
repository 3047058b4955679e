"""int8 weights: the kernel against the float product it stands for, int8 packed models loaded
selectively (only the chosen records read), switched and checked like float ones."""
from __future__ import annotations

import shutil

import pytest
import torch

from selectinfer_ros.core.format import int8
from selectinfer_ros.core.selection.loader import SelectiveModel, load_dense
from selectinfer_ros.core.format.pack import FFN_FILE, OTHER_FILE, pack, read_manifest, verify
from selectinfer_ros.core.format.safetensors_io import FormatError, read_header


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    w = q.float() * (scale[:, None] if scale is not None else 1.0)
    return x.float() @ w.T


@pytest.mark.parametrize("n,k,m", [(7, 45, 3), (64, 640, 1), (130, 2048, 5), (33, 31, 2)])
def test_kernel_matches_the_float_product_of_its_rows(n, k, m):
    assert int8.kernel() is not None, int8.kernel_status()
    g = torch.Generator().manual_seed(n * k)
    q, scale = int8.quantize_rows(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    y, ref = int8.linear(x, q, scale), _reference(x, q, scale)
    # activations quantized per block of 32 to 8 bits: well under 1% of the output range
    assert float((y - ref).abs().max() / ref.abs().max()) < 0.01
    assert y.shape == (m, n)


def test_kernel_reads_a_column_prefix_of_wider_rows():
    g = torch.Generator().manual_seed(0)
    q, _ = int8.quantize_rows(torch.randn(40, 300, generator=g))
    x = torch.randn(2, 1, 170, generator=g)
    prefix = q[:, :170]
    assert prefix.stride(0) == 300
    y = int8.linear(x, prefix, None)
    ref = _reference(x.view(2, 170), prefix, None).view(2, 1, 40)
    assert float((y - ref).abs().max() / ref.abs().max()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_with_a_bias_adds_it_to_the_product(dtype):
    """Qwen2's q/k/v projections: the int8 product of the rows, plus the float bias; the bias is
    a buffer named ``bias`` (the checkpoint's ``<name>.bias``), absent without one."""
    g = torch.Generator().manual_seed(11)
    layer = int8.Int8Linear(40, 96, bias=True)
    assert set(layer.state_dict()) == {"weight", "scale", "bias"}
    assert set(int8.Int8Linear(40, 96).state_dict()) == {"weight", "scale"}
    layer.weight, layer.scale = int8.quantize_rows(torch.randn(40, 96, generator=g))
    layer.bias = (torch.randn(40, generator=g) * 5.0).to(dtype)
    x = torch.randn(3, 1, 96, generator=g).to(dtype)
    ref = _reference(x.view(3, 96), layer.weight, layer.scale)  # [3, 40] float32
    want = ref + layer.bias.float()
    y = layer(x)
    assert y.shape == (3, 1, 40) and y.dtype == dtype
    err = float((y.view(3, 40).float() - want).abs().max())
    tol = 0.01 * float(want.abs().max()) + (0.05 if dtype == torch.bfloat16 else 0.0)
    assert err < tol, err
    assert float((y.view(3, 40).float() - ref).abs().max()) > 10 * tol  # the bias is there


class _Tied(torch.nn.Module):
    """An embedding and the output layer tied to it (what the loader builds for Gemma)."""

    def __init__(self, emb: int8.Int8Embedding):
        super().__init__()
        self.emb, self.head = emb, emb.as_linear()

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head


def test_output_layer_in_tiles_equals_its_rows_and_a_tied_embedding_reads_them_back():
    """The output layer held as the kernel's tiles (one copy, shared with the tied embedding):
    the same logits to float rounding (K a whole number of blocks: the same block sums) for one
    row and many, the same embedding rows exactly; a second call changes nothing."""
    g = torch.Generator().manual_seed(5)
    emb = int8.Int8Embedding(1000, 96, embed_scale=2.0)
    emb.weight, emb.scale = int8.quantize_rows(torch.randn(1000, 96, generator=g))
    model = _Tied(emb)
    ids = torch.tensor([[0, 999, 17], [5, 5, 400]])
    xs = [torch.randn(1, 1, 96, generator=g), torch.randn(4, 96, generator=g),
          torch.randn(2, 7, 96, generator=g)]
    rows, logits = emb(ids), [model.head(x) for x in xs]
    assert int8.tile_int8_layers(model) == int(bool(int8.kernel().si_tile_pays()))
    assert model.head.tiled and emb.tiled and emb.weight is model.head.weight
    assert emb.weight.dtype == torch.uint8 and emb.weight.numel() == 1008 * 96  # 63 whole tiles
    assert torch.equal(emb(ids), rows)
    for x, want in zip(xs, logits):
        got = model.head(x)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert not model.head.to_tiles() and emb.weight is model.head.weight
    with pytest.raises(IndexError, match="out of range"):
        emb(torch.tensor([[1000]]))


def test_quantize_rows_round_trips_within_half_a_step():
    w = torch.randn(50, 70)
    q, scale = int8.quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all())


@pytest.fixture(scope="module")
def int8_packed(tiny_models, tmp_path_factory):
    hf, float_packed = tiny_models["tiny-llama"]
    out = pack(hf, tmp_path_factory.mktemp("int8") / "packed", weights="int8", log=lambda s: None)
    return out.path, float_packed


def test_int8_pack_holds_int8_records_and_the_same_fingerprint(int8_packed, tiny_profiles):
    path, float_packed = int8_packed
    m, f = read_manifest(path), read_manifest(float_packed)
    assert m.weights == "int8" and m.fingerprint == f.fingerprint  # the float profiles apply
    assert m.record_bytes == 3 * m.hidden_size + 12
    tensors, _, _ = read_header(path / OTHER_FILE)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.self_attn.q_proj.scale"].dtype == torch.float32
    assert tensors["model.norm.weight"].dtype != torch.int8
    assert verify(path, log=lambda s: None) == []


@pytest.mark.parametrize("gamma", [1.0, 0.6])
def test_int8_model_reads_only_its_records_and_follows_the_float_model(int8_packed, tiny_profiles,
                                                                        gamma):
    path, float_packed = int8_packed
    profiles = tiny_profiles["tiny-llama"]
    m = read_manifest(path)
    lines: list[str] = []
    sm = SelectiveModel(path, profiles, "alpha", load_ratio=gamma, log=lines.append)
    assert any(line.startswith("[load] int8 weights: int8 kernel") for line in lines), lines
    ref = SelectiveModel(float_packed, profiles, "alpha", load_ratio=gamma)
    tensors, _, _ = read_header(path / OTHER_FILE)
    n = round(gamma * m.intermediate_size)
    assert sm.bytes_read == sum(t.nbytes for t in tensors.values()) + m.num_layers * n * m.record_bytes
    H = m.hidden_size
    lib = int8.kernel()  # tiles: 16-row tiles and 32-column blocks, zero padded
    per_layer = (lib.si_tile_bytes(2 * n, H) + lib.si_tile_bytes(H, n) + 12 * n
                 if sm.mlps[0].tiled else n * m.record_bytes)
    assert sm.mlps[0].tiled == int8.tiles_pay("cpu")
    assert sm.weight_bytes()["ffn"] == m.num_layers * per_layer
    ids = torch.randint(4, 500, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = sm.model(ids).logits, ref.model(ids).logits
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert float(cos) > 0.995
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_int8_task_switch_equals_a_fresh_load(int8_packed, tiny_profiles):
    path, _ = int8_packed
    profiles = tiny_profiles["tiny-llama"]
    sm = SelectiveModel(path, profiles, "alpha", load_ratio=0.6, static_ratio=0.3)
    report = sm.switch_task("beta")
    assert report.bytes_read == report.neurons_read * read_manifest(path).record_bytes > 0
    fresh = SelectiveModel(path, profiles, "beta", load_ratio=0.6, static_ratio=0.3)
    for mlp, ref in zip(sm.mlps, fresh.mlps):  # the same records, base neurons in the prefix
        order, ref_order = torch.argsort(mlp.slot_ids), torch.argsort(ref.slot_ids)
        assert torch.equal(mlp.slot_ids[order], ref.slot_ids[ref_order])
        assert set(mlp.slot_ids[: mlp.n_static].tolist()) == set(ref.slot_ids[: ref.n_static].tolist())
        (gu, down), (ref_gu, ref_down) = mlp.slots.unpacked(), ref.slots.unpacked()
        assert torch.equal(gu[order], ref_gu[ref_order])
        assert torch.equal(mlp.gu_scale[order], ref.gu_scale[ref_order])
        assert torch.equal(down[:, order], ref_down[:, ref_order])
        assert torch.equal(mlp.down_scale[order], ref.down_scale[ref_order])
    ids = torch.randint(4, 500, (1, 9))
    with torch.no_grad():  # slot order changes only the activation blocks' grouping
        a, b = sm.model(ids).logits, fresh.model(ids).logits
    assert float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.999


def test_dense_load_of_an_int8_pack_dequantizes_the_records(int8_packed):
    path, float_packed = int8_packed
    q, _ = load_dense(path)
    f, _ = load_dense(float_packed)
    gate_q = q.model.layers[1].mlp.gate_proj.weight
    gate_f = f.model.layers[1].mlp.gate_proj.weight
    assert gate_q.dtype == gate_f.dtype
    step = gate_f.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((gate_q - gate_f).abs() <= step / 2 + 1e-6).all())


def test_corrupt_int8_record_is_refused(int8_packed, tiny_profiles, tmp_path):
    path, _ = int8_packed
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    m = read_manifest(bad)
    tensors, _, offset = read_header(bad / FFN_FILE)
    info = tensors["layers.1.neurons"]
    with open(bad / FFN_FILE, "r+b") as fh:  # flip one scale byte of neuron 5
        fh.seek(info.start + 5 * m.record_bytes + 3 * m.hidden_size + 1)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(FormatError, match="checksum mismatch in layer 1, neuron record 5"):
        SelectiveModel(bad, tiny_profiles["tiny-llama"], "alpha", load_ratio=1.0)
