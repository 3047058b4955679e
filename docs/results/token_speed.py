"""Decode speed of per-token selection against every loaded neuron, in one process, interleaved.

    python docs/results/token_speed.py --weights q4 --threads 1   # Qwen2.5 1.5B, gamma 1

Loads the model by name twice (``compute_mode`` prompt at phi = gamma, token at ``--share``), the
general profile, then per repeat one greedy generation of each (64-token prompt, 32 new tokens,
end of sequence ignored); prints the medians and their ratio. Faster to rerun than
``selectinfer bench --compute-modes prompt token`` (which adds the dense float rows).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
from selectinfer_ros.core.format import kernel as native
from selectinfer_ros.core.format.models import resolve
from selectinfer_ros.core.format.paths import default_profiles_dir
from selectinfer_ros.core.selection.loader import SelectiveModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--weights", default="q4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--load-ratio", type=float, default=1.0)
    ap.add_argument("--share", type=float, default=0.5, help="token mode's compute_ratio")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve(args.model, args.weights, print)
    profiles = default_profiles_dir(args.model)
    engines = {}
    token = dict(compute_ratio=args.share, compute_mode="token")
    for name, kw in (("all loaded", dict(compute_ratio=args.load_ratio)),
                     (f"token {args.share:g}", token)):
        sm = SelectiveModel(path, profiles, "general", load_ratio=args.load_ratio,
                            static_ratio=min(0.3, args.share), **kw)
        engines[name] = Engine.from_selective(sm)
    print(f"# {args.model} {args.weights}, {native.status()}, {args.threads} threads")
    prompt = list(range(1000, 1064))
    cfg = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    for e in engines.values():
        e.generate(prompt, cfg)  # warm-up
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.repeats):
        for k, e in engines.items():
            rates[k].append(e.generate(prompt, cfg).metrics.tokens_per_second)
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in med.items():
        print(f"{k:>12}  {v:7.2f} tok/s  ({', '.join(f'{x:.1f}' for x in rates[k])})")
    first, second = med.values()
    print(f"token over all loaded: {second / first:.2f}x")


if __name__ == "__main__":
    main()
