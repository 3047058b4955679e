"""``selectinfer frontier`` (lab/frontier.py): the Pareto front, llama-perplexity's
``--kl-divergence-base`` file written and read back against the format of
tools/perplexity/perplexity.cpp, the metrics, and the whole command on a tiny random model
(llama.cpp is not built in CI: its output parser is checked on recorded output)."""
from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from selectinfer_ros.lab import frontier as fr

DATA = Path(__file__).parent / "data"


def _row(name: str, mib: float, agreement: float) -> dict:
    return {"name": name, "weight_bytes": int(mib * 2**20), "agreement": agreement}


def test_pareto_front_keeps_only_rows_no_other_beats():
    rows = [_row("a", 100, 0.80), _row("b", 200, 0.90), _row("c", 150, 0.70),  # c: a beats it
            _row("d", 200, 0.85),  # d: b has the same bytes and more agreement
            _row("e", 400, 0.99), _row("f", 400, 0.99), _row("g", 50, 0.10)]
    front = fr.pareto(rows)
    assert [rows[i]["name"] for i in front] == ["g", "a", "b", "e", "f"]  # ties both stay


def test_best_within_a_budget_and_the_budget_table():
    rows = [dict(_row("ours 0.5", 140, 0.90), source="selectinfer", decode_tokens_per_second=50.0),
            dict(_row("llama Q4_0", 230, 0.93), source="llama.cpp", decode_tokens_per_second=60.0),
            dict(_row("ours 1", 990, 1.0), source="selectinfer", decode_tokens_per_second=20.0)]
    table = {b["budget_mib"]: b for b in fr.budget_table(rows, (100, 150, 250, 1000))}
    assert table[100]["best"] is None and table[100]["llama_cpp"] is None
    assert table[150]["best"] == "ours 0.5" and table[150]["llama_cpp"] is None
    assert table[250]["best"] == "llama Q4_0" and table[250]["llama_cpp"] == "llama Q4_0"
    assert table[1000]["best"] == "ours 1" and table[1000]["agreement"] == 1.0


def _reference_row(logits: np.ndarray) -> tuple[float, float, list[int]]:
    """perplexity.cpp's log_softmax(n_vocab, logits, uint16_t * log_prob, tok), line by line in
    Python: (scale, min_log_prob, q)."""
    max_logit, min_logit = float(logits.max()), float(logits.min())
    min_logit = max(min_logit, max_logit - 16)
    sum_exp = sum(math.exp(float(v) - max_logit) for v in logits)
    min_log_prob = min_logit - max_logit - math.log(sum_exp)
    scale = (max_logit - min_logit) / 65535.0
    q = [int(np.rint((float(v) - min_logit) / scale)) if v > min_logit else 0 for v in logits]
    return scale, min_log_prob, q


@pytest.mark.parametrize("n_vocab", [7, 50])  # odd: rows padded to an even count
def test_base_file_layout_and_round_trip(tmp_path, n_vocab):
    g = torch.Generator().manual_seed(0)
    n_ctx, n_chunk = 10, 3
    tokens = torch.randint(0, n_vocab, (n_chunk, n_ctx), generator=g).numpy().astype(np.int32)
    m = fr.scored_per_chunk(n_ctx)
    assert m == 4  # positions 5..8 of each chunk, predicting tokens 6..9
    logits = [torch.randn(m, n_vocab, generator=g) * 6 for _ in range(n_chunk)]
    logits[0][1] = 0.0  # a flat row: scale 0, all zero (memset in perplexity.cpp)
    path = tmp_path / "base.kld"
    with open(path, "wb") as f:
        fr.write_base_header(f, n_ctx, n_vocab, tokens)
        for lg in logits:
            f.write(fr.encode_log_probs(lg).tobytes())
    raw = path.read_bytes()
    nv = 2 * ((n_vocab + 1) // 2) + 4
    # The layout byte by byte: magic, uint32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens
    assert raw[:8] == b"_logits_"
    assert struct.unpack("<Iii", raw[8:20]) == (n_ctx, n_vocab, n_chunk)
    assert np.array_equal(np.frombuffer(raw[20:20 + 4 * n_ctx * n_chunk], "<i4").reshape(n_chunk, n_ctx), tokens)
    body = raw[20 + 4 * n_ctx * n_chunk:]
    assert len(body) == n_chunk * m * nv * 2
    rows = np.frombuffer(body, "<u2").reshape(n_chunk, m, nv)
    for c in range(n_chunk):
        for i in range(m):
            scale, min_lp = struct.unpack("<ff", rows[c, i, :4].tobytes())
            want_scale, want_min, want_q = _reference_row(logits[c][i].numpy())
            assert scale == pytest.approx(want_scale, rel=1e-5, abs=1e-12)
            if want_scale == 0:
                assert (rows[c, i] == 0).all()
                continue
            assert min_lp == pytest.approx(want_min, abs=1e-4)
            q = rows[c, i, 4:4 + n_vocab].astype(int)
            assert np.abs(q - np.array(want_q)).max() <= 1  # float32 vs double rounding
            assert (rows[c, i, 4 + n_vocab:] == 0).all()
    # Read back: tokens, and log-probs within half a step of the true ones above max - 16
    base = fr.BaseFile.read(path)
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (n_ctx, n_vocab, n_chunk)
    assert np.array_equal(base.tokens, tokens)
    for lg, lp in zip(logits, base.chunks()):
        true = torch.log_softmax(lg, -1)
        for i in range(m):
            if float(lg[i].max() - lg[i].min()) == 0:
                continue
            above = lg[i] > lg[i].max() - 16
            step = float(lg[i].max() - max(lg[i].min(), lg[i].max() - 16)) / 65535
            assert torch.allclose(lp[i][above], true[i][above], atol=step + 1e-4)
            assert (lp[i][~above] <= -16 + 1e-4).all()
    # A truncated file is refused
    path.write_bytes(raw[:-2])
    with pytest.raises(ValueError, match="the header says"):
        fr.BaseFile.read(path)


def test_kl_and_top_against_the_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 40, generator=g) * 3
    base = fr.decode_log_probs(fr.encode_log_probs(logits), 40)
    kl, same = fr.kl_and_top(logits, base)
    assert same.all() and kl.abs().max() < 1e-3  # itself, up to the uint16 steps
    other = logits.clone()
    other[:, 0] = logits.max(-1).values + 5  # token 0 now always on top
    kl2, same2 = fr.kl_and_top(other, base)
    assert (same2 == (logits.argmax(-1) == 0)).all() and (kl2 > 0.1).all()
    # perplexity.cpp's sum over the reference's tokens above e^-16 of p_base (log p_base - log p)
    lp = torch.log_softmax(other, -1)
    want = torch.where(base > -16, base.exp() * (base - lp), torch.zeros_like(lp)).sum(-1)
    assert torch.allclose(kl2, want, atol=1e-4)
    lo, hi = fr.wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert fr.wilson(100, 100)[1] == pytest.approx(1.0) and fr.wilson(100, 100)[0] == pytest.approx(0.963, abs=1e-3)


