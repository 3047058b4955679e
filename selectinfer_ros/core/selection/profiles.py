"""Task profiles: per-neuron activation scores, stored as safetensors, and neuron selection.

A profile file ``profiles/<model-id>/<task>.safetensors`` holds ``scores`` ``[L, I]`` float32
(s_n = sum over counted tokens of |a_n|) and metadata: format version, task, model id, model
fingerprint, dataset sha256, token count and ``sha256``, a checksum of every tensor (name, dtype,
shape, bytes) and every other metadata entry. A file whose checksum, fingerprint or shape does not
match is refused at load with the file name and the mismatch.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..format.pack import Manifest
from ..format.safetensors_io import CountingReader, FormatError, read_header

PROFILE_FORMAT = "selectinfer-profile"
PROFILE_VERSION = 2  # 2: contents checksum (metadata ``sha256``), optional quality curve


def contents_sha256(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """Checksum of a profile's contents: metadata (but ``sha256`` itself), then each tensor's
    name, dtype, shape and bytes, in name order. Independent of the file layout."""
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in sorted(meta.items()) if k != "sha256"},
                        sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class Profile:
    task: str
    model_id: str
    fingerprint: str
    scores: torch.Tensor  # [L, I] float32, sum of |a_n| over counted tokens
    tokens: int
    dataset_sha256: str
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)  # further metadata (quality curve, method)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": PROFILE_FORMAT, "version": str(PROFILE_VERSION), "task": self.task,
                "model_id": self.model_id, "fingerprint": self.fingerprint,
                "tokens": str(self.tokens), "dataset_sha256": self.dataset_sha256,
                **{k: str(v) for k, v in self.info.items() if k not in BASE_META}}
        tensors = {"scores": self.scores.float().contiguous(),
                   **{k: v.contiguous() for k, v in self.extra.items()}}
        meta["sha256"] = contents_sha256(tensors, meta)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    def quality_curves(self) -> dict[str, "QualityCurve"]:
        """Every stored agreement-with-dense curve, by the weights format it was measured on
        (``float``, ``int8``, ...)."""
        out = {}
        for name in self.extra:
            if name.startswith("quality_") and name.endswith("agreement"):
                prefix = name[:-len("agreement")]
                w = prefix[len("quality_"):-1].replace("_", "-") or self.info.get(
                    "quality_weights", "float")
                out[w] = QualityCurve(
                    [round(float(x), 6) for x in self.extra[prefix + "load_ratios"]],
                    [round(float(x), 6) for x in self.extra[prefix + "compute_shares"]],
                    self.extra[prefix + "agreement"].float(), self.extra[prefix + "kl"].float(),
                    self.info.get(prefix + "selection", ""), int(self.info.get(prefix + "items", 0)),
                    int(self.info.get(prefix + "tokens", 0)), self.info.get(prefix + "data", ""),
                    w, self.info.get(prefix + "reference", ""))
        return out

    def quality_curve(self, weights: str | None = None) -> "QualityCurve | None":
        """The measured curve for ``weights`` records; None: the default format's
        (:data:`CURVE_PREFERENCE`). A format without its own curve gets another format's
        (its ``weights`` says which), so a pack of another format still has a prediction."""
        curves = self.quality_curves()
        if weights in curves:
            return curves[weights]
        for w in CURVE_PREFERENCE:
            if w in curves:
                return curves[w]
        return next(iter(curves.values()), None)

    def set_quality_curve(self, curve: "QualityCurve") -> None:
        """Store ``curve`` as the curve of its weights format (float: the version-2 names)."""
        w = curve.weights or "float"
        prefix = "quality_" if w == "float" else f"quality_{w.replace('-', '_')}_"
        self.extra.update({prefix + "load_ratios": torch.tensor(curve.load_ratios),
                           prefix + "compute_shares": torch.tensor(curve.compute_shares),
                           prefix + "agreement": curve.agreement.float().clone(),
                           prefix + "kl": curve.kl.float().clone()})
        self.info.update({prefix + "selection": curve.selection, prefix + "items": str(curve.items),
                          prefix + "tokens": str(curve.tokens), prefix + "data": curve.data,
                          prefix + "reference": curve.reference})
        if w == "float":
            self.info["quality_weights"] = "float"


CURVE_PREFERENCE = ("int8", "float")  # whose curve stands in for a format without its own
MIN_CURVE_TOKENS = 2000  # fewer held-out tokens: a warning shows the uncertainty
Z95 = 1.959964


def wilson_interval(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion ``p`` measured on ``n`` tokens ((0, 1) for
    n = 0). Tokens of one text are not independent, so read it as a lower bound on the width."""
    if n <= 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(0.0, p * (1 - p) / n + z * z / (4 * n * n))) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def with_ci(p: float, n: int) -> str:
    """``0.812 [0.795, 0.828]``: a proportion with its 95 % Wilson interval over ``n`` tokens."""
    lo, hi = wilson_interval(p, n)
    return f"{p:.3f} [{lo:.3f}, {hi:.3f}]"


