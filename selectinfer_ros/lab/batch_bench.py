"""Aggregate decode speed of goals decoded together, against one goal alone, in one process.

    python -m selectinfer_ros.lab.batch_bench [--model NAME | --preset llama-3.2-1b]
        [--weights int8] [--threads 2] [--batches 1 2 4] [--new-tokens 32] [--repeats 3]
        [--load-ratio G --static-ratio D --compute-ratios PHI [PHI ...]]

For each batch size B (interleaved, ``--repeats`` rounds): B requests of the same 64-token
prompt join a :class:`Batch` (their prefills are not timed), then the batched steps are timed
until all are done (``--new-tokens`` each, end of sequence ignored): aggregate decode tok/s =
tokens produced by the steps / their seconds. "alone" is one request through
:meth:`Engine.generate` (the path a goal takes when it runs by itself). Prints medians and each
ratio to "alone"; ``--json`` writes the rows.

``--compute-ratios``: request i asks the i-th ratio (in turn) and has a prompt of its own (seeded
random tokens), so each prompt chooses its own neurons and a batch decodes the union of them,
each row masked to its own; "alone" is then the largest batch's requests run one after another
(their tokens over their decode seconds).
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


def batched_rate(engine: Engine, prompts: list[list[int]], cfgs: list[GenerationConfig]
                 ) -> float:
    """Aggregate decode tok/s of requests (``prompts[b]``, ``cfgs[b]``) stepping together."""
    batch = Batch(engine, len(prompts))
    for prompt, cfg in zip(prompts, cfgs):
        batch.join(list(prompt), cfg)
    rows0, t0 = batch.rows, time.perf_counter()
    while batch.running:
        batch.step()
    return (batch.rows - rows0) / (time.perf_counter() - t0)


def alone_rate(engine: Engine, prompts: list[list[int]], cfgs: list[GenerationConfig]) -> float:
    """Decode tok/s of the requests run one after another (their tokens over their seconds)."""
    tokens = seconds = 0.0
    for prompt, cfg in zip(prompts, cfgs):
        m = engine.generate(list(prompt), cfg).metrics
        tokens += m.generated_tokens - 1  # the decode steps (the first token is the prefill's)
        seconds += (m.generated_tokens - 1) / m.tokens_per_second
    return tokens / seconds


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
    ap.add_argument("--load-ratio", type=float, default=1.0, help="gamma")
    ap.add_argument("--static-ratio", type=float, default=None, help="delta (default: gamma, or "
                    "0.3 with --compute-ratios)")
    ap.add_argument("--compute-ratios", type=float, nargs="+", default=[],
                    help="phi of each request in turn, each with a prompt of its own")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    args.weights = [args.weights]
    torch.set_num_threads(args.threads)
    log = print
    packed, profiles = resolve_model(args, log)
    phis = args.compute_ratios
    delta = args.static_ratio if args.static_ratio is not None else (0.3 if phis else None)
    sm = SelectiveModel(pack_of(packed, args.weights[0], log), profiles, None,
                        load_ratio=args.load_ratio, static_ratio=delta, log=log)
    engine = Engine.from_selective(sm)
    g = torch.Generator().manual_seed(0)
    vocab = int(sm.model.config.vocab_size)
    n = max(args.batches)
    prompts = [torch.randint(100, min(vocab, 30000), (args.prompt_tokens,), generator=g).tolist()
               for _ in range(n if phis else 1)] * (1 if phis else n)
    cfgs = [GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True,
                             compute_ratio=phis[i % len(phis)] if phis else None)
            for i in range(n)]
    kern = native.kernel()
    isa = kern.isa if kern is not None else "none"
    what = (f", gamma {args.load_ratio:g}, phi {' '.join(f'{p:g}' for p in phis)} (a prompt each)"
            if phis else f", gamma {args.load_ratio:g}")
    print(f"# {sm.manifest.model_id} {args.weights[0]}{what}, {engine.decode_path}, kernel path "
          f"{isa}, {args.threads} threads, CPU {_cpu()}")
    alone = (prompts, cfgs) if phis else (prompts[:1], cfgs[:1])
    alone_rate(engine, *alone)  # warm-up
    rates: dict[str, list[float]] = {"alone": []} | {f"B={b}": [] for b in args.batches}
    for _ in range(args.repeats):
        rates["alone"].append(alone_rate(engine, *alone))
        for b in args.batches:
            rates[f"B={b}"].append(batched_rate(engine, prompts[:b], cfgs[:b]))
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
