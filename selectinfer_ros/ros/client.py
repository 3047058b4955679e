"""A small client for the ``Generate`` action and the profile switch (nav2_simple_commander style).

    from selectinfer_ros.ros.client import LLMClient
    with LLMClient.start() as llm:                       # own context, node and executor thread
        if llm.wait_for_server(10.0):
            print(llm.generate("The capital of France is", max_new_tokens=8).text)
            out = llm.choose("Which room next? The kitchen is dirty.\\nAnswer:", ["kitchen", "hall"])
            print(out.choice, out.choice_index)
            out = llm.generate_json("Next action as JSON:", {"type": "object", ...})
            print(out.value)                             # the parsed object (None unless ok)
            out = llm.chat([{"role": "user", "content": "Go to the kitchen."}], tools=TOOLS)
            print(out.tool_calls[0].name, out.tool_calls[0].value)   # navigate_to {'room': ...}

Errors are data: every call returns an :class:`Outcome` (``ok``, ``status``, ``error_code``,
``error_msg``), never raises for a refused goal, a missing server or a timeout.

Two kinds of calls: ``*_async`` ones and every :class:`GoalHandle` method return at once and may
run inside executor callbacks (behaviour trees tick there); ``generate``, ``choose``,
``switch_profile`` and ``wait_for_server`` block until done and are for scripts, never for a
callback of the executor that spins the client's node. On a node of your own, build the
:class:`LLMClient` before that node spins (rclpy registers an ActionClient with its node before
the client's lock exists).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rclpy.node import Node

from ..core.execution.chat import Chat, ToolCall, chat_of, starts_call
from ..core.serving.server import REFUSED
from .plumbing import BURST_QOS
from .safe_action import SafeActionClient

STATUS_SUCCEEDED = "SUCCEEDED"
STATUS_CANCELED = "CANCELED"
STATUS_ABORTED = "ABORTED"
STATUS_REJECTED = "REJECTED"
STATUS_TIMEOUT = "TIMEOUT"
STATUS_NO_SERVER = "NO_SERVER"
STATUS_FAILED = "FAILED"  # a service call answered success=false
# a json_schema/grammar goal, or a tool call, that succeeded but whose answer was cut off
# (max_new_tokens, the context, a stop string) before it was complete: never reported as a
# success (a text answer of a chat goal with tools is cut off as any text is: SUCCEEDED)
STATUS_CUT_OFF = "CUT_OFF"

FEEDBACK_GRACE_S = 1.0  # how long a result waits for feedback still in flight

GOAL_FIELDS = ("task", "max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
               "seed", "stop", "use_chat_template", "compute_ratio", "choices", "length_normalize",
               "json_schema", "grammar", "messages", "tools", "tool_choice")


@dataclass
class Outcome:
    """How a request ended. ``result`` is the Generate.Result (or service response) when one came."""

    status: str
    text: str = ""
    error_code: int = 0
    error_msg: str = ""
    choice_index: int = -1
    result: Any = None
    parsed: bool = False  # a json_schema/grammar goal: the text is complete under it
    value: Any = None  # a json_schema goal that succeeded: the parsed JSON value
    tool_calls: list[ToolCall] = field(default_factory=list)  # a chat goal's calls (.value: args)

    @property
    def message(self) -> dict:
        """The answer as the assistant message that continues its conversation (OpenAI's
        format: ``content`` and ``tool_calls``)."""
        if self.tool_calls:
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]}
        return {"role": "assistant", "content": self.text}

    @property
    def ok(self) -> bool:
        return self.status == STATUS_SUCCEEDED

    @property
    def choice(self) -> str | None:
        """The chosen option (a choices goal that succeeded), else None."""
        return self.text if self.ok and self.choice_index >= 0 else None


def _now() -> float:
    return time.monotonic()


@dataclass
class _Deadlines:
    server: float  # the goal response must come by then
    result: float  # and the result by then (reset when the goal is accepted)


class _Stream:
    """The streamed text, and the result held until that text has caught up with it.

    Feedback and the result travel on separate channels, so the result can overtake the last
    feedback messages; holding it (at most ``FEEDBACK_GRACE_S``, in case feedback was dropped)
    makes the deltas a client saw add up to the result's text. The action client keeps calling
    back with the goal's feedback past its result (rclpy's would stop, see ``safe_action``).
    """

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.chars = 0
        self.held: Outcome | None = None
        self.until = 0.0

    def add(self, delta: str) -> None:
        self.pieces.append(delta)
        self.chars += len(delta)

    def hold(self, outcome: Outcome) -> None:
        self.held, self.until = outcome, _now() + FEEDBACK_GRACE_S

    def release(self) -> Outcome | None:
        """The held result once its text has streamed (a choice streams none), else None."""
        o = self.held
        if o is None or not (o.choice_index >= 0 or self.chars >= len(o.text) or _now() > self.until):
            return None
        self.held = None
        return o


class GoalHandle:
    """One Generate goal as it goes. Every method returns at once.

    ``cancel()`` works in every state: before the goal response arrives the cancel is sent as soon
    as the handle comes; a goal whose response or result misses its timeout is canceled too.
    The outcome comes once the deltas given to ``on_feedback`` add up to its text (see _Stream).
    """

    def __init__(self, client: "LLMClient", goal, server_timeout: float, result_timeout: float,
                 on_feedback: Callable[[Any], None] | None):
        self._client = client
        self._lock = threading.Lock()
        self._on_feedback = on_feedback
        self._deadlines = _Deadlines(_now() + server_timeout, _now() + server_timeout + result_timeout)
        self._server_timeout, self._result_timeout = server_timeout, result_timeout
        self._goal_handle = None
        self._cancel_requested = False
        self._cancel_sent = False
        self._outcome: Outcome | None = None
        self._stream = _Stream()
        self.feedback = None  # the latest Generate.Feedback
        self.accepted: bool | None = None  # None until the goal response comes
        self.goal_id = None
        self._constrained = bool(goal.json_schema or goal.grammar or goal.tools)
        # a chat goal whose text answer (auto, none) may be cut off as any text is
        self._text_allowed = bool(goal.tools) and goal.tool_choice in ("", "auto", "none")
        self._json = bool(goal.json_schema)
        action = client.live_action()
        if not action.server_is_ready():
            self._outcome = Outcome(STATUS_NO_SERVER, error_msg=f"no action server "
                                                                f"{client.action_name}")
            return
        future = action.send_goal_async(goal, feedback_callback=self._feedback)
        future.add_done_callback(self._on_goal_response)

    # ---- callbacks (executor threads) -----------------------------------------------------
    def _feedback(self, msg) -> None:
        fb = msg.feedback
        if self._on_feedback is not None:
            self._on_feedback(fb)  # first: the outcome waits until on_feedback has had the text
        with self._lock:
            self.feedback = fb
            self._stream.add(fb.text_delta)
        self._settle()

    def _on_goal_response(self, future) -> None:
        try:
            gh = future.result()
        except Exception as e:  # noqa: BLE001 - reported as data
            self._set(Outcome(STATUS_ABORTED, error_msg=f"sending the goal failed: {e}"))
            return
        with self._lock:
            self._goal_handle = gh
            self.accepted = bool(gh.accepted)
            self._deadlines.result = _now() + self._result_timeout
            self.goal_id = bytes(gh.goal_id.uuid)
            cancel = self.accepted and self._cancel_requested
        if not gh.accepted:  # a refusal the node answers at once carries its reason (REFUSED)
            self._set(Outcome(STATUS_REJECTED, error_msg=(
                f"goal rejected by {self._client.action_name} without a reason")))
            return
        gh.get_result_async().add_done_callback(self._on_result)
        if cancel:
            self._send_cancel()

    def _on_result(self, future) -> None:
        from action_msgs.msg import GoalStatus
        try:
            response = future.result()
        except Exception as e:  # noqa: BLE001
            self._set(Outcome(STATUS_ABORTED, error_msg=f"no result: {e}"))
            return
        r = response.result
        status = {GoalStatus.STATUS_SUCCEEDED: STATUS_SUCCEEDED,
                  GoalStatus.STATUS_CANCELED: STATUS_CANCELED}.get(response.status, STATUS_ABORTED)
        if status == STATUS_ABORTED and r.finish_reason == REFUSED:  # ended at once: its reason
            status = STATUS_REJECTED
        out = Outcome(status, r.text, int(r.error_code), r.error_msg, int(r.choice_index), r,
                      parsed=bool(r.parsed),
                      tool_calls=[ToolCall(c.name, c.arguments, c.id) for c in r.tool_calls])
        cut_text = self._text_allowed and not starts_call(r.text)
        if status == STATUS_SUCCEEDED and self._constrained and not (cut_text and not r.parsed):
            if not r.parsed:
                out.status = STATUS_CUT_OFF
                out.error_msg = (f"the answer was cut off (finish_reason {r.finish_reason}) before "
                                 f"it was complete")
            elif self._json:
                try:
                    out.value = json.loads(r.text)
                except ValueError as e:  # the grammar guarantees JSON; say so if it did not
                    out.status, out.error_msg = STATUS_ABORTED, f"the answer is not JSON: {e}"
        with self._lock:
            self._stream.hold(out)
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            outcome = self._stream.release()
        if outcome is not None:
            self._set(outcome)

    def _set(self, outcome: Outcome) -> None:
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = outcome
            goal_id = self.goal_id
        action = self._client.action
        if goal_id is not None and action is not None:
            action.forget_feedback(goal_id)  # kept past the result until the text caught up

    def _send_cancel(self) -> None:
        with self._lock:
            if self._cancel_sent or self._goal_handle is None:
                return
            self._cancel_sent = True
            gh = self._goal_handle
        gh.cancel_goal_async()

    # ---- public -------------------------------------------------------------------------
    def _check_deadlines(self) -> None:
        self._settle()
        if self._outcome is not None or self._stream.held is not None:
            return
        now = _now()
        if self.accepted is None and now > self._deadlines.server:
            self._cancel_requested = True  # if the handle still comes, cancel it then
            self._set(Outcome(STATUS_TIMEOUT, error_msg=(
                f"no goal response from {self._client.action_name} within "
                f"{self._server_timeout:g} s")))
        elif self.accepted and now > self._deadlines.result:
            self.cancel()
            self._set(Outcome(STATUS_TIMEOUT, error_msg=f"no result within "
                                                        f"{self._result_timeout:g} s; canceled"))

    def done(self) -> bool:
        """True once the outcome is known (result, rejection or timeout)."""
        self._check_deadlines()
        return self._outcome is not None

    def result(self) -> Outcome | None:
        """The outcome, or None while the goal runs."""
        self._check_deadlines()
        return self._outcome

    @property
    def text(self) -> str:
        """The text streamed so far."""
        with self._lock:
            return "".join(self._stream.pieces)

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def cancel(self) -> None:
        """Ask the server to cancel (now, or as soon as the goal response comes)."""
        with self._lock:
            self._cancel_requested = True
            ready = self._goal_handle is not None and self.accepted
        if ready and self._outcome is None:
            self._send_cancel()

    def wait(self, timeout: float | None = None) -> Outcome:
        """Block until the outcome (scripts only: never inside an executor callback)."""
        end = None if timeout is None else _now() + timeout
        while not self.done():
            if end is not None and _now() > end:
                self.cancel()
                return Outcome(STATUS_TIMEOUT, self.text, error_msg=f"no result within {timeout:g} s")
            time.sleep(0.01)
        return self._outcome


@dataclass
class _Owned:
    context: Any
    executor: Any
    thread: threading.Thread


class LLMClient:
    """Generate / choose / switch_profile against one selectinfer namespace (``llm``)."""

    def __init__(self, node: Node, namespace: str = "llm", *, callback_group=None,
                 server_timeout: float = 5.0, result_timeout: float = 600.0):
        from selectinfer_msgs.action import Generate
        from selectinfer_msgs.srv import SwitchProfile

        from .plumbing import ns_name
        self.node = node
        self.namespace = namespace
        self.server_timeout, self.result_timeout = server_timeout, result_timeout
        self.action_name = ns_name(namespace, "generate")
        self.action: SafeActionClient | None = SafeActionClient(
            node, Generate, self.action_name, callback_group=callback_group)
        self.switch_name = ns_name(namespace, "switch_profile")
        self.switch_client = node.create_client(SwitchProfile, self.switch_name,
                                                qos_profile=BURST_QOS,  # see safe_action
                                                callback_group=callback_group)
        self._owned: _Owned | None = None

    @classmethod
    def start(cls, name: str = "selectinfer_client", namespace: str = "llm",
              args: list[str] | None = None, **kwargs) -> "LLMClient":
        """A client with its own context, node and executor thread (close() ends them)."""
        import os

        from rclpy.executors import MultiThreadedExecutor

        from .plumbing import init_context, spin_in_background
        context = init_context(args)
        node = Node(f"{name}_{os.getpid()}", context=context)
        client = cls(node, namespace, **kwargs)
        executor = MultiThreadedExecutor(num_threads=2, context=context)
        executor.add_node(node)

        # A library never ends its user's process: a dead executor shows as NO_SERVER/TIMEOUT.
        thread = spin_in_background(executor, f"{name}-spin", exit_on_failure=False)
        client._owned = _Owned(context, executor, thread)
        return client

    # ---- goals --------------------------------------------------------------------------
    def goal(self, prompt: str, **options):
        """A Generate.Goal; ``options`` are its fields (TypeError for an unknown one)."""
        from selectinfer_msgs.action import Generate
        unknown = set(options) - set(GOAL_FIELDS)
        if unknown:
            raise TypeError(f"unknown Generate goal field(s) {sorted(unknown)}; known: {GOAL_FIELDS}")
        goal = Generate.Goal(prompt=prompt)
        for k, v in options.items():
            if k == "json_schema" and not isinstance(v, str):
                v = json.dumps(v)  # a schema given as a dict
            setattr(goal, k, list(v) if k in ("stop", "choices", "messages", "tools") else v)
        return goal

    def generate_async(self, prompt: str, *, on_feedback: Callable[[Any], None] | None = None,
                       server_timeout: float | None = None, timeout: float | None = None,
                       **options) -> GoalHandle:
        """Send a goal; returns its :class:`GoalHandle` at once. ``server_timeout``: seconds for
        the goal response; ``timeout``: seconds for the result after that."""
        return GoalHandle(self, self.goal(prompt, **options),
                          self.server_timeout if server_timeout is None else server_timeout,
                          self.result_timeout if timeout is None else timeout, on_feedback)

    def choose_async(self, prompt: str, choices: list[str], **options) -> GoalHandle:
        """A choices goal: the outcome's ``text`` is the chosen option, ``choice_index`` its index."""
        return self.generate_async(prompt, choices=list(choices), **options)

    def chat_async(self, messages: list, *, tools: list | None = None, tool_choice: str = "",
                   **options) -> GoalHandle:
        """A chat goal: ``messages`` (dicts in OpenAI's format or ChatMessage messages) rendered
        with the model's chat template; ``tools`` (dicts: name, description, parameters as a
        JSON schema; or ChatTool messages) the model may call; ``tool_choice`` auto, none,
        required or a tool's name. The outcome's ``tool_calls`` are the calls (``.name``,
        ``.value``: the parsed arguments) or its ``text`` the answer; ``message`` continues the
        conversation. CUT_OFF when a call was cut off before it was complete (a text answer cut
        off succeeds, as a generate goal's does)."""
        chat = chat_of(messages, tools or (), tool_choice)
        return self.generate_async("", **self._chat_fields(chat), **options)

    @staticmethod
    def _chat_fields(chat: Chat) -> dict:
        from selectinfer_msgs.msg import ChatMessage, ChatTool
        from selectinfer_msgs.msg import ToolCall as ToolCallMsg
        return dict(messages=[ChatMessage(role=m.role, content=m.content, tool_call_id=m.tool_call_id,
                                          tool_calls=[ToolCallMsg(id=c.id, name=c.name,
                                                                  arguments=c.arguments)
                                                      for c in m.tool_calls])
                              for m in chat.messages],
                    tools=[ChatTool(name=t.name, description=t.description,
                                    parameters=t.parameters) for t in chat.tools],
                    tool_choice=chat.tool_choice)

    def chat(self, messages: list, *, tools: list | None = None, tool_choice: str = "",
             **options) -> Outcome:
        """:meth:`chat_async` and wait for the outcome (scripts only)."""
        self.wait_for_server(options.get("server_timeout", self.server_timeout))
        return self.chat_async(messages, tools=tools, tool_choice=tool_choice, **options).wait()

    def generate_json_async(self, prompt: str, schema: dict | str, **options) -> GoalHandle:
        """A json_schema goal: the outcome's ``value`` is the parsed JSON (status SUCCEEDED
        only when the answer is complete; CUT_OFF when it was cut off)."""
        return self.generate_async(prompt, json_schema=schema, **options)

    def generate(self, prompt: str, **options) -> Outcome:
        """Generate and wait for the outcome (scripts only; waits ``server_timeout`` for the
        server first)."""
        self.wait_for_server(options.get("server_timeout", self.server_timeout))
        return self.generate_async(prompt, **options).wait()

    def generate_json(self, prompt: str, schema: dict | str, **options) -> Outcome:
        """Answer with JSON valid under ``schema`` (a dict or its JSON text) and wait (scripts
        only); ``outcome.value`` is the parsed object when ``outcome.ok``."""
        return self.generate(prompt, json_schema=schema, **options)

    def choose(self, prompt: str, choices: list[str], **options) -> Outcome:
        """Pick one of ``choices`` and wait for the outcome (scripts only)."""
        return self.generate(prompt, choices=list(choices), **options)

    # ---- profile switch -----------------------------------------------------------------
    def switch_profile_async(self, task: str) -> "ServiceCall":
        """Ask the profile manager to switch task; returns a :class:`ServiceCall` at once."""
        from selectinfer_msgs.srv import SwitchProfile
        if not self.switch_client.service_is_ready():
            return ServiceCall(None, Outcome(STATUS_NO_SERVER,
                                             error_msg=f"no service {self.switch_name} (is the "
                                                       f"profile manager active?)"))
        return ServiceCall(self.switch_client.call_async(SwitchProfile.Request(task=task)))

    def switch_profile(self, task: str, timeout: float = 300.0) -> Outcome:
        """Switch the active task profile and wait (scripts only). ``text`` is the active task."""
        if not self.switch_client.wait_for_service(timeout_sec=min(timeout, self.server_timeout)):
            return Outcome(STATUS_NO_SERVER, error_msg=f"no service {self.switch_name}")
        return self.switch_profile_async(task).wait(timeout)

    # ---- servers --------------------------------------------------------------------------
    def server_ready(self) -> bool:
        """Whether the Generate action server is discovered (returns at once)."""
        return self.live_action().server_is_ready()

    def wait_for_server(self, timeout: float = 10.0) -> bool:
        """Block until the Generate action server is discovered; False after ``timeout``."""
        return self.live_action().wait_for_server(timeout_sec=timeout)

    def live_action(self) -> SafeActionClient:
        """The Generate action client; RuntimeError once close() has run."""
        if self.action is None:
            raise RuntimeError(f"LLMClient for {self.action_name} is closed")
        return self.action

    def close(self) -> None:
        """Destroy the clients (and the node, executor and context that start() made); safe
        while an executor still spins the node (see :mod:`selectinfer_ros.ros.safe_action`)."""
        action, self.action = self.action, None
        if action is None:
            return
        owned, self._owned = self._owned, None
        if owned is not None:
            owned.executor.shutdown(timeout_sec=3.0)
            owned.thread.join(3.0)
        action.destroy()
        self.node.destroy_client(self.switch_client)
        if owned is not None:
            import rclpy
            self.node.destroy_node()
            if owned.context.ok():
                rclpy.shutdown(context=owned.context)

    def __enter__(self) -> "LLMClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ServiceCall:
    """A SwitchProfile call in flight (or already failed). Every method but wait() returns at once."""

    future: Any
    _outcome: Outcome | None = None
    _t0: float = field(default_factory=_now)

    def done(self) -> bool:
        return self._outcome is not None or self.future.done()

    def result(self) -> Outcome | None:
        """The outcome; None while the call runs. ``text`` is the active task."""
        if self._outcome is None and self.future is not None and self.future.done():
            try:
                r = self.future.result()
            except Exception as e:  # noqa: BLE001 - reported as data
                self._outcome = Outcome(STATUS_ABORTED, error_msg=f"service call failed: {e}")
            else:
                self._outcome = Outcome(STATUS_SUCCEEDED if r.success else STATUS_FAILED,
                                        r.active_task, error_msg="" if r.success else r.message,
                                        result=r)
        return self._outcome

    def wait(self, timeout: float) -> Outcome:
        """Block until answered (scripts only); TIMEOUT outcome after ``timeout`` seconds."""
        end = _now() + timeout
        while self.result() is None:
            if _now() > end:
                return Outcome(STATUS_TIMEOUT, error_msg=f"no answer within {timeout:g} s")
            time.sleep(0.01)
        return self._outcome


def wait_future(future, timeout: float):
    """The rclpy future's result, or TimeoutError after ``timeout`` seconds (scripts only)."""
    end = _now() + timeout
    while not future.done():
        if _now() > end:
            raise TimeoutError(f"no answer within {timeout:g} s")
        time.sleep(0.01)
    return future.result()
