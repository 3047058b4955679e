"""``selectinfer bench``: speed and memory of every configuration, interleaved in one process.

Configurations: the unmodified transformers model through the same engine (``dense``, the
baseline), transformers' own ``generate`` on that model, SelectInfer at a (gamma, phi) grid,
PyTorch int8/int4 weight-only quantization, and llama.cpp (Q8_0, F16, Q4_K_M of the same weights,
``lab/llama_cpp.py``) when given its build. Each repeat runs every configuration once
(A B C A B C ...) so machine drift hits all alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..core.execution.engine import Engine, GenerationConfig
from ..core.selection.loader import SelectiveModel, build_skeleton, load_dense, resolve_dtype
from ..core.execution.metrics import peak_rss_bytes, process_rss_bytes
from ..core.format.pack import read_manifest
from ..core.format.tokenizer import load_tokenizer
from ..core.format.weights import BENCH_WEIGHTS
from . import llama_cpp

GRID = [(1.0, 1.0), (0.9, 0.7), (0.7, 0.7), (0.7, 0.5), (0.5, 0.35)]
QUICK_GRID = [(1.0, 1.0), (0.7, 0.7), (0.7, 0.5)]


@dataclass
class Subject:
    """One configuration under test and what was measured for it."""

    name: str
    method: str
    load_ratio: float
    compute_ratio: float
    engine: Engine | None = None
    model: nn.Module | None = None
    load_seconds: float = 0.0
    bytes_read: int = 0
    weight_bytes: int = 0
    peak_rss_bytes: int = 0
    decode: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    selection: list[float] = field(default_factory=list)
    weights: str = "float"
    shares: dict[str, float] = field(default_factory=dict)
    bytes_per_token: int = 0


def _reset_peak() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return process_rss_bytes()


def _unique_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights (parameters and weight buffers, shared ones once; index
    buffers such as the slot ids are not weights)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.dtype in (torch.int64, torch.bool) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def bytes_per_decode_token(model: nn.Module, selective: SelectiveModel | None,
                           counts: tuple[int, int, int] | None = None) -> int:
    """Weight bytes a decode step reads: everything but the embedding table (unless tied to the
    output layer) and, for SelectInfer, the loaded neurons outside the active prefix (per-token
    mode: the neuron rows read over ``counts``, a subject's :meth:`SelectiveModel.counts`
    summed over its runs; a third per row)."""
    total = _unique_bytes(model)
    emb = model.get_input_embeddings().weight
    head = getattr(model, "lm_head", None)
    if head is None or head.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    if selective is not None and selective.state.per_token:
        man = selective.manifest
        read = selective.read_shares(until=counts)["read_share"] * man.num_layers * man.intermediate_size
        ffn = sum(m.weight_bytes() for m in selective.mlps)
        total -= ffn - int(read * selective.mlps[0].neuron_bytes())
    elif selective is not None:
        for m in selective.mlps:
            total -= (m.n_loaded - m.n_active) * m.neuron_bytes()
    return total


def memory_bandwidth(threads: int, device: str = "cpu", nbytes: int = 512 << 20) -> float:
    """Measured read bandwidth (bytes/s) of the memory the weights are in: median of summing a
    large float32 tensor there (on CUDA the device's memory, the sums synchronized)."""
    dev = torch.device(device)
    x = torch.ones(nbytes // 4, device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    times = []
    for _ in range(7):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:])


class PhaseTimer:
    """Forward hooks timing FFN, attention and output layer during decode steps."""

    def __init__(self, model: nn.Module):
        self.totals = {"ffn": 0.0, "attention": 0.0, "output": 0.0}
        self.handles = []
        self._t: dict[int, float] = {}
        for blk in model.model.layers:
            self._hook(blk.mlp, "ffn")
            self._hook(blk.self_attn, "attention")
        self._hook(model.lm_head, "output")

    def _hook(self, mod: nn.Module, key: str) -> None:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def pre(m, *_):
            sync()  # on CUDA, time the kernels, not their launch
            self._t[id(m)] = time.perf_counter()

        def post(m, *_):
            sync()
            self.totals[key] += time.perf_counter() - self._t.pop(id(m))
        self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _load(subject: Subject, make) -> None:
    base = _reset_peak()
    t0 = time.perf_counter()
    make(subject)
    subject.load_seconds = time.perf_counter() - t0
    subject.peak_rss_bytes = peak_rss_bytes() - base


