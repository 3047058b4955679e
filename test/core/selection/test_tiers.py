"""Tiered records (``int8_ratio``): each layer's most valued resident neurons as int8 records,
the rest as 4-bit ones, read from their own files; the decode kernel over both tiers equals the
torch path; a task switch reads only the neurons that enter a tier."""
from __future__ import annotations

import pytest
import torch

from selectinfer_ros.core.execution.engine import Engine
from selectinfer_ros.core.format.pack import (OTHER_FILE, int8_record_bytes, int8_record_parts,
                                              neuron_key, pack, read_manifest)
from selectinfer_ros.core.format.safetensors_io import CountingReader, read_header
from selectinfer_ros.core.selection.loader import SelectiveModel
from selectinfer_ros.core.selection.selective_mlp import TieredMLP


@pytest.fixture(scope="module")
def q4_pack(tiny_models, tmp_path_factory):
    hf, _ = tiny_models["tiny-llama"]
    return pack(hf, tmp_path_factory.mktemp("tiers") / "q4", weights="q4", log=lambda s: None).path


def _records(path, name: str, layer: int, ids: torch.Tensor, nbytes: int) -> torch.Tensor:
    info = read_header(path / name)[0][neuron_key(layer)]
    with CountingReader(path / name) as r:
        raw = r.read_tensor(info).view(torch.uint8).view(-1, nbytes)
    return raw[ids]


def test_tiers_hold_the_first_neurons_of_the_selection_as_int8_and_read_only_their_records(
        q4_pack, tiny_profiles):
    m = read_manifest(q4_pack)
    assert m.high == "int8"
    I, H = m.intermediate_size, m.hidden_size
    kw = dict(load_ratio=0.8, static_ratio=0.2)
    plain = SelectiveModel(q4_pack, tiny_profiles["tiny-llama"], "alpha", **kw)
    sm = SelectiveModel(q4_pack, tiny_profiles["tiny-llama"], "alpha", int8_ratio=0.3, **kw)
    n_hi, n_lo = round(0.3 * I), round(0.8 * I) - round(0.3 * I)
    other = sum(t.nbytes for t in read_header(q4_pack / OTHER_FILE)[0].values())
    assert sm.bytes_read == other + m.num_layers * (n_hi * int8_record_bytes(H) + n_lo * m.record_bytes)
    for layer, (mlp, ref) in enumerate(zip(sm.mlps, plain.mlps)):
        assert isinstance(mlp, TieredMLP) and mlp.lo.rec is not None and mlp.hi.rec is None
        order = ref.slot_ids  # the selection's order: base neurons first
        assert torch.equal(mlp.hi.slot_ids, order[:n_hi]) and torch.equal(mlp.lo.slot_ids, order[n_hi:])
        assert mlp.hi.n_static == round(0.2 * I) and mlp.lo.n_static == 0
        # the high tier's slots hold the int8 records of its neurons, the low tier's the 4-bit ones
        vals, scales = int8_record_parts(_records(q4_pack, "ffn-high.safetensors", layer,
                                                  mlp.hi.slot_ids, int8_record_bytes(H)), H)
        gu, down = mlp.hi.slots.unpacked()
        assert torch.equal(gu, vals[:, :2]) and torch.equal(down.t(), vals[:, 2])
        assert torch.equal(mlp.hi.gu_scale, scales[:, :2])
        assert torch.equal(mlp.lo.slots.records(), _records(q4_pack, "ffn.safetensors", layer,
                                                            mlp.lo.slot_ids, m.record_bytes))
    assert sm.weight_bytes()["ffn"] > plain.weight_bytes()["ffn"]  # int8 records are larger
    assert [ids.numel() for ids in sm.high_neuron_ids()] == [n_hi] * m.num_layers


