"""``selectinfer_node``: the selectively loaded model behind a ROS 2 Generate action.

Everything lives under the node's namespace (``llm`` by default):

* action  ``generate``       selectinfer_msgs/action/Generate
* service ``reload_base``    selectinfer_msgs/srv/ReloadBase (called by the profile manager)
* topic   ``loaded_profile`` selectinfer_msgs/msg/ActiveProfile, transient local: the task whose
  base neurons are resident (the profile manager relays it as ``active_profile``)
* topics  ``diagnostics`` and ``/diagnostics``: diagnostic_msgs/DiagnosticArray every period

Threads: the executor threads only answer (goal and cancel callbacks decide at once). One worker
thread owns the model: it loads it, then runs goals and base reloads one at a time in arrival
order. A goal whose task differs from the active one switches base neurons first, so a switch
never happens while another goal generates. The node holds no algorithm: it translates messages
and parameters to :class:`selectinfer_ros.core.runtime.Runtime`.
"""
from __future__ import annotations

import collections
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import rclpy
from rcl_interfaces.msg import SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from diagnostic_msgs.msg import DiagnosticArray
from selectinfer_msgs.action import Generate
from selectinfer_msgs.msg import ActiveProfile
from selectinfer_msgs.srv import ReloadBase

from . import diagnostics as diag
from .settings import (INFERENCE_PARAMS, InferenceSettings, ParamError, apply_changes,
                       check_model_files, declare, embedded_model_path)

R = Generate.Result
LATCHED = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL,
                     reliability=ReliabilityPolicy.RELIABLE)
# A prompt this many characters per context token is refused before tokenizing it (the goal
# callback must answer at once, even for an absurd prompt).
MAX_CHARS_PER_TOKEN = 100


def _resolve(node, name: str) -> str:
    """Fully qualified name of a relative topic/action ``name`` of ``node``."""
    try:
        return node.resolve_topic_name(name)
    except Exception:  # noqa: BLE001 - older rclpy without resolve_topic_name
        ns = node.get_namespace().rstrip("/")
        return f"{ns}/{name}"