def build_subjects(args, model_path: Path, profiles: Path | None, log) -> list[Subject]:
    grid = QUICK_GRID if args.quick else GRID
    if args.grid:
        grid = [tuple(float(v) for v in g.split(",")) for g in args.grid]
    subjects: list[Subject] = []
    # One-time costs (tokenizer, model code imports) stay out of every configuration's load time.
    tok = load_tokenizer(model_path)
    build_skeleton(model_path, resolve_dtype(args.dtype, read_manifest(model_path).dtype))

    def make_dense(s: Subject) -> None:
        model, s.bytes_read = load_dense(model_path, args.dtype, args.device)
        s.model = model
        s.engine = Engine(model, tok)
        s.weight_bytes = _unique_bytes(model)

    dense = Subject("dense", "dense", 1.0, 1.0)
    _load(dense, make_dense)
    subjects.append(dense)
    if not args.quick:
        hf = Subject("transformers-generate", "hf_generate", 1.0, 1.0, model=dense.model,
                     load_seconds=dense.load_seconds, bytes_read=dense.bytes_read,
                     weight_bytes=dense.weight_bytes, peak_rss_bytes=dense.peak_rss_bytes)
        subjects.append(hf)
    by_gamma: dict[tuple[str, float, str, float], SelectiveModel] = {}
    modes = getattr(args, "compute_modes", None) or ["prompt"]
    for weights, mode in ((w, m) for w in args.weights for m in modes):
        path = model_path if weights == "float" else pack_of(model_path, weights, log)
        high = read_manifest(path).high
        for (gamma, phi), r8 in ((gp, r) for gp in grid for r in
                                 [0.0] + sorted(getattr(args, "int8_ratios", None) or [])):
            if mode == "token" and phi >= gamma:
                continue  # every loaded neuron: the prompt mode's subject
            if r8 and (high != "int8" or r8 >= gamma):
                continue  # tiers: 4-bit packs, below gamma
            tag = "" if weights == "float" else f" {weights}"
            suffix = (f" int8 {r8:g}" if r8 else "") + ("" if mode == "prompt" else " token")
            s = Subject(f"selectinfer{tag} {gamma:g}/{phi:g}{suffix}", "selectinfer", gamma, phi,
                        weights=weights)
            key = (weights, gamma, mode, r8)
            if key not in by_gamma:
                def make_sel(s: Subject, gamma=gamma, path=path, key=key, mode=mode, r8=r8) -> None:
                    sm = SelectiveModel(path, profiles, args.task or None, load_ratio=gamma,
                                        static_ratio=min(0.3, min(p for g, p in grid if g == gamma)),
                                        compute_ratio=gamma, device=args.device, dtype=args.dtype,
                                        compute_mode=mode, int8_ratio=r8, log=log)
                    sm.tokenizer = tok
                    by_gamma[key] = sm
                _load(s, make_sel)
            else:
                first = next(x for x in subjects if x.method == "selectinfer"
                             and x.engine.selective is by_gamma[key])
                s.load_seconds, s.peak_rss_bytes = first.load_seconds, first.peak_rss_bytes
            sm = by_gamma[key]
            s.model, s.engine = sm.model, Engine.from_selective(sm)
            s.bytes_read, s.weight_bytes = sm.bytes_read, sm.weight_bytes()["total"]
            subjects.append(s)
    if args.device == "cpu" and not args.no_quant:
        for bits in (8, 4):
            def make_q(s: Subject, bits=bits) -> None:
                from .quantize import quantize_model
                model, s.bytes_read = load_dense(model_path, args.dtype, args.device)
                s.model = quantize_model(model, bits)
                s.engine = Engine(s.model, tok)
                s.weight_bytes = _unique_bytes(s.model)
            s = Subject(f"int{bits} weight-only", f"int{bits}", 1.0, 1.0)
            try:
                _load(s, make_q)
            except (RuntimeError, ValueError) as e:
                log(f"[bench] int{bits} skipped: {e}")
                continue
            subjects.append(s)
    return subjects


