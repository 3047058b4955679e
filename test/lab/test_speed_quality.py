"""The speed-at-quality table (lab/speed_quality.py)."""
from __future__ import annotations

import pytest

from selectinfer_ros.lab import speed_quality as sq


def _row(name: str, mib: float, agreement: float, source: str, tok_s: float) -> dict:
    return {"name": name, "weight_bytes": int(mib * 2**20), "agreement": agreement,
            "source": source, "decode_tokens_per_second": tok_s}


def test_speed_at_quality_takes_the_fastest_row_of_each_side_that_reaches_it(capsys):
    rows = [_row("ours q4", 954, 0.969, "selectinfer", 30.0),
            _row("ours tier", 1173, 0.982, "selectinfer", 28.0),
            _row("ours int8", 1700, 0.992, "selectinfer", 20.0),
            _row("llama.cpp Q4_K_M", 1066, 0.980, "llama.cpp", 25.0),
            _row("llama.cpp Q4_0", 1017, 0.950, "llama.cpp", 40.0)]
    t = {q["min_agreement"]: q for q in sq.speed_at_quality(rows)}
    assert t[0.95]["ours"] == "ours q4" and t[0.95]["llama_cpp"] == "llama.cpp Q4_0"
    assert t[0.95]["ratio"] == pytest.approx(30.0 / 40.0)
    assert t[0.97]["ours"] == "ours tier" and t[0.97]["llama_cpp"] == "llama.cpp Q4_K_M"
    assert t[0.98]["ours"] == "ours tier" and t[0.98]["ratio"] == pytest.approx(28.0 / 25.0)
    assert t[0.99]["ours"] == "ours int8" and t[0.99]["llama_cpp"] is None and t[0.99]["ratio"] is None
    sq.print_speed_at_quality(rows)
    out = capsys.readouterr().out
    assert ">= 0.98: ours ours tier (0.9820, 28.0); llama.cpp llama.cpp Q4_K_M (0.9800, 25.0); 1.12x" in out
    assert ">= 0.99: ours ours int8 (0.9920, 20.0); llama.cpp -; -" in out


def test_the_speed_quality_plot_draws_both_sides(tmp_path):
    from selectinfer_ros.lab.plots import speed_quality_plot
    rows = [_row("selectinfer q4-all 1/1", 954, 0.969, "selectinfer", 24.5),
            _row("llama.cpp Q4_K_S", 1022, 0.981, "llama.cpp", 20.6),
            {"name": "dense", "decode_tokens_per_second": 2.3, "weight_bytes": 1}]  # no agreement
    for r in rows[:2]:
        r["method"] = r["source"]
    out = speed_quality_plot(rows, tmp_path / "sq.png", title="t")
    assert out.stat().st_size > 10_000
