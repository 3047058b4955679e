"""The embedded model: the converted checkpoint continues like the GGUF loaded by transformers."""
from __future__ import annotations

import json

import torch

from selectinfer_ros.core.default_model import hf_dir
from selectinfer_ros.core.engine import Engine, GenerationConfig
from selectinfer_ros.core.loader import SelectiveModel


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
