"""rclpy action client and server that may be destroyed while an executor spins their node.

rclpy's executor gathers a node's waitables, then enters each one's handle and adds it to the
wait set; an ``ActionClient.destroy()`` or ``ActionServer.destroy()`` that lands in between
leaves a destroyed handle that the executor still adds, and the executor thread dies with
``RCLError: ... action client pointer is invalid`` (a stress loop hit it within 64-70 destroys).
A lifecycle node that removes its action server on deactivate, or a client closed while its
node spins, hits that window. Here ``destroy()`` first marks the entity retired (under a lock the
wait-set calls take), so a retired entity adds nothing, is never ready and yields no data.
"""
from __future__ import annotations

import threading
from typing import Any

from rclpy.action import ActionClient, ActionServer


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
    """``rclpy.action.ActionClient`` whose destroy() may run while its node spins."""


class SafeActionServer(_Retiring, ActionServer):
    """``rclpy.action.ActionServer`` whose destroy() may run while its node spins."""
