"""Per-token selection (compute_mode token): calibration tables, their storage in profiles, and
the torch path against the dense model with the same neurons masked per token."""
from __future__ import annotations

import shutil

import pytest
import torch

from selectinfer_ros.core.format.pack import pack, read_manifest
from selectinfer_ros.core.format.safetensors_io import FormatError
from selectinfer_ros.core.selection import token_rule
from selectinfer_ros.core.selection.loader import SelectiveModel, load_dense
from selectinfer_ros.core.selection.profiles import ProfileCatalog, load_profile


def test_tables_give_the_shares_they_name():
    g = torch.Generator().manual_seed(0)
    cal = token_rule.Calibration(2)
    x = torch.randn(2000, 300, generator=g).abs()
    cal.add(0, x, x * x)
    cal.add(1, 3 * x, x)
    gate, act = cal.tables()
    assert token_rule.check_tables(gate, act, 2) is None
    for share in (0.1, 0.3, 0.5, 0.8):
        gt, at = token_rule.thresholds(gate, act, share)
        assert abs(float((x * x >= at[0]).float().mean()) - share) < 0.03
        assert abs(float((x >= at[1]).float().mean()) - share) < 0.03
        cand = token_rule.candidate_share(share)
        assert abs(float((3 * x >= gt[1]).float().mean()) - cand) < 0.03
    assert token_rule.thresholds(gate, act, 1.0) == ([0.0, 0.0], [0.0, 0.0])


def test_bad_tables_are_named():
    good = torch.linspace(1, 0, token_rule.SHARES).repeat(3, 1)
    assert token_rule.check_tables(good, good, 3) is None
    assert "shape" in token_rule.check_tables(good[:2], good, 3)
    assert "non-increasing" in token_rule.check_tables(good.flip(-1), good, 3)
    nan = good.clone()
    nan[1, 4] = float("nan")
    assert "NaN" in token_rule.check_tables(good, nan, 3)


@pytest.fixture(scope="module")
def calibrated(tiny_models, token_profiles, tmp_path_factory):
    """tiny-llama float, int8 and q4 packs, and a profile that carries the per-token thresholds."""
    hf, packed = tiny_models["tiny-llama"]
    root = tmp_path_factory.mktemp("token")
    packs = {w: pack(hf, root / w, weights=w, log=lambda s: None).path for w in ("int8", "q4")}
    packs["float"] = packed
    return packed, packs, token_profiles


