"""Compare constrained-decoding libraries (llguidance, xgrammar, outlines-core) by the time
they take per token to compute the allowed-token mask over a real vocabulary.

    python -m selectinfer_ros.lab.grammar_libs --tokenizer ~/.cache/selectinfer/gemma3-270m/hf

For each library and schema: compile seconds, then a fixed answer (a JSON document valid under
the schema) is fed token by token and the mask is computed before every token; the table gives
the mean and p95 mask microseconds per token. Libraries that are not installed are skipped
(xgrammar may be put on ``sys.path`` with ``--extra-path``). Measurement only: the robot uses
:mod:`selectinfer_ros.core.execution.constrain` (llguidance).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMAS = [
    ({"type": "object", "properties": {"action": {"enum": ["goto", "pick", "stop"]},
                                       "target": {"type": "string"},
                                       "speed": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["action", "target", "speed"], "additionalProperties": False},
     {"action": "goto", "target": "kitchen", "speed": 0.5}),
    ({"type": "object", "properties": {"objects": {"type": "array", "minItems": 1, "maxItems": 5,
                                                   "items": {"type": "object", "properties": {
                                                       "name": {"type": "string"},
                                                       "count": {"type": "integer", "minimum": 0}},
                                                       "required": ["name", "count"],
                                                       "additionalProperties": False}}},
      "required": ["objects"], "additionalProperties": False},
     {"objects": [{"name": "cup", "count": 2}, {"name": "chair", "count": 4},
                  {"name": "table", "count": 1}]}),
]


def _ids(tok, doc) -> list[int]:
    return tok(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)["input_ids"]


def _token_bytes(hf) -> dict[bytes, list[int]]:
    """Every token's bytes (byte-level BPE or SentencePiece with byte fallback), for libraries
    that take a vocabulary as a map."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    missing = [b for b in range(256) if b not in bs]
    cs = bs + [256 + n for n in range(len(missing))]
    bs = bs + missing
    dec = {chr(c): b for b, c in zip(bs, cs)}  # GPT-2's byte-to-unicode map, inverted
    special = set(hf.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for tok, i in hf.get_vocab().items():
        if i in special:
            continue
        if tok.startswith("<0x") and tok.endswith(">") and len(tok) == 6:
            b = bytes([int(tok[3:5], 16)])
        elif "\u2581" in tok or not all(c in dec for c in tok):
            b = tok.replace("\u2581", " ").encode()
        else:
            b = bytes(dec[c] for c in tok)
        out.setdefault(b, []).append(i)
    return out


def bench_llguidance(hf, tok, schema, doc):
    import llguidance
    import llguidance.hf
    import numpy as np
    lt = llguidance.hf.from_tokenizer(hf)
    t0 = time.perf_counter()
    grm = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={
        "whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, grm)
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    words = (lt.vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    times = []
    for t in _ids(tok, doc):
        s = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - s)
        assert m.consume_token(t), m.get_error()
    return compile_s, times


def bench_xgrammar(hf, tok, schema, doc):
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    comp = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                  separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in _ids(tok, doc):
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert m.accept_token(t)
    return compile_s, times


def bench_outlines(hf, tok, schema, doc):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    vocab = Vocabulary(hf.eos_token_id, _token_bytes(hf))
    t0 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(schema), r"")
    index = Index(regex, vocab)
    compile_s = time.perf_counter() - t0
    g = Guide(index)
    mask = torch.zeros((len(hf) + 31) // 32, dtype=torch.int32)
    times = []
    for t in _ids(tok, doc):
        s = time.perf_counter()
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        times.append(time.perf_counter() - s)
        g.advance(t)
    return compile_s, times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    ap.add_argument("--extra-path", default="", help="prepended to sys.path (e.g. xgrammar)")
    ap.add_argument("--libs", nargs="+", default=["llguidance", "xgrammar", "outlines-core"])
    args = ap.parse_args(argv)
    if args.extra_path:
        sys.path.insert(0, args.extra_path)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    fns = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar,
           "outlines-core": bench_outlines}
    for lib in args.libs:
        for k, (schema, doc) in enumerate(SCHEMAS):
            try:
                compile_s, times = fns[lib](hf, hf, schema, doc)
            except Exception as e:  # noqa: BLE001 - a library that fails is reported, not fatal
                print(f"{lib} schema {k}: failed: {type(e).__name__}: {e}")
                continue
            us = sorted(t * 1e6 for t in times)
            print(json.dumps({"lib": lib, "schema": k, "vocab": len(hf), "tokens": len(us),
                              "compile_s": round(compile_s, 4),
                              "mask_us_mean": round(statistics.mean(us), 1),
                              "mask_us_p95": round(us[int(0.95 * (len(us) - 1))], 1)}))


if __name__ == "__main__":
    main()
