"""A CUDA check of the code a Jetson runs (``device: cuda``), on random-weight models.

The robot config serves the model on CUDA (float16, rows loaded by the same selective loader, the
lean decoder, masks in torch), a path CI never runs (no GPU there). This script checks it on
whatever GPU a machine has, against transformers and against the CPU run of the same code:

1. per family (tiny Llama / Qwen2 / Gemma 3 shapes, random weights): gamma = phi = 1 float32 on
   the GPU equals transformers on the GPU (max |logit diff|, greedy tokens); gamma 0.7 / phi 0.5,
   prompt and token mode, GPU vs CPU; a task switch on the GPU equals a fresh load of that task;
   int8 and 4-bit records on the GPU (dequantized rows) vs the CPU kernel; 4 greedy requests in
   one batch equal their runs alone, also when each asks its own compute ratio (rows masked to
   their own neurons); float16 greedy tokens vs float32;
2. ``selectinfer bench --preset PRESET --device cuda --dtype float16`` (real shapes, random
   weights): dense vs selective decode and prefill tok/s; then where a decode token's time goes
   (torch.profiler: the device's busy time against the wall time, kernel launches a token).

    python docs/results/cuda_check.py --out DIR [--device cuda] [--preset llama-3.2-3b]

Prints one line per check and writes DIR/cuda_check.json; exit 1 when a check fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("SELECTINFER_QUIET", "1")

from selectinfer_ros.core.execution.batch import Batch  # noqa: E402
from selectinfer_ros.core.execution.engine import Engine, GenerationConfig  # noqa: E402
from selectinfer_ros.core.format import kernel as native  # noqa: E402
from selectinfer_ros.core.format.pack import pack, read_manifest  # noqa: E402
from selectinfer_ros.core.format.tokenizer import load_tokenizer  # noqa: E402
from selectinfer_ros.core.profiling.profiler import profile_task  # noqa: E402
from selectinfer_ros.core.selection.loader import SelectiveModel, load_dense  # noqa: E402
from selectinfer_ros.core.selection.profiles import Profile  # noqa: E402
from selectinfer_ros.lab.random_model import make_random_model  # noqa: E402

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
RESULTS: dict = {"checks": [], "bench": None}


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(t)}" for t in torch.randint(4, 500, (n,), generator=g))


def prepare(family: str, root: Path) -> tuple[Path, dict[str, Path], Path]:
    """(HF checkpoint, packed folder per records format, profiles folder with two tasks)."""
    hf = make_random_model(family, root / "hf", std=0.1)
    packs = {"float": pack(hf, root / "float", log=lambda s: None).path}
    for w in ("int8", "q4"):
        packs[w] = pack(hf, root / w, weights=w, log=lambda s: None).path
    profiles = root / "profiles"
    profiles.mkdir(exist_ok=True)
    p = packs["float"]
    dense, tok, m = load_dense(p)[0], load_tokenizer(p), read_manifest(p)
    g = torch.Generator().manual_seed(3)
    records = [{"text": words(g, 40)} for _ in range(8)]
    prof = profile_task(dense, tok, m, "alpha", [], batch_size=4, sensitivity=False,
                        records=records)  # carries the per-token thresholds (token mode)
    prof.save(profiles / "alpha.safetensors")
    # random weights make every text's top neurons alike: the switch needs a task that differs
    beta = torch.rand(prof.scores.shape, generator=g) * prof.scores.mean()
    Profile("beta", m.model_id, m.fingerprint, beta, prof.tokens, "random").save(
        profiles / "beta.safetensors")
    return hf, packs, profiles


@contextlib.contextmanager
def kernel_off():
    """The CPU's int8 / 4-bit products on the float fallback (as without a compiler)."""
    saved = native._kernel, native._error
    native._kernel, native._error = None, "turned off for the check"
    try:
        yield
    finally:
        native._kernel, native._error = saved


