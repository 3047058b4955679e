"""llama.cpp beside the bench (lab/llama_cpp.py, scripts/build_llama_cpp.sh): what runs without
the llama.cpp build, plus a conversion check that runs where the build exists."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from selectinfer_ros.lab import llama_cpp
from selectinfer_ros.lab.bench import print_table

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
BUILD_SCRIPT = ROOT / "scripts" / "build_llama_cpp.sh"


def test_auto_without_a_build_says_how_to_build_it(tmp_path):
    env = {**os.environ, "SELECTINFER_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "selectinfer_ros.cli", "bench", "--quick",
                          "--llama-cpp", "auto"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"no llama-bench in {tmp_path / 'llama.cpp' / llama_cpp.VERSION}" in res.stderr
    assert "bash scripts/build_llama_cpp.sh" in res.stderr


def _fake_tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_an_explicit_build_folder_is_accepted_flat_or_with_bin(tmp_path):
    for exe in ("llama-bench", "llama-quantize"):
        _fake_tool(tmp_path / "flat" / exe, "exit 0")
        _fake_tool(tmp_path / "tree" / "bin" / exe, "exit 0")
    assert llama_cpp.find_build(str(tmp_path / "flat")) == tmp_path / "flat"
    assert llama_cpp.find_build(str(tmp_path / "tree")) == tmp_path / "tree"
    (tmp_path / "flat" / "llama-quantize").unlink()
    with pytest.raises(FileNotFoundError, match="no llama-quantize in"):
        llama_cpp.find_build(str(tmp_path / "flat"))


def test_real_llama_bench_output_parses_to_decode_and_prefill_rates():
    """test/lab/data/llama_bench_gemma3_q8_0.json is real output (see data/README.md)."""
    out = (DATA / "llama_bench_gemma3_q8_0.json").read_text()
    decode, prefill = llama_cpp.parse_bench(out)
    raw = json.loads(out)
    assert decode == next(r["avg_ts"] for r in raw if r["n_gen"] > 0) > 0
    assert prefill == next(r["avg_ts"] for r in raw if r["n_prompt"] > 0 and r["n_gen"] == 0) > decode


def test_rows_take_the_median_over_repeats_and_the_bandwidth_ceiling(tmp_path):
    gguf = tmp_path / "m-q8_0.gguf"
    gguf.write_bytes(b"\0" * 1000)
    s = llama_cpp.LlamaCppSubject("Q8_0", gguf, bytes_per_token=800)
    s.decode, s.prefill = [40.0, 50.0, 45.0], [200.0, 210.0, 190.0]
    row = s.row("m", dense_decode=30.0, dense_weight_bytes=4000, bw=80_000.0, threads=1)
    assert row["name"] == "llama.cpp Q8_0" and row["method"] == "llama.cpp"
    assert row["decode_tokens_per_second"] == 45.0 and row["prefill_tokens_per_second"] == 200.0
    assert (row["decode_tokens_per_second_min"], row["decode_tokens_per_second_max"]) == (40.0, 50.0)
    assert row["decode_speedup"] == 1.5 and row["weight_bytes"] == 1000 and row["weight_ratio"] == 0.25
    assert row["bandwidth_ceiling_tokens_per_second"] == 100.0 and row["fraction_of_ceiling"] == 0.45
    assert row["repeats"] == 3


def test_table_shows_llama_rows_beside_ours_with_the_q8_ratio(capsys):
    ours = {"name": "dense", "method": "dense", "decode_tokens_per_second": 20.0, "decode_speedup": 1.0,
            "fraction_of_ceiling": 0.5, "prefill_tokens_per_second": 100.0,
            "time_to_first_token": 0.3, "weight_bytes": 2**30, "weight_ratio": 1.0,
            "bytes_read": 2**30, "load_seconds": 1.0, "share_ffn": 0.6, "share_attention": 0.2,
            "share_output": 0.2, "vs_llama_cpp_q8_0": 0.5, "memory_bandwidth_bytes_per_second": 1e10}
    peer = {"name": "llama.cpp Q8_0", "method": "llama.cpp", "decode_tokens_per_second": 40.0,
            "decode_speedup": 2.0, "fraction_of_ceiling": 0.6, "prefill_tokens_per_second": 300.0,
            "weight_bytes": 2**28, "weight_ratio": 0.25, "vs_llama_cpp_q8_0": 1.0}
    print_table([ours, peer])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].rstrip().endswith("x llama Q8")
    assert lines[1].split()[-1] == "0.50" and lines[2].split()[-1] == "1.00"
    # llama-bench reports no TTFT, bytes read or load time
    assert lines[2].split()[2:] == ["40.00", "2.00", "0.60", "300.0", "-", "256.0", "0.25", "-", "-",
                                   "-", "1.00"]
    assert any(ln.startswith("llama.cpp rows:") for ln in lines)


def _write_gguf(path: Path, tied: bool) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((32, 8), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 8), np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((24, 8), np.float32))  # shape: only to tell apart
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bytes_per_token_count_tensors_and_the_embedding_only_when_tied(tmp_path):
    _write_gguf(tmp_path / "tied.gguf", tied=True)
    _write_gguf(tmp_path / "untied.gguf", tied=False)
    assert llama_cpp.bytes_per_decode_token(tmp_path / "tied.gguf") == (32 + 16) * 8 * 4
    assert llama_cpp.bytes_per_decode_token(tmp_path / "untied.gguf") == (16 + 24) * 8 * 4


def test_quantized_ggufs_are_made_once_and_renamed_into_place(tmp_path, monkeypatch):
    monkeypatch.setenv("SELECTINFER_CACHE", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    # stand-in for llama-quantize: `--allow-requantize IN OUT TYPE` -> a copy, counted
    _fake_tool(tmp_path / "build" / "bin" / "llama-quantize",
               f'[ "$1" = --allow-requantize ] || exit 3; echo "$4" >> {calls}; cp "$2" "$3"')
    source = tmp_path / "src.gguf"
    source.write_bytes(b"GGUF")
    out = llama_cpp.quantized(tmp_path / "build", source, "m", log=lambda s: None)
    assert list(out) == list(llama_cpp.TYPES)
    gdir = tmp_path / "cache" / "m" / "gguf"
    assert out["Q8_0"] == gdir / "m-q8_0.gguf" and out["F16"].read_bytes() == b"GGUF"
    assert sorted(p.name for p in gdir.iterdir() if not p.name.startswith(".")) == \
        ["m-f16.gguf", "m-q4_k_m.gguf", "m-q8_0.gguf"]
    assert not list(gdir.glob("*.tmp"))
    llama_cpp.quantized(tmp_path / "build", source, "m", log=lambda s: None)
    assert calls.read_text().split() == ["Q8_0", "F16", "Q4_K_M"]


def _flags(tmp_path: Path, cpu_flags: str) -> list[str]:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {cpu_flags}\n\nprocessor\t: 1\nflags\t\t: {cpu_flags}\n")
    res = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-flags"], capture_output=True, text=True,
                         env={**os.environ, "CPUINFO": str(info)}, timeout=60, check=True)
    return res.stdout.split()


def test_build_flags_native_without_amx(tmp_path):
    assert _flags(tmp_path, "fpu sse2 avx avx2 fma f16c bmi2") == ["-DGGML_NATIVE=ON"]
    assert _flags(tmp_path, "fpu avx2 fma avx512f avx512bw avx512_vnni") == ["-DGGML_NATIVE=ON"]


def test_build_flags_on_amx_list_the_cpu_extensions_with_amx_off(tmp_path):
    f = _flags(tmp_path, "fpu avx avx2 fma f16c bmi2 avx512f avx512bw avx512vbmi avx512_vnni "
                         "avx512_bf16 amx_bf16 amx_tile amx_int8")
    assert "-DGGML_NATIVE=OFF" in f
    for on in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
               "AVX512_BF16"):
        assert f"-DGGML_{on}=ON" in f, on
    assert "-DGGML_AVX_VNNI=OFF" in f
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(f)


def test_build_flags_never_force_what_the_cpu_lacks(tmp_path):
    """AMX without AVX-512 (hypothetical): nothing AVX-512 is switched on."""
    f = _flags(tmp_path, "fpu avx avx2 fma f16c amx_tile")
    assert "-DGGML_NATIVE=OFF" in f and "-DGGML_AVX2=ON" in f
    assert not [x for x in f if x.startswith("-DGGML_AVX512") and x.endswith("=ON")]
