"""Choosing records, gamma and phi together from the measured curves (memory_budget_mb,
min_agreement): which point runs, and the log line that names it, its interval and the bound."""
from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from selectinfer_ros.core.options import ModelOptions
from selectinfer_ros.core.selection.profiles import QualityCurve, load_profile


@pytest.fixture(scope="module")
def two_packs(tiny_models, tiny_profiles, tmp_path_factory):
    """The tiny Llama as float and int8 records, and profiles whose curves say: int8 agrees 0.03
    less than float everywhere; phi = 0.7 gamma costs 0.1."""
    from selectinfer_ros.core.format.pack import pack
    hf, packed = tiny_models["tiny-llama"]
    root = tmp_path_factory.mktemp("choice")
    int8 = pack(hf, root / "packed-int8", weights="int8", log=lambda s: None).path
    d = root / "profiles"
    shutil.copytree(tiny_profiles["tiny-llama"], d)
    gammas = [0.5, 0.7, 0.9, 1.0]
    full = torch.tensor([[0.70], [0.80], [0.90], [1.0]])
    agree = torch.cat([full - 0.1, full], 1)
    for task in ("alpha", "beta"):
        prof = load_profile(d / f"{task}.safetensors")
        curve = QualityCurve(gammas, [0.7, 1.0], agree, 1 - agree, "", 40, 2500, "h.jsonl")
        prof.set_quality_curve(curve)
        prof.set_quality_curve(replace(curve, agreement=agree - 0.03, weights="int8"))
        prof.save(d / f"{task}.safetensors")
    return {"int8": str(int8), "float": str(packed)}, d


def _choose(packs, profiles, **kw):
    from selectinfer_ros.core.serving.choice import choose_point
    logs: list[str] = []
    return choose_point(ModelOptions(**kw), packs, profiles, logs.append), "\n".join(logs)


def test_min_agreement_runs_the_fastest_point_that_meets_it(two_packs):
    packs, d = two_packs
    c, log = _choose(packs, d, min_agreement=0.8)
    # int8 reads fewer bytes at any gamma; int8 needs 0.8 + 0.03 -> gamma 0.76 at phi = gamma,
    # or 0.93 at phi = 0.7 gamma (reads 0.65 of the FFN: less than 0.76)
    assert c.weights == "int8" and c.bound == "min_agreement"
    assert c.compute_share == pytest.approx(0.7) and c.load_ratio == pytest.approx(0.93)
    assert c.expected_agreement >= 0.8 - 1e-6  # float32 tables
    assert "min_agreement 0.80 -> load_ratio 0.93" in log and "bound: min_agreement" in log
    assert "int8 records" in log and "95 % CI over 2500 held-out tokens" in log
    assert "warning" not in log
    c, _ = _choose(packs, d, min_agreement=0.8, load_ratio=1.0, compute_ratio=1.0)  # phi fixed
    assert c.weights == "int8" and c.compute_share == 1.0 and c.load_ratio == pytest.approx(0.76)


def test_memory_budget_runs_the_best_agreement_that_fits(two_packs):
    from selectinfer_ros.core.selection.loader import SelectiveModel
    packs, d = two_packs
    sizes = {w: SelectiveModel(p).weight_bytes()["total"] for w, p in packs.items()}
    assert sizes["int8"] < sizes["float"]
    c, log = _choose(packs, d, memory_budget_mb=(sizes["float"] + 1024) / 2**20)
    assert c.weights == "float" and c.load_ratio == 1.0 and c.compute_share == 1.0  # the dense model
    c, log = _choose(packs, d, memory_budget_mb=(sizes["int8"] + 1024) / 2**20)
    assert c.weights == "int8" and c.load_ratio == 1.0 and c.bound == "memory_budget"
    assert "memory budget" in log and "bound: memory_budget" in log


def test_a_target_out_of_the_budgets_reach_runs_the_best_that_fits_and_says_so(two_packs):
    from selectinfer_ros.core.selection.loader import SelectiveModel
    packs, d = two_packs
    int8 = SelectiveModel(packs["int8"]).weight_bytes()
    budget = int8["other"] + 0.8 * int8["ffn"]  # room for gamma 0.8 of int8 records
    c, log = _choose(packs, d, min_agreement=0.99, memory_budget_mb=budget / 2**20)
    assert c.bound == "memory_budget" and c.weights == "int8" and 0.7 < c.load_ratio <= 0.8
    assert c.compute_share == 1.0  # the best agreement that fits computes every loaded neuron
    assert "min_agreement 0.99 is not met" in log and "bound: memory_budget" in log
    assert _choose(packs, d, min_agreement=0.99)[0].weights == "float"  # only float reaches it
    with pytest.raises(ValueError, match="no load_ratio <= 1 reaches it"):
        _choose({"int8": packs["int8"]}, d, min_agreement=0.99)


