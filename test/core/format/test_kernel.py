"""The C kernel's contract and its paths: the ABI check refuses a library that disagrees with the
ctypes mirrors, no compiler means the float fallback (with the reason logged, same results), a
compiler without OpenMP builds a one-thread kernel, and every instruction-set path this CPU runs
gives the plain C path's results to float rounding, for single products and whole decode steps
(of a packed model, and of kernel_harness.c's small models: prompt and per-token selection)."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selectinfer_ros.core.format import int8, kernel
from selectinfer_ros.core.format.pack import pack

# K: odd block counts (the AVX-512 paths take two blocks at once), partial blocks, K < 32, one
# block, two (one AVX-512 pair, no eight-block group: a tiny model's rows, 24 activation rows),
# nine (AVX2: eight blocks at once and one alone); M >= 4 takes the blocked product of a prefill
# (AVX-512 VNNI, NEON): tiles of rows with a partial last one, K beyond one chunk of blocks, M
# not a multiple of the rows per pass
SHAPES = [(7, 45, 3), (64, 640, 1), (130, 2048, 5), (33, 31, 2), (9, 96, 1), (12, 100, 2),
          (5, 160, 1), (64, 1024, 1), (16, 32, 2), (64, 64, 24), (8, 288, 1), (97, 1100, 4),
          (50, 1000, 13), (49, 2080, 64)]


def _linear(k: kernel.Kernel, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None,
            threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], q.shape[0])
    rc = k.lib.si_linear_i8(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), q.shape[0],
                            q.stride(0), scale.data_ptr() if scale is not None else None,
                            y.data_ptr(), threads)
    assert rc == 0
    return y


def _tile_linear(k: kernel.Kernel, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 threads: int) -> torch.Tensor:
    """The rows packed as tiles by this library, their product; every row and column read back,
    and rows and columns written anew read back (partial quads and tiles included)."""
    N, K = q.shape
    tiles = torch.empty(k.lib.si_tile_bytes(N, K), dtype=torch.uint8)
    assert k.lib.si_tile_pack(q.data_ptr(), N, K, q.stride(0), tiles.data_ptr(), threads) == 0

    def io(name: str, ids: torch.Tensor, rows: torch.Tensor) -> int:
        return getattr(k.lib, f"si_tile_{name}")(tiles.data_ptr(), N, K, ids.data_ptr(),
                                                 ids.numel(), rows.data_ptr())

    rows, cols = torch.arange(N), torch.arange(K)
    back, back_t = torch.empty(N, K, dtype=torch.int8), torch.empty(K, N, dtype=torch.int8)
    assert io("rows", rows, back) == 0 and torch.equal(back, q)
    assert io("cols", cols, back_t) == 0 and torch.equal(back_t, q.t())
    g = torch.Generator().manual_seed(N * K)
    some_rows = torch.randperm(N, generator=g)[: N // 2 + 1]
    some_cols = torch.randperm(K, generator=g)[:3]
    new = torch.randint(-127, 128, (some_rows.numel(), K), dtype=torch.int8, generator=g)
    new_t = torch.randint(-127, 128, (3, N), dtype=torch.int8, generator=g)
    assert io("put_rows", some_rows, new) == 0 and io("put_cols", some_cols, new_t) == 0
    want = q.clone()
    want[some_rows] = new
    want[:, some_cols] = new_t.t()
    assert io("rows", rows, back) == 0 and torch.equal(back, want)
    assert io("put_rows", rows, q.contiguous()) == 0  # as packed again
    assert io("rows", torch.tensor([N]), back) == -1 and io("cols", torch.tensor([K]), back_t) == -1
    y = torch.empty(x.shape[0], N)
    assert k.lib.si_tile_linear(x.data_ptr(), x.shape[0], K, tiles.data_ptr(), N, K,
                                scale.data_ptr(), y.data_ptr(), threads) == 0
    return y


def _cases():
    g = torch.Generator().manual_seed(7)
    for n, kk, m in SHAPES:
        q, scale = int8.quantize_rows(torch.randn(n, kk + 13, generator=g))
        yield q[:, :kk], scale, torch.randn(m, kk, generator=g)  # a column prefix of wider rows


def test_kernel_reports_its_path_and_abi():
    k = kernel.kernel()
    assert k is not None, kernel.status()
    assert k.isa == kernel.candidates()[0][0]  # the best path the CPU has
    assert kernel.status().startswith(f"int8 kernel ({k.isa}, ")
    kernel.check_abi(k.lib)
    assert k.path.name.startswith("selectinfer_kernel-") and f"-{k.isa}-" in k.path.name


def test_isa_choice_follows_the_cpu_flags():
    zen4 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert kernel.candidates("x86_64", zen4)[0][0] == "avx512vnni"
    assert kernel.candidates("x86_64", {"avx2", "fma", "f16c", "avx_vnni"})[0][0] == "avxvnni"
    assert [n for n, _ in kernel.candidates("x86_64", {"avx2", "fma", "f16c"})] == ["avx2", "plain"]
    assert kernel.candidates("x86_64", {"sse2"})[0][0] == "plain"
    orin = {"fp", "asimd", "asimdhp", "asimddp", "lrcpc", "dcpop"}  # Cortex-A78AE
    assert kernel.candidates("aarch64", orin)[0][0] == "neon-dotprod"
    assert kernel.candidates("aarch64", orin | {"i8mm"})[0][0] == "neon-i8mm"
    with pytest.raises(kernel.KernelError, match="this CPU lacks avx512_vnni"):
        kernel.candidates("x86_64", {"avx2", "fma"}, forced="avx512vnni")
    with pytest.raises(kernel.KernelError, match="not one of"):
        kernel.candidates("x86_64", zen4, forced="sve")


def test_abi_mismatch_is_refused(tmp_path):
    with pytest.raises(kernel.KernelError, match=r"kernel ABI mismatch: version 999 in C, "
                                                 rf"{kernel.ABI_VERSION} in Python"):
        kernel.load(cache=tmp_path, extra_flags=("-DSI_ABI_VERSION=999",))
    k = kernel.kernel()
    sizes = list(kernel.STRUCT_SIZES)
    sizes[1] += 8  # a Python mirror of si_layer with one field more than the C struct
    with pytest.raises(kernel.KernelError, match=rf"si_layer {sizes[1] - 8} bytes in C, "
                                                 rf"{sizes[1]} in Python"):
        kernel.check_abi(k.lib, sizes=tuple(sizes))


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates()])
def test_every_path_of_this_cpu_equals_the_plain_c_path(isa, tmp_path):
    plain, k = kernel.load(isa="plain"), kernel.load(isa=isa)
    assert k.isa == isa and plain.isa == "plain"
    for q, scale, x in _cases():
        want = _linear(plain, x, q, scale, 1)
        for threads in (1, 2, 3):
            got = _linear(k, x, q, scale, threads)
            # the same integer block products; only the float sums' order differs
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), \
                (isa, q.shape, threads)
            tiles = _tile_linear(k, x, q, scale, threads)  # the same rows held as tiles
            assert torch.allclose(tiles, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), \
                (isa, q.shape, threads)


# A whole int8 model in a child process (the kernel is chosen once per process): teacher-forced
# logits of the lean decoder, selection on (gamma 0.7, phi 0.5), 2 threads.
_CHILD = r"""
import sys, torch
from selectinfer_ros.core.format import int8
from selectinfer_ros.core.selection.loader import SelectiveModel
from selectinfer_ros.core.execution.engine import Engine
torch.set_num_threads(2)
packed, profiles, out = sys.argv[1:4]
lines = []
sm = SelectiveModel(packed, profiles, "alpha", load_ratio=0.7, static_ratio=0.3,
                    compute_ratio=0.5, log=lines.append)
