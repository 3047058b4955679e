"""Offline profiler: per-task neuron activation scores s_n = sum over tokens of |a_n|.

a_n is the input of ``down_proj`` (act(gate . x) * (up . x)). Forward passes are teacher-forced
over prompt + reference, batched with padding; BOS and padding tokens do not count.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from ..format.pack import Manifest
from ..selection.profiles import Profile
from ..selection.token_rule import ACT_KEY, GATE_KEY, Calibration
from ..format.progress import progress


def read_prompts(path: str | Path) -> list[dict]:
    """A user's prompt file: JSONL records (``.jsonl``/``.json``, or every line a JSON object),
    else plain text, one prompt per non-empty line (``{"text": line}``)."""
    path = Path(path)
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no records")
    if path.suffix in (".jsonl", ".json") or all(ln.lstrip().startswith("{") for ln in lines):
        return read_jsonl(path)
    return [{"text": ln.strip()} for ln in lines]


CHAT_MODES = ("none", "only", "both")


def chat_records(tokenizer, records: list[dict], mode: str = "only") -> list[dict]:
    """``records`` as the model's chat template writes them (``mode`` ``only``), or those and
    the plain ones (``both``; ``none``: as given): the prompt (or text) is the user's turn, the
    reference the model's reply. Instruction-tuned models are asked this way on a robot."""
    if mode == "none":
        return list(records)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: this model's tokenizer has no chat template")
    chat = []
    for r in records:
        user = r.get("prompt", r.get("text", ""))
        turn = tokenizer.apply_chat_template([{"role": "user", "content": user.strip()}],
                                             add_generation_prompt=True, tokenize=False)
        chat.append({"text": turn + r.get("reference", "").strip() if "prompt" in r else turn})
    return chat if mode == "only" else list(records) + chat


def split_heldout(records: list, every: int = 5, min_records: int = 8) -> tuple[list, list]:
    """(profiling part, held-out part): every ``every``-th record is held out for the quality
    curve; files of fewer than ``min_records`` records are not split (no held-out part)."""
    if len(records) < min_records:
        return list(records), []
    held = [r for i, r in enumerate(records) if i % every == every - 1]
    return [r for i, r in enumerate(records) if i % every != every - 1], held