def test_a_small_curve_warns_with_its_interval(two_packs, tmp_path):
    packs, d = two_packs
    small = tmp_path / "p"
    shutil.copytree(d, small)
    for task in ("alpha", "beta"):
        prof = load_profile(small / f"{task}.safetensors")
        prof.set_quality_curve(replace(prof.quality_curve("int8"), tokens=65))
        prof.save(small / f"{task}.safetensors")
    c, log = _choose({"int8": packs["int8"]}, small, min_agreement=0.8)
    assert c.weights == "int8"
    assert "warning" in log and "only 65 held-out tokens" in log
    assert "95 % CI over 65 held-out tokens" in log


@pytest.fixture(scope="module")
def with_frontier(two_packs, tiny_models, tmp_path_factory):
    """two_packs plus int8-q4emb records (no task curves of their own) and a measured frontier
    beside the profiles: int8-q4emb agrees 0.05 less than int8 at every point and decodes
    faster (30 vs 20 tok/s at gamma 1)."""
    import json
    from selectinfer_ros.core.format.pack import pack, read_manifest
    packs, d = two_packs
    root = tmp_path_factory.mktemp("frontier")
    q4e = pack(tiny_models["tiny-llama"][0], root / "packed-int8-q4emb", weights="int8-q4emb",
               log=lambda s: None).path
    prof = root / "profiles"
    shutil.copytree(d, prof)
    model = read_manifest(packs["int8"]).model_id
    rows = [{"source": "llama.cpp", "model": "x", "weights": "Q4_0", "load_ratio": 1.0,
             "compute_ratio": 1.0, "agreement": 0.8, "decode_tokens_per_second": 50.0}]
    for w, base, tps in (("int8", 0.95, 20.0), ("int8-q4emb", 0.90, 30.0)):
        for g in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5):
            for phi in (g, round(0.7 * g, 4)):
                rows.append({"source": "selectinfer", "model": model, "weights": w,
                             "load_ratio": g, "compute_ratio": phi, "tokens": 2040, "threads": 1,
                             "agreement": base - (1 - g) / 2 - (g - phi) / 3, "cpu": "Test CPU",
                             "decode_tokens_per_second": tps / (0.5 + phi / 2)})
    (prof / "frontier.json").write_text(json.dumps(rows))
    return {**packs, "int8-q4emb": str(q4e)}, prof


def test_a_format_without_curves_takes_the_frontier_gap_and_its_measured_speed(with_frontier):
    from selectinfer_ros.core.selection.loader import SelectiveModel
    packs, d = with_frontier
    sizes = {w: SelectiveModel(p).weight_bytes() for w, p in packs.items()}
    assert sizes["int8-q4emb"]["total"] < sizes["int8"]["total"]
    budget = sizes["int8-q4emb"]["total"] + 1024  # every int8-q4emb neuron; int8 near gamma 0.8
    c, log = _choose(packs, d, memory_budget_mb=budget / 2**20)
    assert c.weights == "int8-q4emb" and c.load_ratio == 1.0 and c.compute_share == 1.0
    assert c.expected_agreement == pytest.approx(1.0 - 0.03 - 0.05, abs=1e-4)  # int8 curve - gap
    assert "-0.050 measured on the frontier between int8-q4emb and int8 records" in log
    assert "measured decode 30.0 tok/s (1 thread, Test CPU; frontier.json)" in log
    # min_agreement: the fastest measured point that meets it, its gap included
    c, log = _choose(packs, d, min_agreement=0.8)
    assert c.expected_agreement >= 0.8 - 1e-6
    speeds = {"int8": 20.0, "int8-q4emb": 30.0}
    phi = c.load_ratio * c.compute_share
    assert c.weights == "int8-q4emb"  # faster than int8 at any point that meets 0.8
    assert f"measured decode {speeds[c.weights] / (0.5 + round(phi, 1) / 2):.1f}" in log \
        or "at the nearest measured point" in log


