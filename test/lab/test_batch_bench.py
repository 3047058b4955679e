"""The batched-decode bench: every batch size against the requests alone, mixed compute ratios."""
from __future__ import annotations

import json

import torch

from selectinfer_ros.lab import batch_bench


def test_the_bench_rates_each_batch_against_the_requests_alone(tiny_models, tiny_profiles,
                                                              tmp_path, capsys):
    """Requests of their own prompts and compute ratios (0.3, 0.6 of gamma 0.7): a row per batch
    size and one for the requests alone, with the ratios to it, printed and written."""
    _, packed = tiny_models["tiny-llama"]
    out = tmp_path / "rows.json"
    threads = torch.get_num_threads()
    try:
        assert batch_bench.main([
            "--model", str(packed), "--profiles", str(tiny_profiles["tiny-llama"]),
            "--weights", "int8", "--threads", "1", "--batches", "1", "2", "--new-tokens", "4",
            "--prompt-tokens", "8", "--repeats", "1", "--load-ratio", "0.7",
            "--compute-ratios", "0.3", "0.6", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())
    assert [r["subject"] for r in rows] == ["alone", "B=1", "B=2"]
    assert rows[0]["ratio"] == 1.0 and all(r["tokens_per_second"] > 0 for r in rows)
    assert all(r["ratio"] == r["tokens_per_second"] / rows[0]["tokens_per_second"] for r in rows)
    printed = capsys.readouterr().out
    assert "gamma 0.7, phi 0.3 0.6 (a prompt each)" in printed and "B=2" in printed