def scores(sm: SelectiveModel, prefix: list[int], cont: list[int]) -> torch.Tensor:
    return Engine.from_selective(sm).score(prefix, cont).float().cpu()


def check_family(family: str, root: Path, dev: str) -> None:
    from transformers import AutoModelForCausalLM
    hf, packs, profiles = prepare(family, root / family)
    g = torch.Generator().manual_seed(11)
    prefix = load_tokenizer(packs["float"])(words(g, 24), add_special_tokens=False)["input_ids"]
    cont = [int(t) for t in torch.randint(4, 500, (12,), generator=g)]

    # 1. gamma = phi = 1, float32: ours on the GPU vs transformers on the GPU
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).to(dev).eval()
    with torch.inference_mode():
        want = ref(torch.tensor([prefix + cont[:-1]], device=dev)).logits[0, len(prefix) - 1:]
        greedy_ref = ref.generate(torch.tensor([prefix], device=dev), max_new_tokens=12,
                                  do_sample=False, attention_mask=torch.ones(1, len(prefix),
                                  dtype=torch.long, device=dev))[0, len(prefix):].tolist()
    full = SelectiveModel(packs["float"], None, load_ratio=1.0, compute_ratio=1.0, device=dev,
                          dtype="float32")
    eng = Engine.from_selective(full)
    got = eng.score(prefix, cont)
    diff = (got.float() - want.float()).abs().max().item()
    ours = eng.generate(prefix, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    check(f"{family} 1/1 float32 {dev} vs transformers {dev}", diff < 1e-4 and ours == greedy_ref,
          f"max |logit diff| {diff:.2e}; greedy {'equal' if ours == greedy_ref else 'DIFFERENT'} "
          f"({eng.decode_path})")
    del ref, full, eng

    # 2. selective 0.7 / 0.5 (prompt and token mode): GPU vs CPU, same code
    for mode in ("prompt", "token"):
        kw = dict(load_ratio=0.7, static_ratio=0.2, compute_ratio=0.5, dtype="float32",
                  compute_mode=mode)
        a = SelectiveModel(packs["float"], profiles, "alpha", device=dev, **kw)
        b = SelectiveModel(packs["float"], profiles, "alpha", device="cpu", **kw)
        sa, sb = scores(a, prefix, cont), scores(b, prefix, cont)
        same = all(torch.equal(x, y) for x, y in zip(a.active_neuron_ids(), b.active_neuron_ids()))
        d = (sa - sb).abs().max().item()
        check(f"{family} 0.7/0.5 {mode} mode {dev} vs cpu", d < 1e-3 and same,
              f"max |logit diff| {d:.2e}; computed neurons {'equal' if same else 'DIFFER'}")

    # 3. task switch on the GPU: equals a fresh load of the new task
    sw = SelectiveModel(packs["float"], profiles, "alpha", device=dev, load_ratio=0.7,
                        static_ratio=0.2, compute_ratio=0.5, dtype="float32")
    t0 = time.perf_counter()
    rep = sw.switch_task("beta")
    secs = time.perf_counter() - t0
    fresh = SelectiveModel(packs["float"], profiles, "beta", device=dev, load_ratio=0.7,
                           static_ratio=0.2, compute_ratio=0.5, dtype="float32")
    same_set = all(set(x.tolist()) == set(y.tolist())
                   for x, y in zip(sw.loaded_neuron_ids(), fresh.loaded_neuron_ids()))
    d = (scores(sw, prefix, cont) - scores(fresh, prefix, cont)).abs().max().item()
    check(f"{family} switch alpha->beta on {dev}", same_set and d < 1e-4,
          f"{rep.bytes_read} bytes, {rep.neurons_read} neurons read in {secs:.3f} s; loaded set "
          f"{'equal' if same_set else 'DIFFERS'} to a fresh load; max |logit diff| {d:.2e}")
    del sw, fresh

    # 4. int8 and 4-bit records: GPU (dequantized rows) vs the CPU's float fallback (the same
    # arithmetic) and vs the CPU kernel (int8 activations: rounding of its own)
    for w in ("int8", "q4"):
        for gamma, phi in ((1.0, 1.0), (0.7, 0.5)):
            kw = dict(load_ratio=gamma, static_ratio=min(0.2, phi), compute_ratio=phi)
            a = SelectiveModel(packs[w], profiles, "alpha", device=dev, dtype="float32", **kw)
            sa = scores(a, prefix, cont)
            with kernel_off():
                c = SelectiveModel(packs[w], profiles, "alpha", device="cpu", **kw)
                sc = scores(c, prefix, cont)
            b = SelectiveModel(packs[w], profiles, "alpha", device="cpu", **kw)
            sb = scores(b, prefix, cont)
            d = (sa - sc).abs().max().item()
            dk = (sa - sb).abs().max().item()
            agree = (sa.argmax(-1) == sb.argmax(-1)).float().mean().item()
            check(f"{family} {w} {gamma:g}/{phi:g} {dev} vs cpu", d < 1e-4,
                  f"max |logit diff| {d:.2e} vs the CPU float fallback; vs the CPU kernel "
                  f"{dk:.2e} (largest logit {sb.abs().max().item():.2f}), top-token agreement "
                  f"{agree:.3f}")

    # 5. batch of 4 greedy requests on the GPU equals each alone
    sm = SelectiveModel(packs["float"], profiles, "alpha", device=dev, load_ratio=0.7,
                        static_ratio=0.2, compute_ratio=0.7, dtype="float32")
    eng = Engine.from_selective(sm)
    cfg = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    prompts = [words(g, n) for n in (5, 9, 14, 20)]
    alone = [eng.generate(p, cfg).token_ids for p in prompts]
    batch = Batch(eng, 4)
    streams = [batch.join(p, GenerationConfig(max_new_tokens=10, ignore_eos=True))
               for p in prompts]
    while batch.running or batch.pending:
        batch.step()
    together = [s.result().token_ids for s in streams]
    check(f"{family} batch of 4 on {dev} vs alone", together == alone,
          f"{batch.steps} steps, {batch.rows} rows; tokens "
          f"{'equal' if together == alone else 'DIFFER'}")

    # 5b. requests of their own compute ratios (their own neurons, masked rows) equal each alone
    ratios = (0.3, 0.5, 0.7, 0.4)
    cfgs = [GenerationConfig(max_new_tokens=8 + 2 * i, ignore_eos=True, compute_ratio=r)
            for i, r in enumerate(ratios)]
    alone = [eng.generate(p, c).token_ids for p, c in zip(prompts, cfgs)]
    batch = Batch(eng, 4)
    streams = [batch.join(p, c) for p, c in zip(prompts, cfgs)]
    masked = all(m.masked for m in sm.mlps)
    while batch.running or batch.pending:
        batch.step()
    together = [s.result().token_ids for s in streams]
    check(f"{family} batch of 4 ratios {'/'.join(map(str, ratios))} on {dev} vs alone",
          together == alone and masked,
          f"rows masked to their own neurons: {masked}; tokens "
          f"{'equal' if together == alone else 'DIFFER'}")

    # 6. float16 on the GPU (the robot's dtype) vs float32
    if dev != "cpu":
        h = SelectiveModel(packs["float"], profiles, "alpha", device=dev, load_ratio=0.7,
                           static_ratio=0.2, compute_ratio=0.5, dtype="float16")
        f = SelectiveModel(packs["float"], profiles, "alpha", device=dev, load_ratio=0.7,
                           static_ratio=0.2, compute_ratio=0.5, dtype="float32")
        sh, sf = scores(h, prefix, cont), scores(f, prefix, cont)
        agree = (sh.argmax(-1) == sf.argmax(-1)).float().mean().item()
        d = (sh - sf).abs().max().item()
        check(f"{family} 0.7/0.5 float16 vs float32 on {dev}", agree >= 0.9,
              f"top-token agreement {agree:.3f}; max |logit diff| {d:.2e}")


def bench(preset: str, dev: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "selectinfer_ros.cli", "bench", "--preset", preset,
           "--device", dev, "--dtype", "float16" if dev != "cpu" else "float32",
           "--grid", "1,1", "0.7,0.7", "0.7,0.5", "0.5,0.3", "--repeats", "3",
           "--weights", "float",
           "--new-tokens", "64", "--out", str(out / "bench")]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], text=True)
    RESULTS["bench"] = {"cmd": cmd, "rc": r.returncode, "seconds": time.perf_counter() - t0}
    print(f"[bench] rc={r.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)


def step_profile(preset: str, dev: str, new_tokens: int = 32) -> None:
    """Where a decode token's time goes on the device: the bench's packed preset at 1 / 1 and
    0.7 / 0.5, ``new_tokens`` greedy tokens under torch.profiler: the device's busy time (sum of
    its kernels) against the wall time, and kernel launches per token."""
    from torch.profiler import ProfilerActivity, profile

    from selectinfer_ros.core.format.paths import cache_root
    root = cache_root() / f"random-{preset}"
    rows = []
    for gamma, phi in ((1.0, 1.0), (0.7, 0.5)):
        sm = SelectiveModel(root / "packed", root / "profiles", None, load_ratio=gamma,
                            static_ratio=min(0.3, phi), compute_ratio=phi, device=dev,
                            dtype="float16")
        eng = Engine.from_selective(sm)
        prompt = list(range(100, 164))
        cfg = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        eng.generate(prompt, cfg)  # warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res = eng.generate(prompt, cfg)
        ev = prof.key_averages()
        busy = sum(e.self_device_time_total for e in ev) / 1e6  # seconds
        launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cudaLaunchKernelExC"))
        m = res.metrics
        wall = m.decode_seconds + m.time_to_first_token
        row = dict(gamma=gamma, phi=phi, decode_tok_s=m.tokens_per_second, wall_s=wall,
                   device_busy_s=busy, busy_share=busy / wall,
                   launches_per_token=launches / (new_tokens + 1))
        rows.append(row)
        print(f"[step] {preset} {gamma:g}/{phi:g} float16: decode {m.tokens_per_second:.1f} tok/s "
              f"(under the profiler); device busy {busy * 1e3:.1f} ms of {wall * 1e3:.1f} ms "
              f"({100 * busy / wall:.0f} %); {launches / (new_tokens + 1):.0f} kernel launches a "
              f"token", flush=True)
        del sm, eng
    RESULTS["step_profile"] = rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-3.2-3b", help="bench preset ('' = no bench)")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    if dev != "cpu":
        p = torch.cuda.get_device_properties(0)
        RESULTS["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
        print(f"[gpu] {RESULTS['gpu']}", flush=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "cuda-check"
    for family in args.families:
        t0 = time.perf_counter()
        try:
            check_family(family, work, dev)
        except Exception as e:  # noqa: BLE001 - one line per failing family, then the next
            import traceback
            traceback.print_exc()
            check(f"{family} raised", False, f"{type(e).__name__}: {e}")
        print(f"[{family}] {time.perf_counter() - t0:.1f} s", flush=True)
    (out / "cuda_check.json").write_text(json.dumps(RESULTS, indent=1))
    if args.preset:
        bench(args.preset, dev, out)
        (out / "cuda_check.json").write_text(json.dumps(RESULTS, indent=1))
        try:
            step_profile(args.preset, dev)
        except Exception as e:  # noqa: BLE001 - a figure, not a check
            print(f"[step] {type(e).__name__}: {e}", flush=True)
        (out / "cuda_check.json").write_text(json.dumps(RESULTS, indent=1))
    return 0 if all(c["ok"] for c in RESULTS["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