@dataclass(frozen=True)
class QualityCurve:
    """Next-token agreement with the dense model (and KL, nats per token) measured on held-out
    prompts of the task, per load ratio gamma (rows) and compute share phi/gamma (columns; 1.0 =
    loading only), with the selection strategy ``selection``. Between grid points the figures
    are interpolated linearly in gamma and in phi/gamma; outside it they are clamped."""

    load_ratios: list[float]  # ascending, e.g. 0.4 ... 1.0
    compute_shares: list[float]  # ascending, e.g. 0.7, 1.0
    agreement: torch.Tensor  # [G, R]
    kl: torch.Tensor  # [G, R]
    selection: str = ""
    items: int = 0
    tokens: int = 0  # held-out tokens every agreement figure counts
    data: str = ""
    weights: str = ""  # records measured: float, int8, ... ("" = float, an old curve)
    reference: str = ""  # the dense model agreed with ("" = the same pack's dense model)

    def __post_init__(self):
        G, R = len(self.load_ratios), len(self.compute_shares)
        if G < 1 or R < 1 or tuple(self.agreement.shape) != (G, R) or tuple(self.kl.shape) != (G, R):
            raise ValueError(f"grid {G}x{R} does not match agreement {tuple(self.agreement.shape)} "
                             f"/ kl {tuple(self.kl.shape)}")
        if sorted(self.load_ratios) != list(self.load_ratios) or \
                sorted(self.compute_shares) != list(self.compute_shares):
            raise ValueError("grid not ascending")
        if not torch.isfinite(self.agreement).all() or (self.agreement < 0).any() or \
                (self.agreement > 1).any():
            raise ValueError("agreement outside [0, 1]")

    def _interp(self, table: torch.Tensor, load_ratio: float, compute_ratio: float | None) -> float:
        share = 1.0 if compute_ratio is None else compute_ratio / load_ratio
        gi = _bracket(self.load_ratios, load_ratio)
        si = _bracket(self.compute_shares, share)
        out = 0.0
        for g, wg in gi:
            for r, wr in si:
                out += wg * wr * float(table[g, r])
        return out

    def expected_agreement(self, load_ratio: float, compute_ratio: float | None = None) -> float:
        """Expected next-token agreement with dense at (gamma, phi) (phi None: loading only)."""
        return self._interp(self.agreement, load_ratio, compute_ratio)

    def expected_kl(self, load_ratio: float, compute_ratio: float | None = None) -> float:
        return self._interp(self.kl, load_ratio, compute_ratio)

    def interval(self, load_ratio: float, compute_ratio: float | None = None) -> tuple[float, float]:
        """95 % Wilson interval of the agreement at (gamma, phi) over the curve's tokens."""
        return wilson_interval(self.expected_agreement(load_ratio, compute_ratio), self.tokens)

    def describe(self, load_ratio: float, compute_ratio: float | None = None) -> str:
        """``agreement 0.812 [0.795, 0.828] (95 % CI, 2067 held-out tokens, int8 curve)``."""
        p = self.expected_agreement(load_ratio, compute_ratio)
        return (f"agreement {with_ci(p, self.tokens)} (95 % CI, {self.tokens} held-out tokens, "
                f"{self.weights or 'float'} curve)")

    @property
    def too_small(self) -> bool:
        return self.tokens < MIN_CURVE_TOKENS

    def load_ratio_for(self, min_agreement: float, compute_share: float = 1.0,
                       step: float = 0.01) -> float | None:
        """Smallest gamma (on a ``step`` grid) such that the expected agreement at compute share
        phi/gamma = ``compute_share`` is >= ``min_agreement`` there and at every larger gamma (a
        measured curve is noisy; a dip above a lucky point must not be skipped); None if gamma 1
        does not reach it."""
        lo = min(self.load_ratios)
        n = int(round((1.0 - lo) / step))
        best = None
        for k in range(n, -1, -1):  # from gamma 1 down, until the first miss
            g = round(lo + k * step, 6)
            if self.expected_agreement(g, g * compute_share) < min_agreement - 1e-6:  # float32 tables
                break
            best = g
        return best

    def rows(self) -> list[dict]:
        return [{"load_ratio": g, "compute_ratio": round(g * r, 4), "compute_share": r,
                 "agreement": float(self.agreement[i, j]), "kl": float(self.kl[i, j])}
                for i, g in enumerate(self.load_ratios) for j, r in enumerate(self.compute_shares)]


