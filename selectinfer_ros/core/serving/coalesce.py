"""Requests that replace each other: the last requested one wins.

ROS-free. The profile manager runs task switches through :class:`LatestWins`: one switch runs at
a time; a switch that waits is replaced by a newer one, whose caller is answered at once with
:class:`~selectinfer_ros.core.serving.server.Superseded` (naming the task that will be loaded).
So a storm of switches holds at most two callers (the running one and the newest), and every
other caller hears back immediately instead of waiting for its turn.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .server import Superseded, short


class _Ticket:
    def __init__(self, request: str):
        self.request = request
        self.superseded_by: str | None = None


class LatestWins:
    """Runs ``fn(request)`` for one request at a time; a waiting request is superseded by a
    newer one (see the module docstring)."""

    def __init__(self, describe: Callable[[str], str] = lambda r: repr(short(r))):
        self.describe = describe
        self._cond = threading.Condition()
        self._running = False
        self._waiting: _Ticket | None = None

    def run(self, request: str, fn: Callable[[str], Any], timeout: float) -> Any:
        """``fn(request)`` once no other request runs; Superseded when a newer request came while
        this one waited; TimeoutError after ``timeout`` seconds of waiting (nothing ran)."""
        ticket = _Ticket(request)
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._waiting is not None:
                self._waiting.superseded_by = request
                self._cond.notify_all()
            self._waiting = ticket
            while self._running and ticket.superseded_by is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._waiting is ticket:
                self._waiting = None
            if ticket.superseded_by is not None:
                raise Superseded(f"superseded by a later switch to "
                                 f"{self.describe(ticket.superseded_by)} (the last requested task "
                                 f"wins); {self.describe(request)} was not loaded")
            if self._running:
                raise TimeoutError(f"waited {timeout:g} s for the switch ahead of it; "
                                   f"{self.describe(request)} was not loaded")
            self._running = True
        try:
            return fn(request)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running or self._waiting is not None
