"""Selection strategies over profile scores."""
from __future__ import annotations

import pytest
import torch

from selectinfer_ros.core.selection.profiles import (Profile, fuse_scores, neuron_count, select_published,
                                           select_sensitivity)
from selectinfer_ros.core.format.safetensors_io import FormatError


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
    from selectinfer_ros.core.selection.loader import SelectiveModel
    from selectinfer_ros.core.selection.profiles import load_profile
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
    from selectinfer_ros.core.selection.loader import SelectiveModel, load_dense
    from selectinfer_ros.core.format.pack import read_manifest
    from selectinfer_ros.core.selection.profiles import load_profile
    _, packed = tiny_models["tiny-gemma3"]
    d = tmp_path / "p"
    shutil.copytree(tiny_profiles["tiny-gemma3"], d)
    for task, sens in (("alpha", [3.0, 0.2, 1.0, 0.5]), ("beta", [0.2, 3.0, 0.5, 1.0])):
        prof = load_profile(d / f"{task}.safetensors")
        prof.extra["sensitivity"] = torch.tensor(sens)
        prof.save(d / f"{task}.safetensors")
    sm = SelectiveModel(packed, d, "alpha", load_ratio=0.6, static_ratio=0.2, selection="sensitivity")
    assert SelectiveModel(packed, d, "alpha", load_ratio=0.6, static_ratio=0.2).selection_strategy \
        == "shared-sensitivity"  # auto
    before = [set(m.slot_ids.tolist()) for m in sm.mlps]
    report = sm.switch_task("beta")
    fresh = SelectiveModel(packed, d, "beta", load_ratio=0.6, static_ratio=0.2, selection="sensitivity")
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
    from selectinfer_ros.core.selection.profiles import select_shared_sensitivity
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


# -- contents checksum --------------------------------------------------------------------------

def test_zeroed_bytes_in_a_shipped_profile_are_refused(embedded_profiles, tmp_path):
    """64 bytes zeroed in the middle of a real shipped profile, header intact: refused at load with
    the file name and the checksum mismatch (zeros are valid scores, so only a checksum sees it)."""
    from selectinfer_ros.core.selection.profiles import load_profile
    from selectinfer_ros.core.format.safetensors_io import read_header
    src = embedded_profiles / "qa.safetensors"
    f = tmp_path / "qa.safetensors"
    raw = bytearray(src.read_bytes())
    f.write_bytes(bytes(raw))
    load_profile(f)  # the intact copy loads
    _, _, base = read_header(f)
    mid = base + (len(raw) - base) // 2
    assert any(raw[mid:mid + 64])
    raw[mid:mid + 64] = bytes(64)
    f.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=r"qa\.safetensors: corrupt: contents checksum mismatch"):
        load_profile(f)


def test_profile_without_checksum_is_refused(tmp_path):
    from safetensors.torch import save_file
    from selectinfer_ros.core.selection.profiles import PROFILE_FORMAT, PROFILE_VERSION, load_profile
    f = tmp_path / "t.safetensors"
    save_file({"scores": torch.rand(2, 8)}, str(f), metadata={
        "format": PROFILE_FORMAT, "version": str(PROFILE_VERSION), "task": "t", "tokens": "3"})
    with pytest.raises(FormatError, match=r"t\.safetensors: no contents checksum"):
        load_profile(f)


def test_checksum_covers_metadata_and_extra_tensors(tmp_path):
    from safetensors.torch import load_file, save_file
    from selectinfer_ros.core.selection.profiles import load_profile
    from selectinfer_ros.core.format.safetensors_io import read_header
    p = _profile(sens=[1.0, 2.0, 3.0, 4.0])
    f = p.save(tmp_path / "t.safetensors")
    assert torch.equal(load_profile(f).extra["sensitivity"], p.extra["sensitivity"])
    _, meta, _ = read_header(f)
    tensors = load_file(str(f))
    save_file(tensors, str(f), metadata={**meta, "tokens": "11"})
    with pytest.raises(FormatError, match="checksum mismatch"):
        load_profile(f)
    tensors["sensitivity"][0] = 9.0
    save_file(tensors, str(f), metadata=meta)
    with pytest.raises(FormatError, match="checksum mismatch"):
        load_profile(f)


# -- quality curve, min_agreement ---------------------------------------------------------------

def _curve(selection="sensitivity"):
    from selectinfer_ros.core.selection.profiles import QualityCurve
    gammas = [0.5, 0.7, 0.9, 1.0]
    agree = torch.tensor([[0.40, 0.50], [0.55, 0.70], [0.75, 0.90], [0.85, 1.0]])
    return QualityCurve(gammas, [0.7, 1.0], agree, 1 - agree, selection, 12, 300, "x.jsonl")


