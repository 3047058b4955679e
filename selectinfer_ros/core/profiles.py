"""Task profiles: per-neuron activation scores, stored as safetensors, and neuron selection.

A profile file ``profiles/<model-id>/<task>.safetensors`` holds ``scores`` ``[L, I]`` float32
(s_n = sum over counted tokens of |a_n|) and metadata: format version, task, model id, model
fingerprint, dataset sha256 and token count. A file whose fingerprint or shape does not match the
model is refused at load with the file name and the mismatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .pack import Manifest
from .safetensors_io import CountingReader, FormatError, read_header

PROFILE_FORMAT = "selectinfer-profile"
PROFILE_VERSION = 1


@dataclass
class Profile:
    task: str
    model_id: str
    fingerprint: str
    scores: torch.Tensor  # [L, I] float32, sum of |a_n| over counted tokens
    tokens: int
    dataset_sha256: str
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": PROFILE_FORMAT, "version": str(PROFILE_VERSION), "task": self.task,
                "model_id": self.model_id, "fingerprint": self.fingerprint,
                "tokens": str(self.tokens), "dataset_sha256": self.dataset_sha256}
        tensors = {"scores": self.scores.float().contiguous(), **self.extra}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
        return path


def load_profile(path: str | Path, manifest: Manifest | None = None) -> Profile:
    """Read a profile, refusing corrupt files and (given ``manifest``) other models' profiles."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"profile {path} does not exist")
    tensors, meta, _ = read_header(path)
    if meta.get("format") != PROFILE_FORMAT:
        raise FormatError(f"{path}: not a SelectInfer profile (format {meta.get('format')!r})")
    if meta.get("version") != str(PROFILE_VERSION):
        raise FormatError(f"{path}: profile version {meta.get('version')}, this build reads "
                          f"{PROFILE_VERSION}; re-run `selectinfer profile`")
    if "scores" not in tensors:
        raise FormatError(f"{path}: no 'scores' tensor")
    if manifest is not None:
        if meta.get("fingerprint") != manifest.fingerprint:
            raise FormatError(f"{path}: made for model {meta.get('model_id')!r} (fingerprint "
                              f"{meta.get('fingerprint')}), loaded model is {manifest.model_id!r} "
                              f"(fingerprint {manifest.fingerprint})")
        want = (manifest.num_layers, manifest.intermediate_size)
        if tensors["scores"].shape != want:
            raise FormatError(f"{path}: scores shape {tensors['scores'].shape}, model needs {want}")
    with CountingReader(path) as r:
        loaded = {k: r.read_tensor(v) for k, v in tensors.items()}
    scores = loaded.pop("scores").float()
    if not torch.isfinite(scores).all() or (scores < 0).any():
        raise FormatError(f"{path}: scores contain negative, NaN or infinite values")
    try:
        tokens = int(meta["tokens"])
    except (KeyError, ValueError) as e:
        raise FormatError(f"{path}: bad token count in metadata") from e
    return Profile(meta.get("task", path.stem), meta.get("model_id", ""), meta.get("fingerprint", ""),
                   scores, tokens, meta.get("dataset_sha256", ""), loaded)


def profile_path(profiles_dir: str | Path, task: str) -> Path:
    return Path(profiles_dir) / f"{task}.safetensors"


class ProfileCatalog:
    """All task profiles of one model in one folder, validated against the model."""

    def __init__(self, profiles_dir: str | Path, manifest: Manifest):
        self.dir = Path(profiles_dir)
        self.manifest = manifest
        if not self.dir.is_dir():
            raise FileNotFoundError(f"profiles folder {self.dir} does not exist")
        self.profiles = {p.stem: load_profile(p, manifest)
                         for p in sorted(self.dir.glob("*.safetensors"))}
        if not self.profiles:
            raise FileNotFoundError(f"no profiles (*.safetensors) in {self.dir}; "
                                    f"run `selectinfer profile` first")

    @property
    def tasks(self) -> list[str]:
        return sorted(self.profiles)

    def get(self, task: str) -> Profile:
        if task not in self.profiles:
            raise KeyError(f"unknown task {task!r}; profiles in {self.dir}: {', '.join(self.tasks)}")
        return self.profiles[task]

    def reload(self, task: str) -> Profile:
        """Re-read one task's file (refusing it if it became corrupt) and keep it."""
        prof = load_profile(profile_path(self.dir, task), self.manifest)
        self.profiles[task] = prof
        return prof

    def secondary_scores(self) -> torch.Tensor:
        """Cross-task fused scores ``[L, I]``: each task normalised per layer, then averaged."""
        return fuse_scores([p.scores for p in self.profiles.values()])


def fuse_scores(scores: list[torch.Tensor]) -> torch.Tensor:
    """Average of per-layer-normalised score tables (a long dataset does not dominate)."""
    return torch.stack([s / s.sum(dim=1, keepdim=True).clamp_min(1e-30) for s in scores]).mean(0)


