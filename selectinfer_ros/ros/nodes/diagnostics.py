"""Diagnostics of the inference node as ``diagnostic_msgs/DiagnosticArray``.

Three statuses, named like diagnostic_updater names its tasks (``"<node>: <task>"``) so that
diagnostic_aggregator analyzers and rqt_robot_monitor group them:

* ``<node>: memory``     resident weights (FFN / other), process RSS, CUDA, system available
* ``<node>: throughput`` decode tokens/s, time to first token, queue, goal counters, the prompt
  cache (entries, bytes, hits, misses, prompt tokens saved, entries evicted and invalidated)
* ``<node>: profile``    active task, ratios in force, neurons loaded, switches, reload time

``hardware_id`` is the torch device; the throughput status carries the node's
``lifecycle_state``. Levels: ERROR when no model is loaded (the message says
why: loading, unconfigured, the load error), WARN when the model is loaded but the node is not
active (goals are not served), the goal queue is full or system available memory is under the
headroom, OK otherwise. STALE is left to the aggregator. Values are strings (DiagnosticStatus KeyValue); byte counts are integers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

OK = DiagnosticStatus.OK
WARN = DiagnosticStatus.WARN
ERROR = DiagnosticStatus.ERROR

MEMORY_KEYS = ("weight_bytes", "ffn_weight_bytes", "other_weight_bytes", "process_rss_bytes",
               "peak_rss_bytes", "cuda_allocated_bytes", "system_available_bytes",
               "memory_headroom_bytes", "load_ratio", "compute_ratio", "neurons_loaded")
THROUGHPUT_KEYS = ("last_tokens_per_second", "average_tokens_per_second",
                   "last_time_to_first_token", "last_computed_share", "queue_depth", "queue_length", "generating",
                   "running_goals", "max_batch", "aggregate_tokens_per_second",
                   "goals_succeeded", "goals_canceled", "goals_aborted", "goals_rejected",
                   "goals_closed_early", "goals_loops_broken",
                   "last_rejection", "lifecycle_state", "prompt_cache_entries", "prompt_cache_bytes",
                   "prompt_cache_limit_bytes", "prompt_cache_hits", "prompt_cache_misses",
                   "prompt_cache_saved_tokens", "prompt_cache_evicted", "prompt_cache_invalidated")
PROFILE_KEYS = ("active_task", "tasks", "model_id", "load_ratio", "static_ratio", "compute_ratio",
                "compute_mode",
                "neurons_loaded", "profile_switches", "last_reload_seconds",
                "last_reload_bytes_read", "last_reload_neurons_read",
                "last_reload_neurons_retiered", "int8_ratio", "full_load_seconds", "full_load_bytes_read",
                "expected_agreement", "load_ratio_bound")


@dataclass
class Snapshot:
    """What the inference node knows at one instant (filled by the node, ROS-free)."""

    node_name: str
    device: str
    model_loaded: bool
    model_state: str = ""  # "loading", the load error, ... when not loaded
    lifecycle_state: str = ""  # unconfigured, configuring, inactive, active, ...
    model_id: str = ""
    memory: dict = field(default_factory=dict)  # Runtime.memory()
    memory_headroom_bytes: int = 0
    load_ratio: float = 0.0
    static_ratio: float = 0.0
    compute_ratio: float = 0.0
    compute_mode: str = "prompt"
    active_task: str = ""
    tasks: tuple = ()
    last_tokens_per_second: float = 0.0
    average_tokens_per_second: float = 0.0
    last_time_to_first_token: float = 0.0
    last_computed_share: float = -1.0  # compute_mode token: neurons computed per decode token
    queue_depth: int = 0
    queue_length: int = 0
    generating: bool = False
    running_goals: int = 0  # decoding now (together, up to max_batch)
    max_batch: int = 1
    aggregate_tokens_per_second: float = 0.0  # all goals of the current (or last) batch together
    succeeded: int = 0
    canceled: int = 0
    aborted: int = 0
    rejected: int = 0
    closed_early: int = 0  # constrained answers ended early to fit max_new_tokens
    loops_broken: int = 0  # constrained answers kept from repeating a span
    last_rejection: str = ""
    switches: int = 0
    last_reload_seconds: float = 0.0
    last_reload_bytes_read: int = 0
    last_reload_neurons_read: int = 0
    last_reload_neurons_retiered: int = 0  # tiered records: of those read, promoted or demoted
    int8_ratio: float = 0.0  # share of each layer's neurons in the int8 tier (0: one tier)
    full_load_seconds: float = 0.0
    full_load_bytes_read: int = 0
    expected_agreement: float | None = None  # the active profile's quality curve at gamma/phi
    load_ratio_bound: str = ""  # what chose load_ratio: load_ratio, memory_budget, min_agreement
    prompt_cache: dict = field(default_factory=dict)  # PromptCache.snapshot()

    @property
    def queue_full(self) -> bool:
        return self.generating and self.queue_depth >= self.queue_length


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def _status(name: str, hw: str, level: int, message: str, values: dict) -> DiagnosticStatus:
    return DiagnosticStatus(level=level, name=name, message=message, hardware_id=hw,
                            values=[KeyValue(key=k, value=_fmt(v)) for k, v in values.items()])


def _not_loaded(s: Snapshot) -> str:
    state = s.model_state if s.model_state not in ("", "unloaded") else ""
    return f"no model loaded ({state or s.lifecycle_state or 'not started'})"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_status(s: Snapshot) -> DiagnosticStatus:
    m = s.memory
    values = {k: int(m.get(k, 0)) for k in ("weight_bytes", "ffn_weight_bytes", "other_weight_bytes",
                                            "process_rss_bytes", "peak_rss_bytes")}
    if s.device.startswith("cuda") or m.get("cuda_allocated_bytes"):
        values["cuda_allocated_bytes"] = int(m.get("cuda_allocated_bytes", 0))
    values["system_available_bytes"] = int(m.get("system_available_bytes", 0))
    values["memory_headroom_bytes"] = int(s.memory_headroom_bytes)
    values.update(load_ratio=s.load_ratio, compute_ratio=s.compute_ratio,
                  neurons_loaded=int(m.get("neurons_loaded", 0)))
    if not s.model_loaded:
        level, msg = ERROR, _not_loaded(s)
    elif values["system_available_bytes"] < s.memory_headroom_bytes:
        level, msg = WARN, (f"system available memory {_mib(values['system_available_bytes'])} is "
                            f"under the headroom {_mib(s.memory_headroom_bytes)}")
    else:
        level, msg = OK, (f"weights {_mib(values['weight_bytes'])} (FFN "
                          f"{_mib(values['ffn_weight_bytes'])}), RSS {_mib(values['process_rss_bytes'])}")
    return _status(f"{s.node_name}: memory", s.device, level, msg, values)


def throughput_status(s: Snapshot) -> DiagnosticStatus:
    values = {
        "last_tokens_per_second": float(s.last_tokens_per_second),
        "average_tokens_per_second": float(s.average_tokens_per_second),
        "last_time_to_first_token": float(s.last_time_to_first_token),
        "last_computed_share": float(s.last_computed_share),
        "queue_depth": s.queue_depth, "queue_length": s.queue_length, "generating": s.generating,
        "running_goals": s.running_goals, "max_batch": s.max_batch,
        "aggregate_tokens_per_second": float(s.aggregate_tokens_per_second),
        "goals_succeeded": s.succeeded, "goals_canceled": s.canceled,
        "goals_aborted": s.aborted, "goals_rejected": s.rejected,
        "goals_closed_early": s.closed_early, "goals_loops_broken": s.loops_broken,
        "last_rejection": s.last_rejection, "lifecycle_state": s.lifecycle_state,
    }
    values.update({k: int(s.prompt_cache.get(k, 0)) for k in THROUGHPUT_KEYS
                   if k.startswith("prompt_cache_")})
    if not s.model_loaded:
        level, msg = ERROR, _not_loaded(s)
    elif s.lifecycle_state and s.lifecycle_state != "active":
        level, msg = WARN, f"model loaded, node {s.lifecycle_state}: goals are not served"
    elif s.queue_full:
        level, msg = WARN, f"goal queue full ({s.queue_depth}/{s.queue_length}): new goals are rejected"
    else:
        state = (f"generating ({s.running_goals} goals, {s.aggregate_tokens_per_second:.1f} tok/s "
                 "together)" if s.running_goals > 1 else "generating" if s.generating else "idle")
        msg = f"{state}, {s.last_tokens_per_second:.1f} tok/s last, queue {s.queue_depth}/{s.queue_length}"
        level = OK
    return _status(f"{s.node_name}: throughput", s.device, level, msg, values)


def profile_status(s: Snapshot) -> DiagnosticStatus:
    values = {
        "active_task": s.active_task, "tasks": tuple(s.tasks), "model_id": s.model_id,
        "load_ratio": s.load_ratio, "static_ratio": s.static_ratio, "compute_ratio": s.compute_ratio,
        "compute_mode": s.compute_mode, "neurons_loaded": int(s.memory.get("neurons_loaded", 0)),
        "profile_switches": s.switches, "last_reload_seconds": float(s.last_reload_seconds),
        "last_reload_bytes_read": int(s.last_reload_bytes_read),
        "last_reload_neurons_read": int(s.last_reload_neurons_read),
        "last_reload_neurons_retiered": int(s.last_reload_neurons_retiered),
        "int8_ratio": float(s.int8_ratio),
        "full_load_seconds": float(s.full_load_seconds),
        "full_load_bytes_read": int(s.full_load_bytes_read),
        "expected_agreement": "n/a" if s.expected_agreement is None else float(s.expected_agreement),
        "load_ratio_bound": s.load_ratio_bound,
    }
    if not s.model_loaded:
        level, msg = ERROR, _not_loaded(s)
    else:
        agreement = ("" if s.expected_agreement is None else
                     f", expected next-token agreement with dense {s.expected_agreement:.2f}")
        level, msg = OK, (f"task {s.active_task or '-'} on {s.model_id}, load_ratio {s.load_ratio:g}, "
                          f"compute_ratio {s.compute_ratio:g}"
                          f"{' per token' if s.compute_mode == 'token' else ''}{agreement}")
    return _status(f"{s.node_name}: profile", s.device, level, msg, values)


def build_array(s: Snapshot, stamp=None) -> DiagnosticArray:
    """The DiagnosticArray of one snapshot (``stamp``: a builtin_interfaces/Time)."""
    arr = DiagnosticArray(status=[memory_status(s), throughput_status(s), profile_status(s)])
    if stamp is not None:
        arr.header.stamp = stamp
    return arr


def as_dict(status: DiagnosticStatus) -> dict[str, str]:
    """The KeyValues of a status as a dict (for clients and tests)."""
    return {kv.key: kv.value for kv in status.values}