def run_once(s: Subject, prompt: list[int], new_tokens: int) -> None:
    if s.method == "hf_generate":
        ids = torch.tensor([prompt], device=next(s.model.parameters()).device)
        kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
        t0 = time.perf_counter()
        s.model.generate(ids, **{**kw, "min_new_tokens": 1, "max_new_tokens": 1})
        t1 = time.perf_counter()
        s.model.generate(ids, **kw)
        t2 = time.perf_counter()
        first = t1 - t0
        s.ttft.append(first)
        s.prefill.append(len(prompt) / first)
        if (t2 - t1) - first > 0.05 * (t2 - t1):  # else timing noise exceeds the decode time:
            s.decode.append((new_tokens - 1) / ((t2 - t1) - first))  # no figure from this run
        return
    cfg = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True,
                           compute_ratio=s.compute_ratio if s.method == "selectinfer" else None)
    sm = s.engine.selective if s.method == "selectinfer" else None
    before = sm.counts() if sm is not None else None
    res = s.engine.generate(prompt, cfg)
    if sm is not None and sm.state.per_token and hasattr(s, "token_counts"):
        s.token_counts = tuple(t + a - b for t, a, b in zip(s.token_counts, sm.counts(), before))
    m = res.metrics
    s.selection.append(m.selection_seconds)
    s.decode.append(m.tokens_per_second)
    s.prefill.append(m.prefill_tokens_per_second)
    s.ttft.append(m.time_to_first_token)


def measure_shares(s: Subject, prompt: list[int], new_tokens: int) -> None:
    if s.method == "hf_generate":
        return
    cfg = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True,
                           compute_ratio=s.compute_ratio if s.method == "selectinfer" else None)
    dec = s.engine.decoder
    if dec is not None:  # the lean decoder times its decode steps itself
        dec.timings = {"ffn": 0.0, "attention": 0.0, "output": 0.0}
        res = s.engine.generate(prompt, cfg)
        step = res.metrics.decode_seconds
        s.shares = {k: v / step if step > 0 else 0.0 for k, v in dec.timings.items()}
        dec.timings = None
        return
    timer = PhaseTimer(s.model)
    t0 = time.perf_counter()
    res = s.engine.generate(prompt, cfg)
    total = time.perf_counter() - t0
    timer.remove()
    step = total - res.metrics.time_to_first_token
    # The hooks also ran during prefill; scale by the decode share of the wall time.
    pre = res.metrics.time_to_first_token
    frac = step / (step + pre) if step + pre > 0 else 0.0
    s.shares = {k: (v * frac) / step if step > 0 else 0.0 for k, v in timer.totals.items()}


def run(args: argparse.Namespace) -> list[dict]:
    log = (lambda s: None) if args.json_only else (lambda s: print(s, file=sys.stderr, flush=True))
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    llama_dir = llama_cpp.find_build(args.llama_cpp) if args.llama_cpp else None  # fails fast
    model_path, profiles = resolve_model(args, log, llama_dir)
    manifest = read_manifest(model_path)
    log(f"[bench] {manifest.model_id}: threads={threads} device={args.device} dtype={args.dtype or manifest.dtype}")
    peers = llama_cpp.subjects(llama_dir, manifest.model_id, log,
                               tuple(getattr(args, "llama_types", None) or llama_cpp.TYPES)
                               ) if llama_dir else []
    subjects = build_subjects(args, model_path, profiles, log)
    g = torch.Generator().manual_seed(0)
    vocab = subjects[0].model.config.vocab_size
    prompt = [int(t) for t in torch.randint(10, min(vocab, 30000), (args.prompt_tokens,), generator=g)]
    for s in subjects:  # warm-up, and the FFN/attention/output split of a decode step
        run_once(s, prompt, 2)
        measure_shares(s, prompt, args.new_tokens)
    for s in subjects:
        if s.method == "selectinfer":
            sm = s.engine.selective
            sm.set_compute_ratio(s.compute_ratio)
            s.bytes_per_token = bytes_per_decode_token(s.model, sm)
        else:
            s.bytes_per_token = bytes_per_decode_token(s.model, None)
    for s in subjects:
        s.token_counts = (0, 0, 0)  # per-token mode: what this subject's timed runs computed
    for r in range(args.repeats):
        for s in subjects:
            if s.method == "selectinfer":
                s.engine.selective.set_compute_ratio(s.compute_ratio)
            run_once(s, prompt, args.new_tokens)
        for p in peers:  # in the same repeat: drift hits llama.cpp and us alike
            p.run_once(llama_dir, threads, args.prompt_tokens, args.new_tokens)
        log(f"[bench] repeat {r + 1}/{args.repeats} done")
    for s in subjects:  # per-token mode: what its decode steps computed and read, measured
        sm = s.engine.selective if s.method == "selectinfer" else None
        if sm is not None and sm.state.per_token:
            s.bytes_per_token = bytes_per_decode_token(s.model, sm, s.token_counts)
            s.token_shares = sm.read_shares(until=s.token_counts)
    bw = memory_bandwidth(threads, args.device)
    dense = subjects[0]
    rows = [row_of(s, dense, manifest.model_id, bw, args, threads) for s in subjects]
    rows += [p.row(manifest.model_id, rows[0]["decode_tokens_per_second"], dense.weight_bytes, bw,
                   threads) for p in peers]
    q8 = next((r for r in rows if r["name"] == "llama.cpp Q8_0"), None)
    q4 = next((r for r in rows if r["name"] == "llama.cpp Q4_K_M"), None)
    from ..core.format.kernel import cpu_description
    cpu = cpu_description()  # the CPU and our kernel's path: every figure names them
    if torch.device(args.device).type == "cuda":  # the kernel is not used there: name the GPU
        cpu = f"{torch.cuda.get_device_name(torch.device(args.device))} (CUDA); host {cpu}"
    for row in rows:
        row["memory_bandwidth_bytes_per_second"] = bw
        row["cpu"] = cpu
        if q8 is not None:
            row["vs_llama_cpp_q8_0"] = row["decode_tokens_per_second"] / q8["decode_tokens_per_second"]
        if q4 is not None:
            row["vs_llama_cpp_q4_k_m"] = row["decode_tokens_per_second"] / q4["decode_tokens_per_second"]
    if profiles is not None:
        attach_agreement(rows, Path(profiles) / "frontier.json")
    return rows