e = Engine.from_selective(sm)
ids = torch.randint(4, 500, (24,), generator=torch.Generator().manual_seed(5)).tolist()
with torch.inference_mode():
    e._start(torch.tensor([ids[:10]]))
    logits = [e.decoder.prefill(ids[:10], extra=14)]
    e._end_prefill()
    logits += [e.decoder.decode_one_token(t) for t in ids[10:]]
g = torch.Generator().manual_seed(2)
q, s = int8.quantize_rows(torch.randn(40, 100, generator=g))
x = torch.randn(3, 100, generator=g)
lin = (int8.linear(x, q, s) - x @ (q.float() * s[:, None]).T).abs().max() / x.abs().max()
from selectinfer_ros.core.format import q4
p4, d4 = q4.quantize(torch.randn(40, 192, generator=g))
x4 = torch.randn(3, 192, generator=g)
lin4 = (q4.linear(x4, p4, d4) - x4 @ q4.dequantize(p4, d4).T).abs().max() / x4.abs().max()
# three requests in three KV slots at different positions: a batched step against each alone
d = e.decoder
d.reserve(32, 3)
for s, n in enumerate((4, 9, 6)):
    d.prefill(ids[s:s + n], extra=4, slot=s)
start = list(d.lengths)
alone = torch.stack([d.decode_batch([t], [s])[0] for s, t in enumerate((7, 8, 9))])
d.lengths[:] = start
batch_diff = float((d.decode_batch([7, 8, 9], [0, 1, 2]) - alone).abs().max())
torch.save(dict(logits=torch.stack(logits), lines=lines, path=e.decoder.path,
                status=int8.kernel_status(), linear_err=float(lin),
                q4_err=float(lin4), batch_diff=batch_diff), out)
