"""`selectinfer bench --quick` and `selectinfer eval --quick` write their files with sane values."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from selectinfer_ros.core.format.kernel import cpu_description
from selectinfer_ros.lab.textmetrics import chrf, exact_match, rouge_l


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "selectinfer_ros.cli", *args], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_bench_quick_writes_json_and_plot(tiny_models, tiny_profiles, tmp_path):
    _, packed = tiny_models["tiny-llama"]
    out = _cli("bench", "--quick", "--model", str(packed), "--profiles", str(tiny_profiles["tiny-llama"]),
               "--task", "alpha", "--threads", "1", "--weights", "float", "int8", "q4", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench_speed_vs_memory.png").stat().st_size > 10_000
    assert "decode tok/s" in out.stdout
    assert {r["cpu"] for r in rows} == {cpu_description()} and "kernel " in rows[0]["cpu"]
    assert f"CPU: {cpu_description()}, 1 thread(s)" in out.stdout
    names = [r["name"] for r in rows]
    assert names[0] == "dense" and "selectinfer 0.7/0.5" in names and "int8 weight-only" in names
    dense = rows[0]
    assert dense["decode_speedup"] == 1.0 and dense["weight_ratio"] == 1.0
    for r in rows:
        for key in ("decode_tokens_per_second", "prefill_tokens_per_second", "time_to_first_token",
                    "weight_bytes", "bytes_read", "load_seconds", "peak_rss_bytes",
                    "memory_bandwidth_bytes_per_second", "bytes_per_decode_token"):
            assert r[key] > 0, (r["name"], key)
        assert 0 < r["decode_speedup"] < 100
        assert 0.0 <= r["share_ffn"] + r["share_attention"] + r["share_output"] <= 1.05
    sel = {r["name"]: r for r in rows if r["method"] == "selectinfer"}
    # Resident weights and bytes read follow gamma; decode bytes per token follow phi.
    assert sel["selectinfer 0.7/0.7"]["weight_bytes"] < sel["selectinfer 1/1"]["weight_bytes"]
    assert sel["selectinfer 0.7/0.7"]["bytes_read"] < sel["selectinfer 1/1"]["bytes_read"]
    assert sel["selectinfer 0.7/0.5"]["bytes_per_decode_token"] < sel["selectinfer 0.7/0.7"]["bytes_per_decode_token"]
    assert "selection_seconds" in sel["selectinfer 0.7/0.5"]
    # int8 neuron records: the same grid, a quarter of the float32 FFN bytes read
    q = sel["selectinfer int8 0.7/0.5"]
    assert q["weights"] == "int8" and sel["selectinfer 0.7/0.5"]["weights"] == "float"
    assert q["bytes_read"] < 0.5 * sel["selectinfer 0.7/0.5"]["bytes_read"]
    assert q["bytes_per_decode_token"] < 0.5 * sel["selectinfer 0.7/0.5"]["bytes_per_decode_token"]
    # 4-bit records (4.5 bits per weight against int8's 8), int8 attention and output rows
    q4 = sel["selectinfer q4 0.7/0.5"]
    assert q4["weights"] == "q4"
    assert q4["bytes_read"] < q["bytes_read"] and q4["weight_bytes"] < q["weight_bytes"]
    assert q4["bytes_per_decode_token"] < q["bytes_per_decode_token"]


def test_bench_rows_take_the_agreement_the_frontier_measured_for_their_configuration(tmp_path):
    from selectinfer_ros.lab.bench import attach_agreement
    rows = [{"name": "dense", "method": "dense"},
            {"name": "selectinfer q4-all 1/1", "method": "selectinfer"},
            {"name": "llama.cpp Q4_K_M", "method": "llama.cpp"}]
    front = tmp_path / "frontier.json"
    assert attach_agreement(rows, front) == 0 and all("agreement" not in r for r in rows)  # none
    front.write_text("{not json")
    assert attach_agreement(rows, front) == 0
    front.write_text(json.dumps([{"name": "selectinfer q4-all 1/1", "agreement": 0.9686},
                                 {"name": "llama.cpp Q4_K_M", "agreement": 0.9799},
                                 {"name": "selectinfer int8 1/1", "agreement": 0.9917}]))
    assert attach_agreement(rows, front) == 2
    assert "agreement" not in rows[0]
    assert rows[1]["agreement"] == 0.9686 and rows[1]["source"] == "selectinfer"
    assert rows[2]["agreement"] == 0.9799 and rows[2]["source"] == "llama.cpp"
    assert rows[1]["agreement_from"] == str(front)


def test_bench_token_rows_measure_what_they_read(tiny_models, token_profiles, tmp_path):
    """Per-token rows (compute_mode token): the shares computed and read are measured over the
    timed runs, and the bytes per decode token follow them."""
    _, packed = tiny_models["tiny-llama"]
    _cli("bench", "--quick", "--model", str(packed), "--profiles", str(token_profiles), "--task",
         "alpha", "--threads", "1", "--weights", "int8", "--no-quant", "--compute-modes", "prompt",
         "token", "--out", str(tmp_path))
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench.json").read_text())}
    tok, prompt = rows["selectinfer int8 0.7/0.5 token"], rows["selectinfer int8 0.7/0.5"]
    assert tok["compute_mode"] == "token" and "compute_mode" not in prompt
    assert 0.2 < tok["computed_share"] < 0.6 and tok["computed_share"] <= tok["candidate_share"]
    full = rows["selectinfer int8 0.7/0.7"]["bytes_per_decode_token"]
    assert tok["bytes_per_decode_token"] < full and tok["decode_tokens_per_second"] > 0


@pytest.mark.timeout(1500)  # a whole quick eval of the real model: minutes on 2 busy cores
def test_eval_quick_on_embedded_model(embedded, embedded_profiles, tmp_path):
    _cli("eval", "--quick", "--only", "loading_only,random", "--threads", "2", "--out", str(tmp_path),
         timeout=1500)
    rows = json.loads((tmp_path / "eval.json").read_text())
    assert (tmp_path / "eval_accuracy_vs_memory.png").exists()
    by = {r["method"]: r for r in rows}
    assert set(by) == {"dense", "loading_only", "random"}
    assert by["dense"]["next_token_agreement"] == 1.0 and by["dense"]["mean4_frac"] == 1.0
    for r in rows:
        assert 0 <= r["qa_em"] <= 1 and 0 <= r["translation_chrf"] <= 100
        assert r["prose_ppl"] >= 1 and r["summary_ref_ppl"] >= 1
    # The paper's central claim on a real model: profiled loading beats random loading.
    assert by["loading_only"]["next_token_agreement"] > by["random"]["next_token_agreement"] + 0.2
    assert by["loading_only"]["prose_ppl"] < by["random"]["prose_ppl"]
    assert by["loading_only"]["weight_bytes"] == by["random"]["weight_bytes"] < by["dense"]["weight_bytes"]


def test_text_metrics():
    assert exact_match(" The Rome.", "rome") == 1.0 and exact_match("Paris", "Rome") == 0.0
    assert chrf(["le chat dort"], ["le chat dort"]) == 100.0
    assert 0 < chrf(["le chien dort"], ["le chat dort"]) < 100
    assert rouge_l("a robot picks the cup", "the robot picks up a cup") > 0.5
    assert rouge_l("", "x") == 0.0


@pytest.mark.timeout(1500)
def test_eval_cross_phrasing_quick(embedded, embedded_profiles, tmp_path):
    """Both directions (profiles of one phrasing on prompts of the other); the per-task agreement
    and the stored curve's prediction sit beside each other."""
    _cli("eval", "--quick", "--cross-phrasing", "--alt-profiles", str(embedded_profiles), "--only",
         "loading_only", "--headline-only", "--threads", "1", "--out", str(tmp_path), timeout=1500)
    rows = json.loads((tmp_path / "eval.json").read_text())
    assert {r["direction"] for r in rows} == {"A->B", "B->A"}
    assert {r["data"].rsplit("/", 1)[-1] for r in rows} == {"eval", "eval_alt"}
    for r in rows:
        assert 0 <= r["qa_em"] <= 1 and 0 <= r["task_agreement"] <= 1 and "mean4_frac" in r
        if r["method"] == "dense":
            assert r["task_agreement"] == 1.0 and r["qa_agreement"] == 1.0
        else:
            assert 0 < r["qa_kl"] and r["qa_agreement"] < 1.0