def test_quality_curve_interpolates_and_clamps():
    c = _curve()
    assert c.expected_agreement(0.7) == pytest.approx(0.70)
    assert c.expected_agreement(0.8) == pytest.approx(0.80)  # halfway between 0.7 and 0.9
    assert c.expected_agreement(0.7, 0.49) == pytest.approx(0.55)  # phi/gamma = 0.7
    assert c.expected_agreement(0.7, 0.595) == pytest.approx(0.625)  # phi/gamma = 0.85
    assert c.expected_agreement(0.3) == pytest.approx(0.50)  # clamped below the grid
    assert c.expected_kl(0.9) == pytest.approx(0.10)


def test_load_ratio_for_agreement_is_the_smallest_meeting_it():
    c = _curve()
    assert c.load_ratio_for(0.80) == pytest.approx(0.80)
    assert c.load_ratio_for(0.70) == pytest.approx(0.70)
    assert c.load_ratio_for(0.30) == pytest.approx(0.50)
    assert c.load_ratio_for(0.95, compute_share=0.7) is None  # 0.85 at gamma 1, phi 0.7
    g = c.load_ratio_for(0.77)
    assert c.expected_agreement(g) >= 0.77 - 1e-6 > c.expected_agreement(g - 0.01)
    from selectinfer_ros.core.selection.profiles import QualityCurve
    noisy = QualityCurve([0.5, 0.6, 0.7, 1.0], [1.0], torch.tensor([[0.7], [0.87], [0.85], [1.0]]),
                         torch.zeros(4, 1))
    assert noisy.load_ratio_for(0.86) == pytest.approx(0.72)  # not the lucky 0.6 below the dip at 0.7


def test_curve_is_stored_checksummed_and_read_back(tmp_path):
    from selectinfer_ros.core.selection.profiles import load_profile
    p = _profile(sens=[1.0, 2.0, 3.0, 4.0])
    p.set_quality_curve(_curve())
    f = p.save(tmp_path / "t.safetensors")
    c = load_profile(f).quality_curve()
    assert c.load_ratios == [0.5, 0.7, 0.9, 1.0] and c.compute_shares == [0.7, 1.0]
    assert c.selection == "sensitivity" and c.items == 12 and c.tokens == 300
    assert c.expected_agreement(0.8) == pytest.approx(0.80)
    assert _profile().quality_curve() is None


def test_choose_load_ratio_says_which_bound():
    from selectinfer_ros.core.selection.profiles import choose_load_ratio
    c = choose_load_ratio(0.7, 0.85, min_agreement=0.8)
    assert c.load_ratio == 0.7 and c.bound == "min_agreement"
    c = choose_load_ratio(0.9, 0.75, min_agreement=0.8)
    assert c.load_ratio == 0.75 and c.bound == "memory_budget" and "below the agreement" in c.message
    with pytest.raises(ValueError, match="memory budget allows at most 0.750"):
        choose_load_ratio(0.9, 0.75, min_agreement=0.8, strict=True)
    assert choose_load_ratio(None, 0.6).bound == "memory_budget"
    assert choose_load_ratio(0.6, None).bound == "min_agreement"
    assert choose_load_ratio(None, None, requested=0.8).load_ratio == 0.8


def test_catalog_expected_agreement_and_min_agreement(tiny_models, tiny_profiles, tmp_path):
    import shutil
    from selectinfer_ros.core.format.pack import read_manifest
    from selectinfer_ros.core.selection.profiles import ProfileCatalog, QualityCurve, load_profile
    _, packed = tiny_models["tiny-llama"]
    d = tmp_path / "p"
    shutil.copytree(tiny_profiles["tiny-llama"], d)
    prof = load_profile(d / "alpha.safetensors")
    prof.set_quality_curve(_curve("published"))
    prof.save(d / "alpha.safetensors")
    cat = ProfileCatalog(d, read_manifest(packed))
    assert cat.expected_agreement("alpha", 0.8) == pytest.approx(0.80)
    assert cat.expected_agreement("alpha", 0.8, selection="sensitivity") is None  # other strategy
    assert cat.expected_agreement("beta", 0.8) is None  # no curve
    assert cat.load_ratio_for_agreement(0.8, tasks=["alpha"]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="'beta'.*no quality curve"):
        cat.load_ratio_for_agreement(0.8)
    beta = load_profile(d / "beta.safetensors")
    agree = torch.tensor([[0.5, 0.6], [0.6, 0.75], [0.8, 0.92], [0.9, 1.0]])
    beta.set_quality_curve(QualityCurve([0.5, 0.7, 0.9, 1.0], [0.7, 1.0], agree, 1 - agree))
    beta.save(d / "beta.safetensors")
    cat = ProfileCatalog(d, read_manifest(packed))
    assert cat.load_ratio_for_agreement(0.8) == pytest.approx(0.8)  # beta needs ~0.78, alpha 0.80
    assert cat.load_ratio_for_agreement(0.9) == pytest.approx(0.9)  # beta needs 0.9 (0.92 at 0.9)