def neuron_count(ratio: float, total: int) -> int:
    return max(0, min(total, int(math.floor(ratio * total + 0.5))))


@dataclass(frozen=True)
class Selection:
    """Per layer, the neuron ids to load in slot order (static/base ones first)."""

    neurons: list[torch.Tensor]  # L x [n_load_l] int64, first n_static_l are the base neurons
    n_static: list[int]

    @property
    def n_loaded(self) -> list[int]:
        return [len(n) for n in self.neurons]


def select_published(task_scores: torch.Tensor, secondary: torch.Tensor, load_ratio: float,
                     static_ratio: float) -> Selection:
    """SelectInfer's selection: top delta*I task (base) neurons, then secondary ones up to gamma*I."""
    L, I = task_scores.shape
    n_load, n_static = neuron_count(load_ratio, I), neuron_count(static_ratio, I)
    neurons = []
    for layer in range(L):
        base = torch.topk(task_scores[layer], n_static).indices
        rest = secondary[layer].clone()
        rest[base] = -1.0
        sec = torch.topk(rest, n_load - n_static).indices
        neurons.append(torch.cat([base, sec]))
    return Selection(neurons, [n_static] * L)


def select_random(num_layers: int, intermediate: int, load_ratio: float, static_ratio: float,
                  seed: int = 0) -> Selection:
    """Random neurons (the ablation the method is compared against)."""
    g = torch.Generator().manual_seed(seed)
    n_load = neuron_count(load_ratio, intermediate)
    neurons = [torch.randperm(intermediate, generator=g)[:n_load] for _ in range(num_layers)]
    return Selection(neurons, [neuron_count(static_ratio, intermediate)] * num_layers)


SENSITIVITY_FLOOR = 0.45  # every layer keeps at least this share of its neurons


def sensitivity_budgets(sensitivity: torch.Tensor, scores: torch.Tensor, load_ratio: float,
                        floor: float, n_static: int) -> list[int]:
    """Neurons per layer: rank all neurons by (layer sensitivity) x (score / layer score mass),
    each layer keeping at least ``floor`` of its neurons; the total is ``round(gamma*I) * L``."""
    L, I = scores.shape
    n_load = neuron_count(load_ratio, I)
    n_floor = min(n_load, max(n_static, neuron_count(floor, I)))
    norm = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-30)
    key = sensitivity.float().clamp_min(0)[:, None] * norm  # [L, I]
    forced = torch.zeros(L, I, dtype=torch.bool)
    forced.scatter_(1, torch.topk(norm, n_floor, dim=1).indices, True)
    key = torch.where(forced, torch.full_like(key, float("inf")), key)
    chosen = torch.zeros(L * I, dtype=torch.bool)
    chosen[torch.topk(key.flatten(), n_load * L).indices] = True
    return chosen.view(L, I).sum(dim=1).tolist()


def _require_sensitivity(profile: Profile) -> torch.Tensor:
    sens = profile.extra.get("sensitivity")
    if sens is None:
        raise FormatError(f"profile {profile.task!r} has no per-layer sensitivity; re-run "
                          f"`selectinfer profile` without --no-sensitivity")
    return sens


def select_sensitivity(profile: Profile, load_ratio: float, static_ratio: float,
                       floor: float = SENSITIVITY_FLOOR) -> Selection:
    """Per-layer budgets from the task's measured layer sensitivity, same total as uniform gamma;
    each layer keeps its top neurons by the task's own scores (base neurons first)."""
    sens = _require_sensitivity(profile)
    L, I = profile.scores.shape
    n_static = neuron_count(static_ratio, I)
    budgets = sensitivity_budgets(sens, profile.scores, load_ratio, floor, n_static)
    neurons = [torch.topk(profile.scores[layer], budgets[layer]).indices for layer in range(L)]
    return Selection(neurons, [n_static] * L)


def select_shared_sensitivity(profile: Profile, catalog_profiles: list[Profile], load_ratio: float,
                              static_ratio: float, floor: float = SENSITIVITY_FLOOR) -> Selection:
    """Per-layer budgets from the sensitivity averaged over all tasks and the fused scores, so
    every task gets the same budgets and secondary neurons: only base neurons differ, and a task
    switch reads only those. Per layer: the task's base neurons, then fused secondary ones."""
    sens = torch.stack([_require_sensitivity(p) / _require_sensitivity(p).mean()
                        for p in catalog_profiles]).mean(0)
    fused = fuse_scores([p.scores for p in catalog_profiles])
    L, I = fused.shape
    n_static = neuron_count(static_ratio, I)
    budgets = sensitivity_budgets(sens, fused, load_ratio, floor, n_static)
    neurons = []
    for layer in range(L):
        base = torch.topk(profile.scores[layer], min(n_static, budgets[layer])).indices
        rest = fused[layer].clone()
        rest[base] = -1.0
        neurons.append(torch.cat([base, torch.topk(rest, budgets[layer] - len(base)).indices]))
    return Selection(neurons, [n_static] * L)
