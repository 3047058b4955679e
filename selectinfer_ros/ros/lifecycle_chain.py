"""The bring-up of ``selectinfer_node`` and ``profile_manager``, written once.

``BRINGUP`` is the ordered chain of lifecycle transitions: selectinfer_node configure (loads the
model) -> activate (the generate action server appears) -> profile_manager configure -> activate
(applies the initial task). Its users:

* ``launch/jetson.launch.py`` turns :func:`handoffs` into OnStateTransition handlers (each step's
  success emits the next ChangeState event) and :func:`failures` into handlers that end the
  launch with the node and the reason;
* ``selectinfer_ros.ros.bringup`` (and the demo) and the test fixtures drive it with
  :func:`run_chain` through the nodes' ``change_state`` / ``get_state`` services.

Importing this module needs only ``lifecycle_msgs`` (the launch file imports it); the runner
imports rclpy when called.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

INFERENCE, MANAGER = "selectinfer_node", "profile_manager"
LOAD_TIMEOUT = 1800.0  # seconds for selectinfer_node's configure (a first run converts the model)
SERVICE_WAIT = 30.0  # seconds a node's lifecycle services may take to appear

# transition -> (transition state while it runs, state on success, state on failure)
TRANSITIONS = {
    "configure": ("configuring", "inactive", "unconfigured"),
    "activate": ("activating", "active", "inactive"),
}


@dataclass(frozen=True)
class Step:
    """One lifecycle transition of one node of the chain."""

    node: str  # node name, inside the namespace
    transition: str  # a key of TRANSITIONS
    timeout: float  # seconds to wait for the node's answer
    done: str  # what the node does once the step succeeded (logged)

    @property
    def transition_id(self) -> int:
        from lifecycle_msgs.msg import Transition
        return getattr(Transition, f"TRANSITION_{self.transition.upper()}")

    @property
    def start_state(self) -> str:
        return TRANSITIONS[self.transition][0]

    @property
    def goal_state(self) -> str:
        return TRANSITIONS[self.transition][1]

    @property
    def failed_state(self) -> str:
        return TRANSITIONS[self.transition][2]


BRINGUP: tuple[Step, ...] = (
    Step(INFERENCE, "configure", LOAD_TIMEOUT, "model loaded"),
    Step(INFERENCE, "activate", 60.0, "serving the generate action"),
    Step(MANAGER, "configure", 600.0, "profiles read"),
    Step(MANAGER, "activate", 600.0, "initial task applied"),
)
NODES = tuple(dict.fromkeys(step.node for step in BRINGUP))  # in bring-up order


def handoffs(steps: Iterable[Step] = BRINGUP) -> list[tuple[Step, Step | None]]:
    """(step, next step or None for the last): when ``step`` has succeeded, ``next`` starts."""
    steps = list(steps)
    return list(zip(steps, steps[1:] + [None]))


def failures(steps: Iterable[Step] = BRINGUP) -> list[tuple[Step, str]]:
    """(step, message) for each step: ``step``'s node left ``start_state`` for ``failed_state``."""
    return [(s, f"{s.node} failed to {s.transition} during bring-up") for s in steps]


def step_message(step: Step, following: Step | None) -> str:
    """What the launch logs when ``step`` succeeded."""
    then = f"; {following.node}: {following.transition}" if following else "; bring-up done"
    return f"{step.node}: {step.done}{then}"


# ---- the runner over lifecycle services -------------------------------------------------------

class Interrupted(RuntimeError):
    """Ctrl-C (or SIGTERM) came while waiting for a transition."""


class StepFailed(RuntimeError):
    """A step of the chain refused, timed out, or its node did not answer; names the node, the
    transition and the reason."""

    def __init__(self, step: Step, reason: str, state: str = ""):
        self.step, self.reason, self.state = step, reason, state
        where = f" (now {state})" if state else ""
        super().__init__(f"{step.node} failed to {step.transition}{where}: {reason}")


def _call(node, srv_type, name: str, request, timeout: float,
          interrupt: threading.Event | None):
    """Call service ``name`` from ``node`` (spun by some executor) and wait for the answer;
    TimeoutError / Interrupted / RuntimeError (service absent)."""
    client = node.create_client(srv_type, name)
    try:
        if not client.wait_for_service(timeout_sec=min(SERVICE_WAIT, timeout)):
            raise RuntimeError(f"service {name} not available")
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _f: done.set())
        deadline = time.monotonic() + timeout
        while not (future.done() or done.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                remove = getattr(client, "remove_pending_request", None)
                if remove is not None:
                    remove(future)
                raise TimeoutError(f"{name}: no answer within {timeout:g} s")
            if interrupt is not None and interrupt.is_set():
                raise Interrupted(f"interrupted while waiting for {name}")
            done.wait(min(left, 0.05) if interrupt is not None else left)
        result = future.result()
        if result is None:
            raise RuntimeError(f"{name}: the call failed")
        return result
    finally:
        node.destroy_client(client)


def change_state(node, namespace: str, target: str, transition_id: int, timeout: float,
                 interrupt: threading.Event | None = None) -> bool:
    """Ask lifecycle node ``target`` for a transition through its change_state service (what
    launch's ChangeState event does); its success flag."""
    from lifecycle_msgs.srv import ChangeState

    from .plumbing import ns_name
    req = ChangeState.Request()
    req.transition.id = transition_id
    name = ns_name(namespace, f"{target}/change_state")
    return bool(_call(node, ChangeState, name, req, timeout, interrupt).success)


def get_state(node, namespace: str, target: str, timeout: float = 10.0) -> str:
    """The label of lifecycle node ``target``'s current state (``unconfigured``, ``active``...)."""
    from lifecycle_msgs.srv import GetState

    from .plumbing import ns_name
    name = ns_name(namespace, f"{target}/get_state")
    return _call(node, GetState, name, GetState.Request(), timeout, None).current_state.label


def run_chain(node, namespace: str, steps: Iterable[Step] = BRINGUP, *,
              timeouts: Mapping[tuple[str, str], float] | None = None,
              interrupt: threading.Event | None = None,
              explain: Callable[[str], str] | None = None,
              log: Callable[[str], None] | None = None) -> None:
    """Run ``steps`` in order from ``node`` (a node spun by an executor, in the nodes' graph).

    ``timeouts`` overrides a step's timeout by (node, transition); ``explain(node_name)`` gives
    the reason a node refused (its log has it otherwise); ``interrupt`` set: stop waiting
    (:class:`Interrupted`). A step that fails raises :class:`StepFailed` with the node, the
    transition, the state the node is in, and the reason."""
    for step in steps:
        timeout = (timeouts or {}).get((step.node, step.transition), step.timeout)
        try:
            ok = change_state(node, namespace, step.node, step.transition_id, timeout, interrupt)
        except (TimeoutError, RuntimeError) as e:
            if isinstance(e, Interrupted):
                raise
            raise StepFailed(step, str(e)) from None
        if not ok:
            try:
                state = get_state(node, namespace, step.node)
            except (TimeoutError, RuntimeError):
                state = ""
            reason = (explain(step.node) if explain else "") or "see its log"
            raise StepFailed(step, reason, state)
        if log is not None:
            log(f"{step.node}: {step.done}")
