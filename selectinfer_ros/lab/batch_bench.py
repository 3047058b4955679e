"""Aggregate decode speed of goals decoded together, against one goal alone, in one process.

    python -m selectinfer_ros.lab.batch_bench [--model NAME | --preset llama-3.2-1b]
        [--weights int8] [--threads 2] [--batches 1 2 4] [--new-tokens 32] [--repeats 3]

For each batch size B (interleaved, ``--repeats`` rounds): B requests of the same 64-token
prompt join a :class:`Batch` (their prefills are not timed), then the batched steps are timed
until all are done (``--new-tokens`` each, end of sequence ignored): aggregate decode tok/s =
tokens produced by the steps / their seconds. "alone" is one request through
:meth:`Engine.generate` (the path a goal takes when it runs by itself). Prints medians and each
ratio to "alone"; ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from ..core.execution.batch import Batch
from ..core.execution.engine import Engine, GenerationConfig
from ..core.format import kernel as native
from ..core.selection.loader import SelectiveModel
from .bench import pack_of, resolve_model


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def batched_rate(engine: Engine, prompt: list[int], B: int, cfg: GenerationConfig) -> float:
    """Aggregate decode tok/s of B requests stepping together."""
    batch = Batch(engine, B)
    for _ in range(B):
        batch.join(list(prompt), cfg)
    rows0, t0 = batch.rows, time.perf_counter()
    while batch.running:
        batch.step()
    return (batch.rows - rows0) / (time.perf_counter() - t0)


def alone_rate(engine: Engine, prompt: list[int], cfg: GenerationConfig) -> float:
    return engine.generate(list(prompt), cfg).metrics.tokens_per_second


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="model name or packed folder (default: embedded)")
    ap.add_argument("--preset", default="", help="random-weight shape instead (llama-3.2-1b, ...)")
    ap.add_argument("--profiles", default="")
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    args.weights = [args.weights]
    torch.set_num_threads(args.threads)
    log = print
    packed, profiles = resolve_model(args, log)
    sm = SelectiveModel(pack_of(packed, args.weights[0], log), profiles, None, load_ratio=1.0,
                        log=log)
    engine = Engine.from_selective(sm)
    g = torch.Generator().manual_seed(0)
    vocab = int(sm.model.config.vocab_size)
    prompt = torch.randint(100, min(vocab, 30000), (args.prompt_tokens,), generator=g).tolist()
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    kern = native.kernel()
    isa = kern.isa if kern is not None else "none"
    print(f"# {sm.manifest.model_id} {args.weights[0]}, {engine.decode_path}, kernel path {isa}, "
          f"{args.threads} threads, CPU {_cpu()}")
    alone_rate(engine, prompt, cfg)  # warm-up
    rates: dict[str, list[float]] = {"alone": []} | {f"B={b}": [] for b in args.batches}
    for _ in range(args.repeats):
        rates["alone"].append(alone_rate(engine, prompt, cfg))
        for b in args.batches:
            rates[f"B={b}"].append(batched_rate(engine, prompt, b, cfg))
    base = statistics.median(rates["alone"])
    rows = []
    for name, r in rates.items():
        med = statistics.median(r)
        rows.append(dict(subject=name, tokens_per_second=med, ratio=med / base,
                         threads=args.threads, model=sm.manifest.model_id, isa=isa, cpu=_cpu()))
        print(f"{name:>6}  {med:8.1f} tok/s together  {med / base:5.2f}x alone")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
