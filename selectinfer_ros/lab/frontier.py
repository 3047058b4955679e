"""``selectinfer frontier``: quality against memory (and speed) of every way to shrink the model.

One set of held-out tokens (the eval texts, which no profile saw, or ``--data``), cut into
llama-perplexity's chunks: ``[BOS] + n_ctx - 1`` tokens each, scored on positions n_ctx/2 ..
n_ctx - 2 (each predicting the next token). The dense float model's log-probs on those positions
are written in llama-perplexity's ``--kl-divergence-base`` file layout, the tokens included, so
``llama-perplexity --kl-divergence`` scores every llama.cpp quant on exactly these tokens against
exactly this reference; ours are scored against the same file with the same formulas
(:func:`kl_and_top`): top-token agreement ("Same top p") and mean KL(dense || config), full
vocabulary, reference probabilities below e^-16 skipped, as llama.cpp does.

Rows: ours for every ``pack --weights`` format x gamma x phi in {gamma, 0.7 gamma} (x the int8
tier's share, ``--int8-ratios``, of 4-bit packs; x a random ranking in place of the profile's,
``--rankings``: the ablation at the same bytes), PyTorch int8/int4 weight-only, llama.cpp quants
of the same weights. Each with resident weight bytes and
decode tok/s (short runs, bench's measurement, ``--threads``, default 1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import torch

from . import llama_cpp
from .speed_quality import print_speed_at_quality

GAMMAS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
PHI_SHARES = (1.0, 0.7)  # phi / gamma
TOKEN_SHARES = (0.7, 0.5)  # phi / gamma of the per-token rows (compute_mode token)
LLAMA_TYPES = llama_cpp.FRONTIER_TYPES
RANKINGS = ("profile", "random")  # the selection order of ours: the profiler's, or a random one
TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")
BUDGETS_MIB = (150, 200, 250, 400, 1000)
MAGIC = b"_logits_"
LOG_P_FLOOR = -16.0  # reference log-probs at or below this are left out of the KL (llama.cpp)
Q4_K_M_NOTE = ("these weights were dequantized from a Q4_K_M GGUF, so llama.cpp Q4_K_M "
               "re-quantizes them nearly losslessly by construction: its row flatters Q4_K_M")

Log = Callable[[str], None]


def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


# -- llama-perplexity's --kl-divergence-base file ----------------------------------------------
# "_logits_", uint32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk * n_ctx], then per
# chunk n_ctx - 1 - n_ctx/2 rows of nv = 2*((n_vocab+1)/2) + 4 uint16: float32 scale and float32
# min_log_prob (the first 4 uint16), then one uint16 q per token, log p = scale * q + min_log_prob
# (tools/perplexity/perplexity.cpp: log_softmax with uint16 output, kl_divergence).

def row_width(n_vocab: int) -> int:
    """uint16 per scored position in the base file."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_per_chunk(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def write_base_header(f: BinaryIO, n_ctx: int, n_vocab: int, tokens: np.ndarray) -> None:
    """The header and the tokens ``[n_chunk, n_ctx]`` (int32)."""
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    f.write(MAGIC + struct.pack("<Iii", n_ctx, n_vocab, tokens.shape[0]))
    f.write(tokens.tobytes())


def encode_log_probs(logits: torch.Tensor) -> np.ndarray:
    """Rows ``[m, nv]`` uint16 of logits ``[m, V]`` as llama-perplexity writes them: per row the
    log-probs from max - 16 upwards in 65535 steps, lower ones at the floor."""
    x = logits.float()
    m, v = x.shape
    mx = x.max(-1, keepdim=True).values
    mn = torch.maximum(x.min(-1, keepdim=True).values, mx - 16)
    lse = torch.log(torch.exp(x - mx).sum(-1, keepdim=True, dtype=torch.float64)).float()
    min_log_prob = mn - mx - lse
    scale = (mx - mn) / 65535.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.where(x > mn, torch.round((x - mn) * inv), torch.zeros_like(x)).clamp_(0, 65535)
    out = np.zeros((m, row_width(v)), dtype="<u2")
    head = torch.cat([scale, torch.where(scale > 0, min_log_prob, torch.zeros_like(scale))], -1)
    out[:, :4] = head.numpy().astype("<f4").view("<u2")
    out[:, 4:4 + v] = q.to(torch.int32).numpy().astype("<u2")
    return out