def _bracket(grid: list[float], x: float) -> list[tuple[int, float]]:
    """Indices and weights of linear interpolation of ``x`` on ascending ``grid`` (clamped)."""
    if x <= grid[0]:
        return [(0, 1.0)]
    if x >= grid[-1]:
        return [(len(grid) - 1, 1.0)]
    for i in range(len(grid) - 1):
        a, b = grid[i], grid[i + 1]
        if a <= x <= b:
            w = (x - a) / (b - a) if b > a else 0.0
            return [(i, 1.0 - w), (i + 1, w)]
    return [(len(grid) - 1, 1.0)]


@dataclass(frozen=True)
class LoadRatioChoice:
    """The load ratio to run at, which constraint set it, and a sentence saying so."""

    load_ratio: float
    bound: str  # "min_agreement", "memory_budget" or "load_ratio"
    message: str
    expected_agreement: float | None = None
    weights: str = ""  # records chosen ("" = the model's own)
    compute_share: float | None = None  # phi/gamma chosen with it (None: compute_ratio's rule)
    path: str = ""  # the packed folder of ``weights``
    int8_ratio: float | None = None  # the int8 tier chosen with it (None: the int8_ratio setting)


def choose_load_ratio(agreement_ratio: float | None, memory_ratio: float | None,
                      requested: float = 1.0, min_agreement: float | None = None,
                      strict: bool = False) -> LoadRatioChoice:
    """Combine the smallest gamma that meets ``min_agreement`` (``agreement_ratio``) with the
    largest gamma that fits the memory budget (``memory_ratio``).

    Rule: the agreement target asks for gamma >= agreement_ratio, the budget allows gamma <=
    memory_ratio. When both hold, run at agreement_ratio (the smallest gamma meeting the target:
    least memory, fastest) and report ``min_agreement`` as the bound. When they conflict
    (agreement_ratio > memory_ratio) memory wins, since weights that do not fit cannot run: gamma =
    memory_ratio, bound ``memory_budget``, and the message says the target is not met (``strict``:
    raise ValueError instead). With only one of them, that one binds; with neither, ``requested``.
    """
    target = f"{min_agreement:.2f}" if min_agreement is not None else "the target"
    if agreement_ratio is None and memory_ratio is None:
        return LoadRatioChoice(requested, "load_ratio", f"load_ratio {requested:g} as requested")
    if memory_ratio is None:
        return LoadRatioChoice(agreement_ratio, "min_agreement",
                               f"min_agreement {target} -> load_ratio {agreement_ratio:g}")
    if agreement_ratio is None:
        return LoadRatioChoice(memory_ratio, "memory_budget",
                               f"memory budget -> load_ratio {memory_ratio:.3f}")
    if agreement_ratio <= memory_ratio:
        return LoadRatioChoice(agreement_ratio, "min_agreement",
                               f"min_agreement {target} -> load_ratio {agreement_ratio:g} (the memory "
                               f"budget would allow up to {memory_ratio:.3f}); bound: min_agreement")
    msg = (f"min_agreement {target} needs load_ratio >= {agreement_ratio:g} but the memory budget "
           f"allows at most {memory_ratio:.3f}")
    if strict:
        raise ValueError(msg)
    return LoadRatioChoice(memory_ratio, "memory_budget",
                           msg + f"; running at {memory_ratio:.3f}, below the agreement target; "
                           f"bound: memory_budget")


