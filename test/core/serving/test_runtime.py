"""Runtime: options as the nodes and the CLI give them (memory budget, defaults)."""
from __future__ import annotations

import json

import pytest

from selectinfer_ros.core.options import ModelOptions, ParamError, from_values
from selectinfer_ros.core.format.pack import read_manifest
from selectinfer_ros.core.serving.runtime import Runtime


def test_memory_budget_with_default_compute_ratio(tiny_models, tiny_profiles):
    """compute_ratio left at its default follows the gamma the budget chose (it used to follow
    the requested load_ratio and was refused: "compute_ratio must be in [0.3, 0.598], got 1.0")."""
    _, packed = tiny_models["tiny-llama"]
    m = read_manifest(packed)
    rt0 = Runtime(ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"])))
    other = rt0.memory()["other_weight_bytes"]
    budget_mb = (other + 0.6 * m.ffn_bytes) / 2**20
    rt = Runtime(ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"]),
                              task="alpha", memory_budget_mb=budget_mb))
    assert 0.5 < rt.load_ratio <= 0.6
    assert rt.compute_ratio == rt.load_ratio
    assert rt.selective.static_ratio == pytest.approx(0.3)
    assert rt.memory()["weight_bytes"] <= budget_mb * 2**20
    with pytest.raises(ValueError, match="compute_ratio 0.9 must not exceed it"):
        Runtime(ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"]),
                             memory_budget_mb=budget_mb, compute_ratio=0.9))


def test_options_are_validated_in_one_place():
    with pytest.raises(ParamError, match=r"load_ratio must be in \(0.0, 1.0\], got 1.5"):
        from_values(ModelOptions, {"load_ratio": 1.5})
    with pytest.raises(ParamError, match="selection must be one of"):
        from_values(ModelOptions, {"selection": "best"})
    with pytest.raises(ParamError, match="compute_ratio must be in"):
        from_values(ModelOptions, {"load_ratio": 0.5, "compute_ratio": 0.8})
    assert from_values(ModelOptions, {"static_ratio": -1.0}).ratios.static == 0.3
    assert from_values(ModelOptions, {"load_ratio": 1}).load_ratio == 1.0  # an int for a float


def test_min_agreement_and_memory_budget_the_stricter_wins(embedded, embedded_profiles):
    """gamma from the stored quality curve; a memory budget below it wins and says so."""
    base = dict(model=str(embedded), profiles=str(embedded_profiles), task="qa")
    logs: list[str] = []
    rt = Runtime(ModelOptions(**base, min_agreement=0.6), log=logs.append)
    curve = rt.selective.catalog.quality_curve("qa", rt.selective.manifest.weights)
    assert rt.load_choice.bound == "min_agreement"
    assert rt.load_ratio == curve.load_ratio_for(0.6, rt.load_choice.compute_share)
    assert rt.expected_agreement() >= 0.6
    assert any("min_agreement 0.60 -> load_ratio" in line for line in logs)
    other = rt.memory()["other_weight_bytes"]
    ffn_full = rt.memory()["ffn_weight_bytes"] / rt.load_ratio
    tight_mb = (other + 0.5 * ffn_full) / 2**20  # room for about gamma 0.5
    del rt
    logs.clear()
    rt = Runtime(ModelOptions(**base, min_agreement=0.99, memory_budget_mb=tight_mb),
                 log=logs.append)
    assert rt.load_choice.bound == "memory_budget" and rt.load_ratio <= 0.5
    assert any("bound: memory_budget" in line for line in logs)


def _other_bytes(packed) -> int:
    from selectinfer_ros.core.format.pack import OTHER_FILE
    from selectinfer_ros.core.format.safetensors_io import read_header
    tensors, _, _ = read_header(packed / OTHER_FILE)
    return sum(t.nbytes for t in tensors.values())


def test_memory_budget_chooses_load_ratio(tiny_models, tiny_profiles):
    """The budget is chosen in one place (the runtime); the weights fit it."""
    _, packed = tiny_models["tiny-llama"]
    m = read_manifest(packed)
    budget = _other_bytes(packed) + int(0.55 * m.ffn_bytes)
    rt = Runtime(ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"]),
                              task="alpha", static_ratio=0.2, memory_budget_mb=budget / 2**20))
    assert 0.5 <= rt.load_ratio <= 0.55
    assert rt.selective.weight_bytes()["total"] <= budget
    with pytest.raises(ValueError, match="leaves no room"):
        Runtime(ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"]),
                             memory_budget_mb=1000 / 2**20))