def test_a_corrupt_or_foreign_frontier_file_is_refused_with_its_name(with_frontier, tmp_path):
    import json
    packs, d = with_frontier
    bad = tmp_path / "p"
    shutil.copytree(d, bad)
    (bad / "frontier.json").write_text('{"rows": 3}')
    with pytest.raises(ValueError, match="frontier.json: not a `selectinfer frontier` file"):
        _choose(packs, bad, memory_budget_mb=500)
    rows = json.loads((d / "frontier.json").read_text())
    for r in rows:
        r["model"] = "another-model"
    (bad / "frontier.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match="measured on another-model"):
        _choose(packs, bad, memory_budget_mb=500)


@pytest.fixture(scope="module")
def with_tiers(with_frontier, tiny_models, tmp_path_factory):
    """with_frontier plus 4-bit records (an int8 tier in their pack) and frontier rows: q4 alone
    agrees 0.10 below int8, with an int8 tier of 0.3 0.02 below; the random-ranking row of the
    same tier (0.5 below) is the ablation, which no node runs."""
    import json
    from selectinfer_ros.core.format.pack import pack, read_manifest
    packs, d = with_frontier
    root = tmp_path_factory.mktemp("tiers")
    q4 = pack(tiny_models["tiny-llama"][0], root / "packed-q4", weights="q4", log=lambda s: None).path
    prof = root / "profiles"
    shutil.copytree(d, prof)
    rows = json.loads((d / "frontier.json").read_text())
    model = read_manifest(q4).model_id
    for r8, ranking, below, tps in ((0.0, "profile", 0.10, 40.0), (0.3, "profile", 0.02, 35.0),
                                    (0.3, "random", 0.5, 35.0)):
        rows.append({"source": "selectinfer", "model": model, "weights": "q4", "load_ratio": 1.0,
                     "compute_ratio": 1.0, "int8_ratio": r8, "ranking": ranking, "tokens": 2040,
                     "threads": 1, "agreement": 0.95 - below, "cpu": "Test CPU",
                     "decode_tokens_per_second": tps})
    (prof / "frontier.json").write_text(json.dumps(rows))
    return {**packs, "q4": str(q4)}, prof


def test_a_tiered_point_is_chosen_by_its_measured_gap_and_its_bytes(with_tiers):
    from selectinfer_ros.core.selection.loader import SelectiveModel
    from selectinfer_ros.core.serving.measured import MeasuredFrontier
    packs, d = with_tiers
    m = MeasuredFrontier.load(d, SelectiveModel(packs["q4"]).manifest.model_id)
    assert m.tiers("q4") == [0.3] and m.tiers("int8") == []
    assert m.nearest("q4+int8:0.3", 1.0, 1.0).agreement == pytest.approx(0.93)  # not the ablation
    tiered = SelectiveModel(packs["q4"], d, "alpha", int8_ratio=0.3).weight_bytes()["total"]
    plain = SelectiveModel(packs["q4"], d, "alpha").weight_bytes()["total"]
    int8 = SelectiveModel(packs["int8"], d, "alpha").weight_bytes()["total"]
    assert plain < tiered < int8
    # a budget that holds the tiered q4 records at gamma 1 but int8 only near 0.8: the tier wins
    # (int8 curve 1.0 - 0.03, gap -0.02 -> 0.95; int8 at its gamma agrees less)
    c, log = _choose(packs, d, memory_budget_mb=(tiered + 4096) / 2**20)
    assert c.weights == "q4" and c.int8_ratio == 0.3 and c.load_ratio == pytest.approx(1.0)
    assert c.expected_agreement == pytest.approx(1.0 - 0.03 - 0.02, abs=1e-4)
    assert "q4 records with an int8 tier of 0.3" in log
    assert "measured on the frontier between q4+int8:0.3 and int8 records" in log
    assert "measured decode 35.0 tok/s (1 thread, Test CPU" in log
    # the chosen point runs: the loader holds that tier
    sm = SelectiveModel(c.path, d, "alpha", load_ratio=c.load_ratio, int8_ratio=c.int8_ratio)
    assert sm.weight_bytes()["total"] <= (tiered + 4096)
    # a budget below the tier's bytes: not the tier
    c, log = _choose(packs, d, memory_budget_mb=(plain + 4096) / 2**20)
    assert c.int8_ratio is None


def test_without_task_curves_the_frontier_rows_give_the_agreement(with_tiers, tmp_path):
    """Profiles measured without held-out curves (here: beta's): the frontier's measured rows
    stand in, each point taking the best row of its format that holds no more neurons."""
    from selectinfer_ros.core.selection.loader import SelectiveModel
    packs, d = with_tiers
    bare = tmp_path / "profiles"
    shutil.copytree(d, bare)
    prof = load_profile(bare / "beta.safetensors")
    for k in [k for k in prof.extra if k.startswith("quality_")]:
        del prof.extra[k]
    prof.save(bare / "beta.safetensors")
    tiered = SelectiveModel(packs["q4"], d, "alpha", int8_ratio=0.3).weight_bytes()["total"]
    # the budget holds the tier at gamma 1 (row 0.93) and int8 near gamma 0.8 (row 0.8/0.8: 0.85)
    c, log = _choose(packs, bare, memory_budget_mb=(tiered + 4096) / 2**20)
    assert c.weights == "q4" and c.int8_ratio == 0.3
    assert c.expected_agreement == pytest.approx(0.93)
    assert "frontier row q4+int8:0.3 1/1; no quality curve in the beta profile" in log
    int8_budget = SelectiveModel(packs["int8"], d, "alpha").weight_bytes()["total"] * 0.75
    c, log = _choose({"int8": packs["int8"]}, bare, memory_budget_mb=int8_budget / 2**20)
    assert 0.5 < c.load_ratio < 0.9 and "(fewer neurons than this point: a floor)" in log
    floor = max(0.95 - (1 - g) / 2 for g in (0.5, 0.6, 0.7, 0.8) if g <= c.load_ratio)
    assert c.expected_agreement == pytest.approx(floor)
    # min_agreement: the fastest measured row meeting it (all timed on one CPU and thread count)
    c, log = _choose(packs, bare, min_agreement=0.9)
    assert c.weights == "q4" and c.int8_ratio == 0.3 and "measured decode 35.0 tok/s" in log
    c, log = _choose(packs, bare, min_agreement=0.94)  # only int8 at gamma = phi = 1 holds 0.95
    assert c.weights == "int8" and c.load_ratio == 1.0 and c.compute_share == 1.0
    with pytest.raises(ValueError, match="no load_ratio <= 1 reaches it"):
        _choose(packs, bare, min_agreement=0.99)