GENERAL_TASK = "general"  # the model-wide profile: used when no task is given


def general_profile(profiles: list[Profile], model_id: str, fingerprint: str) -> Profile:
    """The model-wide profile: the fused cross-task ranking (:func:`fuse_scores`) as scores and
    the mean normalised per-layer sensitivity. Its selection is the neurons every task shares;
    adding it to a folder changes no other task's selection (the fusion of the tasks and their
    fusion is the same table)."""
    tasks = [p for p in profiles if p.info.get("kind") != "general"]
    if not tasks:
        raise ValueError("a general profile needs at least one task profile")
    extra = {}
    if all("sensitivity" in p.extra for p in tasks):
        extra["sensitivity"] = torch.stack([p.extra["sensitivity"] / p.extra["sensitivity"].mean()
                                            for p in tasks]).mean(0)
    extra.update(general_token_tables(tasks))
    return Profile(GENERAL_TASK, model_id, fingerprint, fuse_scores([p.scores for p in tasks]),
                   sum(p.tokens for p in tasks),
                   hashlib.sha256("".join(p.dataset_sha256 for p in tasks).encode()).hexdigest(),
                   extra, {"kind": "general", "fused_from": ",".join(p.task for p in tasks)})


def general_token_tables(profiles: list[Profile]) -> dict[str, torch.Tensor]:
    """The per-token thresholds of the task profiles fused (weighted by their tokens); none
    unless every task has them."""
    from .token_rule import ACT_KEY, GATE_KEY, fuse
    tasks = [p for p in profiles if p.info.get("kind") != "general"]
    if not tasks or not all(GATE_KEY in p.extra and ACT_KEY in p.extra for p in tasks):
        return {}
    gate, act = fuse([(p.extra[GATE_KEY], p.extra[ACT_KEY]) for p in tasks], [p.tokens for p in tasks])
    return {GATE_KEY: gate, ACT_KEY: act}