def test_answer_containment():
    from selectinfer_ros.lab.textmetrics import contains
    assert contains(" Leonardo da Vinci painted it", "Leonardo da Vinci") == 1.0
    assert contains(" Parisian", "Paris") == 0.0 and contains("", "x") == 0.0


def test_eval_answers_only_with_one_profile_for_every_task(embedded, embedded_profiles, tmp_path):
    """`--answers qa --task general`: only QA answers (no agreement, no perplexity), every task
    on the general profile (what runs when no task is given), as fractions of dense."""
    _cli("eval", "--quick", "--answers", "qa", "--task", "general", "--only",
         "loading_only,selectinfer-token", "--compute-modes", "prompt", "token",
         "--threads", "1", "--out", str(tmp_path), timeout=1500)
    rows = json.loads((tmp_path / "eval.json").read_text())
    # the shipped profiles carry the per-token thresholds: the grid point's per-token row too
    assert [r["method"] for r in rows] == ["dense", "selectinfer-token", "loading_only"]
    assert [r["compute_mode"] for r in rows] == ["prompt", "token", "prompt"]
    for r in rows:
        assert 0 <= r["qa_em"] <= 1 and "qa_agreement" not in r and "prose_ppl" not in r
    if rows[0]["qa_em"] > 0:  # 3 items: the dense model may miss them all
        assert rows[0]["qa_em_frac"] == 1.0
        assert rows[1]["qa_em_frac"] == pytest.approx(rows[1]["qa_em"] / rows[0]["qa_em"])