class GoalRejected(Exception):
    """A goal refused, with a Generate.Result error code and a reason."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class _Job:
    kind: str  # "goal" or "reload"
    goal_handle: Any = None
    task: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    abandoned: bool = False


def goal_config(goal, settings: InferenceSettings, rt):
    """The GenerationConfig of a Generate goal, or GoalRejected (no tokenization here)."""
    from ..core.engine import GenerationConfig
    from ..core.loader import check_ratios
    if not goal.prompt or not goal.prompt.strip():
        raise GoalRejected(R.INVALID_GOAL, "empty prompt")
    if goal.task and goal.task != rt.task and goal.task not in rt.tasks:
        known = ", ".join(rt.tasks) or "none (no profiles folder)"
        raise GoalRejected(R.UNKNOWN_TASK, f"unknown task {goal.task!r}; tasks: {known}")
    n = goal.max_new_tokens or settings.max_new_tokens
    if n > settings.max_new_tokens_limit:
        raise GoalRejected(R.INVALID_GOAL, f"max_new_tokens {n} exceeds the limit "
                                           f"{settings.max_new_tokens_limit}")
    for name in ("temperature", "top_p", "repetition_penalty", "compute_ratio"):
        if not math.isfinite(getattr(goal, name)):
            raise GoalRejected(R.INVALID_GOAL, f"{name} is not a finite number")
    if goal.top_p < 0 or goal.top_p > 1:
        raise GoalRejected(R.INVALID_GOAL, f"top_p must be in [0, 1] (0 = off), got {goal.top_p:g}")
    if goal.repetition_penalty < 0:
        raise GoalRejected(R.INVALID_GOAL, "repetition_penalty must be > 0 (0 = off), got "
                                           f"{goal.repetition_penalty:g}")
    if goal.compute_ratio < 0:
        raise GoalRejected(R.INVALID_GOAL, f"compute_ratio must be in (0, 1] (0 = node default), "
                                           f"got {goal.compute_ratio:g}")
    default_phi = settings.compute_ratio if settings.compute_ratio > 0 else rt.load_ratio
    phi = float(goal.compute_ratio) if goal.compute_ratio > 0 else default_phi
    if rt.selective is not None:
        try:
            check_ratios(rt.load_ratio, rt.selective.static_ratio, phi)
        except ValueError as e:
            raise GoalRejected(R.INVALID_GOAL, str(e)) from None
    cfg = GenerationConfig(
        max_new_tokens=int(n), temperature=float(goal.temperature), top_k=int(goal.top_k),
        top_p=float(goal.top_p) if goal.top_p > 0 else 1.0,
        repetition_penalty=float(goal.repetition_penalty) if goal.repetition_penalty > 0 else 1.0,
        seed=int(goal.seed) if goal.seed >= 0 else None,
        stop=[s for s in goal.stop if s], use_chat_template=bool(goal.use_chat_template),
        compute_ratio=phi if rt.selective is not None and abs(phi - rt.compute_ratio) > 1e-9 else None)
    try:
        cfg.validate()
    except ValueError as e:
        raise GoalRejected(R.INVALID_GOAL, str(e)) from None
    return cfg, phi


def check_choices(goal, rt, prompt_tokens: int) -> None:
    """GoalRejected(INVALID_GOAL, reason) when a goal's ``choices`` cannot be scored."""
    from ..core.engine import validate_choices
    if not goal.choices:
        return
    try:
        validate_choices(list(goal.choices), rt.engine, prompt_tokens)
    except ValueError as e:
        raise GoalRejected(R.INVALID_GOAL, f"invalid choices: {e}") from None
    except Exception:  # noqa: BLE001 - tokenizer busy in the worker: Engine.choose checks again
        return


def choose_result(result, res) -> None:
    """Fill a Generate.Result from a :class:`~selectinfer_ros.core.engine.ChoiceResult`."""
    result.text, result.finish_reason = res.choice, "choice"
    result.choice_index = res.index
    result.choice_logprobs = [float(x) for x in res.logprobs]
    result.choice_logprobs_normalized = [float(x) for x in res.logprobs_normalized]
    result.prompt_tokens, result.generated_tokens = res.prompt_tokens, 0
    result.time_to_first_token, result.tokens_per_second = res.seconds, 0.0