def attach_agreement(rows: list[dict], frontier_json: Path) -> int:
    """Each row's top-token agreement with the dense model as the model's ``frontier.json``
    measured it for the configuration of the same name (agreement is the weights', not the
    CPU's), for the speed-at-quality table; the rows that got one."""
    try:
        measured = {r["name"]: r for r in json.loads(frontier_json.read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    n = 0
    for row in rows:
        m = measured.get(row["name"])
        if m is not None and "agreement" in m:
            row["agreement"], row["agreement_from"] = m["agreement"], str(frontier_json)
            row["source"] = row["method"]
            n += 1
    return n


def row_of(s: Subject, dense: Subject, model_id: str, bw: float, args, threads: int) -> dict:
    med = statistics.median
    decode = med(s.decode) if s.decode else 0.0
    base = med(dense.decode)
    ceiling = bw / s.bytes_per_token if s.bytes_per_token else 0.0
    row = {
        "model": model_id, "name": s.name, "method": s.method, "load_ratio": s.load_ratio,
        "compute_ratio": s.compute_ratio, "dtype": str(args.dtype or "packed"), "threads": threads,
        "weights": s.weights,
        "decode_tokens_per_second": decode,
        "decode_tokens_per_second_min": min(s.decode) if s.decode else 0.0,
        "decode_tokens_per_second_max": max(s.decode) if s.decode else 0.0,
        "decode_speedup": decode / base if base else 0.0,
        "prefill_tokens_per_second": med(s.prefill) if s.prefill else 0.0,
        "time_to_first_token": med(s.ttft) if s.ttft else 0.0,
        "weight_bytes": s.weight_bytes, "weight_ratio": s.weight_bytes / dense.weight_bytes,
        "peak_rss_bytes": s.peak_rss_bytes, "bytes_read": s.bytes_read,
        "load_seconds": s.load_seconds, "load_speedup": dense.load_seconds / s.load_seconds
        if s.load_seconds else 0.0,
        "bytes_per_decode_token": s.bytes_per_token,
        "bandwidth_ceiling_tokens_per_second": ceiling,
        "fraction_of_ceiling": decode / ceiling if ceiling else 0.0,
        "share_ffn": s.shares.get("ffn", 0.0), "share_attention": s.shares.get("attention", 0.0),
        "share_output": s.shares.get("output", 0.0), "repeats": len(s.decode),
    }
    if getattr(s, "token_shares", None):
        row.update(compute_mode="token", **s.token_shares)
    if s.selection and any(s.selection):
        row["selection_seconds"] = med(s.selection[-len(s.decode):])
        row["selection_share_of_prefill"] = row["selection_seconds"] / row["time_to_first_token"]
    return row


def pack_of(packed: Path, weights: str, log) -> Path:
    """The ``pack --weights WEIGHTS`` pack of a float packed model: the model itself for its own
    format, else ``<packed>-<weights>`` beside it, made once from the checkpoint it was packed from."""
    from ..core.format.filelock import exclusive_lock
    from ..core.format.pack import is_packed, pack
    m = read_manifest(packed)
    if m.weights == weights:
        return packed
    target = packed.with_name(f"{packed.name}-{weights}")
    with exclusive_lock(packed.parent / f".{weights}.lock", log, f"the {weights} pack"):
        if is_packed(target):
            return target
        src = Path(json.loads((packed / "manifest.json").read_text()).get("source", ""))
        if not (src / "config.json").exists():
            raise FileNotFoundError(f"{packed}: its checkpoint {src} is gone; make the {weights} "
                                    f"pack with `selectinfer pack HF_DIR {target} --weights {weights}`")
        log(f"[bench] packing {weights} weights of {m.model_id} (once) -> {target}")
        pack(src, target, model_id=m.model_id, dtype=m.dtype, weights=weights, log=log)
    return target


def resolve_model(args, log, llama_dir: Path | None = None) -> tuple[Path, Path | None]:
    """The packed model (and profiles) to bench: --model, a random --preset, or the embedded one.
    With a llama.cpp build, a preset's checkpoint is also converted to GGUF (once)."""
    from ..core.format.models import resolve
    from ..core.format.paths import cache_root
    from ..core.format.paths import default_profiles_dir
    if args.preset:
        root = cache_root() / f"random-{args.preset}"
        packed = root / "packed"
        model_id = f"random-{args.preset}"

        def write_checkpoint() -> None:  # seeded: a rewrite holds the packed weights
            from .random_model import make_random_model
            make_random_model(args.preset, root / "hf", dtype=torch.bfloat16)
        from ..core.format.pack import is_packed
        if not (packed / "manifest.json").exists():
            from ..core.format.pack import pack
            log(f"[bench] writing random-weight {args.preset} (once) ...")
            write_checkpoint()
            pack(root / "hf", packed, model_id=model_id, log=log)
        # The checkpoint goes once the packs are made: a later run that needs another pack
        # (int8 after a float-only run, GGUF after a run without llama.cpp) writes it again.
        need = [f"{w} pack" for w in args.weights
                if w != "float" and not is_packed(packed.with_name(f"{packed.name}-{w}"))]
        need_gguf = llama_dir is not None and not llama_cpp.gguf_path(model_id, "F16").exists()
        if (need or need_gguf) and not (root / "hf" / "config.json").exists():
            log(f"[bench] rewriting the random-weight {args.preset} checkpoint for the "
                f"{' and the '.join(need + (['GGUF'] if need_gguf else []))} ...")
            write_checkpoint()
        for w in args.weights:  # the quantized packs: made from the checkpoint, which then goes
            if w != "float":
                pack_of(packed, w, log)
        if need_gguf:
            try:
                llama_cpp.convert_random(llama_dir, root / "hf", model_id, log)
            except (RuntimeError, KeyError) as e:
                log(f"[bench] --llama-cpp: cannot convert {model_id} to GGUF, no llama.cpp rows: {e}")
        if (root / "hf").exists():
            import shutil
            shutil.rmtree(root / "hf")
        profiles = root / "profiles"
        if not any(profiles.glob("*.safetensors")):
            random_profile(packed, profiles, log)
        return packed, profiles
    packed = resolve(args.model or "", "float", log)
    prof = Path(args.profiles) if args.profiles else default_profiles_dir(read_manifest(packed).model_id)
    return packed, prof if prof.is_dir() else None


def random_profile(packed: Path, out: Path, log) -> None:
    """A profile for a random-weight model from random token text (speed work only)."""
    from ..core.profiling.profiler import activation_scores
    from ..core.selection.profiles import Profile
    m = read_manifest(packed)
    model, _ = load_dense(packed, torch.bfloat16)
    tok = load_tokenizer(packed)
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(4, 30000, (64,), generator=g)) for _ in range(4)]
    scores, tokens = activation_scores(model, tok, texts, batch_size=2, desc="profile random")
    Profile("random", m.model_id, m.fingerprint, scores, tokens, "random-text").save(out / "random.safetensors")
    del model


