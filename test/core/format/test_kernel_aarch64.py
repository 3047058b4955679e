"""The aarch64 NEON kernel paths (the Jetson Orin's cores) against the plain C path: the kernel
with test/core/format/kernel_harness.c built for aarch64 (Debian's gcc-aarch64-linux-gnu;
scripts/setup.sh installs it with qemu-user) and run under qemu-user (``-cpu max``: dot product
and i8mm), or natively on an aarch64 machine."""
from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from selectinfer_ros.core.format.kernel import ISAS, SOURCE
from test_kernel import _HARNESS_KINDS, check_harness_batches, check_harness_products

HARNESS = Path(__file__).with_name("kernel_harness.c")
NATIVE = platform.machine() in ("aarch64", "arm64")


def _tools() -> tuple[str, list[str]]:
    cc, run = ("cc", []) if NATIVE else ("aarch64-linux-gnu-gcc", ["qemu-aarch64", "-cpu", "max"])
    missing = [t for t in (cc, *run[:1]) if shutil.which(t) is None]
    assert not missing, (f"missing {', '.join(missing)}: run scripts/setup.sh (apt-get install "
                         f"gcc-aarch64-linux-gnu qemu-user)")
    return cc, run


def _run(isa: str, tmp: Path) -> dict[str, list[torch.Tensor] | str]:
    cc, runner = _tools()
    flags = dict((n, f) for n, _, f in ISAS["aarch64"])[isa]
    exe = tmp / isa
    build = subprocess.run([cc, "-O3", "-std=c11", "-fopenmp", "-static", *flags,
                            f"-I{SOURCE.parent}", str(HARNESS), "-o", str(exe), "-lm"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    res = subprocess.run([*runner, str(exe), "candidates"], capture_output=True, text=True,
                         timeout=300)
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
def plain(tmp_path_factory):
    return _run("plain", tmp_path_factory.mktemp("aarch64"))


@pytest.mark.parametrize("isa", ["neon-dotprod", "neon-i8mm"])
def test_neon_kernel_equals_the_plain_c_path(isa, plain, tmp_path):
    got = _run(isa, tmp_path)
    assert got["isa"] == isa and plain["isa"] == "plain"
    assert len(got["linear"]) == len(plain["linear"]) == 24
    assert len(got["q4"]) == len(plain["q4"]) == len(got["axpy"]) == len(plain["axpy"]) == 8
    check_harness_products(got, plain, isa)  # same block sums; tiles equal the rows
    # whole decode steps: a float sum's last bit can move an int8 activation by one step
    # (per-token selection, decodet / decode4t: a neuron within a last bit of a threshold may
    # flip too; none of the harness's does)
    for kind in ("decode", "decode4", "decodet", "decode4t"):  # int8 and 4-bit models
        assert len(got[kind]) == len(plain[kind]) == 6
        rel = torch.stack([(a - b).abs().max() / b.std() for a, b in zip(got[kind], plain[kind])])
        assert float(rel.median()) < 1e-3 and float(rel.max()) < 0.05, (kind, rel)
    check_harness_batches(got, plain)  # a batch's rows equal the same rows alone
    for kind in ("keptt", "kept4t"):  # neurons kept per layer and step: about half of 80
        counts, want = torch.stack(got[kind]), torch.stack(plain[kind])
        assert counts.shape == (6, 2) and 20 <= float(want.min()) and float(want.max()) <= 60
        assert float((counts - want).abs().max()) <= 1, (kind, counts, want)
    for kind, kept in (("candt", "keptt"), ("cand4t", "kept4t")):  # candidates: up row read
        counts, want = torch.stack(got[kind]), torch.stack(plain[kind])
        assert counts.shape == (6, 2) and (want >= torch.stack(plain[kept])).all()
        assert float((counts - want).abs().max()) <= 1, (kind, counts, want)