def decode_log_probs(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """Reference log-probs ``[m, V]`` float32 of base-file rows ``[m, nv]``."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4")  # [m, 2]: scale, min_log_prob
    q = torch.from_numpy(rows[:, 4:4 + n_vocab].astype(np.float32))
    h = torch.from_numpy(head.astype(np.float32))
    return q * h[:, :1] + h[:, 1:2]


@dataclass
class BaseFile:
    """A ``--kl-divergence-base`` file read back."""

    path: Path
    n_ctx: int
    n_vocab: int
    tokens: np.ndarray  # [n_chunk, n_ctx]

    @property
    def n_chunk(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def read(cls, path: str | Path) -> "BaseFile":
        path = Path(path)
        with open(path, "rb") as f:
            if f.read(8) != MAGIC:
                raise ValueError(f"{path}: not a llama-perplexity log-probability file")
            n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
            tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4").reshape(n_chunk, n_ctx)
        want = 20 + tokens.nbytes + n_chunk * scored_per_chunk(n_ctx) * row_width(n_vocab) * 2
        if path.stat().st_size != want:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, the header says {want}")
        return cls(path, n_ctx, n_vocab, tokens.copy())

    def chunks(self) -> Iterator[torch.Tensor]:
        """Per chunk, the reference log-probs ``[n_ctx - 1 - n_ctx/2, V]``."""
        m, nv = scored_per_chunk(self.n_ctx), row_width(self.n_vocab)
        with open(self.path, "rb") as f:
            f.seek(20 + self.tokens.nbytes)
            for _ in range(self.n_chunk):
                rows = np.frombuffer(f.read(m * nv * 2), dtype="<u2").reshape(m, nv)
                yield decode_log_probs(rows, self.n_vocab)


# -- held-out tokens ----------------------------------------------------------------------------

def heldout_texts(data: str | None, task: str | None) -> tuple[list[str], str]:
    """(texts, what they are): the user's file, else the eval sets (data/eval: QA, translation,
    summarization, navigation, prose; no profile was made from them), one record of each in
    turn, ``task``'s own first when it has an eval set."""
    from ..core.format.paths import DATA_DIR
    from ..core.profiling.profiler import read_prompts, record_text
    if data:
        return [record_text(r) for r in read_prompts(data)], str(data)
    names = ["qa", "translation", "summarization", "navigation", "prose"]
    sets = {n: [record_text(r) for r in read_prompts(DATA_DIR / "eval" / f"{n}.jsonl")] for n in names}
    texts = list(sets.pop(task)) if task in sets else []
    rest = list(sets.values())
    for i in range(max(len(s) for s in rest)):
        texts += [s[i] for s in rest if i < len(s)]
    return texts, "data/eval/{qa,translation,summarization,navigation,prose}.jsonl" + (
        f" ({task}'s first)" if task in names else "")