BASE_META = ("format", "version", "task", "model_id", "fingerprint", "tokens", "dataset_sha256",
             "sha256")


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
    stored = meta.get("sha256")
    if not stored:
        raise FormatError(f"{path}: no contents checksum (sha256) in metadata; re-run "
                          f"`selectinfer profile`")
    actual = contents_sha256(loaded, meta)
    if actual != stored:
        raise FormatError(f"{path}: corrupt: contents checksum mismatch (stored sha256 "
                          f"{stored[:16]}..., contents hash to {actual[:16]}...)")
    scores = loaded.pop("scores").float()
    if not torch.isfinite(scores).all() or (scores < 0).any():
        raise FormatError(f"{path}: scores contain negative, NaN or infinite values")
    try:
        tokens = int(meta["tokens"])
    except (KeyError, ValueError) as e:
        raise FormatError(f"{path}: bad token count in metadata") from e
    prof = Profile(meta.get("task", path.stem), meta.get("model_id", ""), meta.get("fingerprint", ""),
                   scores, tokens, meta.get("dataset_sha256", ""), loaded,
                   {k: v for k, v in meta.items() if k not in BASE_META})
    try:
        prof.quality_curve()
    except (ValueError, KeyError) as e:
        raise FormatError(f"{path}: bad quality curve ({e})") from e
    from .token_rule import ACT_KEY, GATE_KEY, check_tables
    if GATE_KEY in loaded or ACT_KEY in loaded:
        why = ("one of the two per-token threshold tables is missing"
               if not (GATE_KEY in loaded and ACT_KEY in loaded)
               else check_tables(loaded[GATE_KEY], loaded[ACT_KEY], scores.shape[0]))
        if why:
            raise FormatError(f"{path}: {why}")
    return prof


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
        """The tasks loaded, and any profile added to the folder since (read on first use): a
        running node switches to a new task by name."""
        return sorted(set(self.profiles) | {p.stem for p in self.dir.glob("*.safetensors")})

    @property
    def default_task(self) -> str:
        """The task served when none is given: the general profile (made from the folder's task
        profiles in memory when the folder has no ``general.safetensors``)."""
        return GENERAL_TASK

    def get(self, task: str) -> Profile:
        if task not in self.profiles:
            if profile_path(self.dir, task).exists():
                return self.reload(task)
            if task == GENERAL_TASK:  # fused in memory: selects what the stored one would
                prof = general_profile(list(self.profiles.values()), self.manifest.model_id,
                                       self.manifest.fingerprint)
                self.profiles[task] = prof
                return prof
            raise KeyError(f"unknown task {task!r}; profiles in {self.dir}: {', '.join(self.tasks)}")
        return self.profiles[task]

    def reload(self, task: str) -> Profile:
        """Re-read one task's file (refusing it if it became corrupt) and keep it."""
        prof = load_profile(profile_path(self.dir, task), self.manifest)
        self.profiles[task] = prof
        return prof

    def quality_curve(self, task: str, weights: str | None = None) -> QualityCurve | None:
        """The stored agreement curve of ``task`` for ``weights`` records (see
        :meth:`Profile.quality_curve`; None when its profile carries none)."""
        return self.get(task).quality_curve(weights)

    def expected_agreement(self, task: str, load_ratio: float, compute_ratio: float | None = None,
                           selection: str | None = None, weights: str | None = None) -> float | None:
        """Expected next-token agreement with dense for ``task`` at (gamma, phi), from the curve
        measured by ``selectinfer profile``; None when there is no curve or it was measured with
        another selection strategy than ``selection`` (``auto``/None: no check)."""
        curve = self.quality_curve(task, weights)
        if curve is None:
            return None
        if selection not in (None, "", "auto") and curve.selection and selection != curve.selection:
            return None
        return curve.expected_agreement(load_ratio, compute_ratio)

    def load_ratio_for_agreement(self, min_agreement: float, tasks: list[str] | None = None,
                                 compute_share: float = 1.0, weights: str | None = None) -> float:
        """Smallest gamma whose expected agreement is >= ``min_agreement`` for every task in
        ``tasks`` (default: all, since the node may switch to any): the largest of the per-task
        answers. Raises ValueError when a task has no curve or cannot reach the target."""
        if not 0.0 < min_agreement <= 1.0:
            raise ValueError(f"min_agreement must be in (0, 1], got {min_agreement}")
        need = 0.0
        for task in tasks or self.tasks:
            curve = self.quality_curve(task, weights)
            if curve is None:
                raise ValueError(f"profile {task!r} in {self.dir} has no quality curve; re-run "
                                 f"`selectinfer profile` (or `profile --curve-only`) for it")
            g = curve.load_ratio_for(min_agreement, compute_share)
            if g is None:
                raise ValueError(f"task {task!r}: no load_ratio <= 1 reaches agreement "
                                 f"{min_agreement:.2f} at compute share {compute_share:g}")
            need = max(need, g)
        return need

    def secondary_scores(self) -> torch.Tensor:
        """Cross-task fused scores ``[L, I]``: each task normalised per layer, then averaged."""
        return fuse_scores([p.scores for p in self.profiles.values()])

    def general(self) -> Profile:
        """A general profile fused from this folder's task profiles (to store with ``save``)."""
        return general_profile(list(self.profiles.values()), self.manifest.model_id,
                               self.manifest.fingerprint)


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