def test_int8_ratio_is_refused_where_no_high_tier_exists_or_above_load_ratio(q4_pack, tiny_models):
    _, float_packed = tiny_models["tiny-llama"]
    with pytest.raises(ValueError, match="int8_ratio 0.3 needs 4-bit records"):
        SelectiveModel(float_packed, int8_ratio=0.3)
    with pytest.raises(ValueError, match="exceeds load_ratio"):
        SelectiveModel(q4_pack, load_ratio=0.5, int8_ratio=0.6, selection="random")


def _decode(sm: SelectiveModel, native: bool) -> torch.Tensor:
    """Logits of a prefill and 10 decode steps, through the kernel or the torch path."""
    e = Engine.from_selective(sm)
    d = e.decoder
    assert d.path == "int8 decode kernel"
    if not native:
        d.native = None
    ids = torch.randint(4, 500, (22,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        e._start(torch.tensor([ids[:12]]))
        out = [d.prefill(ids[:12], extra=12)]
        e._end_prefill()
        out += [d.decode_one_token(t) for t in ids[12:]]
    return torch.stack(out)


@pytest.mark.parametrize("kw", [dict(), dict(load_ratio=0.7, compute_ratio=0.4, static_ratio=0.1),
                                dict(compute_mode="token", compute_ratio=0.5, static_ratio=0.0)],
                         ids=["all", "prompt-0.7-0.4", "token-0.5"])
def test_the_kernel_over_both_tiers_equals_the_torch_path(q4_pack, token_profiles, kw):
    make = lambda: SelectiveModel(q4_pack, token_profiles, "alpha", int8_ratio=0.3, **kw)
    sm = make()
    kernel, torch_path = _decode(sm, True), _decode(make(), False)
    assert float((kernel - torch_path).abs().max() / torch_path.std()) < 1e-4
    if kw.get("compute_mode") == "token":  # both tiers' neurons counted, about half computed
        share = sm.read_shares()["computed_share"]
        assert 0.3 < share < 0.8, share
    # the tiers matter: all-4-bit records give other logits
    untiered = _decode(SelectiveModel(q4_pack, token_profiles, "alpha", **kw), True)
    assert float((untiered - kernel).abs().max() / kernel.std()) > 1e-3


def test_a_task_switch_reads_only_the_neurons_entering_a_tier_and_equals_a_fresh_load(
        q4_pack, tiny_profiles):
    m = read_manifest(q4_pack)
    H = m.hidden_size
    kw = dict(load_ratio=0.8, static_ratio=0.3, int8_ratio=0.3)
    sm = SelectiveModel(q4_pack, tiny_profiles["tiny-llama"], "alpha", **kw)
    before = [(mlp.hi.slot_ids.clone(), mlp.lo.slot_ids.clone()) for mlp in sm.mlps]
    report = sm.switch_task("beta")
    fresh = SelectiveModel(q4_pack, tiny_profiles["tiny-llama"], "beta", **kw)
    promoted = demoted = entering_lo = 0
    for (hi0, lo0), mlp, ref in zip(before, sm.mlps, fresh.mlps):
        for part, rpart in zip(mlp.parts, ref.parts):  # the same neurons per tier, static first
            assert torch.equal(part.slot_ids.sort().values, rpart.slot_ids.sort().values)
            assert set(part.slot_ids[:part.n_static].tolist()) == set(
                rpart.slot_ids[:rpart.n_static].tolist())
        hi1, lo1 = set(mlp.hi.slot_ids.tolist()), set(mlp.lo.slot_ids.tolist())
        promoted += len(hi1 - set(hi0.tolist()))
        entering_lo += len(lo1 - set(lo0.tolist()))
        demoted += len(lo1 & set(hi0.tolist()))
    assert promoted > 0 and demoted > 0
    assert report.neurons_read == promoted + entering_lo
    assert report.bytes_read == promoted * int8_record_bytes(H) + entering_lo * m.record_bytes
    assert report.neurons_retiered >= demoted
    # the same answer as a model loaded for the task (the kernel's decode steps)
    assert torch.equal(_decode(sm, True), _decode(fresh, True))