def test_memory_budget_counts_dense_layers(tiny_models, tiny_profiles):
    """The layers ``dense_layers`` keeps whole are part of the budget (they were not: a tiny
    model with dense_layers=1 loaded 922 KB for a 765 KB budget)."""
    _, packed = tiny_models["tiny-llama"]
    m = read_manifest(packed)
    layer = m.ffn_bytes // m.num_layers
    assert m.num_layers >= 3
    budget = _other_bytes(packed) + 2 * layer + int(0.5 * (m.num_layers - 2) * layer)
    rt = Runtime(ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"]),
                              task="alpha", static_ratio=0.1, dense_layers=1,
                              memory_budget_mb=budget / 2**20))
    sm = rt.selective
    assert 0.45 <= sm.load_ratio <= 0.5
    assert sm.weight_bytes()["total"] <= budget
    assert all(mlp.n_loaded == m.intermediate_size for i, mlp in enumerate(sm.mlps)
               if i in (0, m.num_layers - 1))
    assert sm.weight_bytes()["total"] >= budget - m.num_layers * m.record_bytes


def test_one_ratio_rule():
    """Ratios.resolve is the one place where compute_ratio 0 means the load and static_ratio -1
    means min(0.3, compute); a chosen load keeps an asked compute_ratio's share (min_agreement)
    or refuses one above it (memory budget)."""
    from selectinfer_ros.core.options import Ratios
    assert Ratios.resolve(0.8, -1.0, 0.0) == Ratios(0.8, 0.3, 0.8)
    assert Ratios.resolve(0.8, -1.0, 0.2) == Ratios(0.8, 0.2, 0.2)
    assert Ratios.resolve(0.8, 0.1, 0.4, chosen_load=0.4, bound="min_agreement") == \
        Ratios(0.4, 0.1, 0.2)
    with pytest.raises(ValueError, match="must not exceed"):
        Ratios.resolve(1.0, -1.0, 0.9, chosen_load=0.5, bound="memory_budget")
    with pytest.raises(ValueError, match="compute_ratio"):
        Ratios(0.5, 0.3, 0.2)
    r = Ratios(0.7, 0.3, 0.5)
    assert r.with_compute(0.0) == r and r.with_compute(0.6).compute == 0.6
    with pytest.raises(ValueError):
        r.with_compute(0.9)


def test_nothing_given_runs_int8_records_and_the_general_profile(embedded_profiles):
    """The embedded model with no options: int8 records (the CPU kernel), and with gamma < 1 and
    no task the general profile, not the alphabetically first task; float stays one option away."""
    from selectinfer_ros.core.format.default_model import DEFAULT_WEIGHTS
    logs: list[str] = []
    rt = Runtime(ModelOptions(load_ratio=0.7), log=logs.append)
    assert DEFAULT_WEIGHTS == "int8" and rt.selective.manifest.weights == "int8"
    assert rt.task == "general" and "general" in rt.tasks
    assert any("int8 decode kernel" in line or "int8 weights" in line for line in logs)
    del rt
    rt = Runtime(ModelOptions(weights="float", task="qa", load_ratio=0.7))
    assert rt.selective.manifest.weights == "float" and rt.task == "qa"


def test_memory_budget_on_the_embedded_model_chooses_records_from_its_measured_frontier(
        embedded_profiles):
    """Nothing but a 200 MiB budget: int8 records would fit only about a tenth of the neurons
    (the int8 embedding is 160 MiB), so the 4-bit output table's records (int8-q4emb, 186 MiB
    with every neuron) run; the log names the frontier's gap and measured speed."""
    from selectinfer_ros.core.serving.measured import MeasuredFrontier
    measured = MeasuredFrontier.load(embedded_profiles, "gemma3-270m")  # shipped
    assert measured is not None
    # the per-token rows (compute_mode token) do not stand in for the prompt mode's points
    rows = json.loads((embedded_profiles / "frontier.json").read_text())
    token = [r for r in rows if r.get("compute_mode") == "token"]
    ablation = [r for r in rows if r.get("ranking") == "random"]  # no node runs a random order
    assert token and len(measured.points) == sum(
        r["source"] == "selectinfer" for r in rows) - len(token) - len(ablation)
    assert measured.nearest("int8", 1.0, 0.7).agreement == next(
        r["agreement"] for r in rows if r["name"] == "selectinfer int8 1/0.7")
    logs: list[str] = []
    rt = Runtime(ModelOptions(memory_budget_mb=200, profiles=str(embedded_profiles)),
                 log=logs.append)
    assert rt.load_choice.weights == "int8-q4emb" and rt.load_choice.bound == "memory_budget"
    assert rt.selective.manifest.weights == "int8-q4emb"
    assert rt.memory()["weight_bytes"] <= 200 * 2**20
    said = next(line for line in logs if "bound: memory_budget" in line)
    # no task has an int8-q4emb curve: the lowest task curve (int8 or float) with its gap
    assert "measured on the frontier between int8-q4emb and " in said
    assert "measured decode" in said and "tok/s" in said
    assert 0.5 < rt.expected_agreement() < 0.95
