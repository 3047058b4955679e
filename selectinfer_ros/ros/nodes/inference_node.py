"""``selectinfer_node``: the selectively loaded model behind a ROS 2 Generate action.

A lifecycle node (as llama_ros's): "action server available" means "goals will be served".

* configure   checks the files (model folder, profiles, task: FAILURE with the reason) and
              loads the model (preparing the embedded one once, under an inter-process lock) on
              the serving worker thread; the lifecycle services stay answering meanwhile
              (``ros2 lifecycle get`` works during a long load)
* activate    creates the ``generate`` action server and the ``reload_base`` service
* deactivate  aborts the waiting goals and the running one (within one decode step) with the
              reason, then removes the action server and the service
* cleanup     frees the model; shutdown does all of the above from any state

Always (in every state): ``loaded_profile`` (selectinfer_msgs/msg/ActiveProfile, transient
local: the task whose base neurons are resident) and ``diagnostics`` + ``/diagnostics``
(diagnostic_msgs/DiagnosticArray every period, with the lifecycle state).

**A goal the node will not serve** (invalid, unknown task, prompt too long, queue full, no model)
is accepted and ended at once, ABORTED, with the result's ``error_code``, ``error_msg`` (the
reason) and ``finish_reason: rejected``, as Nav2's servers end goals: a ROS 2 goal rejection
carries no message, so the reason travels with the goal. It still costs no queue place and is
counted as rejected (``goals_rejected``, ``last_rejection`` on the diagnostics).

The node translates messages and parameters; the queue, the worker and the goal validation are
the core's :class:`selectinfer_ros.core.serving.server.Server`.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback

from rcl_interfaces.msg import SetParametersResult
from rclpy.action import CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.duration import Duration
from rclpy.lifecycle import LifecycleNodeMixin, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.qos import QoSProfile

from diagnostic_msgs.msg import DiagnosticArray
from selectinfer_msgs.action import Generate
from selectinfer_msgs.msg import ActiveProfile, ToolCall
from selectinfer_msgs.srv import ReloadBase

from ...core.execution.chat import Chat
from ...core.serving.server import (CANCELED, GENERATION_FAILED, REFUSED, GoalJob, Outcome,
                                    Rejected, Server, goal_config, goal_prompt, reload_timeout,
                                    short)
from ..plumbing import (BURST_QOS, LATCHED, exit_now, guarded, internal_error,
                        one_transition_at_a_time, run_node)
from ..safe_action import SafeActionServer
from . import diagnostics as diag
from .settings import NodeSettings, ParamError, apply_changes, check_model_files, declare

R = Generate.Result
REFUSALS_KEPT = 1024  # refusals between the goal and the accepted callback (normally one at a time)
RESULT_GRACE = 0.2  # seconds for the last results to reach their clients before the server goes
WATCH_PERIOD = 0.5  # seconds between two looks at the running goal (time bound, its client)


def _resolve(node, name: str) -> str:
    """Fully qualified name of a relative topic/action ``name`` of ``node``."""
    try:
        return node.resolve_topic_name(name)
    except Exception:  # noqa: BLE001 - older rclpy without resolve_topic_name
        ns = node.get_namespace().rstrip("/")
        return f"{ns}/{name}"


def finish_reason(outcome: Outcome, generated: str) -> str:
    """``finish_reason`` agreeing with the goal's status: ``canceled`` only for a goal its client
    canceled, ``aborted`` for one the node stopped (deactivate, shutdown: NO_MODEL), ``error`` for
    another failure; a generation that ended by itself keeps its reason (stop, length)."""
    if outcome.status == "canceled":
        return "canceled"
    if outcome.status == "aborted" and (generated in ("", "canceled")):
        stopped = outcome.code in ("NO_MODEL", "CANCELED") or generated == "canceled"
        return "aborted" if stopped else "error"
    return generated or "error"


def result_message(outcome: Outcome) -> Generate.Result:
    """The Generate result of a goal's outcome."""
    r = R(error_code=getattr(R, outcome.code), error_msg=outcome.message,
          profile=outcome.task, load_ratio=float(outcome.load_ratio),
          compute_ratio=float(outcome.compute_ratio))
    if outcome.choice is not None:
        c = outcome.choice
        r.text, r.finish_reason, r.choice_index = c.choice, "choice", c.index
        r.choice_logprobs = [float(x) for x in c.logprobs]
        r.choice_logprobs_normalized = [float(x) for x in c.logprobs_normalized]
        r.prompt_tokens, r.time_to_first_token = c.prompt_tokens, c.seconds
        return r
    res = outcome.result
    if res is None:
        r.finish_reason = finish_reason(outcome, "")
        return r
    m = res.metrics
    r.text, r.finish_reason = res.text, finish_reason(outcome, res.finish_reason)
    r.parsed = bool(res.parsed) and outcome.status == "succeeded"
    r.closed_early = bool(res.closed_early) and r.parsed
    r.warnings = [str(w) for w in res.warnings]
    r.prompt_tokens, r.generated_tokens = m.prompt_tokens, m.generated_tokens
    r.time_to_first_token, r.tokens_per_second = m.time_to_first_token, m.tokens_per_second
    r.cached_tokens = m.cached_tokens
    r.tool_calls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in res.tool_calls]
    return r