def test_a_profile_added_to_the_folder_is_found_by_name(tiny_models, tiny_profiles, tmp_path):
    """A user's new task file is served by name by an already running model (no restart)."""
    import shutil

    from selectinfer_ros.core.selection.loader import SelectiveModel
    d = tmp_path / "profiles"
    shutil.copytree(tiny_profiles["tiny-llama"], d)
    sm = SelectiveModel(tiny_models["tiny-llama"][1], d, "alpha", load_ratio=0.6, static_ratio=0.2)
    assert sm.catalog.tasks == ["alpha", "beta"]
    shutil.copy(d / "beta.safetensors", d / "my_task.safetensors")
    assert sm.catalog.tasks == ["alpha", "beta", "my_task"]
    report = sm.switch_task("my_task")
    assert report.task == "my_task" and sm.task == "my_task"


# -- confidence intervals, curves per weights format, the general profile -----------------------

def test_wilson_interval_matches_the_formula_and_narrows_with_tokens():
    from selectinfer_ros.core.selection.profiles import wilson_interval, with_ci
    lo, hi = wilson_interval(0.5, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    lo2, hi2 = wilson_interval(0.5, 2000)
    assert hi2 - lo2 < (hi - lo) / 4  # ~1/sqrt(n)
    lo, hi = wilson_interval(1.0, 65)  # the README's 65-token curve: not [1, 1]
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.9442, abs=1e-3)
    assert wilson_interval(0.7, 0) == (0.0, 1.0)
    assert with_ci(0.5, 100) == "0.500 [0.404, 0.596]"


def test_curves_are_stored_per_weights_format_and_an_old_file_reads_as_float(tmp_path):
    from dataclasses import replace

    from selectinfer_ros.core.selection.profiles import load_profile
    p = _profile(sens=[1.0, 2.0, 3.0, 4.0])
    p.set_quality_curve(_curve())  # weights "": an old (float) curve, version-2 names
    f = p.save(tmp_path / "t.safetensors")
    assert set(load_profile(f).quality_curves()) == {"float"}
    assert load_profile(f).quality_curve("int8").weights == "float"  # stands in, says so
    agree = _curve().agreement - 0.05
    p.set_quality_curve(replace(_curve(), agreement=agree, tokens=2400, weights="int8",
                                reference="dense float records"))
    p.save(f)
    prof = load_profile(f)
    assert set(prof.quality_curves()) == {"float", "int8"}
    c8 = prof.quality_curve("int8")
    assert c8.tokens == 2400 and c8.reference == "dense float records" and not c8.too_small
    assert c8.expected_agreement(0.8) == pytest.approx(0.75)
    assert prof.quality_curve("float").expected_agreement(0.8) == pytest.approx(0.80)
    assert prof.quality_curve().weights == "int8"  # the default records' curve first
    assert prof.quality_curve("float").too_small  # 300 tokens
    assert "[0.7" in c8.describe(0.8) and "2400 held-out tokens" in c8.describe(0.8)


def test_general_profile_is_the_fused_ranking_and_changes_no_task(tiny_models, tiny_profiles,
                                                                  tmp_path):
    """With no task given the model-wide (fused) neurons are loaded, not the first task's; a
    stored general profile leaves every task's selection as it was."""
    import shutil

    from selectinfer_ros.core.format.pack import read_manifest
    from selectinfer_ros.core.selection.loader import SelectiveModel
    from selectinfer_ros.core.selection.profiles import GENERAL_TASK, ProfileCatalog
    _, packed = tiny_models["tiny-llama"]
    m = read_manifest(packed)
    d = tmp_path / "p"
    shutil.copytree(tiny_profiles["tiny-llama"], d)
    cat = ProfileCatalog(d, m)
    before = select_published(cat.get("alpha").scores, cat.secondary_scores(), 0.6, 0.3)
    general = cat.general()
    assert general.task == GENERAL_TASK and general.info["fused_from"] == "alpha,beta"
    assert torch.allclose(general.scores, cat.secondary_scores())
    general.save(d / "general.safetensors")
    cat = ProfileCatalog(d, m)
    assert "general" in cat.tasks and cat.default_task == GENERAL_TASK
    after = select_published(cat.get("alpha").scores, cat.secondary_scores(), 0.6, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(before.neurons, after.neurons))
    sm = SelectiveModel(packed, d, None, load_ratio=0.6, static_ratio=0.3)
    assert sm.task == GENERAL_TASK
    (d / "general.safetensors").unlink()  # a folder without one: fused in memory, same neurons
    sm2 = SelectiveModel(packed, d, None, load_ratio=0.6, static_ratio=0.3)
    assert sm2.task == GENERAL_TASK
    assert all(torch.equal(a.slot_ids.sort().values, b.slot_ids.sort().values)
               for a, b in zip(sm.mlps, sm2.mlps))
    alpha = SelectiveModel(packed, d, "alpha", load_ratio=0.6, static_ratio=0.3)
    assert any(not torch.equal(a.slot_ids.sort().values, b.slot_ids.sort().values)
               for a, b in zip(sm.mlps, alpha.mlps))
