"""Parameters of the nodes: declaration, type coercion and validation with a reason.

Kept free of model loading: checks here are cheap (ranges, ratio order, files exist, profiles
match the model's manifest) so that a node refuses a bad value at once, at start and at runtime.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from ..core.loader import SELECTIONS, check_ratios
from ..core.runtime import DEFAULT_STATIC_RATIO

DTYPES = ("", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16", "auto")


@dataclass(frozen=True)
class ParamSpec:
    name: str
    default: Any
    kind: type  # str, float, int or bool
    description: str
    runtime: bool = False  # may be changed while the node runs
    check: Callable[[Any], str | None] | None = None  # single-value check: reason or None


def _in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    def check(v):
        ok_lo = v > lo if lo_open else v >= lo
        ok_hi = v < hi if hi_open else v <= hi
        if not (ok_lo and ok_hi):
            return f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, got {v}"
        return None
    return check


def _at_least(lo):
    return lambda v: None if v >= lo else f"must be >= {lo}, got {v}"


def _positive(v):
    return None if v > 0 else f"must be > 0, got {v}"


def _device(v: str) -> str | None:
    if v == "cpu":
        return None
    if v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit()):
        import torch
        if not torch.cuda.is_available():
            return f"is {v!r} but CUDA is not available on this machine (use device:=cpu)"
        index = int(v[5:]) if ":" in v else 0
        if index >= torch.cuda.device_count():
            return f"is {v!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
        return None
    return f"must be 'cpu', 'cuda' or 'cuda:N', got {v!r}"


def _dtype(v: str) -> str | None:
    return None if v in DTYPES else f"must be one of float32, float16, bfloat16 (or empty), got {v!r}"


def _selection(v: str) -> str | None:
    return None if v in SELECTIONS else f"must be one of {', '.join(SELECTIONS)}, got {v!r}"


def _static(v: float) -> str | None:
    return None if v == -1.0 or 0.0 <= v <= 1.0 else f"must be -1 (auto) or in [0, 1], got {v}"


def _compute(v: float) -> str | None:
    return None if v == 0.0 or 0.0 < v <= 1.0 else f"must be 0 (= load_ratio) or in (0, 1], got {v}"


INFERENCE_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("model", "", str, "packed model folder; empty = the embedded Gemma 3 270M"),
    ParamSpec("profiles", "", str, "task profiles folder; empty = profiles/<model-id>"),
    ParamSpec("task", "", str, "task profile loaded at start; empty = the first one"),
    ParamSpec("load_ratio", 1.0, float, "gamma: share of MLP neurons resident in memory",
              check=_in(0.0, 1.0, lo_open=True)),
    ParamSpec("static_ratio", -1.0, float,
              f"delta: share of base (task) neurons; -1 = min({DEFAULT_STATIC_RATIO}, compute_ratio)",
              check=_static),
    ParamSpec("compute_ratio", 0.0, float,
              "phi: default share of neurons computed per token (goals may override); 0 = load_ratio",
              runtime=True, check=_compute),
    ParamSpec("alpha", 0.2, float, "per-token top share voting for dynamic neurons",
              check=_in(0.0, 1.0, lo_open=True)),
    ParamSpec("device", "cpu", str, "torch device: cpu, cuda, cuda:N", check=_device),
    ParamSpec("dtype", "", str, "float32, float16 or bfloat16; empty = the packed dtype", check=_dtype),
    ParamSpec("dense_layers", 0, int, "first/last layers kept dense", check=_at_least(0)),
    ParamSpec("selection", "auto", str, "neuron selection: " + ", ".join(SELECTIONS),
              check=_selection),
    ParamSpec("memory_budget_mb", 0.0, float,
              "MiB the weights may take (chooses load_ratio); 0 = use load_ratio",
              check=_at_least(0.0)),
    ParamSpec("context_limit", 0, int, "context window cap in tokens; 0 = the model's",
              check=_at_least(0)),
    ParamSpec("max_new_tokens", 128, int, "max_new_tokens of goals that give 0", runtime=True,
              check=_at_least(1)),
    ParamSpec("max_new_tokens_limit", 1024, int, "goals asking for more are rejected",
              runtime=True, check=_at_least(1)),
    ParamSpec("queue_length", 4, int, "goals that may wait behind the running one; more are rejected",
              runtime=True, check=_at_least(0)),
    ParamSpec("diagnostics_period", 1.0, float, "seconds between diagnostics messages",
              runtime=True, check=_positive),
    ParamSpec("memory_headroom_mb", 512.0, float,
              "diagnostics WARN when system available memory is below this", runtime=True,
              check=_at_least(0.0)),
    ParamSpec("num_threads", 0, int, "torch CPU threads; 0 = torch's default", check=_at_least(0)),
    ParamSpec("reload_timeout", 600.0, float,
              "seconds a reload_base call may wait for goals ahead of it and the reload",
              runtime=True, check=_positive),
)

MANAGER_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("model", "", str, "packed model folder; empty = the embedded Gemma 3 270M"),
    ParamSpec("profiles", "", str, "task profiles folder; empty = profiles/<model-id>"),
    ParamSpec("task", "", str, "task applied on activate; empty = keep the inference node's"),
    ParamSpec("reload_timeout", 300.0, float,
              "seconds to wait for the inference node's reload_base (incl. its model load)",
              runtime=True, check=_positive),
)


class ParamError(ValueError):
    """A parameter value refused, with the reason."""


def coerce(spec: ParamSpec, value: Any) -> Any:
    """``value`` as ``spec.kind`` (an integer is accepted for a double), or ParamError."""
    if spec.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamError(f"{spec.name} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ParamError(f"{spec.name} must be finite, got {value}")
    elif spec.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamError(f"{spec.name} must be an integer, got {value!r}")
    elif spec.kind is str:
        if not isinstance(value, str):
            raise ParamError(f"{spec.name} must be a string, got {value!r}")
        value = value.strip()
    elif spec.kind is bool and not isinstance(value, bool):
        raise ParamError(f"{spec.name} must be true or false, got {value!r}")
    if spec.check is not None:
        reason = spec.check(value)
        if reason:
            raise ParamError(f"{spec.name} {reason}")
    return value


@dataclass(frozen=True)
class InferenceSettings:
    model: str = ""
    profiles: str = ""
    task: str = ""
    load_ratio: float = 1.0
    static_ratio: float = -1.0
    compute_ratio: float = 0.0
    alpha: float = 0.2
    device: str = "cpu"
    dtype: str = ""
    dense_layers: int = 0
    selection: str = "auto"
    memory_budget_mb: float = 0.0
    context_limit: int = 0
    max_new_tokens: int = 128
    max_new_tokens_limit: int = 1024
    queue_length: int = 4
    diagnostics_period: float = 1.0
    memory_headroom_mb: float = 512.0
    num_threads: int = 0
    reload_timeout: float = 600.0

    # ---- derived ------------------------------------------------------------------------
    @property
    def effective_compute_ratio(self) -> float:
        return self.compute_ratio if self.compute_ratio > 0 else self.load_ratio

    @property
    def effective_static_ratio(self) -> float:
        if self.static_ratio >= 0:
            return self.static_ratio
        return min(DEFAULT_STATIC_RATIO, self.effective_compute_ratio)

    def check(self, files: bool = True) -> None:
        """Cross-parameter checks (and, with ``files``, that the folders exist and match)."""
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ParamError(f"max_new_tokens={self.max_new_tokens} exceeds "
                             f"max_new_tokens_limit={self.max_new_tokens_limit}")
        if self.memory_budget_mb <= 0:  # with a budget the loader chooses load_ratio
            try:
                check_ratios(self.load_ratio, self.effective_static_ratio,
                             self.effective_compute_ratio)
            except ValueError as e:
                raise ParamError(f"ratios refused (need 0 <= static_ratio <= compute_ratio <= "
                                 f"load_ratio <= 1): {e}") from None
        if files:
            check_model_files(self.model, self.profiles, self.task,
                              need_profiles=self.load_ratio < 1.0 and self.selection != "random")

    def runtime_options(self, model_path: str):
        from ..core.runtime import RuntimeOptions
        return RuntimeOptions(
            model=model_path, profiles=self.profiles or None, task=self.task,
            load_ratio=self.load_ratio,
            static_ratio=self.static_ratio if self.static_ratio >= 0 else None,
            compute_ratio=self.compute_ratio if self.compute_ratio > 0 else None,
            alpha=self.alpha, device=self.device, dtype=self.dtype or None,
            dense_layers=self.dense_layers, selection=self.selection,
            memory_budget_bytes=int(self.memory_budget_mb * 2**20) if self.memory_budget_mb > 0 else None,
            context_limit=self.context_limit or None)


@dataclass(frozen=True)
class ManagerSettings:
    model: str = ""
    profiles: str = ""
    task: str = ""
    reload_timeout: float = 300.0


def embedded_model_path(convert: bool = False, log: Callable[[str], None] = lambda s: None) -> Path | None:
    """The packed embedded model; ``None`` when not converted yet and ``convert`` is false."""
    from ..core import default_model
    from ..core.pack import is_packed
    path = default_model.packed_dir()
    if is_packed(path):
        return path
    return default_model.ensure_packed(log=log) if convert else None


def check_model_files(model: str, profiles: str, task: str, need_profiles: bool = True) -> None:
    """The model folder is a packed model, the profiles folder exists and every profile in it
    matches the model; ``task`` (if given) is one of them. Raises ParamError with the reason.
    With ``model`` empty (the embedded model) the checks run only once it is converted."""
    from ..core.pack import read_manifest
    from ..core.paths import default_profiles_dir
    from ..core.profiles import ProfileCatalog
    if model:
        if not Path(model).is_dir():
            raise ParamError(f"model: folder {model} does not exist")
        path = Path(model)
    else:
        path = embedded_model_path(convert=False)
        if path is None:
            return  # converted (and then checked) when the model loads
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        raise ParamError(f"model: {e}") from None
    folder = Path(profiles) if profiles else default_profiles_dir(manifest.model_id)
    if profiles and not folder.is_dir():
        raise ParamError(f"profiles: folder {folder} does not exist")
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        if need_profiles:
            raise ParamError(f"profiles: no task profiles in {folder} for model "
                             f"{manifest.model_id} (load_ratio < 1 needs them); run `selectinfer "
                             f"profile`")
        if task:
            raise ParamError(f"task: {task!r} given but there are no profiles in {folder}")
        return
    try:
        catalog = ProfileCatalog(folder, manifest)
    except (OSError, ValueError) as e:
        raise ParamError(f"profiles: {e}") from None
    if task and task not in catalog.tasks:
        raise ParamError(f"task: unknown task {task!r}; profiles in {folder}: "
                         f"{', '.join(catalog.tasks)}")


def declare(node, specs: tuple[ParamSpec, ...]) -> dict[str, Any]:
    """Declare ``specs`` on an rclpy node (dynamic typing: an int for a double is accepted and
    converted here); returns the coerced values. Raises ParamError with the reason."""
    from rcl_interfaces.msg import ParameterDescriptor
    values = {}
    for spec in specs:
        desc = ParameterDescriptor(
            description=spec.description + ("" if spec.runtime else " (fixed once started)"),
            dynamic_typing=True)
        value = node.declare_parameter(spec.name, spec.default, desc).value
        values[spec.name] = coerce(spec, value)
    return values


def apply_changes(current, specs: tuple[ParamSpec, ...], params) -> tuple[Any, str | None]:
    """Validate rclpy ``params`` (a runtime set request) against ``current`` settings.
    Returns (new settings, None) or (current, reason)."""
    by_name = {s.name: s for s in specs}
    names = {f.name for f in fields(current)}
    changes = {}
    try:
        for p in params:
            spec = by_name.get(p.name)
            if spec is None or p.name not in names:
                continue  # not ours (use_sim_time, ...)
            value = coerce(spec, p.value)
            if value == getattr(current, p.name):
                continue
            if not spec.runtime:
                raise ParamError(f"{p.name} is fixed once the node has started; change it in the "
                                 f"parameters file and restart the node")
            changes[p.name] = value
        new = replace(current, **changes)
        if hasattr(new, "check"):
            new.check(files=False)
        return new, None
    except ParamError as e:
        return current, str(e)