class InferenceNode(Node):
    """The Generate action server over one loaded Runtime (see the module docstring)."""

    def __init__(self, node_name: str = "selectinfer_node", *, namespace: str = "llm", **kwargs):
        super().__init__(node_name, namespace=namespace, **kwargs)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[bytes, _Job] = {}
        self._in_system = 0  # accepted goals not finished (running + waiting)
        self._running: _Job | None = None
        self._stopping = False
        self._runtime = None
        self._model_state = "loading"
        self._load_error = ""
        self._loaded = threading.Event()
        self._rejected_without_model = 0
        self._last_rejection = ""
        try:
            self.settings = InferenceSettings(**declare(self, INFERENCE_PARAMS))
            self.settings.check(files=True)
        except ParamError as e:
            self.get_logger().error(f"refusing to start: {e}")
            super().destroy_node()
            raise
        self.add_on_set_parameters_callback(self._on_set_parameters)

        self._goal_group = ReentrantCallbackGroup()
        self._reload_group = MutuallyExclusiveCallbackGroup()
        self._diag_group = MutuallyExclusiveCallbackGroup()
        self._action_server = ActionServer(
            self, Generate, "generate",
            goal_callback=self._on_goal, handle_accepted_callback=self._on_accepted,
            cancel_callback=self._on_cancel, execute_callback=self._execute_wait,
            callback_group=self._goal_group)
        self._reload_srv = self.create_service(ReloadBase, "reload_base", self._on_reload_base,
                                               callback_group=self._reload_group)
        self._loaded_pub = self.create_publisher(ActiveProfile, "loaded_profile", LATCHED)
        self._diag_pubs = [self.create_publisher(DiagnosticArray, "diagnostics", 10)]
        if _resolve(self, "diagnostics") != "/diagnostics":
            self._diag_pubs.append(self.create_publisher(DiagnosticArray, "/diagnostics", 10))
        self._diag_timer = self.create_timer(self.settings.diagnostics_period,
                                             self.publish_diagnostics, callback_group=self._diag_group)
        self._worker = threading.Thread(target=self._worker_main, name=f"{node_name}-worker",
                                        daemon=True)
        self._worker.start()

    # ---- public helpers (bringup, demo, tests) -------------------------------------------
    @property
    def runtime(self):
        """The loaded Runtime, or None while loading / after a failed load."""
        return self._runtime

    @property
    def load_error(self) -> str:
        return self._load_error

    def wait_loaded(self, timeout: float) -> bool:
        """True once the model is loaded (False on timeout or a failed load)."""
        return self._loaded.wait(timeout) and self._runtime is not None

    # ---- model loading (worker thread) ----------------------------------------------------
    def _load(self) -> None:
        from ..core.runtime import Runtime
        s = self.settings
        log = self.get_logger()
        if s.num_threads:
            import torch
            torch.set_num_threads(s.num_threads)
        if s.model:
            path = s.model
        else:
            log.info("model: the embedded Gemma 3 270M")
            path = str(embedded_model_path(convert=True, log=log.info))
            check_model_files(path, s.profiles, s.task,  # deferred until converted
                              need_profiles=s.load_ratio < 1.0 and s.selection != "random")
        rt = Runtime(s.runtime_options(path), log=log.info)
        with self._lock:
            self._runtime = rt
            self._model_state = "loaded"
        log.info(f"loaded {rt.model_id} on {rt.device}: task {rt.task or '-'}, load_ratio "
                 f"{rt.load_ratio:g}, compute_ratio {rt.compute_ratio:g}, "
                 f"{rt.bytes_read / 2**20:.1f} MiB read in {rt.load_seconds:.2f} s; serving "
                 f"{_resolve(self, 'generate')}")
        self._publish_loaded()

    def _worker_main(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported, the node keeps answering
            self._load_error = f"{type(e).__name__}: {e}"
            self._model_state = f"load failed: {self._load_error}"
            self.get_logger().error(f"model load failed: {self._load_error}")
        finally:
            self._loaded.set()
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                if job.kind == "goal":
                    self._running = job
            try:
                if job.kind == "goal":
                    self._run_goal(job)
                elif not job.abandoned:
                    self._run_reload(job)
            except Exception as e:  # noqa: BLE001 - never let the worker die
                self.get_logger().error(f"worker: unexpected {type(e).__name__}: {e}")
            finally:
                with self._lock:
                    if job.kind == "goal":
                        self._running = None
                        self._in_system -= 1
                job.done.set()

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    # ---- action callbacks (executor threads: answer at once) ------------------------------
    def _on_goal(self, goal) -> GoalResponse:
        try:
            rt = self._runtime
            if self._stopping:
                raise GoalRejected(R.NO_MODEL, "node is shutting down")
            if rt is None:
                raise GoalRejected(R.NO_MODEL, f"no model loaded ({self._model_state})")
            goal_config(goal, self.settings, rt)
            prompt_tokens = self._check_prompt_length(goal, rt)
            if prompt_tokens is not None:
                check_choices(goal, rt, prompt_tokens)
            with self._lock:
                capacity = self.settings.queue_length + 1
                if self._in_system >= capacity:
                    raise GoalRejected(R.QUEUE_FULL, f"queue full: {self._in_system} goals in "
                                                     f"progress, queue_length "
                                                     f"{self.settings.queue_length}")
                self._in_system += 1
            return GoalResponse.ACCEPT
        except GoalRejected as e:
            with self._lock:
                if self._runtime is not None:
                    self._runtime.stats.rejected += 1
                else:
                    self._rejected_without_model += 1
                self._last_rejection = f"{e.code}: {e.reason}"
            self.get_logger().warning(f"goal rejected ({e.code}): {e.reason}")
            return GoalResponse.REJECT

    def _check_prompt_length(self, goal, rt) -> int | None:
        from ..core.engine import ContextLengthError
        limit = rt.engine.context_limit
        if len(goal.prompt) > limit * MAX_CHARS_PER_TOKEN:
            raise GoalRejected(R.PROMPT_TOO_LONG, f"prompt has {len(goal.prompt)} characters; the "
                                                  f"context limit is {limit} tokens")
        try:
            ids = rt.engine.encode(goal.prompt, bool(goal.use_chat_template))
        except ValueError as e:  # e.g. no chat template
            raise GoalRejected(R.INVALID_GOAL, str(e)) from None
        except Exception:  # noqa: BLE001 - tokenizer busy in the worker: it checks again
            return None
        try:
            rt.engine.check_prompt(len(ids))
        except ContextLengthError as e:
            raise GoalRejected(R.PROMPT_TOO_LONG, str(e)) from None
        except ValueError as e:
            raise GoalRejected(R.INVALID_GOAL, str(e)) from None
        return len(ids)

    def _on_accepted(self, goal_handle) -> None:
        job = _Job("goal", goal_handle)
        with self._lock:
            self._jobs[bytes(goal_handle.goal_id.uuid)] = job
        self._enqueue(job)

    def _on_cancel(self, goal_handle) -> CancelResponse:
        return CancelResponse.ACCEPT

    def _execute_wait(self, goal_handle):
        """The rclpy execute callback: the worker does the work; this only hands its result to
        the action server (which sends it to the clients)."""
        key = bytes(goal_handle.goal_id.uuid)
        with self._lock:
            job = self._jobs.get(key)
        if job is None:
            return R(error_code=R.UNKNOWN, error_msg="goal not found", finish_reason="error")
        while not job.done.wait(0.2):
            if self._stopping and not self._worker.is_alive():
                break
        with self._lock:
            self._jobs.pop(key, None)
        if job.result is None:
            return R(error_code=R.UNKNOWN, error_msg="node shutting down", finish_reason="error")
        return job.result

    # ---- goal execution (worker thread) ---------------------------------------------------
    def _run_goal(self, job: _Job) -> None:
        from ..core.engine import Canceled, ContextLengthError
        gh = job.goal_handle
        goal = gh.request
        rt = self._runtime
        result = R(finish_reason="error")
        outcome = "aborted"
        try:
            gh.execute()  # EXECUTING (unless a cancel came while queued); schedules _execute_wait
        except Exception as e:  # noqa: BLE001
            self.get_logger().error(f"goal could not start: {e}")
            job.result = R(error_code=R.UNKNOWN, error_msg=str(e), finish_reason="error")
            return
        try:
            if gh.is_cancel_requested:
                result.finish_reason, outcome = "canceled", "canceled"
                result.error_code, result.error_msg = R.CANCELED, "canceled before it started"
            elif self._stopping:
                raise GoalRejected(R.UNKNOWN, "node shutting down")
            elif rt is None:
                raise GoalRejected(R.NO_MODEL, f"no model loaded ({self._model_state})")
            else:
                cfg, phi = goal_config(goal, self.settings, rt)
                if goal.task and goal.task != rt.task:
                    self._switch(rt, goal.task, R.PROFILE_SWITCH_FAILED)
                if goal.choices:
                    res = rt.choose(goal.prompt, list(goal.choices),
                                    length_normalize=bool(goal.length_normalize),
                                    compute_ratio=cfg.compute_ratio,
                                    use_chat_template=cfg.use_chat_template,
                                    cancel=lambda: gh.is_cancel_requested or self._stopping)
                    choose_result(result, res)
                else:
                    res = self._generate(gh, rt, goal.prompt, cfg)
                    m = res.metrics
                    result.text, result.finish_reason = res.text, res.finish_reason
                    result.prompt_tokens, result.generated_tokens = m.prompt_tokens, m.generated_tokens
                    result.time_to_first_token = m.time_to_first_token
                    result.tokens_per_second = m.tokens_per_second
                result.profile, result.load_ratio, result.compute_ratio = rt.task, rt.load_ratio, phi
                if result.finish_reason == "canceled":
                    if gh.is_cancel_requested:
                        outcome = "canceled"
                        result.error_code, result.error_msg = R.CANCELED, "canceled by client"
                    else:
                        result.error_code, result.error_msg = R.UNKNOWN, "node shutting down"
                else:
                    outcome = "succeeded"
        except GoalRejected as e:
            result.error_code, result.error_msg = e.code, e.reason
        except Canceled:
            result.finish_reason = "canceled"
            if gh.is_cancel_requested:
                outcome = "canceled"
                result.error_code, result.error_msg = R.CANCELED, "canceled by client"
            else:
                result.error_code, result.error_msg = R.UNKNOWN, "node shutting down"
        except ContextLengthError as e:
            result.error_code, result.error_msg = R.PROMPT_TOO_LONG, str(e)
        except ValueError as e:
            result.error_code, result.error_msg = R.INVALID_GOAL, str(e)
        except Exception as e:  # noqa: BLE001 - abort this goal, keep serving
            result.error_code = R.GENERATION_FAILED
            result.error_msg = f"generation failed: {type(e).__name__}: {e}"
        if rt is not None and not result.profile:
            result.profile, result.load_ratio = rt.task, rt.load_ratio
        self._finish(gh, rt, outcome, result)
        job.result = result

    def _generate(self, gh, rt, prompt: str, cfg):
        polls = [0]
        t_first = [0.0]

        # The engine polls cancel once before prefill and once after each token it emitted
        # (except the last), so when on_text runs, polls == tokens generated so far.
        def cancel() -> bool:
            polls[0] += 1
            return gh.is_cancel_requested or self._stopping

        def on_text(delta: str) -> None:
            now = time.perf_counter()
            if not t_first[0]:
                t_first[0] = now
            n = polls[0]
            tps = (n - 1) / (now - t_first[0]) if n > 1 and now > t_first[0] else 0.0
            gh.publish_feedback(Generate.Feedback(text_delta=delta, generated_tokens=n,
                                                  tokens_per_second=tps))

        return rt.generate(prompt, cfg, on_text=on_text, cancel=cancel)

    def _finish(self, gh, rt, outcome: str, result) -> None:
        with self._lock:
            if rt is not None:
                stats = rt.stats
                if outcome == "succeeded":
                    stats.succeeded += 1
                elif outcome == "canceled":
                    stats.canceled += 1
                else:
                    stats.aborted += 1
        if outcome == "aborted":
            self.get_logger().warning(f"goal aborted ({result.error_code}): {result.error_msg}")
        try:
            if outcome == "succeeded":
                gh.succeed()
            elif outcome == "canceled":
                gh.canceled()
            else:
                gh.abort()
        except Exception as e:  # noqa: BLE001 - e.g. the goal handle was destroyed
            self.get_logger().warning(f"could not set the goal's final state ({outcome}): {e}")

    # ---- base reloads ---------------------------------------------------------------------
    def _switch(self, rt, task: str, code: int):
        """Switch base neurons to ``task`` (worker thread); GoalRejected(code) on failure, the
        previous task staying active."""
        from ..core.safetensors_io import FormatError
        before = rt.task
        try:
            report = rt.switch_task(task)
        except KeyError as e:
            raise GoalRejected(R.UNKNOWN_TASK, str(e.args[0]) if e.args else str(e)) from None
        except (FormatError, ValueError, OSError) as e:
            raise GoalRejected(code, f"profile switch to {task!r} refused ({e}); {before!r} stays "
                                     f"active") from None
        self.get_logger().info(
            f"switched base neurons {before!r} -> {task!r} in {report.seconds:.3f} s: read "
            f"{report.bytes_read / 2**20:.2f} MiB ({report.neurons_read} neurons), dropped "
            f"{report.neurons_dropped} (full load: {rt.bytes_read / 2**20:.1f} MiB in "
            f"{rt.load_seconds:.2f} s)")
        self._publish_loaded()
        return report

    def _run_reload(self, job: _Job) -> None:
        resp = ReloadBase.Response()
        rt = self._runtime
        if rt is None:
            resp.success, resp.message = False, f"no model loaded ({self._model_state})"
        elif not job.task or job.task == rt.task:
            resp.success = True
            resp.message = f"task {rt.task!r} is active" + ("" if not job.task else " already")
            self._publish_loaded()
        else:
            try:
                report = self._switch(rt, job.task, R.PROFILE_SWITCH_FAILED)
                resp.success = True
                resp.message = (f"switched to {job.task!r}: {report.bytes_read} bytes read "
                                f"({report.neurons_read} neurons) in {report.seconds:.3f} s")
                resp.reload_seconds = float(report.seconds)
                resp.bytes_read = int(report.bytes_read)
                resp.neurons_read = int(report.neurons_read)
            except GoalRejected as e:
                resp.success, resp.message = False, e.reason
                self.get_logger().warning(f"reload_base refused: {e.reason}")
        resp.active_task = rt.task if rt is not None else ""
        job.result = resp

    def _on_reload_base(self, request, response):
        job = _Job("reload", task=request.task.strip())
        self._enqueue(job)
        timeout = self.settings.reload_timeout
        if not job.done.wait(timeout):
            job.abandoned = True
            response.success = False
            response.message = (f"timed out after {timeout:g} s waiting for the goals ahead of "
                                f"the reload (or the model load)")
            rt = self._runtime
            response.active_task = rt.task if rt is not None else ""
            return response
        return job.result

    def _publish_loaded(self) -> None:
        rt = self._runtime
        if rt is None:
            return
        msg = ActiveProfile(task=rt.task, model_id=rt.model_id, load_ratio=float(rt.load_ratio),
                            static_ratio=float(rt.selective.static_ratio if rt.selective else 1.0))
        msg.stamp = self.get_clock().now().to_msg()
        self._loaded_pub.publish(msg)

    # ---- parameters -----------------------------------------------------------------------
    def _on_set_parameters(self, params) -> SetParametersResult:
        from ..core.loader import check_ratios
        new, reason = apply_changes(self.settings, INFERENCE_PARAMS, params)
        rt = self._runtime
        if reason is None and rt is not None and rt.selective is not None:
            phi = new.compute_ratio if new.compute_ratio > 0 else rt.load_ratio
            try:
                check_ratios(rt.load_ratio, rt.selective.static_ratio, phi)
            except ValueError as e:
                reason = f"compute_ratio refused for the loaded model: {e}"
        if reason is not None:
            self.get_logger().warning(f"parameter change refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        old, self.settings = self.settings, new
        if new.diagnostics_period != old.diagnostics_period:
            self.destroy_timer(self._diag_timer)
            self._diag_timer = self.create_timer(new.diagnostics_period, self.publish_diagnostics,
                                                 callback_group=self._diag_group)
        return SetParametersResult(successful=True)

    # ---- diagnostics ----------------------------------------------------------------------
    def snapshot(self) -> diag.Snapshot:
        rt = self._runtime
        s = self.settings
        with self._lock:
            generating = self._running is not None
            depth = self._in_system - (1 if generating else 0)
            rejected_early = self._rejected_without_model
            last_rejection = self._last_rejection
        snap = diag.Snapshot(
            node_name=self.get_name(), device=s.device, model_loaded=rt is not None,
            model_state=self._model_state, memory_headroom_bytes=int(s.memory_headroom_mb * 2**20),
            queue_depth=max(0, depth), queue_length=s.queue_length, generating=generating,
            rejected=rejected_early, last_rejection=last_rejection)
        if rt is None:
            return snap
        st = rt.stats
        last = rt.last_switch
        snap.device = str(rt.device)
        snap.model_id = rt.model_id
        snap.memory = rt.memory()
        snap.load_ratio = float(rt.load_ratio)
        snap.static_ratio = float(rt.selective.static_ratio if rt.selective else 1.0)
        snap.compute_ratio = float(s.compute_ratio if s.compute_ratio > 0 else rt.load_ratio)
        snap.active_task, snap.tasks = rt.task, tuple(rt.tasks)
        snap.last_tokens_per_second = st.last_tokens_per_second
        snap.average_tokens_per_second = st.average_tokens_per_second
        snap.last_time_to_first_token = st.last_time_to_first_token
        snap.succeeded, snap.canceled, snap.aborted = st.succeeded, st.canceled, st.aborted
        snap.rejected += st.rejected
        snap.switches = rt.switches
        snap.last_reload_seconds = last.seconds if last else 0.0
        snap.last_reload_bytes_read = last.bytes_read if last else 0
        snap.full_load_seconds, snap.full_load_bytes_read = rt.load_seconds, rt.bytes_read
        return snap

    def publish_diagnostics(self) -> DiagnosticArray:
        arr = diag.build_array(self.snapshot(), self.get_clock().now().to_msg())
        for pub in self._diag_pubs:
            pub.publish(arr)
        return arr

    # ---- shutdown -------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the worker: the running goal is canceled within one decode step and aborted,
        waiting goals are aborted. True if the worker ended within ``timeout``."""
        with self._cond:
            self._stopping = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in waiting:
            if job.kind == "goal":
                try:
                    job.goal_handle.execute()
                    job.goal_handle.abort()
                except Exception:  # noqa: BLE001 - best effort while shutting down
                    pass
                job.result = R(error_code=R.UNKNOWN, error_msg="node shutting down",
                               finish_reason="error")
                with self._lock:
                    self._in_system -= 1
            job.done.set()
        if self._worker.is_alive() and self._worker is not threading.current_thread():
            self._worker.join(timeout)
        return not self._worker.is_alive()

    def destroy_node(self) -> None:
        if not self.stop():
            self.get_logger().warning("worker still busy (model loading?) at shutdown")
        self._action_server.destroy()
        super().destroy_node()


def spin_node(node, num_threads: int = 6) -> None:
    """Spin ``node`` in a MultiThreadedExecutor until Ctrl-C or external shutdown."""
    from rclpy.executors import MultiThreadedExecutor
    executor = MultiThreadedExecutor(num_threads=num_threads, context=node.context)
    executor.add_node(node)
    try:
        executor.spin()
    except KeyboardInterrupt:
        pass
    except Exception as e:  # ExternalShutdownException (not in every distribution's rclpy)
        if type(e).__name__ != "ExternalShutdownException":
            raise
    finally:
        executor.shutdown(timeout_sec=5.0)
        node.destroy_node()
        if node.context.ok():
            rclpy.shutdown(context=node.context)


def run_node(make, name: str, args: list[str] | None = None, num_threads: int = 6) -> int:
    """Console-script body: init, build the node (a refused parameter exits 2 with the reason), spin."""
    rclpy.init(args=args)
    try:
        node = make()
    except ParamError as e:
        print(f"{name}: {e}", file=sys.stderr)
        rclpy.shutdown()
        return 2
    spin_node(node, num_threads=num_threads)
    return 0


def main(args: list[str] | None = None) -> int:
    return run_node(InferenceNode, "selectinfer_node", args)


if __name__ == "__main__":
    sys.exit(main())