def agreement_pairs(tokenizer, records: list[dict], max_tokens: int = 256) -> list[tuple[list[int], list[int]]]:
    """(prefix, continuation) token ids per record: the text (prompt + reference) split in the
    middle. The selection is made on the prefix; agreement is counted on the continuation. The
    quality curve and ``selectinfer eval`` use the same split, so their figures compare."""
    out = []
    for r in records:
        ids = tokenizer(record_text(r))["input_ids"][:max_tokens]
        if len(ids) < 3:
            continue
        half = max(2, len(ids) // 2)
        out.append((ids[:half], ids[half:]))
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a JSONL file; each needs ``prompt`` (optional ``reference``) or ``text``."""
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        if not isinstance(rec, dict) or not ("prompt" in rec or "text" in rec):
            raise ValueError(f"{path}:{n}: needs a 'prompt' (and optional 'reference') or 'text'")
        out.append(rec)
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def record_text(rec: dict) -> str:
    return rec["text"] if "text" in rec else rec["prompt"] + rec.get("reference", "")


def file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()


CALIBRATION_TOKENS = 64  # counted tokens per batch whose magnitudes enter the per-token thresholds


@torch.inference_mode()
def activation_scores(model: nn.Module, tokenizer, texts: list[str], batch_size: int = 8,
                      max_tokens: int = 256, desc: str = "profile", normalize: str = "none",
                      calibration: Calibration | None = None) -> tuple[torch.Tensor, int]:
    """Sum of |a_n| per layer and neuron over the counted tokens of ``texts``: ([L, I], tokens).

    ``normalize="token"``: each token's |a| vector is first divided by its mean over the layer's
    neurons, so every token weighs the same (a few tokens with huge activations, such as
    separators and newlines, do not decide the ranking). ``calibration``: also collects
    ``|act(gate)|`` and ``|a|`` of up to ``CALIBRATION_TOKENS`` counted tokens per batch, spread
    over the batch, for the per-token thresholds (:mod:`..selection.token_rule`)."""
    if normalize not in ("none", "token"):
        raise ValueError(f"unknown score normalisation {normalize!r}; use none or token")
    layers = model.model.layers
    device = next(model.parameters()).device
    inter = layers[0].mlp.down_proj.in_features
    scores = torch.zeros(len(layers), inter, dtype=torch.float64, device=device)
    mask_box: list[torch.Tensor] = []
    gates: dict[int, torch.Tensor] = {}  # layer -> act(gate) [B, T, I] of the batch in flight

    def hook(layer: int):
        def pre(_mod, args):
            a = args[0].abs().float()  # [B, T, I]
            if calibration is not None:
                pick = mask_box[1]  # [n, 2] (row, position) of the sampled tokens
                calibration.add(layer, gates.pop(layer)[pick[:, 0], pick[:, 1]], a[pick[:, 0], pick[:, 1]])
            if normalize == "token":
                a = a / a.mean(-1, keepdim=True).clamp_min(1e-12)
            scores[layer] += torch.einsum("bti,bt->i", a, mask_box[0]).double()
        return pre

    def gate_hook(layer: int, act_fn):
        def post(_mod, _args, out):
            gates[layer] = act_fn(out)
        return post

    handles = [blk.mlp.down_proj.register_forward_pre_hook(hook(i)) for i, blk in enumerate(layers)]
    if calibration is not None:
        handles += [blk.mlp.gate_proj.register_forward_hook(gate_hook(i, blk.mlp.act_fn))
                    for i, blk in enumerate(layers)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bos = tokenizer.bos_token_id
    tokens = 0
    try:
        batches = [texts[i:i + batch_size] for i in range(0, len(texts), batch_size)]
        for batch in progress(batches, desc=desc):
            enc = [tokenizer(t)["input_ids"][:max_tokens] for t in batch]
            width = max(len(e) for e in enc)
            ids = torch.full((len(enc), width), pad, dtype=torch.long)
            attn = torch.zeros((len(enc), width), dtype=torch.long)
            for row, e in enumerate(enc):
                ids[row, :len(e)] = torch.tensor(e)
                attn[row, :len(e)] = 1
            count = attn.clone().float()
            if bos is not None:
                count[ids == bos] = 0.0
            counted = torch.nonzero(count > 0)  # [n, 2]
            step = max(1, -(-counted.shape[0] // CALIBRATION_TOKENS))
            mask_box[:] = [count.to(device), counted[::step].to(device)]
            # The decoder stack only: the FFN activations are all we need, not the logits.
            model.model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
            tokens += int(count.sum())
    finally:
        for h in handles:
            h.remove()
    return scores.float().cpu(), tokens


SENSITIVITY_KEEP = 0.5  # each layer alone is cut to this share of neurons to measure it


@torch.inference_mode()
def layer_sensitivity(model: nn.Module, tokenizer, texts: list[str], scores: torch.Tensor,
                      max_texts: int = 16, max_tokens: int = 256, top_vocab: int = 32,
                      desc: str = "sensitivity") -> torch.Tensor:
    """Per layer: KL(dense || layer alone keeping its top half) of the next-token distribution
    on ``texts``, divided by the share of the layer's score mass dropped. ``[L]`` float32.

    The KL runs over the tokens that are among the dense model's ``top_vocab`` most likely at
    some position (the output layer over the whole vocabulary would cost more than the rest).
    """
    layers = model.model.layers
    mask: list[torch.Tensor | None] = [None]

    def pre(_mod, args):
        return (args[0] * mask[0],) if mask[0] is not None else None

    device = next(model.parameters()).device
    ids = [torch.tensor([tokenizer(t)["input_ids"][:max_tokens]], device=device) for t in texts[:max_texts]]
    vocab = torch.unique(torch.cat([torch.topk(model(i).logits[0, :-1].float(), top_vocab, -1).indices.flatten()
                                    for i in ids]))
    head = model.get_output_embeddings().weight[vocab]  # [V', H]

    def log_probs(i: torch.Tensor) -> torch.Tensor:
        hidden = model.model(i).last_hidden_state[0, :-1]  # [T-1, H]
        return torch.log_softmax((hidden @ head.t()).float(), -1)

    ref = [log_probs(i) for i in ids]
    n_tok = sum(r.shape[0] for r in ref)
    out = torch.zeros(len(layers))
    inter = scores.shape[1]
    for layer in progress(range(len(layers)), desc=desc, total=len(layers)):
        keep = torch.topk(scores[layer], int(SENSITIVITY_KEEP * inter)).indices
        m = torch.zeros(inter, device=device, dtype=head.dtype)
        m[keep.to(device)] = 1
        handle = layers[layer].mlp.down_proj.register_forward_pre_hook(pre)
        mask[0] = m
        try:
            kl = sum(float((r.exp() * (r - log_probs(i))).sum()) for i, r in zip(ids, ref))
        finally:
            handle.remove()
            mask[0] = None
        dropped = float(1 - scores[layer][keep].sum() / scores[layer].sum().clamp_min(1e-30))
        out[layer] = (kl / n_tok) / max(dropped, 1e-6)
    return out


def profile_task(model: nn.Module, tokenizer, manifest: Manifest, task: str,
                 data: list[str | Path], batch_size: int = 8, max_tokens: int = 256,
                 sensitivity: bool = True, records: list[dict] | None = None,
                 normalize: str = "none") -> Profile:
    """Profile one task into a :class:`Profile` (scores, and per-layer sensitivity for the
    sensitivity-based selection strategies). ``records`` (default: every record of the files
    ``data``) are what is profiled; ``data`` names the dataset (its sha256)."""
    paths = [Path(p) for p in data]
    if records is None:
        records = [r for p in paths for r in read_prompts(p)]
    texts = [record_text(r) for r in records]
    cal = Calibration(len(model.model.layers))
    scores, tokens = activation_scores(model, tokenizer, texts, batch_size, max_tokens,
                                       desc=f"profile {task}", normalize=normalize, calibration=cal)
    extra = dict(zip((GATE_KEY, ACT_KEY), cal.tables()))
    if sensitivity:
        extra["sensitivity"] = layer_sensitivity(model, tokenizer, texts, scores,
                                                 max_tokens=max_tokens, desc=f"sensitivity {task}")
    return Profile(task, manifest.model_id, manifest.fingerprint, scores, tokens, file_sha256(paths),
                   extra, {"score_normalize": normalize, "records": str(len(records))})


def calibrate_task(model: nn.Module, tokenizer, records: list[dict], batch_size: int = 8,
                   max_tokens: int = 256, desc: str = "calibrate") -> dict[str, torch.Tensor]:
    """The per-token thresholds of ``records`` (profile tensors by name), as :func:`profile_task`
    stores them, for a profile made before they existed."""
    cal = Calibration(len(model.model.layers))
    activation_scores(model, tokenizer, [record_text(r) for r in records], batch_size, max_tokens,
                      desc=desc, calibration=cal)
    return dict(zip((GATE_KEY, ACT_KEY), cal.tables()))


def summarize(profiles: dict[str, Profile], static_ratio: float = 0.3, top: int = 5) -> str:
    """Readable summary: tokens per task, top neurons per layer, base-set overlap between tasks."""
    lines = []
    names = sorted(profiles)
    for name in names:
        p = profiles[name]
        L, I = p.scores.shape
        lines.append(f"task {name}: model {p.model_id} ({p.fingerprint}), {p.tokens} tokens, "
                     f"{L} layers x {I} neurons, dataset {p.dataset_sha256[:12]}")
        for layer in (0, L // 2, L - 1):
            row = p.scores[layer]
            idx = torch.topk(row, top).indices.tolist()
            share = float(torch.topk(row, int(static_ratio * I)).values.sum() / row.sum())
            lines.append(f"  layer {layer:2d}: top neurons {idx}; top {static_ratio:.0%} carry "
                         f"{share:.0%} of the mass")
    if len(names) > 1:
        k = int(static_ratio * profiles[names[0]].scores.shape[1])
        sets = {n: [set(torch.topk(r, k).indices.tolist()) for r in profiles[n].scores] for n in names}
        lines.append(f"base-set overlap (Jaccard at {static_ratio:.0%}, mean over layers):")
        lines.append("  " + " ".join(f"{n[:11]:>11}" for n in [""] + names))
        for a in names:
            row = []
            for b in names:
                j = [len(x & y) / len(x | y) for x, y in zip(sets[a], sets[b])]
                row.append(f"{sum(j) / len(j):11.2f}")
            lines.append(f"  {a[:11]:>11} " + " ".join(row))
    return "\n".join(lines)


CURVE_LOAD_RATIOS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CURVE_COMPUTE_SHARES = (0.7, 1.0)  # phi / gamma: 1.0 is loading only
KL_TOP = 64  # KL over the dense model's top tokens per position (the full vocabulary costs more)


@torch.inference_mode()
def dense_reference(engine, pairs: list[tuple[list[int], list[int]]]) -> list[tuple]:
    """Per pair, the dense model's argmax and its top-``KL_TOP`` (ids, log-probs) per position."""
    out = []
    for prefix, cont in pairs:
        lp = torch.log_softmax(engine.score(prefix, cont).float(), -1)
        top = torch.topk(lp, KL_TOP, -1)
        out.append((lp.argmax(-1).cpu(), top.indices.cpu(), top.values.cpu()))
    return out


@torch.inference_mode()
def agreement_and_kl(engine, pairs, reference) -> tuple[float, float, int]:
    """(next-token agreement with dense, KL(dense || this) nats per token over the dense top
    tokens, tokens counted) over ``pairs`` (see :func:`agreement_pairs`)."""
    agree = total = 0
    kl = 0.0
    for (prefix, cont), (d_arg, d_idx, d_lp) in zip(pairs, reference):
        lp = torch.log_softmax(engine.score(prefix, cont).float(), -1).cpu()
        agree += int((lp.argmax(-1) == d_arg).sum())
        total += len(cont)
        kl += float((d_lp.exp() * (d_lp - lp.gather(1, d_idx))).sum())
    return agree / max(1, total), kl / max(1, total), total


def measure_quality_curve(packed_dir: str | Path, profiles_dir: str | Path, task: str,
                          records: list[dict], selection: str = "auto",
                          load_ratios=CURVE_LOAD_RATIOS, shares=CURVE_COMPUTE_SHARES,
                          alpha: float = 0.2, device: str = "cpu", dtype=None, data_name: str = "",
                          log=lambda s: None, reference_dir: str | Path | None = None,
                          reference: list | None = None):
    """Agreement with dense (and KL) of ``task``'s profile on held-out ``records`` over a gamma x
    (phi/gamma) grid, as generation computes it (selection at the prefix's prefill, decode path on
    the continuation). delta = min(0.3, phi) as the runtime's default. The dense model agreed
    with is ``reference_dir``'s (default: ``packed_dir``'s own; the embedded model's int8 records
    are measured against its float pack) or the precomputed ``reference``
    (:func:`dense_reference` of the same records). Fewer than
    :data:`~..selection.profiles.MIN_CURVE_TOKENS` held-out tokens: a warning with the interval."""
    from ..execution.engine import Engine
    from ..selection.loader import SelectiveModel, load_dense
    from ..selection.profiles import QualityCurve
    from ..format.tokenizer import load_tokenizer
    from ..format.pack import read_manifest
    from ..selection.profiles import MIN_CURVE_TOKENS, with_ci
    tok = load_tokenizer(packed_dir)
    pairs = agreement_pairs(tok, records)
    if not pairs:
        raise ValueError(f"no held-out records to measure the quality curve of {task!r}")
    n_tokens = sum(len(c) for _, c in pairs)
    if n_tokens < MIN_CURVE_TOKENS:
        log(f"[curve] warning: {task}: only {n_tokens} held-out tokens (< {MIN_CURVE_TOKENS}); an "
            f"agreement of 0.80 measured on them lies in {with_ci(0.8, n_tokens).split(' ', 1)[1]} "
            f"(95 % CI): add held-out prompts (--heldout) for a curve worth choosing by")
    weights = read_manifest(packed_dir).weights
    ref_dir = Path(reference_dir) if reference_dir is not None else Path(packed_dir)
    ref = reference
    if ref is None:
        log(f"[curve] {task}: dense reference ({ref_dir.name}) on {len(pairs)} records, "
            f"{n_tokens} tokens ...")
        dense, _ = load_dense(ref_dir, dtype, device)
        ref = dense_reference(Engine(dense, tok), pairs)
        del dense
    load_ratios, shares = sorted(load_ratios), sorted(shares)
    agree = torch.zeros(len(load_ratios), len(shares))
    kl = torch.zeros_like(agree)
    resolved, tokens = selection, n_tokens
    # gamma 1, phi 1 is the reference itself, unless the reference is another pack's dense model
    # (int8 records against float: measured like any other point)
    own = ref_dir.resolve() == Path(packed_dir).resolve()
    points = sum(1 for g in load_ratios for s in shares if not (own and g >= 1.0 and s >= 1.0))
    done, t0 = 0, time.perf_counter()
    for i, gamma in enumerate(load_ratios):
        todo = [(j, s) for j, s in enumerate(shares) if not (own and gamma >= 1.0 and s >= 1.0)]
        for j, s in enumerate(shares):
            if (j, s) not in todo:
                agree[i, j], kl[i, j] = 1.0, 0.0  # the dense model itself
        if not todo:
            continue
        delta = min(0.3, gamma * min(s for _, s in todo))
        sm = SelectiveModel(packed_dir, profiles_dir, task, load_ratio=gamma, static_ratio=delta,
                            compute_ratio=gamma, alpha=alpha, device=device, dtype=dtype,
                            selection=selection)
        sm.tokenizer = tok
        resolved = sm.selection_strategy
        engine = Engine.from_selective(sm)
        for j, s in todo:
            sm.set_compute_ratio(max(delta, gamma * s))
            agree[i, j], kl[i, j], tokens = agreement_and_kl(engine, pairs, ref)
            done += 1
            log(f"[curve] {task} {weights} gamma={gamma:g} phi={gamma * s:.3g}: agreement "
                f"{with_ci(float(agree[i, j]), tokens)} kl {float(kl[i, j]):.3f} "
                f"({done}/{points} points, {time.perf_counter() - t0:.0f} s)")
        del sm, engine
    return QualityCurve(list(load_ratios), list(shares), agree, kl, resolved, len(pairs), tokens,
                        data_name, weights, "" if own else
                        f"dense {read_manifest(ref_dir).weights} records")
