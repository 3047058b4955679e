"""A short-lived rclpy client (context, node, executor thread) for the small commands."""
from __future__ import annotations

import os
import threading

import rclpy
from rclpy.context import Context
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node


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


def spin_in_background(executor, name: str = "executor") -> threading.Thread:
    """Spin ``executor`` in a started daemon thread that ends quietly when the context goes."""
    def spin() -> None:
        try:
            executor.spin()
        except Exception:  # noqa: BLE001 - context shut down
            pass

    thread = threading.Thread(target=spin, name=name, daemon=True)
    thread.start()
    return thread


class RosClient:
    """``with RosClient('name') as c: ...``: a node spun by a background executor thread."""

    def __init__(self, name: str, args: list[str] | None = None):
        """(Action clients: use :class:`selectinfer_ros.client.LLMClient`, made before its node
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