class _Goal:
    """A goal handle and its core job; feedback and results go through here."""

    def __init__(self, gh, job_args, choices: list[str], length_normalize: bool):
        self.gh = gh
        self.started = False
        self.done = threading.Event()
        self.t_first = 0.0
        self.clients: frozenset = frozenset()  # action clients on the graph when it came
        self.job = GoalJob(*job_args, cancel_requested=lambda: gh.is_cancel_requested,
                           on_start=self._start, on_text=self._feedback, on_done=self._done,
                           choices=choices, length_normalize=length_normalize)

    def _start(self) -> None:
        self.started = True
        self.gh.execute()  # EXECUTING; rclpy schedules the execute callback (the node's _execute)

    def _feedback(self, delta: str, tokens: int) -> None:
        now = time.perf_counter()
        if not self.t_first:
            self.t_first = now
        tps = (tokens - 1) / (now - self.t_first) if tokens > 1 and now > self.t_first else 0.0
        self.gh.publish_feedback(Generate.Feedback(text_delta=delta, generated_tokens=tokens,
                                                   tokens_per_second=tps))

    def _done(self, outcome: Outcome) -> None:
        if not self.started:  # ended while waiting: the execute callback still hands the result
            self.started = True
            self.gh.execute()
        self.done.set()


class InferenceNode(LifecycleNodeMixin, Node):
    """The Generate action server over one loaded model (see the module docstring)."""

    def __init__(self, node_name: str = "selectinfer_node", *, namespace: str = "llm", **kwargs):
        Node.__init__(self, node_name, namespace=namespace, **kwargs)
        # Lifecycle services in a reentrant group: get_state answers while configure loads.
        LifecycleNodeMixin.__init__(self, callback_group=ReentrantCallbackGroup())
        one_transition_at_a_time(self)
        try:  # values only; the files are checked by configure
            self.settings: NodeSettings = declare(self, NodeSettings)
        except ParamError as e:
            self.get_logger().error(f"refusing to start: {e}")
            Node.destroy_node(self)
            raise
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._lock = threading.Lock()
        self._goals: dict[bytes, _Goal] = {}
        self._failed: dict[bytes, str | Rejected] = {}  # accepted goals not queued: why
        # goal callback -> accepted callback: the refusal of a goal accepted only to end at once
        # with its reason (keyed by the goal message's identity: rclpy hands both callbacks the
        # same object)
        self._refusals: collections.OrderedDict[int, tuple[object, Rejected]] = \
            collections.OrderedDict()
        self._executing = 0  # execute callbacks not returned yet
        self.server = Server(self.settings.queue_length, log=self.get_logger().info,
                             max_batch=self.settings.max_batch)
        self.server.on_switch = lambda report: self._publish_loaded()
        self.server.start()
        self._goal_group = ReentrantCallbackGroup()
        self._reload_group = ReentrantCallbackGroup()
        self._diag_group = MutuallyExclusiveCallbackGroup()
        self._action_server: SafeActionServer | None = None
        self._reload_srv = None
        self._loaded_pub = self.create_publisher(ActiveProfile, "loaded_profile", LATCHED)
        self._diag_pubs = [self.create_publisher(DiagnosticArray, "diagnostics", 10)]
        if _resolve(self, "diagnostics") != "/diagnostics":
            self._diag_pubs.append(self.create_publisher(DiagnosticArray, "/diagnostics", 10))
        self._diag_timer = self.create_timer(self.settings.diagnostics_period,
                                             self.publish_diagnostics, callback_group=self._diag_group)
        # Probes on the action's feedback topic (a nil goal id: clients ignore them): a reader
        # that stops acknowledging them belongs to a client that was killed or froze.
        self._feedback_topic = _resolve(self, "generate") + "/_action/feedback"
        self._probe = self.create_publisher(Generate.Impl.FeedbackMessage, self._feedback_topic,
                                            QoSProfile(depth=1))
        self._acked_at = 0.0  # when every reader last acknowledged a probe
        self._watching = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="selectinfer-watch", daemon=True)
        self._watcher.start()

    def _needs_profiles(self) -> bool:
        s = self.settings
        return (s.load_ratio < 1.0 or s.memory_budget_mb > 0) and s.selection != "random"

    # ---- public helpers (bringup, demo, tests) -------------------------------------------
    @property
    def runtime(self):
        """The loaded Runtime, or None (unconfigured, loading, after a failed load)."""
        return self.server.runtime

    @property
    def load_error(self) -> str:
        return self.server.state if self.server.state.startswith("load failed") else ""

    @property
    def lifecycle_state(self) -> str:
        """``unconfigured``, ``inactive``, ``active``, ``configuring``, ... (the state's label)."""
        return self._state_machine.current_state[1]

    # ---- lifecycle ------------------------------------------------------------------------
    @guarded(lambda self, e, state: TransitionCallbackReturn.FAILURE)
    def on_configure(self, state) -> TransitionCallbackReturn:
        from ...core.serving.runtime import Runtime
        log = self.get_logger()
        s = self.settings
        log.info(f"configuring: loading {s.model or 'the embedded Gemma 3 270M'} on {s.device} "
                 f"(the lifecycle services keep answering)")
        def make():
            check_model_files(s.model, s.profiles, s.task, need_profiles=self._needs_profiles())
            return Runtime(s, log=log.info)

        try:  # a refused file is reported as a failed load (load_error, diagnostics)
            rt = self.server.load(make)
        except Exception as e:  # noqa: BLE001 - reported, the node stays unconfigured
            log.error(f"configure failed: {type(e).__name__}: {e}")
            return TransitionCallbackReturn.FAILURE
        rt.engine.set_prompt_cache(s.prompt_cache_mb)
        log.info(f"loaded {rt.model_id} on {rt.device}: task {rt.task or '-'}, load_ratio "
                 f"{rt.load_ratio:g}, compute_ratio {rt.compute_ratio:g}, "
                 f"{rt.bytes_read / 2**20:.1f} MiB read in {rt.load_seconds:.2f} s")
        self._publish_loaded()
        return TransitionCallbackReturn.SUCCESS

    @guarded(lambda self, e, state: TransitionCallbackReturn.FAILURE)
    def on_activate(self, state) -> TransitionCallbackReturn:
        if self.server.runtime is None:
            self.get_logger().error("activate refused: no model loaded")
            return TransitionCallbackReturn.FAILURE
        self.server.queue_length = self.settings.queue_length
        self.server.max_batch = self.settings.max_batch
        self.server.accepting = True
        self._action_server = SafeActionServer(
            self, Generate, "generate",
            goal_callback=self._on_goal, handle_accepted_callback=self._on_accepted,
            cancel_callback=self._on_cancel, execute_callback=self._execute,
            callback_group=self._goal_group)  # request queues: BURST_QOS (safe_action)
        self._reload_srv = self.create_service(ReloadBase, "reload_base", self._on_reload_base,
                                               qos_profile=BURST_QOS,
                                               callback_group=self._reload_group)
        self.get_logger().info(f"active: serving {_resolve(self, 'generate')}")
        return super().on_activate(state)

    @guarded(lambda self, e, state: TransitionCallbackReturn.ERROR)
    def on_deactivate(self, state) -> TransitionCallbackReturn:
        self._stop_serving("node deactivating")
        self.get_logger().info("inactive: goals are not served")
        return super().on_deactivate(state)

    @guarded(lambda self, e, state: TransitionCallbackReturn.ERROR)
    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self.server.unload()
        self.get_logger().info("unconfigured: model freed")
        return TransitionCallbackReturn.SUCCESS

    @guarded(lambda self, e, state: TransitionCallbackReturn.ERROR)
    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self._stop_serving("node shutting down")
        self.server.unload()
        return TransitionCallbackReturn.SUCCESS

    def _stop_serving(self, reason: str) -> None:
        """Abort every goal with ``reason``, let the results go out, remove the servers."""
        if not self.server.drain(reason, timeout=30.0):
            self.get_logger().warning(f"{reason}: a goal did not end within 30 s")
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with self._lock:
                if not self._executing:
                    break
            time.sleep(0.01)
        if self._action_server is not None:
            time.sleep(RESULT_GRACE)
            self._action_server.destroy()
            self._action_server = None
        if self._reload_srv is not None:
            self.destroy_service(self._reload_srv)
            self._reload_srv = None

    # ---- action callbacks (executor threads: answer at once) ------------------------------
    # Every callback is guarded: a failure of ours is logged with its traceback and answered
    # (a refusal, an aborted goal, success=false), never left to stop the executor.
    def _goal_failed(self, e: Exception, goal) -> GoalResponse:
        return self._refuse(goal, Rejected("UNKNOWN", internal_error(e)))

    def _refuse(self, goal, e: Rejected) -> GoalResponse:
        """Count and log a refusal; accept the goal so that it ends at once with the reason
        (:meth:`_on_accepted`)."""
        self.server.note_rejection(e)
        self.get_logger().warning(f"goal refused ({e.code}): {e.reason}")
        with self._lock:
            self._refusals[id(goal)] = (goal, e)
            while len(self._refusals) > REFUSALS_KEPT:
                self._refusals.popitem(last=False)
        return GoalResponse.ACCEPT

    @guarded(_goal_failed)
    def _on_goal(self, goal) -> GoalResponse:
        try:
            rt = self.server.runtime
            if rt is None:
                raise Rejected("NO_MODEL", f"no model loaded ({self.server.state})")
            cfg, _ = goal_config(goal, self.settings, rt)
            prompt = goal_prompt(goal)
            tokens = self.server.check_prompt(prompt, bool(goal.use_chat_template),
                                              self.settings.prompt_special_tokens)
            if goal.choices:
                self.server.check_choices(list(goal.choices), tokens)
            if isinstance(prompt, Chat):
                self.server.check_tools(prompt)  # names the tool whose schema does not compile
            self.server.check_constraint(cfg)  # json_schema / grammar: compiled (bounded), cached
            self.server.admit()
            return GoalResponse.ACCEPT
        except Rejected as e:
            return self._refuse(goal, e)

    def _accept_failed(self, e: Exception, gh) -> None:
        """An accepted goal we could not queue: its place is freed and it is aborted with the
        reason (by the execute callback)."""
        key = bytes(gh.goal_id.uuid)
        with self._lock:
            self._goals.pop(key, None)
            self._failed[key] = internal_error(e)
        self.server.release()
        gh.execute()

    @guarded(_accept_failed)
    def _on_accepted(self, gh) -> None:
        goal = gh.request
        with self._lock:
            refused = self._refusals.pop(id(goal), None)
            if refused is not None and refused[0] is goal:  # ended at once with the reason
                self._failed[bytes(gh.goal_id.uuid)] = refused[1]
        if refused is not None and refused[0] is goal:
            gh.execute()
            return
        try:
            rt = self.server.runtime
            if rt is None:
                raise Rejected("NO_MODEL", f"no model loaded ({self.server.state})")
            cfg, phi = goal_config(goal, self.settings, rt)
            refused = None
        except Rejected as e:  # validated a moment ago; only a vanished model gets here
            cfg, phi, refused = None, 0.0, e
        g = _Goal(gh, (goal_prompt(goal), cfg, goal.task, phi), list(goal.choices),
                  bool(goal.length_normalize))
        g.job.refused = refused
        g.clients = self._action_clients()
        with self._lock:
            self._goals[bytes(gh.goal_id.uuid)] = g
        self.server.submit(g.job)

    @guarded(lambda self, e, gh: CancelResponse.REJECT)
    def _on_cancel(self, gh) -> CancelResponse:
        with self._lock:
            g = self._goals.get(bytes(gh.goal_id.uuid))
        if g is not None:
            self.server.cancel(g.job)  # a waiting goal leaves the queue now
        return CancelResponse.ACCEPT

    def _execute(self, gh):
        """The rclpy execute callback: waits for the worker's outcome of this goal, sets the
        goal's final state and hands the result to the action server."""
        key = bytes(gh.goal_id.uuid)
        with self._lock:
            g = self._goals.get(key)
            failed = self._failed.pop(key, "goal not found")
            self._executing += 1
        try:
            if g is None:
                gh.abort()
                if isinstance(failed, Rejected):
                    return R(error_code=getattr(R, failed.code, R.UNKNOWN),
                             error_msg=failed.reason, finish_reason=REFUSED)
                return R(error_code=R.UNKNOWN, error_msg=failed, finish_reason="error")
            g.done.wait()
            outcome = g.job.outcome
            if outcome.status == "succeeded":
                gh.succeed()
            elif outcome.status == "canceled":
                deadline = time.monotonic() + 2.0  # a cancel that emptied the queue: CANCELING
                while not gh.is_cancel_requested and time.monotonic() < deadline:
                    time.sleep(0.002)
                gh.canceled() if gh.is_cancel_requested else gh.abort()
            else:
                self.get_logger().warning(f"goal aborted ({outcome.code}): {outcome.message}")
                gh.abort()
            return result_message(outcome)
        except Exception as e:  # noqa: BLE001 - the goal ends aborted with the reason
            self.get_logger().error(f"execute failed: {type(e).__name__}: {e}\n"
                                    f"{traceback.format_exc()}")
            try:
                gh.abort()
            except Exception:  # noqa: BLE001 - already in a final state
                pass
            return R(error_code=R.UNKNOWN, error_msg=internal_error(e), finish_reason="error")
        finally:
            with self._lock:
                self._goals.pop(key, None)
                self._executing -= 1

    # ---- the running goal's bounds: time, its client ---------------------------------------
    def _action_clients(self) -> frozenset:
        """Endpoint ids of the readers of the action's feedback (one per action client)."""
        try:
            return frozenset(bytes(i.endpoint_gid) for i in
                             self.get_subscriptions_info_by_topic(self._feedback_topic))
        except Exception:  # noqa: BLE001 - the graph is a hint; never fail a goal on it
            return frozenset()

    def _watch(self) -> None:
        """Watcher thread: every WATCH_PERIOD, end the running goal when it ran past
        ``max_goal_seconds``, when every action client present when it came has left the graph,
        or (a goal running alone while another waits) when a reader that acknowledged the
        node's messages during this goal stopped doing so for ``client_timeout`` seconds (its
        client was killed or froze: DDS would keep it matched ~20 s)."""
        while not self._watching.wait(WATCH_PERIOD):
            try:
                self._check_running()
            except Exception as e:  # noqa: BLE001 - logged; the watcher goes on
                self.get_logger().error(f"watch: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    def _check_running(self) -> None:
        if self._action_server is None or not self.context.ok():
            return
        s = self.settings
        self._probe.publish(Generate.Impl.FeedbackMessage())  # also while idle: a baseline
        if self._probe.wait_for_all_acked(Duration(seconds=min(1.0, s.client_timeout / 2))):
            self._acked_at = time.monotonic()
        running = self.server.running_jobs
        for job in running:
            if job.started_at is not None:
                self._check_job(job, s, alone=len(running) == 1)

    def _check_job(self, job: GoalJob, s, alone: bool = True) -> None:
        """End a running goal that ran too long or whose client is gone or frozen. A silent
        reader says nothing of whose client froze: with several goals decoding together
        (``alone`` false) the silence ends none of them (it would end the others' goals too);
        the waiting goals take the slot of the first to end."""
        with self._lock:
            g = next((x for x in self._goals.values() if x.job is job), None)
        now = time.monotonic()
        if now - job.started_at > s.max_goal_seconds:
            self._end(job, GENERATION_FAILED, f"the goal ran longer than max_goal_seconds="
                                              f"{s.max_goal_seconds:g} s")
            return
        if g is not None and g.clients and not (g.clients & self._action_clients()):
            self._end(job, CANCELED, "its client left the graph (no action client that was "
                                     "there when the goal came is left)")
            return
        # acknowledged until shortly before this goal started (a reader dead since earlier is
        # not this goal's client), then silent for client_timeout while others wait
        silent = now - self._acked_at
        if (alone and self._acked_at > job.started_at - 2 * WATCH_PERIOD
                and silent >= s.client_timeout and self.server.waiting > 0):
            self._end(job, CANCELED, f"its client stopped taking results (no acknowledgment for "
                                     f"{silent:.1f} s, client_timeout {s.client_timeout:g} s) "
                                     f"and {self.server.waiting} goal(s) wait")

    def _end(self, job: GoalJob, code: str, reason: str) -> None:
        if self.server.end_running(job, code, reason):
            self.get_logger().warning(f"ending the running goal ({code}): {reason}")

    # ---- base reloads ---------------------------------------------------------------------
    def _reload_failed(self, e: Exception, request, response):
        response.success, response.message = False, internal_error(e)
        response.active_task = self.server.task
        return response

    @guarded(_reload_failed)
    def _on_reload_base(self, request, response):
        task = request.task.strip()
        try:
            timeout = reload_timeout(request.timeout, self.settings.reload_timeout)
            report = self.server.reload(task, timeout)
            response.success = True
            if report is None:
                response.message = f"task {self.server.task!r} is active" + (" already" if task else "")
                self._publish_loaded()
            else:
                retiered = (f", {report.neurons_retiered} re-tiered" if report.neurons_retiered
                            else "")
                response.message = (f"switched to {short(task)!r}: {report.bytes_read} bytes read "
                                    f"({report.neurons_read} neurons{retiered}) in "
                                    f"{report.seconds:.3f} s")
                response.reload_seconds = float(report.seconds)
                response.bytes_read = int(report.bytes_read)
                response.neurons_read = int(report.neurons_read)
                response.neurons_retiered = int(report.neurons_retiered)
        except (Rejected, TimeoutError, RuntimeError) as e:
            response.success = False
            response.message = e.reason if isinstance(e, Rejected) else str(e)
            self.get_logger().warning(f"reload_base refused: {response.message}")
        response.active_task = self.server.task
        return response

    def _publish_loaded(self) -> None:
        rt = self.server.runtime
        if rt is None:
            return
        msg = ActiveProfile(task=rt.task, model_id=rt.model_id, load_ratio=float(rt.load_ratio),
                            static_ratio=float(rt.selective.static_ratio if rt.selective else 1.0))
        msg.stamp = self.get_clock().now().to_msg()
        self._loaded_pub.publish(msg)

    # ---- parameters -----------------------------------------------------------------------
    @guarded(lambda self, e, params: SetParametersResult(successful=False,
                                                         reason=internal_error(e)))
    def _on_set_parameters(self, params) -> SetParametersResult:
        new, reason = apply_changes(self.settings, params, self)
        rt = self.server.runtime
        if reason is None and rt is not None:
            try:
                rt.ratios_for(new.compute_ratio)
            except ValueError as e:
                reason = f"compute_ratio refused for the loaded model: {e}"
        if reason is not None:
            self.get_logger().warning(f"parameter change refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        if new.diagnostics_period != self.settings.diagnostics_period:
            timer = self.create_timer(new.diagnostics_period, self.publish_diagnostics,
                                      callback_group=self._diag_group)  # before the old one goes
            old_timer, self._diag_timer = self._diag_timer, timer
            self.destroy_timer(old_timer)
        if rt is not None and new.prompt_cache_mb != self.settings.prompt_cache_mb:
            rt.engine.set_prompt_cache(new.prompt_cache_mb)
        self.settings = new
        self.server.queue_length = new.queue_length
        self.server.max_batch = new.max_batch  # from the next batch that forms
        return SetParametersResult(successful=True)

    # ---- diagnostics ----------------------------------------------------------------------
    def snapshot(self) -> diag.Snapshot:
        rt = self.server.runtime
        s = self.settings
        srv = self.server
        snap = diag.Snapshot(
            node_name=self.get_name(), device=s.device, model_loaded=rt is not None,
            model_state=srv.state, lifecycle_state=self.lifecycle_state,
            memory_headroom_bytes=int(s.memory_headroom_mb * 2**20),
            queue_depth=max(0, srv.waiting), queue_length=s.queue_length,
            generating=srv.generating, rejected=srv.rejected_without_model,
            last_rejection=srv.last_rejection, running_goals=len(srv.running_jobs),
            max_batch=s.max_batch,
            aggregate_tokens_per_second=srv.aggregate_tokens_per_second)
        if rt is None:
            return snap
        st = rt.stats
        last = rt.last_switch
        snap.device = str(rt.device)
        snap.model_id = rt.model_id
        snap.memory = rt.memory()
        snap.load_ratio = float(rt.load_ratio)
        snap.static_ratio = float(rt.selective.static_ratio if rt.selective else 1.0)
        try:
            snap.compute_ratio = float(rt.ratios_for(s.compute_ratio).compute)
        except ValueError:  # refused when set; kept for a model loaded since
            snap.compute_ratio = float(rt.compute_ratio)
        snap.active_task, snap.tasks = rt.task, tuple(rt.tasks)
        snap.compute_mode = rt.selective.compute_mode if rt.selective else "prompt"
        snap.last_tokens_per_second = st.last_tokens_per_second
        snap.average_tokens_per_second = st.average_tokens_per_second
        snap.last_time_to_first_token = st.last_time_to_first_token
        snap.last_computed_share = st.last_computed_share
        snap.succeeded, snap.canceled, snap.aborted = st.succeeded, st.canceled, st.aborted
        snap.closed_early, snap.loops_broken = st.closed_early, st.loops_broken
        snap.rejected += st.rejected
        snap.switches = rt.switches
        snap.last_reload_seconds = last.seconds if last else 0.0
        snap.last_reload_bytes_read = last.bytes_read if last else 0
        snap.last_reload_neurons_read = last.neurons_read if last else 0
        snap.last_reload_neurons_retiered = last.neurons_retiered if last else 0
        snap.int8_ratio = float(rt.selective.int8_ratio if rt.selective else 0.0)
        snap.full_load_seconds, snap.full_load_bytes_read = rt.load_seconds, rt.bytes_read
        snap.expected_agreement = rt.expected_agreement(snap.compute_ratio)
        snap.load_ratio_bound = rt.load_choice.bound
        snap.prompt_cache = rt.engine.prompt_cache.snapshot()
        return snap

    @guarded(lambda self, e: None)
    def publish_diagnostics(self) -> DiagnosticArray:
        arr = diag.build_array(self.snapshot(), self.get_clock().now().to_msg())
        for pub in self._diag_pubs:
            pub.publish(arr)
        return arr

    # ---- shutdown -------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> bool:
        """Abort every goal (the running one within one decode step) and end the worker; True
        if it ended within ``timeout``. Call before the executor stops, so results go out."""
        with self._lock:
            serving = self._action_server is not None
        if serving:
            self._stop_serving("node shutting down")
        return self.server.stop("node shutting down", timeout)

    def destroy_node(self) -> None:
        self._watching.set()
        if not self.stop():
            self.get_logger().warning("worker still busy (model loading?) at shutdown")
        if self._action_server is not None:
            self._action_server.destroy()
            self._action_server = None
        super().destroy_node()


def main(args: list[str] | None = None) -> int:
    exit_now(run_node(InferenceNode, "selectinfer_node", args))


if __name__ == "__main__":
    main()