def _cell(r: dict, key: str, fmt: str, width: int, scale: float = 1.0) -> str:
    """``r[key]`` formatted, or ``-`` where a row has no such figure (llama.cpp: TTFT, load)."""
    v = r.get(key)
    return f"{'-':>{width}}" if v is None else f"{v / scale:>{width}{fmt}}"


def print_table(rows: list[dict]) -> None:
    q8, q4 = "vs_llama_cpp_q8_0" in rows[0], "vs_llama_cpp_q4_k_m" in rows[0]
    hdr = (f"{'configuration':<24}{'decode tok/s':>13}{'x dense':>8}{'of ceil':>8}{'prefill t/s':>12}"
           f"{'TTFT s':>8}{'weights MiB':>12}{'x dense':>8}{'read MiB':>10}{'load s':>8}{'ffn/attn/out':>15}"
           + (f"{'x llama Q8':>11}" if q8 else "") + (f"{'x llama Q4':>11}" if q4 else ""))
    print(hdr)
    for r in rows:
        shares = (f"{r.get('share_ffn', 0):.2f}/{r.get('share_attention', 0):.2f}/"
                  f"{r.get('share_output', 0):.2f}") if r.get("share_ffn") else "-"
        print(f"{r['name']:<24}{r['decode_tokens_per_second']:>13.2f}{r.get('decode_speedup', 0):>8.2f}"
              f"{r.get('fraction_of_ceiling', 0):>8.2f}{(r.get('prefill_tokens_per_second') or 0):>12.1f}"
              f"{_cell(r, 'time_to_first_token', '.3f', 8)}{r['weight_bytes'] / 2**20:>12.1f}"
              f"{r.get('weight_ratio', 0):>8.2f}{_cell(r, 'bytes_read', '.1f', 10, 2**20)}"
              f"{_cell(r, 'load_seconds', '.2f', 8)}{shares:>15}"
              + (_cell(r, "vs_llama_cpp_q8_0", ".2f", 11) if q8 else "")
              + (_cell(r, "vs_llama_cpp_q4_k_m", ".2f", 11) if q4 else ""))
    if rows[0].get("cpu"):
        print(f"CPU: {rows[0]['cpu']}, {rows[0]['threads']} thread(s)")
    bw = rows[0].get("memory_bandwidth_bytes_per_second")
    if bw:
        print(f"memory bandwidth (measured read): {bw / 1e9:.1f} GB/s; 'of ceil' = decode tok/s over "
              f"bandwidth / bytes read per decode token")
    if any(r["method"] == "llama.cpp" for r in rows):
        print("llama.cpp rows: one `llama-bench -r 1` per repeat, interleaved with ours (its decode test "
              "starts from an empty context); weights = GGUF file; 'x llama Q8' / 'x llama Q4' = decode "
              "tok/s over llama.cpp Q8_0's / Q4_K_M's")
    sel = [r for r in rows if "selection_share_of_prefill" in r]
    for r in sel:
        print(f"{r['name']}: selection {r['selection_seconds'] * 1000:.1f} ms = "
              f"{r['selection_share_of_prefill']:.1%} of time to first token")