def make_chunks(tok, texts: list[str], n_ctx: int, want_tokens: int) -> np.ndarray:
    """Token chunks ``[n_chunk, n_ctx]``: each the BOS (when the tokenizer has one) and the next
    tokens of the texts joined by blank lines, enough chunks for ``want_tokens`` scored tokens."""
    ids = tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    bos = tok.bos_token_id
    body = n_ctx - 1 if bos is not None else n_ctx
    n_chunk = min(math.ceil(want_tokens / scored_per_chunk(n_ctx)), len(ids) // body)
    if n_chunk < 1:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than one chunk of {n_ctx}")
    out = np.empty((n_chunk, n_ctx), dtype=np.int32)
    for c in range(n_chunk):
        part = ids[c * body:(c + 1) * body]
        out[c] = ([bos] if bos is not None else []) + part
    return out


# -- scoring ------------------------------------------------------------------------------------

@torch.inference_mode()
def chunk_logits(engine, chunk: np.ndarray) -> torch.Tensor:
    """Logits ``[n_ctx - 1 - n_ctx/2, V]`` at positions n_ctx/2 .. n_ctx - 2 (the positions
    llama-perplexity scores), as generation computes them: selection at the prefill of
    positions 0 .. n_ctx/2, the decode path over the rest, teacher-forced."""
    ids = [int(t) for t in chunk]
    first = len(ids) // 2
    return engine.score(ids[:first + 1], ids[first + 1:]).float()


@dataclass
class Reference:
    """One chunk's reference log-probs, prepared once for scoring many configurations:
    p = exp(log p) where log p > -16 (else 0), per row sum p, sum p log p and the top token."""

    p: torch.Tensor  # [m, V]
    sum_p: torch.Tensor  # [m]
    sum_p_log_p: torch.Tensor  # [m]
    top: torch.Tensor  # [m]

    @classmethod
    def of(cls, base_lp: torch.Tensor) -> "Reference":
        p = torch.where(base_lp > LOG_P_FLOOR, base_lp.exp(), torch.zeros_like(base_lp))
        return cls(p, p.sum(-1), (p * base_lp).sum(-1), base_lp.argmax(-1))


def kl_and_top(logits: torch.Tensor, ref: Reference | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(reference || this) in nats over the reference's tokens above e^-16, and
    whether the top tokens agree (first maximum, as llama-perplexity's "Same top p").
    KL = sum p (log p - x + lse(x)) with x = logits - max, p as in :class:`Reference`."""
    ref = ref if isinstance(ref, Reference) else Reference.of(ref)
    x = logits.float()
    top = x.argmax(-1)
    x = x - x.max(-1, keepdim=True).values
    lse = torch.logsumexp(x, -1)
    dot = torch.bmm(ref.p.unsqueeze(1), x.unsqueeze(2)).view(-1)  # [m]: sum_i p_i x_i
    return ref.sum_p_log_p - dot + lse * ref.sum_p, top == ref.top


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, min(p, c - h)), min(1.0, max(p, c + h))


def score_engine(engine, base: BaseFile, refs: list[Reference] | None = None) -> dict:
    """Agreement (with its Wilson interval) and mean KL of ``engine`` on the base file's tokens
    (``refs``: the base file's chunks prepared, else read again)."""
    same = total = 0
    kl = 0.0
    for chunk, ref in zip(base.tokens, refs or (Reference.of(lp) for lp in base.chunks())):
        k, s = kl_and_top(chunk_logits(engine, chunk), ref)
        same += int(s.sum())
        total += int(s.numel())
        kl += float(k.sum())
    return quality(same, total, kl / total)


def quality(same: int, total: int, kl: float) -> dict:
    lo, hi = wilson(same, total)
    return {"agreement": same / total, "agreement_ci_low": lo, "agreement_ci_high": hi,
            "kl": kl, "tokens": total}


def write_base(engine, tok_chunks: np.ndarray, path: Path, log: Log) -> BaseFile:
    """The dense model's log-probs on every chunk, in llama-perplexity's base layout."""
    from ..core.format.progress import progress
    n_vocab = None
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for c in progress(range(len(tok_chunks)), desc="dense reference"):
            logits = chunk_logits(engine, tok_chunks[c])
            if n_vocab is None:
                n_vocab = logits.shape[-1]
                write_base_header(f, tok_chunks.shape[1], n_vocab, tok_chunks)
            f.write(encode_log_probs(logits).tobytes())
    os.replace(tmp, path)
    log(f"[frontier] dense reference: {len(tok_chunks)} chunks of {tok_chunks.shape[1]} tokens "
        f"-> {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return BaseFile.read(path)


# -- llama.cpp ----------------------------------------------------------------------------------

def parse_perplexity(out: str) -> tuple[float, float]:
    """(Same top p as a fraction, mean KL) from ``llama-perplexity --kl-divergence`` output."""
    top = re.search(r"Same top p:\s*([0-9.]+)\s*±", out)
    kld = re.search(r"Mean\s+KLD:\s*(-?[0-9.]+)", out)
    if not top or not kld:
        raise RuntimeError("no 'Mean KLD' / 'Same top p' in llama-perplexity's output: "
                           + out[-1500:])
    return float(top.group(1)) / 100.0, float(kld.group(1))


def score_gguf(d: Path, gguf: Path, base: BaseFile, threads: int, keep_log: Path | None = None) -> dict:
    """llama.cpp's agreement and KL for ``gguf`` on the base file's tokens against its log-probs
    (its whole output to ``keep_log`` when given)."""
    cmd = [str(llama_cpp._exe(d, "llama-perplexity")), "-m", str(gguf), "--kl-divergence-base",
           str(base.path), "--kl-divergence", "-c", str(base.n_ctx), "-b", str(base.n_ctx),
           "-t", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    out = res.stdout + res.stderr
    if keep_log is not None:
        keep_log.parent.mkdir(parents=True, exist_ok=True)
        keep_log.write_text(" ".join(cmd) + "\n" + out)
    if res.returncode != 0:
        raise RuntimeError(f"llama-perplexity {gguf.name} failed: {out[-1500:]}")
    if "inconsistent vocabulary" in out:
        raise RuntimeError(f"llama-perplexity {gguf.name}: {base.n_vocab}-token vocabulary of ours "
                           f"differs from the GGUF's")
    top, kl = parse_perplexity(out)
    total = base.n_chunk * scored_per_chunk(base.n_ctx)
    return quality(round(top * total), total, kl)


# -- configurations -----------------------------------------------------------------------------

def speed(engine, compute_ratio: float | None, prompt: list[int], threads: int, repeats: int,
          new_tokens: int) -> float:
    """Median decode tok/s over ``repeats`` short runs at ``threads`` threads (bench's run)."""
    from .bench import Subject, run_once
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s = Subject("", "selectinfer" if compute_ratio is not None else "dense", 1.0,
                    compute_ratio or 1.0, engine=engine)
        run_once(s, prompt, 2)  # warm-up
        s.decode.clear()
        for _ in range(repeats):
            run_once(s, prompt, new_tokens)
        return statistics.median(s.decode)
    finally:
        torch.set_num_threads(before)


def choose_profile(profiles: Path | None, task: str | None, log: Log) -> str | None:
    """``--task``, else the ``general`` profile, else the catalogue's first (said so)."""
    if profiles is None or not any(profiles.glob("*.safetensors")):
        log(f"[frontier] no profiles in {profiles}: only gamma = 1 rows of ours")
        return None
    if task:
        log(f"[frontier] profile: {task} (--task)")
        return task
    if (profiles / "general.safetensors").exists():
        log(f"[frontier] profile: general ({profiles})")
        return "general"
    first = sorted(p.stem for p in profiles.glob("*.safetensors"))[0]
    log(f"[frontier] profile: {first} (no 'general' profile in {profiles}: the first listed, as "
        f"a model loaded without --task gets)")
    return first


def weight_formats(wanted: list[str] | None) -> list[str]:
    """``pack --weights`` formats to run: those the pack format knows (or the ones asked for)."""
    from ..core.format.pack import WEIGHTS
    if wanted:
        bad = [w for w in wanted if w not in WEIGHTS]
        if bad:
            raise ValueError(f"unknown weights {', '.join(bad)}; pack knows {', '.join(WEIGHTS)}")
        return list(wanted)
    return list(WEIGHTS)


def int8_ratios(high: str | None, gamma: float, wanted: list[float] | None) -> list[float]:
    """The int8 tier's shares of a pack's rows at load ratio ``gamma``: 0 (one tier), and for a
    pack with an int8 high tier those of ``wanted`` below gamma."""
    extra = sorted({r for r in (wanted or []) if 0.0 < r < gamma}) if high == "int8" else []
    return [0.0] + extra


def pareto(rows: list[dict]) -> list[int]:
    """Indices of the rows no other row beats: as few or fewer weight bytes and as high or higher
    agreement, one of them strictly. Sorted by weight bytes."""
    front = []
    for i, r in enumerate(rows):
        dominated = any(o["weight_bytes"] <= r["weight_bytes"] and o["agreement"] >= r["agreement"]
                        and (o["weight_bytes"] < r["weight_bytes"] or o["agreement"] > r["agreement"])
                        for j, o in enumerate(rows) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (rows[i]["weight_bytes"], rows[i]["agreement"]))


def best_within(rows: list[dict], budget_bytes: float, source: str | None = None) -> dict | None:
    """The row of highest agreement within ``budget_bytes`` (of ``source`` when given)."""
    fit = [r for r in rows if r["weight_bytes"] <= budget_bytes
           and (source is None or r["source"] == source)]
    return max(fit, key=lambda r: (r["agreement"], -r["weight_bytes"]), default=None)


def budget_table(rows: list[dict], budgets_mib=BUDGETS_MIB) -> list[dict]:
    """Per budget: the best row overall and llama.cpp's best quant within it."""
    out = []
    for b in budgets_mib:
        best = best_within(rows, b * 2**20)
        llama = best_within(rows, b * 2**20, "llama.cpp")
        out.append({"budget_mib": b, "best": best and best["name"],
                    "agreement": best and best["agreement"],
                    "decode_tokens_per_second": best and best["decode_tokens_per_second"],
                    "weight_mib": best and best["weight_bytes"] / 2**20,
                    "llama_cpp": llama and llama["name"],
                    "llama_cpp_agreement": llama and llama["agreement"]})
    return out


def run(args: argparse.Namespace, log: Log = _log) -> list[dict]:
    from ..core.execution.engine import Engine
    from ..core.format.pack import read_manifest
    from ..core.format.paths import default_profiles_dir
    from ..core.format.tokenizer import load_tokenizer
    from ..core.format.models import resolve
    from ..core.selection.loader import SelectiveModel, load_dense
    from .bench import _unique_bytes, pack_of

    llama_dir = llama_cpp.find_build(args.llama_cpp, TOOLS) if args.llama_cpp else None  # fails fast
    if args.score_threads:
        torch.set_num_threads(args.score_threads)
    formats = weight_formats(args.weights)
    model_path = resolve(args.model or "", "float", log)
    manifest = read_manifest(model_path)
    profiles = Path(args.profiles) if args.profiles else default_profiles_dir(manifest.model_id)
    task = choose_profile(profiles if profiles.is_dir() else None, args.task, log)
    tok = load_tokenizer(model_path)
    texts, what = heldout_texts(args.data, args.task)
    chunks = make_chunks(tok, texts, args.ctx, args.tokens)
    log(f"[frontier] {manifest.model_id}: held-out {what}: {chunks.shape[0]} chunks x {args.ctx} "
        f"tokens, {chunks.shape[0] * scored_per_chunk(args.ctx)} scored; speed at {args.threads} "
        f"thread(s), scoring at {torch.get_num_threads()}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="frontier-", dir=args.out or None))  # the base file
    from ..core.format.kernel import cpu_description
    common = {"model": manifest.model_id, "threads": args.threads, "profile": task or "",
              "heldout": what, "cpu": cpu_description()}
    rows: list[dict] = []

    def add(row: dict) -> None:
        row = {**common, **row}
        rows.append(row)
        if args.out:  # a long run's rows so far, should it be stopped
            (Path(args.out) / "frontier.partial.json").write_text(json.dumps(rows, indent=2) + "\n")
        log(f"[frontier] {row['name']}: agreement {row['agreement']:.4f} "
            f"[{row['agreement_ci_low']:.4f}, {row['agreement_ci_high']:.4f}] kl {row['kl']:.4f} "
            f"{row['weight_bytes'] / 2**20:.1f} MiB {row['decode_tokens_per_second']:.1f} tok/s")

    try:
        t0 = time.perf_counter()
        dense, _ = load_dense(model_path)
        if args.base:  # a reference file of an earlier run (same model, same tokens)
            base = BaseFile.read(args.base)
            if base.tokens.shape != chunks.shape or not np.array_equal(base.tokens, chunks):
                raise ValueError(f"{args.base} holds other tokens than this run's held-out chunks")
            log(f"[frontier] dense reference: {args.base} (--base)")
        else:
            kept = Path(args.out) if args.out else work  # --out: kept for a later run's --base
            base = write_base(Engine(dense, tok), chunks, kept / "dense-logits.kld", log)
        dense_bytes = _unique_bytes(dense)
        refs = [Reference.of(lp) for lp in base.chunks()]  # [n_chunk] x [m, V] float32, once
        g = torch.Generator().manual_seed(0)  # the decode runs' prompt, as bench's
        prompt = [int(t) for t in torch.randint(10, min(dense.config.vocab_size, 30000), (32,),
                                                generator=g)]
        if llama_dir is not None:
            for row in llama_rows(llama_dir, manifest.model_id, base, args, log):
                add(row)
        del dense
        gammas = tuple(args.gammas or GAMMAS) if task else (1.0,)
        modes = [m for m in (args.compute_modes or ["prompt"]) if m == "prompt" or task]
        phi_shares = tuple(args.phi_shares or PHI_SHARES)
        for weights, mode, gamma in ((w, m, g) for w in formats for m in modes for g in gammas):
            path = pack_of(model_path, weights, log)
            shares = phi_shares if mode == "prompt" else tuple(args.token_shares or TOKEN_SHARES)
            phis = sorted({round(gamma * s, 4) for s in shares}, reverse=True)
            tiers = int8_ratios(read_manifest(path).high, gamma, args.int8_ratios)
            for ranking, r8 in ((k, r) for r in tiers for k in (args.rankings or ["profile"])):
                if ranking == "random" and gamma >= 1.0 and r8 == 0.0:
                    continue  # every neuron in one tier: no order to ablate
                sm = SelectiveModel(path, profiles if task else None, task, load_ratio=gamma,
                                    static_ratio=min(0.3, min(phis)), compute_ratio=gamma,
                                    compute_mode=mode, int8_ratio=r8,
                                    selection="random" if ranking == "random" else "auto")
                sm.tokenizer = tok
                eng = Engine.from_selective(sm)
                suffix = ((f" int8 {r8:g}" if r8 else "") + ("" if mode == "prompt" else " token")
                          + (" random" if ranking == "random" else ""))
                for phi in phis:
                    if mode == "token" and phi >= gamma:
                        continue  # every loaded neuron: the prompt mode's row
                    sm.set_compute_ratio(phi)
                    before = sm.counts()
                    q = score_engine(eng, base, refs)
                    read = sm.read_shares(before)  # measured over the scoring passes
                    tps = speed(eng, phi, prompt, args.threads, args.repeats, args.new_tokens)
                    add({"name": f"selectinfer {weights} {gamma:g}/{phi:g}{suffix}",
                         "source": "selectinfer", "weights": weights, "load_ratio": gamma,
                         "compute_ratio": phi, "compute_mode": mode, "int8_ratio": r8,
                         "ranking": ranking, **read,
                         "weight_bytes": sm.weight_bytes()["total"], **q,
                         "decode_tokens_per_second": tps})
                del sm, eng
        if not args.no_quant:
            from .quantize import quantize_model
            for bits in (8, 4):
                model, _ = load_dense(model_path)
                try:
                    model = quantize_model(model, bits)
                except (RuntimeError, ValueError) as e:
                    log(f"[frontier] torch int{bits} skipped: {e}")
                    continue
                eng = Engine(model, tok)
                add({"name": f"torch int{bits} weight-only", "source": "torch", "weights": f"int{bits}",
                     "load_ratio": 1.0, "compute_ratio": 1.0, "weight_bytes": _unique_bytes(model),
                     **score_engine(eng, base, refs),
                     "decode_tokens_per_second": speed(eng, None, prompt, args.threads,
                                                       args.repeats, args.new_tokens)})
                del model, eng
        log(f"[frontier] {len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        r["weight_ratio"] = r["weight_bytes"] / dense_bytes
        r["pareto"] = False
    for i in pareto(rows):
        rows[i]["pareto"] = True
    return rows


def llama_rows(d: Path, model_id: str, base: BaseFile, args, log: Log) -> Iterator[dict]:
    """llama.cpp's quants of the same weights on the same tokens (none, said why, when the model
    has no GGUF)."""
    from ..core.format.models import CATALOG
    source = llama_cpp.source_gguf(model_id, log)
    if source is None:
        return
    types = tuple(args.llama_types or LLAMA_TYPES)
    for qtype, gguf in llama_cpp.quantized(d, source, model_id, log, types).items():
        log(f"[frontier] llama-perplexity --kl-divergence {gguf.name} ...")
        q = score_gguf(d, gguf, base, args.score_threads or torch.get_num_threads(),
                       Path(args.out) / "llama-perplexity" / f"{qtype}.log" if args.out else None)
        tps = statistics.median(llama_cpp.bench_once(d, gguf, args.threads, 32, args.new_tokens)[0]
                                for _ in range(args.repeats))
        row = {"name": f"llama.cpp {qtype}", "source": "llama.cpp", "weights": qtype,
               "load_ratio": 1.0, "compute_ratio": 1.0,
               "weight_bytes": llama_cpp.tensor_bytes(gguf, d), **q,
               "decode_tokens_per_second": tps, "gguf_file_bytes": gguf.stat().st_size}
        if qtype == "Q4_K_M" and model_id in CATALOG and "Q4_K_M" in CATALOG[model_id].gguf_name.upper():
            row["note"] = Q4_K_M_NOTE
        yield row


def print_table(rows: list[dict]) -> None:
    print(f"{'configuration':<30}{'source':>12}{'MiB':>8}{'agreement':>11}{'95% CI':>17}"
          f"{'KL':>9}{'tok/s':>8}{'front':>6}")
    for r in sorted(rows, key=lambda r: r["weight_bytes"]):
        ci = f"{r['agreement_ci_low']:.3f}-{r['agreement_ci_high']:.3f}"
        print(f"{r['name']:<30}{r['source']:>12}{r['weight_bytes'] / 2**20:>8.1f}"
              f"{r['agreement']:>11.4f}{ci:>17}{r['kl']:>9.4f}{r['decode_tokens_per_second']:>8.1f}"
              f"{'*' if r['pareto'] else '':>6}")
    r0 = rows[0]
    print(f"agreement = top token equal to the dense float model's, KL = KL(dense || config) nats "
          f"per token, both on the same {r0['tokens']} held-out tokens ({r0['heldout']}); "
          f"tok/s: decode at {'/'.join(str(t) for t in sorted({r['threads'] for r in rows}))} "
          f"thread(s) (merged runs: each row its own); front = on the Pareto front "
          f"(fewer MiB, higher agreement); profile: {r0['profile'] or '-'}")
    for r in rows:
        if r.get("note"):
            print(f"{r['name']}: {r['note']}")
    f16 = next((r for r in rows if r["name"] == "llama.cpp F16"), None)
    if f16 is not None:
        print(f"cross-check: llama.cpp F16 against our dense float: agreement {f16['agreement']:.4f}, "
              f"KL {f16['kl']:.5f} ({'pass' if f16['agreement'] >= 0.98 else 'FAIL'}: needs >= 0.98)")
    q40 = next((r for r in rows if r["name"] == "llama.cpp Q4_0"), None)
    if q40 is not None:
        ours = best_within([r for r in rows if r["source"] == "selectinfer"], q40["weight_bytes"])
        if ours is not None:
            verdict = "at least as well" if ours["agreement"] >= q40["agreement"] else "worse"
            print(f"at llama.cpp Q4_0's {q40['weight_bytes'] / 2**20:.1f} MiB: our best is {ours['name']} "
                  f"(agreement {ours['agreement']:.4f} vs {q40['agreement']:.4f}: {verdict})")
        else:
            print(f"at llama.cpp Q4_0's {q40['weight_bytes'] / 2**20:.1f} MiB: no row of ours fits")
    print("best within a weight budget:")
    for b in budget_table(rows):
        if b["best"] is None:
            print(f"  {b['budget_mib']:>5} MiB: nothing fits")
            continue
        print(f"  {b['budget_mib']:>5} MiB: {b['best']} ({b['weight_mib']:.0f} MiB, agreement "
              f"{b['agreement']:.4f}, {b['decode_tokens_per_second']:.1f} tok/s); llama.cpp: "
              + (f"{b['llama_cpp']} ({b['llama_cpp_agreement']:.4f})" if b["llama_cpp"] else "-"))


def merge(rows: list[dict], earlier: str | Path) -> list[dict]:
    """``earlier``'s rows (a frontier.json of the same model and held-out tokens) with this run's
    added, a row of the same name replaced; the Pareto front recomputed."""
    old = json.loads(Path(earlier).read_text())
    for key in ("model", "heldout", "tokens"):
        if old and rows and old[0].get(key) != rows[0].get(key):
            raise ValueError(f"--merge {earlier}: its {key} is {old[0].get(key)!r}, this run's "
                             f"{rows[0].get(key)!r}")
    names = {r["name"] for r in rows}
    out = [r for r in old if r["name"] not in names] + rows
    for r in out:
        r["pareto"] = False
    for i in pareto(out):
        out[i]["pareto"] = True
    return out


def cmd_frontier(args: argparse.Namespace) -> int:
    from .plots import compute_mode_plot, frontier_plot, tier_plot
    rows = run(args)
    if args.merge:
        rows = merge(rows, args.merge)
    print_table(rows)
    print_speed_at_quality(rows)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "frontier.json").write_text(json.dumps(rows, indent=2) + "\n")
        frontier_plot(rows, pareto(rows), out / "frontier.png",
                      title=f"{rows[0]['model']}: agreement with dense vs resident weights "
                            f"({rows[0]['tokens']} held-out tokens)")
        for w in sorted({r["weights"] for r in rows if r.get("compute_mode") == "token"}):
            compute_mode_plot(rows, out / f"compute-modes-{w}.png", w,
                              title=f"{rows[0]['model']} {w}: per-prompt vs per-token selection "
                                    f"({rows[0]['tokens']} held-out tokens)")
        if any(r.get("int8_ratio") for r in rows):
            tier_plot(rows, pareto(rows), out / "tiers.png",
                      title=f"{rows[0]['model']}: 4-bit records with int8 tiers vs llama.cpp "
                            f"({rows[0]['tokens']} held-out tokens)")
        (out / "frontier.partial.json").unlink(missing_ok=True)
        print(f"wrote {out / 'frontier.json'} and {out / 'frontier.png'}; copied into the "
              f"model's profiles folder as frontier.json, it gives memory_budget_mb / "
              f"min_agreement their measured speeds and format gaps")
    return 0
