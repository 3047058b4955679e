"""The embedded model: the converted checkpoint continues like the GGUF loaded by transformers."""
from __future__ import annotations

import json

import torch

from selectinfer_ros.core.format.default_model import hf_dir
from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
from selectinfer_ros.core.selection.loader import SelectiveModel


def test_converted_model_continues_like_the_gguf(embedded):
    ref = json.loads((hf_dir() / "gguf_reference.json").read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir())
    model = AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=torch.float32).eval()
    ids = tok(ref["prompt"], return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=len(ref["greedy_token_ids"]), do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == ref["greedy_token_ids"]
    # The packed model through the project's own engine gives the same tokens.
    eng = Engine.from_selective(SelectiveModel(embedded))
    res = eng.generate(ref["prompt"], GenerationConfig(max_new_tokens=len(ref["greedy_token_ids"])))
    assert res.token_ids == ref["greedy_token_ids"]


def test_two_processes_preparing_the_model_at_once_both_end_with_a_working_model(embedded, tmp_path):
    """Two nodes of one launch prepare the embedded model together: one packs it under the
    inter-process lock, the other waits and reuses the result; both load it."""
    import os
    import shutil
    import subprocess
    import sys

    from selectinfer_ros.core.format import default_model
    cache = tmp_path / "cache"
    hf = cache / default_model.MODEL_ID / "hf"

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(default_model.hf_dir(), hf, copy_function=link)  # converted: pack only
    code = ("from selectinfer_ros.core.format.default_model import ensure_packed\n"
            "from selectinfer_ros.core.selection.loader import SelectiveModel\n"
            "sm = SelectiveModel(ensure_packed())\n"
            "print('LOADED', sm.bytes_read)\n")
    env = dict(os.environ, SELECTINFER_CACHE=str(cache), SELECTINFER_QUIET="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("LOADED" in o for o in outs), outs
    assert sum("[pack] gemma3-270m" in o for o in outs) == 1, outs  # packed once
    assert any("waiting for another process" in o for o in outs), outs
    left = sorted(p.name for p in (cache / default_model.MODEL_ID).iterdir())
    assert left == [".prepare.lock", "hf", "packed"], left  # no temp folder left behind


def test_cache_lives_outside_the_install_tree(monkeypatch, tmp_path):
    from pathlib import Path

    from selectinfer_ros.core.format import default_model
    monkeypatch.delenv("SELECTINFER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.packed_dir() == tmp_path / "xdg" / "selectinfer" / "gemma3-270m" / "packed"
    assert default_model.packed_dir("int8") == default_model.packed_dir().with_name("packed-int8")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.cache_root() == Path.home() / ".cache" / "selectinfer"
    monkeypatch.setenv("SELECTINFER_CACHE", str(tmp_path / "mine"))
    assert default_model.cache_root() == tmp_path / "mine"