def cmd_bench(args: argparse.Namespace) -> int:
    from .speed_quality import print_speed_at_quality
    from .plots import speed_quality_plot, tradeoff_plot
    if args.weights is None:
        args.weights = ["float"] if args.quick else list(BENCH_WEIGHTS)
    if args.quick:
        args.repeats = min(args.repeats, 2)
        args.new_tokens = min(args.new_tokens, 8)
        args.prompt_tokens = min(args.prompt_tokens, 32)
    rows = run(args)
    print_table(rows)
    rated = [r for r in rows if "agreement" in r]
    if rated:
        print_speed_at_quality(rated)
        print(f"(agreement: {rated[0]['agreement_from']}, the same configurations scored on its "
              f"held-out tokens; speeds: this run)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(rows, indent=2) + "\n")
        tradeoff_plot(rows, "decode_tokens_per_second", "decode tokens/s", out / "bench_speed_vs_memory.png",
                      title=f"{rows[0]['model']}: decode speed vs resident weights\n"
                            f"{rows[0]['cpu']}, {rows[0]['threads']} thread(s)")
        print(f"wrote {out / 'bench.json'} and {out / 'bench_speed_vs_memory.png'}")
        if rated:
            speed_quality_plot(rated, out / "bench_speed_vs_agreement.png",
                               title=f"{rows[0]['model']}: decode speed vs agreement with dense\n"
                                     f"{rows[0]['cpu']}, {rows[0]['threads']} thread(s)")
            print(f"wrote {out / 'bench_speed_vs_agreement.png'}")
    return 0