def test_llama_perplexity_output_parses():
    """test/lab/data/llama_perplexity_kld_gemma3_q8_0.txt: real ``llama-perplexity
    --kl-divergence`` output (see data/README.md)."""
    out = (DATA / "llama_perplexity_kld_gemma3_q8_0.txt").read_text()
    top, kl = fr.parse_perplexity(out)
    assert 0.5 < top < 1.0 and 0.0 < kl < 1.0
    assert f"Same top p: {100 * top:6.3f}" in out and f"Mean    KLD: {kl:10.6f}" in out
    with pytest.raises(RuntimeError, match="Same top p"):
        fr.parse_perplexity("main: failed to load model\n")


def test_weight_formats_are_those_pack_writes():
    from selectinfer_ros.core.format.pack import WEIGHTS
    assert fr.weight_formats(None) == list(WEIGHTS) and "float" in WEIGHTS
    assert fr.weight_formats(["int8"]) == ["int8"]
    with pytest.raises(ValueError, match="unknown weights int3"):
        fr.weight_formats(["int3"])


def test_frontier_command_on_a_tiny_model(tiny_models, tiny_profiles, tmp_path):
    _, packed = tiny_models["tiny-llama"]
    g = torch.Generator().manual_seed(2)
    text = tmp_path / "heldout.txt"
    text.write_text("\n".join(" ".join(f"w{int(t)}" for t in torch.randint(4, 500, (40,), generator=g))
                              for _ in range(4)))
    res = subprocess.run([sys.executable, "-m", "selectinfer_ros.cli", "frontier", "--model", str(packed),
                          "--profiles", str(tiny_profiles["tiny-llama"]), "--data", str(text),
                          "--ctx", "32", "--tokens", "60", "--repeats", "1", "--new-tokens", "3",
                          "--weights", "float", "int8",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "profile: alpha (no 'general' profile" in res.stderr
    rows = json.loads((tmp_path / "out" / "frontier.json").read_text())
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 10_000
    assert not list((tmp_path / "out").glob("frontier-*"))  # the base file's folder is gone
    ours = [r for r in rows if r["source"] == "selectinfer"]
    assert {r["weights"] for r in ours} == {"float", "int8"} and len(ours) == 24
    assert {r["name"] for r in rows if r["source"] == "torch"} == {"torch int8 weight-only"}
    assert "torch int4 skipped" in res.stderr  # hidden 64: not a multiple of the int4 group
    for r in rows:
        assert r["tokens"] == 4 * fr.scored_per_chunk(32) == 60  # 4 chunks, 15 scored in each
        assert 0 <= r["agreement_ci_low"] <= r["agreement"] <= r["agreement_ci_high"] <= 1
        assert r["kl"] >= -1e-4 and r["weight_bytes"] > 0 and r["decode_tokens_per_second"] > 0
    by = {r["name"]: r for r in rows}
    full = by["selectinfer float 1/1"]
    assert full["agreement"] == 1.0 and full["kl"] < 1e-3  # the dense model itself
    assert by["selectinfer float 0.5/0.35"]["weight_bytes"] < by["selectinfer float 0.9/0.9"]["weight_bytes"] < full["weight_bytes"]
    assert by["selectinfer int8 1/1"]["weight_bytes"] < full["weight_bytes"]
    assert max(rows, key=lambda r: (r["agreement"], -r["weight_bytes"]))["pareto"]
    assert min(rows, key=lambda r: (r["weight_bytes"], -r["agreement"]))["pareto"]
    assert "cross-check" not in res.stdout  # no llama.cpp rows
    assert "best within a weight budget:" in res.stdout


def test_token_rows_beside_the_prompt_rows_and_merged(tiny_models, token_profiles, tmp_path):
    """Per-token rows (compute_mode token) carry their measured shares; --merge keeps an earlier
    run's rows, this run's replacing those of the same name, and recomputes the front."""
    _, packed = tiny_models["tiny-llama"]
    g = torch.Generator().manual_seed(4)
    words = [" ".join(f"w{int(t)}" for t in torch.randint(4, 500, (40,), generator=g)) for _ in range(4)]
    text = tmp_path / "heldout.txt"
    text.write_text("\n".join(words))
    common = [sys.executable, "-m", "selectinfer_ros.cli", "frontier", "--model", str(packed),
              "--profiles", str(token_profiles), "--data", str(text), "--ctx", "32",
              "--tokens", "60", "--repeats", "1", "--new-tokens", "3", "--weights", "int8",
              "--gammas", "1", "--no-quant"]
    first = subprocess.run(common + ["--out", str(tmp_path / "a")], capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    res = subprocess.run(common + ["--compute-modes", "token", "--token-shares", "0.5",
                                   "--merge", str(tmp_path / "a" / "frontier.json"),
                                   "--out", str(tmp_path / "b")], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "b" / "frontier.json").read_text())}
    assert set(rows) == {"selectinfer int8 1/1", "selectinfer int8 1/0.7", "selectinfer int8 1/0.5 token"}
    tok = rows["selectinfer int8 1/0.5 token"]
    assert tok["compute_mode"] == "token" and rows["selectinfer int8 1/1"]["compute_mode"] == "prompt"
    assert 0.3 < tok["computed_share"] < 0.6, tok
    assert tok["computed_share"] <= tok["candidate_share"] <= 1.0
    assert tok["read_share"] == pytest.approx((1.0 + tok["candidate_share"] + tok["computed_share"]) / 3)
    assert tok["agreement"] < 1.0 and rows["selectinfer int8 1/1"]["agreement"] > tok["agreement"]
    assert sum(r["pareto"] for r in rows.values()) >= 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{**tok, "heldout": "something else"}]))
    bad = subprocess.run(common + ["--merge", str(other)], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "its heldout is 'something else'" in bad.stderr


def test_tier_rows_and_the_random_ranking_ablation(tiny_models, tiny_profiles, tmp_path):
    """--int8-ratios adds the tiered rows of a 4-bit pack (the same pack, more bytes than one tier),
    --rankings random the ablation at exactly the tiered row's bytes; the tier plot is drawn and
    the dense reference kept for a later --base."""
    _, packed = tiny_models["tiny-llama"]
    g = torch.Generator().manual_seed(5)
    text = tmp_path / "heldout.txt"
    text.write_text("\n".join(" ".join(f"w{int(t)}" for t in torch.randint(4, 500, (40,), generator=g))
                              for _ in range(4)))
    common = [sys.executable, "-m", "selectinfer_ros.cli", "frontier", "--model", str(packed),
              "--profiles", str(tiny_profiles["tiny-llama"]), "--data", str(text), "--ctx", "32",
              "--tokens", "60", "--repeats", "1", "--new-tokens", "3", "--weights", "q4",
              "--gammas", "1", "--phi-shares", "1", "--no-quant"]
    res = subprocess.run(common + ["--int8-ratios", "0.3", "1.5", "--rankings", "profile", "random",
                                   "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "out" / "frontier.json").read_text())}
    assert set(rows) == {"selectinfer q4 1/1", "selectinfer q4 1/1 int8 0.3",
                         "selectinfer q4 1/1 int8 0.3 random"}  # 1.5: not below gamma, no row
    one, tier, rnd = (rows["selectinfer q4 1/1"], rows["selectinfer q4 1/1 int8 0.3"],
                      rows["selectinfer q4 1/1 int8 0.3 random"])
    assert (one["int8_ratio"], tier["int8_ratio"], rnd["int8_ratio"]) == (0.0, 0.3, 0.3)
    assert (tier["ranking"], rnd["ranking"]) == ("profile", "random")
    assert one["weight_bytes"] < tier["weight_bytes"] == rnd["weight_bytes"]
    assert (tmp_path / "out" / "tiers.png").stat().st_size > 10_000
    base = tmp_path / "out" / "dense-logits.kld"
    again = subprocess.run(common + ["--base", str(base)], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(--base)" in again.stderr and "selectinfer q4 1/1: agreement" in again.stderr
    assert f"selectinfer q4 1/1: agreement {one['agreement']:.4f}" in again.stderr
