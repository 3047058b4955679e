"""The rclpy plumbing shared by the nodes, the client facade and the small commands: contexts,
spinning, process exit, latched QoS, and the text form of results and diagnostics."""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
import traceback

import rclpy
from rclpy.context import Context
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

from ..core.options import ParamError

LATCHED = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL,
                     reliability=ReliabilityPolicy.RELIABLE)
# Requests a service (or an action's goal, cancel and result services) keeps until the executor
# takes them. ROS 2's default is 10: a burst of more calls than that lost the rest, and their
# callers waited for their own timeouts. Every request kept is answered (accepted, done, or
# refused with the reason).
SERVICE_DEPTH = 1000
BURST_QOS = QoSProfile(depth=SERVICE_DEPTH, reliability=ReliabilityPolicy.RELIABLE)


def one_transition_at_a_time(node) -> None:
    """Make a lifecycle node's ``change_state`` service refuse a transition requested while
    another one runs (success false at once, the reason in the node's log), instead of running
    two transitions of one state machine side by side on two executor threads; and keep
    SERVICE_DEPTH requests. rcl_lifecycle makes its service 10 deep, and a burst of 20 calls
    lost 8: the same service is served by one of this node's own (BURST_QOS), and rcl_lifecycle's
    is left out of the executor (it stays on the graph, keeps at most 10 requests and answers
    none)."""
    from lifecycle_msgs.srv import ChangeState
    srv = getattr(node, "_service_change_state", None)
    if srv is None:
        return
    lock = threading.Lock()
    inner = srv.callback

    def change_state(request, response):
        if not lock.acquire(blocking=False):
            node.get_logger().warning(
                f"change_state (transition {request.transition.id} "
                f"{request.transition.label!r}) refused: another transition is in progress "
                f"(state {node._state_machine.current_state[1]})")
            response.success = False
            return response
        try:
            return inner(request, response)
        finally:
            lock.release()

    own = node.create_service(ChangeState, srv.srv_name, change_state, qos_profile=BURST_QOS,
                              callback_group=srv.callback_group)
    node._services.remove(srv)
    node._service_change_state = own


def init_context(args: list[str] | None = None) -> Context:
    """A fresh context; Ctrl-C stays a KeyboardInterrupt (so a command can cancel its goal)."""
    context = Context()
    try:
        from rclpy.signals import SignalHandlerOptions
        rclpy.init(args=args, context=context, signal_handler_options=SignalHandlerOptions.NO)
    except (ImportError, TypeError):  # rclpy without signal handler options
        rclpy.init(args=args, context=context)
    return context


def ns_name(namespace: str, name: str) -> str:
    """``name`` inside ``namespace`` (``llm`` + ``generate`` -> ``/llm/generate``)."""
    if name.startswith("/"):
        return name
    ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
    return f"{ns}/{name}"


SPIN_FAILURES_ALLOWED = 20  # unexpected exceptions per minute before a spinning process gives up
EXIT_SPIN_FAILED = 70  # exit status of a process whose executor could not go on (EX_SOFTWARE)


