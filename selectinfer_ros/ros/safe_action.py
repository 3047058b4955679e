"""rclpy action client and server for the package's nodes and client, with three rclpy gaps closed.

**Destroy while spinning.**
rclpy's executor gathers a node's waitables, then enters each one's handle and adds it to the
wait set; an ``ActionClient.destroy()`` or ``ActionServer.destroy()`` that lands in between
leaves a destroyed handle that the executor still adds, and the executor thread dies with
``RCLError: ... action client pointer is invalid`` (a stress loop hit it within 64-70 destroys).
A lifecycle node that removes its action server on deactivate, or a client closed while its
node spins, hits that window. Here ``destroy()`` first marks the entity retired (under a lock the
wait-set calls take), so a retired entity adds nothing, is never ready and yields no data.

**Feedback the result overtook.** Feedback (a topic) and the result (a service response) travel
on separate channels, so the result can arrive before the goal's last feedback messages; rclpy's
ActionClient drops the goal's feedback callback as soon as the result arrives, and those last
messages are lost (a CI run saw the last three text deltas of a canceled goal go missing).
:class:`SafeActionClient` keeps the callback until :meth:`~SafeActionClient.forget_feedback`.

**Service queue depth.** Goal, cancel and result requests and responses are kept
``SERVICE_DEPTH`` deep on both sides instead of 10: with Fast DDS every client of a service reads
every caller's response, so a burst of more than 10 answers (100 goals sent at once) could push
a client's own answer out before it was taken, and the server could drop requests its executor
had not taken yet.

**Feedback queue depth.** Feedback is queued ``FEEDBACK_DEPTH`` deep on both sides instead of
rclpy's 10, so a client whose executor stalls for a moment loses no text deltas (one per token).
"""
from __future__ import annotations

import threading
from typing import Any

from rclpy.action import ActionClient, ActionServer
from rclpy.qos import QoSProfile

from .plumbing import BURST_QOS

FEEDBACK_DEPTH = 100  # feedback messages queued per writer/reader (rclpy's default: 10)


class _Retiring:
    """Mixin for an rclpy action waitable: destroy() is safe under a spinning executor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._retire_lock = threading.Lock()
        self._retired = False
        super().__init__(*args, **kwargs)

    def add_to_wait_set(self, wait_set) -> None:
        with self._retire_lock:
            if not self._retired:
                super().add_to_wait_set(wait_set)

    def is_ready(self, wait_set) -> bool:
        with self._retire_lock:
            return not self._retired and super().is_ready(wait_set)

    def take_data(self):
        with self._retire_lock:
            return {} if self._retired else super().take_data()

    def destroy(self) -> None:
        with self._retire_lock:
            if self._retired:
                return
            self._retired = True
        super().destroy()


class SafeActionClient(_Retiring, ActionClient):
    """``rclpy.action.ActionClient`` whose destroy() may run while its node spins, and whose
    feedback callbacks outlive the result until :meth:`forget_feedback`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("feedback_sub_qos_profile", QoSProfile(depth=FEEDBACK_DEPTH))
        for name in ("goal_service_qos_profile", "result_service_qos_profile",
                     "cancel_service_qos_profile"):
            kwargs.setdefault(name, BURST_QOS)
        super().__init__(*args, **kwargs)

    def _remove_pending_result_request(self, future) -> None:
        # rclpy's (Humble to Kilted), less dropping the goal's feedback callback.
        seq = self._remove_pending_request(future, self._pending_result_requests)
        self._result_sequence_number_to_goal_id.pop(seq, None)

    def forget_feedback(self, goal_id: bytes) -> None:
        """Stop calling the feedback callback of goal ``goal_id`` (its UUID bytes)."""
        self._feedback_callbacks.pop(goal_id, None)


class SafeActionServer(_Retiring, ActionServer):
    """``rclpy.action.ActionServer`` whose destroy() may run while its node spins."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("feedback_pub_qos_profile", QoSProfile(depth=FEEDBACK_DEPTH))
        for name in ("goal_service_qos_profile", "result_service_qos_profile",
                     "cancel_service_qos_profile"):
            kwargs.setdefault(name, BURST_QOS)
        super().__init__(*args, **kwargs)
