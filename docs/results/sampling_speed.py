"""Decode speed of greedy and sampled goals on the embedded model (int8, every neuron), in one
process, interleaved: the cost of picking a token from the whole vocabulary.

    python docs/results/sampling_speed.py [--threads 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
from selectinfer_ros.core.selection.loader import SelectiveModel
from selectinfer_ros.lab.bench import pack_of, resolve_model

SETTINGS = {"greedy": {}, "temperature 0.8": dict(temperature=0.8),
            "temperature 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9),
            "temperature 1, top-k 40, top-p 0.95": dict(temperature=1.0, top_k=40, top_p=0.95)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ns = argparse.Namespace(model="", preset="", profiles="", weights=["int8"], task=None)
    packed, profiles = resolve_model(ns, lambda s: None)
    sm = SelectiveModel(pack_of(packed, "int8", lambda s: None), profiles, None, load_ratio=1.0)
    engine = Engine.from_selective(sm)
    prompt = "Question: What should a delivery robot do when its path is blocked?\nAnswer:"
    rates: dict[str, list[float]] = {k: [] for k in SETTINGS}
    for r in range(args.repeats + 1):  # the first round warms up
        for name, kw in SETTINGS.items():
            res = engine.generate(prompt, GenerationConfig(max_new_tokens=48, ignore_eos=True,
                                                           seed=r, **kw))
            if r:
                rates[name].append(res.metrics.tokens_per_second)
    for name, v in rates.items():
        print(f"{name:>36}: {statistics.median(v):6.1f} tok/s")


if __name__ == "__main__":
    main()
