"""Selection strategies over profile scores."""
from __future__ import annotations

import pytest
import torch

from selectinfer_ros.core.profiles import (Profile, fuse_scores, neuron_count, select_published,
                                           select_sensitivity)
from selectinfer_ros.core.safetensors_io import FormatError


def _profile(sens=None, L=4, I=100, seed=0) -> Profile:
    g = torch.Generator().manual_seed(seed)
    extra = {"sensitivity": torch.tensor(sens, dtype=torch.float32)} if sens is not None else {}
    return Profile("t", "m", "f", torch.rand(L, I, generator=g), 10, "x", extra)


def test_published_takes_base_then_secondary():
    p, q = _profile(seed=1), _profile(seed=2)
    sec = fuse_scores([p.scores, q.scores])
    sel = select_published(p.scores, sec, 0.6, 0.2)
    for layer, ids in enumerate(sel.neurons):
        assert len(ids) == 60 and len(set(ids.tolist())) == 60
        assert set(ids[:20].tolist()) == set(torch.topk(p.scores[layer], 20).indices.tolist())
        rest = sec[layer].clone()
        rest[ids[:20]] = -1
        assert set(ids[20:].tolist()) == set(torch.topk(rest, 40).indices.tolist())


def test_sensitivity_budgets_follow_sensitivity_and_keep_total():
    p = _profile(sens=[0.1, 5.0, 1.0, 0.1])
    sel = select_sensitivity(p, 0.7, 0.3, floor=0.45)
    counts = [len(n) for n in sel.neurons]
    assert sum(counts) == neuron_count(0.7, 100) * 4
    assert min(counts) >= 45
    assert counts[1] > counts[2] > counts[0]  # the most sensitive layer keeps the most
    for layer, ids in enumerate(sel.neurons):
        assert len(set(ids.tolist())) == len(ids)
        assert set(ids[:30].tolist()) == set(torch.topk(p.scores[layer], 30).indices.tolist())


def test_sensitivity_needs_the_measurement():
    with pytest.raises(FormatError, match="no per-layer sensitivity"):
        select_sensitivity(_profile(), 0.7, 0.3)


def test_per_layer_budgets_scale_compute_per_layer(tiny_models, tiny_profiles, tmp_path):
    from selectinfer_ros.core.loader import SelectiveModel
    from selectinfer_ros.core.profiles import load_profile
    import shutil
    _, packed = tiny_models["tiny-llama"]
    d = tmp_path / "p"
    shutil.copytree(tiny_profiles["tiny-llama"], d)
    prof = load_profile(d / "alpha.safetensors")
    prof.extra["sensitivity"] = torch.tensor([3.0, 0.2, 1.0])
    prof.save(d / "alpha.safetensors")
    sm = SelectiveModel(packed, d, "alpha", load_ratio=0.7, static_ratio=0.2, compute_ratio=0.5,
                        selection="sensitivity")
    loaded = [m.n_loaded for m in sm.mlps]
    assert loaded[0] > loaded[2] > loaded[1] and sum(loaded) == 3 * neuron_count(0.7, 256)
    for m in sm.mlps:
        assert m.n_active == int(m.n_loaded * 0.5 / 0.7 + 0.5)
    total = sm.weight_bytes()["ffn"]
    assert total == sum(loaded) * 3 * 64 * 4


def test_switch_between_per_layer_budgets_reads_only_new_neurons(tiny_models, tiny_profiles, tmp_path):
    import shutil
    from selectinfer_ros.core.loader import SelectiveModel, load_dense
    from selectinfer_ros.core.pack import read_manifest
    from selectinfer_ros.core.profiles import load_profile
    _, packed = tiny_models["tiny-gemma3"]
    d = tmp_path / "p"
    shutil.copytree(tiny_profiles["tiny-gemma3"], d)
    for task, sens in (("alpha", [3.0, 0.2, 1.0, 0.5]), ("beta", [0.2, 3.0, 0.5, 1.0])):
        prof = load_profile(d / f"{task}.safetensors")
        prof.extra["sensitivity"] = torch.tensor(sens)
        prof.save(d / f"{task}.safetensors")
    sm = SelectiveModel(packed, d, "alpha", load_ratio=0.6, static_ratio=0.2)  # auto -> sensitivity
    assert sm.selection_strategy == "sensitivity"
    before = [set(m.slot_ids.tolist()) for m in sm.mlps]
    report = sm.switch_task("beta")
    fresh = SelectiveModel(packed, d, "beta", load_ratio=0.6, static_ratio=0.2)
    after = [set(m.slot_ids.tolist()) for m in fresh.mlps]
    assert [m.n_loaded for m in sm.mlps] == [m.n_loaded for m in fresh.mlps] != [len(b) for b in before]
    added = sum(len(a - b) for a, b in zip(after, before))
    assert report.neurons_read == added
    assert report.bytes_read == added * read_manifest(packed).record_bytes
    dense, _ = load_dense(packed)
    for mlp, blk in zip(sm.mlps, dense.model.layers):
        torch.testing.assert_close(mlp.gu[:, 1], blk.mlp.up_proj.weight[mlp.slot_ids])
        torch.testing.assert_close(mlp.down, blk.mlp.down_proj.weight[:, mlp.slot_ids])


def test_shared_sensitivity_gives_every_task_the_same_budgets_and_secondary():
    from selectinfer_ros.core.profiles import select_shared_sensitivity
    a, b = _profile(sens=[0.1, 5.0, 1.0, 0.1], seed=3), _profile(sens=[0.3, 2.0, 4.0, 0.2], seed=4)
    sa = select_shared_sensitivity(a, [a, b], 0.7, 0.3, floor=0.45)
    sb = select_shared_sensitivity(b, [a, b], 0.7, 0.3, floor=0.45)
    assert [len(n) for n in sa.neurons] == [len(n) for n in sb.neurons]
    assert sum(len(n) for n in sa.neurons) == neuron_count(0.7, 100) * 4
    assert len({len(n) for n in sa.neurons}) > 1  # budgets follow sensitivity
    for layer in range(4):
        assert set(sa.neurons[layer][:30].tolist()) == set(torch.topk(a.scores[layer], 30).indices.tolist())
        # a switch from a to b reads at most the base neurons b adds and as many displaced ones
        base_a, base_b = set(sa.neurons[layer][:30].tolist()), set(sb.neurons[layer][:30].tolist())
        new = set(sb.neurons[layer].tolist()) - set(sa.neurons[layer].tolist())
        assert len(new) <= 2 * len(base_b - base_a)
