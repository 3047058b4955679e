"""Offline profiler: per-task neuron activation scores s_n = sum over tokens of |a_n|.

a_n is the input of ``down_proj`` (act(gate . x) * (up . x)). Forward passes are teacher-forced
over prompt + reference, batched with padding; BOS and padding tokens do not count.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from .pack import Manifest
from .profiles import Profile
from .progress import progress


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


@torch.inference_mode()
def activation_scores(model: nn.Module, tokenizer, texts: list[str], batch_size: int = 8,
                      max_tokens: int = 256, desc: str = "profile") -> tuple[torch.Tensor, int]:
    """Sum of |a_n| per layer and neuron over the counted tokens of ``texts``: ([L, I], tokens)."""
    layers = model.model.layers
    device = next(model.parameters()).device
    inter = layers[0].mlp.down_proj.in_features
    scores = torch.zeros(len(layers), inter, dtype=torch.float64, device=device)
    mask_box: list[torch.Tensor] = []

    def hook(layer: int):
        def pre(_mod, args):
            a = args[0].abs().float()  # [B, T, I]
            scores[layer] += torch.einsum("bti,bt->i", a, mask_box[0]).double()
        return pre

    handles = [blk.mlp.down_proj.register_forward_pre_hook(hook(i)) for i, blk in enumerate(layers)]
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
            mask_box[:] = [count.to(device)]
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
                 sensitivity: bool = True) -> Profile:
    """Profile one task from JSONL files into a :class:`Profile` (scores, and per-layer
    sensitivity for the ``sensitivity`` selection strategy)."""
    paths = [Path(p) for p in data]
    texts = [record_text(r) for p in paths for r in read_jsonl(p)]
    scores, tokens = activation_scores(model, tokenizer, texts, batch_size, max_tokens,
                                       desc=f"profile {task}")
    extra = {}
    if sensitivity:
        extra["sensitivity"] = layer_sensitivity(model, tokenizer, texts, scores,
                                                 max_tokens=max_tokens, desc=f"sensitivity {task}")
    return Profile(task, manifest.model_id, manifest.fingerprint, scores, tokens, file_sha256(paths),
                   extra)


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
