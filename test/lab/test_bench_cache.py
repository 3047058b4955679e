"""Any sequence of `selectinfer bench` runs on a random-weight preset works without touching the
cache by hand: a run that needs a pack the earlier runs did not make rewrites the (seeded)
checkpoint they deleted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from selectinfer_ros.core.format.pack import read_manifest


def _bench(cache, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SELECTINFER_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-m", "selectinfer_ros.cli", "bench", "--preset",
                          "tiny-llama", "--threads", "1", "--no-quant", "--new-tokens", "4",
                          "--prompt-tokens", "8", "--repeats", "1", "--grid", "1,1", "0.7,0.5",
                          *args], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_bench_runs_in_any_order_without_touching_the_cache(tmp_path):
    cache = tmp_path / "cache"
    root = cache / "random-tiny-llama"
    _bench(cache, "--quick")  # float only: the checkpoint goes, no int8 pack
    assert (root / "packed" / "manifest.json").exists()
    assert not (root / "hf").exists() and not (root / "packed-int8").exists()
    out = _bench(cache, "--weights", "float", "int8", "q4", "--out", str(tmp_path / "b"))
    assert ("rewriting the random-weight tiny-llama checkpoint for the int8 pack and the q4 pack"
            in out.stderr)
    names = [r["name"] for r in json.loads((tmp_path / "b" / "bench.json").read_text())]
    assert {"selectinfer int8 0.7/0.5", "selectinfer q4 0.7/0.5", "selectinfer 0.7/0.5"} <= set(names)
    assert not (root / "hf").exists()
    # the rewritten checkpoint held the packed weights: the float profiles apply to the int8 pack
    assert read_manifest(root / "packed-int8").fingerprint == read_manifest(root / "packed").fingerprint
    out = _bench(cache, "--quick", "--weights", "int8", "q4")  # the packs there: nothing rewritten
    assert "rewriting" not in out.stderr and "packing" not in out.stderr