def _report(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def spin_in_background(executor, name: str = "executor", *, log=_report,
                       exit_on_failure: bool = True) -> threading.Thread:
    """Spin ``executor`` in a started daemon thread. It ends quietly when the context or the
    executor shuts down. An exception a callback let out (rclpy's executor re-raises it in
    ``spin``) is logged with its traceback and spinning goes on; when spinning cannot go on
    (more than SPIN_FAILURES_ALLOWED such exceptions within a minute), the message is logged
    and, with ``exit_on_failure``, the process ends with status EXIT_SPIN_FAILED, so that
    launch or a supervisor can restart it, instead of staying up deaf."""
    def stopped() -> bool:
        return not executor.context.ok() or getattr(executor, "_is_shutdown", False)

    def spin() -> None:
        failures: list[float] = []
        while not stopped():
            try:
                executor.spin()
                return
            except Exception as e:  # noqa: BLE001 - logged; spinning goes on if it can
                if stopped():
                    return
                now = time.monotonic()
                failures = [t for t in failures if now - t < 60.0] + [now]
                log(f"[{name}] a callback raised {type(e).__name__}: {e}\n"
                    f"{traceback.format_exc()}")
                if len(failures) > SPIN_FAILURES_ALLOWED:
                    log(f"[{name}] {len(failures)} callback failures within a minute: the "
                        f"executor cannot go on" + ("; ending the process (status "
                                                    f"{EXIT_SPIN_FAILED})" if exit_on_failure
                                                    else ""))
                    if exit_on_failure:
                        exit_now(EXIT_SPIN_FAILED)
                    return

    thread = threading.Thread(target=spin, name=name, daemon=True)
    thread.start()
    return thread


def guarded(on_error):
    """Decorator for a node's rclpy callback (a method): an exception it raises is logged with
    its traceback on the node's logger, and ``on_error(self, exc, *args)`` gives the answer
    (a refusal, an error response), so that no callback's failure reaches the executor."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - logged and answered
                self.get_logger().error(f"{fn.__name__} failed: {type(e).__name__}: {e}\n"
                                        f"{traceback.format_exc()}")
                return on_error(self, e, *args)
        return call
    return wrap


def internal_error(e: BaseException) -> str:
    """The message a client gets for a failure of ours (the traceback is in the node's log)."""
    return f"internal error: {type(e).__name__}: {str(e)[:200]} (see the node's log)"


def spin_node(node, num_threads: int = 6) -> None:
    """Spin ``node`` in a background MultiThreadedExecutor until SIGINT/SIGTERM or an external
    shutdown. On the way out the node's goals end first, with a reason that reaches their
    clients while the executor still spins; then the executor stops and the node is destroyed."""
    from rclpy.executors import MultiThreadedExecutor
    executor = MultiThreadedExecutor(num_threads=num_threads, context=node.context)
    executor.add_node(node)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    thread = spin_in_background(executor, log=node.get_logger().error)
    while not stop.wait(0.2):
        if not node.context.ok() or not thread.is_alive():
            break
    ending = getattr(node, "stop", None)
    if ending is not None and node.context.ok():
        ending()
    executor.shutdown(timeout_sec=5.0)
    thread.join(5.0)
    node.destroy_node()
    if node.context.ok():
        rclpy.shutdown(context=node.context)


def run_node(make, name: str, args: list[str] | None = None, num_threads: int = 6) -> int:
    """Console-script body: init (SIGINT handled here, not by rclpy, so that goals can end with a
    reason before the context goes), build the node (a refused parameter exits 2), spin."""
    context = init_context(args)
    try:
        node = make(context=context)
    except ParamError as e:
        print(f"{name}: {e}", file=sys.stderr)
        rclpy.shutdown(context=context)
        return 2
    spin_node(node, num_threads=num_threads)
    return 0


def exit_now(rc: int) -> None:
    """End the process once the nodes are down: goals ended, results sent, nodes destroyed,
    context shut down. The interpreter's own teardown of torch and transformers (and of a loaded
    model) takes seconds, past the 5 s ``ros2 launch`` grants after SIGINT before it escalates to
    SIGTERM; nothing is left for it to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


class RosClient:
    """``with RosClient('name') as c: ...``: a node spun by a background executor thread."""

    def __init__(self, name: str, args: list[str] | None = None):
        """(Action clients: use :class:`selectinfer_ros.ros.client.LLMClient`, made before its node
        spins.)"""
        self.context = init_context(args)
        self.node = Node(f"{name}_{os.getpid()}", context=self.context)
        self.executor = MultiThreadedExecutor(num_threads=2, context=self.context)
        self.executor.add_node(self.node)
        self._thread = spin_in_background(self.executor, f"{name}-spin")

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=3.0)
        self._thread.join(3.0)
        self.node.destroy_node()
        if self.context.ok():
            rclpy.shutdown(context=self.context)

    def __enter__(self) -> "RosClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; ``3 << 20`` -> ``3.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def status_name(status: int) -> str:
    from action_msgs.msg import GoalStatus
    names = {GoalStatus.STATUS_SUCCEEDED: "SUCCEEDED", GoalStatus.STATUS_CANCELED: "CANCELED",
             GoalStatus.STATUS_ABORTED: "ABORTED", GoalStatus.STATUS_EXECUTING: "EXECUTING",
             GoalStatus.STATUS_ACCEPTED: "ACCEPTED", GoalStatus.STATUS_CANCELING: "CANCELING"}
    return names.get(status, f"status {status}")


def format_result(status: int | str, r) -> str:
    """One line about a Generate result (``status``: a GoalStatus value or an Outcome status)."""
    if r is None:
        return f"{status}: no result"
    name = status if isinstance(status, str) else status_name(status)
    if r.choice_index >= 0:
        scores = ", ".join(f"{lp:.2f}" for lp in r.choice_logprobs)
        return (f"{name}: choice {r.choice_index} {r.text!r} (log-probs {scores}; per token "
                f"{', '.join(f'{lp:.2f}' for lp in r.choice_logprobs_normalized)}), prompt "
                f"{r.prompt_tokens} tokens, answered after {r.time_to_first_token:.2f} s, profile "
                f"{r.profile or '-'}, load_ratio {r.load_ratio:.2f}, compute_ratio "
                f"{r.compute_ratio:.2f}")
    line = (f"{name}: finish={r.finish_reason or '-'}, {r.generated_tokens} tokens "
            f"(prompt {r.prompt_tokens}), {r.tokens_per_second:.2f} tok/s, first token after "
            f"{r.time_to_first_token:.2f} s, profile {r.profile or '-'}, load_ratio "
            f"{r.load_ratio:.2f}, compute_ratio {r.compute_ratio:.2f}")
    if r.error_code:
        line += f"; error {r.error_code}: {r.error_msg}"
    return line


LEVEL_NAMES = {0: "OK", 1: "WARN", 2: "ERROR", 3: "STALE"}


def level_of(status: DiagnosticStatus) -> int:
    """``level`` as an int (the message field is a ``byte``: ``bytes`` in rclpy)."""
    lv = status.level
    return lv if isinstance(lv, int) else int.from_bytes(lv, "little")


def format_array(arr: DiagnosticArray) -> str:
    """Human-readable text of a DiagnosticArray (what the diagnostics tool and demo print)."""
    lines = []
    for st in arr.status:
        level = level_of(st)
        lines.append(f"[{LEVEL_NAMES.get(level, level)}] {st.name} (hardware_id={st.hardware_id}): "
                     f"{st.message}")
        width = max((len(kv.key) for kv in st.values), default=0)
        for kv in st.values:
            lines.append(f"    {kv.key:<{width}}  {kv.value}")
    return "\n".join(lines)