"""


@pytest.fixture(scope="module")
def int8_tiny(tiny_models, tiny_profiles, tmp_path_factory):
    hf, _ = tiny_models["tiny-gemma3"]
    path = pack(hf, tmp_path_factory.mktemp("kernel") / "int8", weights="int8",
                log=lambda s: None).path
    return path, tiny_profiles["tiny-gemma3"]


def _child(int8_tiny, tmp_path: Path, **env: str) -> dict:
    out = tmp_path / "child.pt"
    res = subprocess.run([sys.executable, "-c", _CHILD, str(int8_tiny[0]), str(int8_tiny[1]),
                          str(out)], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs().amax(dim=-1) / b.std(dim=-1)


@pytest.fixture(scope="module")
def plain_run(int8_tiny, tmp_path_factory):
    r = _child(int8_tiny, tmp_path_factory.mktemp("plain"), SELECTINFER_KERNEL_ISA="plain")
    assert r["path"] == "int8 decode kernel" and r["status"].startswith("int8 kernel (plain, ")
    return r


def test_without_a_compiler_the_float_fallback_says_why_and_agrees(int8_tiny, plain_run, tmp_path):
    r = _child(int8_tiny, tmp_path, CC=str(tmp_path / "no-such-cc"),
               SELECTINFER_CACHE=str(tmp_path / "cache"))
    why = f"float fallback (cannot run the C compiler '{tmp_path / 'no-such-cc'}'"
    assert r["status"].startswith(why), r["status"]
    assert any(line.startswith(f"[load] int8 weights: {why}") for line in r["lines"]), r["lines"]
    assert r["path"].startswith("torch ops (float fallback (cannot run the C compiler")
    assert r["linear_err"] < 1e-5 and r["q4_err"] < 1e-5  # the float product of dequantized rows
    # float activations instead of int8 ones: the same model to int8 noise
    cos = torch.nn.functional.cosine_similarity(r["logits"], plain_run["logits"], dim=-1)
    assert float(cos.min()) > 0.99
    assert float((r["logits"].argmax(-1) == plain_run["logits"].argmax(-1)).float().mean()) >= 0.8


def test_a_compiler_without_openmp_builds_a_one_thread_kernel(int8_tiny, plain_run, tmp_path):
    cc = tmp_path / "cc-no-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && '
                  '{ echo "cc1: error: unsupported option -fopenmp" >&2; exit 1; }; done\n'
                  'exec cc "$@"\n')
    cc.chmod(0o755)
    k = kernel.load(cc=str(cc), cache=tmp_path / "cache")
    assert not k.openmp and "1 thread" in k.describe()
    assert k.lib.si_max_threads() == 1
    plain = kernel.load(isa="plain")
    for q, scale, x in _cases():
        want = _linear(plain, x, q, scale, 1)
        got = _linear(k, x, q, scale, 4)  # asks for 4, runs on 1
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    r = _child(int8_tiny, tmp_path, CC=str(cc), SELECTINFER_CACHE=str(tmp_path / "cache"))
    assert "no OpenMP in the compiler: 1 thread" in r["status"] and r["path"] == "int8 decode kernel"
    assert float(_rel(r["logits"], plain_run["logits"]).median()) < 1e-3


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates() if n != "plain"])
def test_decode_steps_of_every_path_equal_the_plain_c_path(isa, int8_tiny, plain_run, tmp_path):
    """Whole decode steps on two threads. Float rounding can move an activation across an int8
    rounding step (see test_decode), so: most steps equal, all within int8 noise."""
    r = _child(int8_tiny, tmp_path, SELECTINFER_KERNEL_ISA=isa)
    assert r["status"].startswith(f"int8 kernel ({isa}, ") and r["path"] == "int8 decode kernel"
    rel = _rel(r["logits"], plain_run["logits"])
    assert float(rel.median()) < 1e-3 and float(rel.max()) < 0.2, rel
    # a batched step's rows equal the same rows stepped alone, exactly, on every path
    assert r["batch_diff"] == 0.0 and plain_run["batch_diff"] == 0.0, r["batch_diff"]


# kernel_harness.c (see test_kernel_aarch64.py) built for every path of this CPU: single products
# and whole decode steps of small int8 and 4-bit models, with an active prefix and with per-token
# selection (si_layer.token, its kept and candidate counts), on 2 threads
HARNESS = Path(__file__).with_name("kernel_harness.c")
_HARNESS_KINDS = ("linear", "tiles", "tilerows", "q4", "axpy", "decode", "decodetl", "decode4",
                  "decodet", "keptt", "candt", "decode4t", "kept4t", "cand4t", "batchpa",
                  "batchpb", "batchta", "batchtb")


def check_harness_batches(got: dict, plain: dict) -> None:
    """The harness's batch of 3 rows (4-bit model; active prefix "p", per-token "t"): each step's
    rows together equal the same rows stepped alone exactly, and the plain C path's within int8
    noise (see the decode steps)."""
    for kind in ("batchp", "batcht"):
        alone, together = got[kind + "a"], got[kind + "b"]
        assert len(alone) == len(together) == len(plain[kind + "b"]) == 4
        assert all(torch.equal(a, b) for a, b in zip(alone, together)), kind
        rel = torch.stack([(a - b).abs().max() / b.std() for a, b in zip(together, plain[kind + "b"])])
        assert float(rel.median()) < 1e-3 and float(rel.max()) < 0.05, (kind, rel)


def check_harness_products(got: dict, plain: dict, isa: str) -> None:
    """Single products: the same block sums as the plain C path's (axpy: in the same order);
    rows held as tiles equal the rows (the same blocks, a partial one in float) and read back
    unchanged."""
    for kind in ("linear", "tiles", "q4", "axpy"):
        assert len(got[kind]) == len(plain[kind]) > 0
        for a, b in zip(got[kind], plain[kind]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max())), (isa, kind)
    assert len(got["tiles"]) == len(got["linear"])
    for a, b in zip(got["tiles"], got["linear"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max())), isa
    assert got["tilerows"] and all(float(t) == 1.0 for t in got["tilerows"]), isa
    # decode steps with the attention projections and the neuron slots as tiles (80 of 96
    # neurons active: a partial block): the steps with rows, to the last bit of a float sum
    # moving an int8 activation by one step
    assert len(got["decodetl"]) == len(got["decode"]) == 6
    rel = torch.stack([(a - b).abs().max() / b.std()
                       for a, b in zip(got["decodetl"], got["decode"])])
    assert float(rel.median()) < 1e-3 and float(rel.max()) < 0.05, (isa, rel)


def _harness(isa: str, tmp: Path) -> dict:
    cflags = dict(kernel.candidates(forced=isa))[isa]
    exe = tmp / f"harness-{isa}"
    cc = os.environ.get("CC") or "cc"
    build = subprocess.run([cc, "-O3", "-std=c11", "-fopenmp", *cflags,
                            f"-I{kernel.SOURCE.parent}", str(HARNESS), "-o", str(exe), "-lm"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    res = subprocess.run([str(exe), "candidates"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out: dict = {k: [] for k in _HARNESS_KINDS}
    for line in res.stdout.splitlines():
        kind, *rest = line.split()
        if kind == "isa":
            out["isa"] = rest[0]
        else:
            out[kind].append(torch.tensor([float.fromhex(v) for v in rest[2:]]))
    return out


@pytest.fixture(scope="module")
def plain_harness(tmp_path_factory):
    return _harness("plain", tmp_path_factory.mktemp("harness"))


@pytest.mark.parametrize("isa", [n for n, _ in kernel.candidates() if n != "plain"])
def test_harness_of_every_path_equals_the_plain_c_path(isa, plain_harness, tmp_path):
    got, plain = _harness(isa, tmp_path), plain_harness
    assert got["isa"] == isa and plain["isa"] == "plain"
    check_harness_products(got, plain, isa)
    # whole decode steps: a float sum's last bit can move an int8 activation by one step, and
    # (per token) a neuron within a last bit of a threshold across it
    for kind in ("decode", "decode4", "decodet", "decode4t"):
        assert len(got[kind]) == len(plain[kind]) == 6
        rel = torch.stack([(a - b).abs().max() / b.std() for a, b in zip(got[kind], plain[kind])])
        assert float(rel.median()) < 1e-3 and float(rel.max()) < 0.05, (isa, kind, rel)
    check_harness_batches(got, plain)
    check_harness_batches(plain, plain)
    for kind in ("keptt", "kept4t"):  # neurons kept per layer and step: about half of 80
        counts, want = torch.stack(got[kind]), torch.stack(plain[kind])
        assert counts.shape == (6, 2) and 20 <= float(want.min()) and float(want.max()) <= 60
        assert float((counts - want).abs().max()) <= 1, (isa, kind, counts, want)
    # candidates (up row read) per layer and step: at least the kept, fewer than all 80
    for kind, kept in (("candt", "keptt"), ("cand4t", "kept4t")):
        counts, want = torch.stack(got[kind]), torch.stack(plain[kind])
        assert counts.shape == (6, 2) and float(want.max()) < 80
        assert bool((want >= torch.stack(plain[kept])).all()), (kind, want, plain[kept])
        assert bool((want > torch.stack(plain[kept])).any()), (kind, want, plain[kept])
        assert float((counts - want).abs().max()) <= 1, (isa, kind, counts, want)


@pytest.fixture
def groups_kernel():
    k = kernel.kernel()
    if k is None or not k.lib.si_q4g_pays():
        pytest.skip("the 4-bit groups run on the x86 vector paths only")  # not this CPU's path
    saved = k.lib.si_tune(-1)
    yield k
    k.lib.si_tune(saved)  # the process's setting, as the other tests found it


def test_the_fetch_calibration_measures_every_setting(groups_kernel):
    gbps = kernel.calibrate(groups_kernel, choices=(0, 2), nbytes=4 << 20, repeats=1)
    assert set(gbps) == {0, 2} and all(v > 0.1 for v in gbps.values())
    assert groups_kernel.lib.si_q4g_calibrate(100, 8, 2, 1) == -2  # not whole pairs of blocks


def test_tune_calibrates_once_per_cpu_then_reads_the_cache(groups_kernel, tmp_path, monkeypatch):
    monkeypatch.delenv(kernel.PF_ENV, raising=False)
    monkeypatch.setattr(kernel, "CALIBRATE_BYTES", 4 << 20)
    first = kernel.tune(groups_kernel, cache=tmp_path)
    assert first["source"] == "calibrated" and first["pf_half"] in kernel.PF_CHOICES
    measured = {int(c): v for c, v in first["gbps"].items()}
    assert set(measured) == set(kernel.PF_CHOICES)
    assert first["pf_half"] == max(measured, key=measured.get)  # the fastest measured
    saved = json.loads((tmp_path / "tuning.json").read_text())
    (key,) = saved  # (an entry of a library no longer built would have gone: see below)
    assert kernel.cpu_model() in key and groups_kernel.isa in key
    saved[key]["pf_half"] = 3 if first["pf_half"] != 3 else 1  # the cache decides from now on
    (tmp_path / "tuning.json").write_text(json.dumps(saved))
    again = kernel.tune(groups_kernel, cache=tmp_path)
    assert again["source"] == "cached" and again["pf_half"] == saved[key]["pf_half"]
    assert groups_kernel.lib.si_tune(-1) == saved[key]["pf_half"]


def test_the_environment_sets_the_fetch_and_a_bad_value_is_refused(groups_kernel, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv(kernel.PF_ENV, "0")
    got = kernel.tune(groups_kernel, cache=tmp_path)
    assert got == {"pf_half": 0, "source": kernel.PF_ENV, "gbps": {}}
    assert groups_kernel.lib.si_tune(-1) == 0 and not (tmp_path / "tuning.json").exists()
    monkeypatch.setenv(kernel.PF_ENV, "fast")
    with pytest.raises(kernel.KernelError, match=r"SELECTINFER_KERNEL_PF='fast': not one of 0-4"):
        kernel.tune(groups_kernel, cache=tmp_path)


def test_a_calibration_drops_the_entries_of_libraries_no_longer_built(groups_kernel, tmp_path,
                                                                      monkeypatch):
    monkeypatch.delenv(kernel.PF_ENV, raising=False)
    monkeypatch.setattr(kernel, "CALIBRATE_BYTES", 4 << 20)
    gone = f"{kernel.cpu_model()} | {groups_kernel.isa} | selectinfer_kernel-gone.so"
    here = f"{kernel.cpu_model()} | {groups_kernel.isa} | {groups_kernel.path.name}"
    (tmp_path / "tuning.json").write_text(json.dumps({gone: {"pf_half": 1, "gbps": {}}}))
    assert kernel.tune(groups_kernel, cache=tmp_path)["source"] == "calibrated"
    assert set(json.loads((tmp_path / "tuning.json").read_text())) == {here}