def _masked_reference(sm: SelectiveModel, packed, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """The dense float model, each decode token's MLP keeping the neurons that clear the
    thresholds of ``sm``'s layers (computed here from the float weights)."""
    dense, _ = load_dense(packed)
    thr = [(mlp.gate_thr, mlp.act_thr) for mlp in sm.mlps]
    box: dict[int, torch.Tensor] = {}

    def gate_hook(layer, act_fn):
        def post(_m, _a, out):
            box[layer] = act_fn(out)
        return post

    def down_hook(layer):
        def pre(_m, args):
            a = args[0]
            keep = (box[layer].abs() >= thr[layer][0]) & (a.abs() >= thr[layer][1])
            keep[:, :prefix] = True  # the prefill computes every loaded neuron
            return (a * keep,)
        return pre

    for i, blk in enumerate(dense.model.layers):
        blk.mlp.gate_proj.register_forward_hook(gate_hook(i, blk.mlp.act_fn))
        blk.mlp.down_proj.register_forward_pre_hook(down_hook(i))
    with torch.no_grad():
        return dense(ids).logits[0, prefix - 1:-1].float()


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_token_mode_keeps_what_clears_the_thresholds(calibrated, weights):
    """Float records: equal to the dense model masked per token. int8 / 4-bit: their rounding
    moves some neurons across a threshold, so they are only far closer to that than to the
    unmasked model."""
    packed, packs, profiles = calibrated
    sm = SelectiveModel(packs[weights], profiles, "alpha", load_ratio=1.0, static_ratio=0.3,
                        compute_ratio=1.0, compute_mode="token")
    ids = torch.randint(4, 500, (1, 40), generator=torch.Generator().manual_seed(5))
    prefix = 16
    from selectinfer_ros.core.execution.engine import Engine
    eng = Engine.from_selective(sm)
    full = eng.score(ids[0, :prefix].tolist(), ids[0, prefix:].tolist())
    sm.set_compute_ratio(0.4)
    before = sm.counts()
    part = eng.score(ids[0, :prefix].tolist(), ids[0, prefix:].tolist())
    shares = sm.read_shares(before)
    # the share computed is near the target, the candidates between it and all
    assert 0.25 < shares["computed_share"] < 0.5, shares
    assert shares["computed_share"] <= shares["candidate_share"] < 1.0
    assert shares["read_share"] < 0.85
    ref = _masked_reference(sm, packed, ids, prefix)
    err = float((part - ref).abs().max() / ref.abs().max())
    moved = float((part - full).abs().max() / full.abs().max())  # what the mask changes
    assert moved > 0.1
    assert err < (1e-5 if weights == "float" else 0.6 * moved), (err, moved)


def test_token_mode_at_share_one_equals_every_loaded_neuron(calibrated):
    _, packs, profiles = calibrated
    ids = torch.randint(4, 500, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    from selectinfer_ros.core.execution.engine import Engine
    for weights in ("float", "int8"):
        out = {}
        for mode in ("prompt", "token"):
            sm = SelectiveModel(packs[weights], profiles, "alpha", load_ratio=1.0, compute_mode=mode)
            out[mode] = Engine.from_selective(sm).score(ids[:10], ids[10:])
        err = float((out["prompt"] - out["token"]).abs().max() / out["prompt"].abs().max())
        # int8: the prompt mode quantizes the down product's activations, the token mode's
        # torch path multiplies them in float
        assert err < (1e-5 if weights == "float" else 0.03), (weights, err)


def test_profiles_without_thresholds_are_refused_for_token_mode(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-llama"]
    with pytest.raises(ValueError, match="no per-token thresholds.*calibrate-only"):
        SelectiveModel(packed, tiny_profiles["tiny-llama"], "alpha", load_ratio=1.0,
                       compute_mode="token")
    with pytest.raises(ValueError, match="needs a profiles folder"):
        SelectiveModel(packed, None, None, load_ratio=1.0, compute_mode="token")
    with pytest.raises(ValueError, match="compute_mode"):
        SelectiveModel(packed, None, None, load_ratio=1.0, compute_mode="sometimes")


def test_stored_tables_are_checked_and_fused(calibrated, tmp_path):
    packed, _, profiles = calibrated
    m = read_manifest(packed)
    d = tmp_path / "p"
    shutil.copytree(profiles, d)
    prof = load_profile(d / "alpha.safetensors", m)
    beta = load_profile(d / "alpha.safetensors", m)
    beta.task = "beta"
    beta.extra[token_rule.GATE_KEY] = beta.extra[token_rule.GATE_KEY] * 4
    beta.save(d / "beta.safetensors")
    general = ProfileCatalog(d, m).general()
    fused = general.extra[token_rule.GATE_KEY]
    assert torch.allclose(fused, prof.extra[token_rule.GATE_KEY] * 2, rtol=1e-4)  # geometric mean
    bad = load_profile(d / "alpha.safetensors", m)
    bad.extra[token_rule.ACT_KEY] = bad.extra[token_rule.ACT_KEY].flip(-1)
    bad.save(d / "alpha.safetensors")  # a valid checksum over values that make no thresholds
    with pytest.raises(FormatError, match="non-increasing"):
        load_profile(d / "alpha.safetensors", m)
    del bad.extra[token_rule.ACT_KEY]
    bad.save(d / "alpha.safetensors")
    with pytest.raises(FormatError, match="one of the two"):
        load_profile(d / "alpha.safetensors", m)


def test_a_switch_to_a_task_without_thresholds_is_refused_and_changes_nothing(calibrated, tmp_path):
    packed, packs, profiles = calibrated
    d = tmp_path / "p"
    shutil.copytree(profiles, d)
    beta = load_profile(d / "alpha.safetensors", read_manifest(packed))
    beta.task = "beta"
    beta.scores = beta.scores.flip(-1)  # other neurons: a switch would read some
    del beta.extra[token_rule.GATE_KEY], beta.extra[token_rule.ACT_KEY]
    beta.save(d / "beta.safetensors")
    sm = SelectiveModel(packs["int8"], d, "alpha", load_ratio=0.5, static_ratio=0.3,
                        compute_mode="token")
    before = [ids.clone() for ids in sm.loaded_neuron_ids()]
    with pytest.raises(ValueError, match="'beta' has no per-token thresholds"):
        sm.switch_task("beta")
    assert sm.task == "alpha"
    assert all(torch.equal(a, b) for a, b in zip(before, sm.loaded_neuron_ids()))
