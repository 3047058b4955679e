"""py_trees behaviours that call the LLM: :class:`Generate`, :class:`Choose`, :class:`GenerateJSON`,
:class:`Chat` (a conversation kept on the blackboard), :class:`CallTool` (a tool call a tree
dispatches), :class:`SwitchProfile`.

As in py_trees_ros, ``__init__`` takes configuration only and rclpy comes in late: ``tree.setup(
node=node)`` (before that node spins: rclpy registers an ActionClient with its node before the
client's lock exists) makes or reuses one :class:`~selectinfer_ros.ros.client.LLMClient` per node and
namespace (or pass your own as ``tree.setup(node=node, selectinfer_client=client)``) and waits
``wait_for_server_timeout`` seconds for the servers. Ticks never block: ``initialise`` sends the
goal, ``update`` returns RUNNING until the outcome, then SUCCESS or FAILURE (the error as
``feedback_message`` and on the ``error_key`` blackboard key). A behaviour interrupted (``terminate
(INVALID)``, e.g. a higher-priority branch took over) or shut down (``tree.shutdown()``) cancels its
goal, also when the goal response has not come yet: the cancel goes out as soon as it comes.

Timeouts, as BehaviorTree.ROS2's: ``server_timeout`` for the goal response (a goal the server
never answers fails), ``result_timeout`` for the result (the goal is then canceled and fails).
"""
from __future__ import annotations

import string
import weakref
from typing import Any

import py_trees
from py_trees.common import Access, Status

from .client import STATUS_SUCCEEDED, GoalHandle, LLMClient, Outcome, ServiceCall

_clients: "weakref.WeakKeyDictionary[Any, dict[str, LLMClient]]" = weakref.WeakKeyDictionary()


def shared_client(node, namespace: str = "llm") -> LLMClient:
    """One LLMClient per (node, namespace), made on first use (before the node spins)."""
    per_node = _clients.setdefault(node, {})
    if namespace not in per_node:
        per_node[namespace] = LLMClient(node, namespace)
    return per_node[namespace]


def close_shared_clients(node) -> None:
    """Destroy the clients :func:`shared_client` made on ``node`` (before destroying the node)."""
    for client in _clients.pop(node, {}).values():
        client.close()


def _key(key: str) -> str:
    return key if key.startswith("/") else "/" + key


class _LLMBehaviour(py_trees.behaviour.Behaviour):
    """Shared plumbing: late rclpy, blackboard keys, the goal in flight."""

    def __init__(self, name: str, namespace: str, wait_for_server_timeout: float,
                 server_timeout: float, result_timeout: float):
        super().__init__(name)
        self.namespace = namespace
        self.wait_for_server_timeout = wait_for_server_timeout
        self.server_timeout, self.result_timeout = server_timeout, result_timeout
        self.client: LLMClient | None = None
        self.blackboard = self.attach_blackboard_client(name=name)

    def _register(self, key: str | None, access: Access) -> str | None:
        if key is None:
            return None
        key = _key(key)
        self.blackboard.register_key(key=key, access=access)
        return key

    def setup(self, **kwargs: Any) -> None:
        """Attach rclpy: ``node`` (required unless ``selectinfer_client`` is given)."""
        client = kwargs.get("selectinfer_client")
        if client is None:
            node = kwargs.get("node")
            if node is None:
                raise KeyError(f"{self.name}: setup() needs node=<rclpy Node> (or "
                               f"selectinfer_client=<LLMClient>)")
            client = shared_client(node, self.namespace)
        self.client = client
        self._wait_for_server()

    def _wait_for_server(self) -> None:
        if not self.client.wait_for_server(self.wait_for_server_timeout):
            raise TimeoutError(f"{self.name}: no action server {self.client.action_name} within "
                               f"{self.wait_for_server_timeout:g} s")


class Generate(_LLMBehaviour):
    """Generate text for a prompt; writes the text (and error) to the blackboard.

    ``prompt`` is a format string whose ``{fields}`` are blackboard keys (``"Scene: {scene}"``
    reads ``/scene``); ``prompt_key`` reads the whole prompt from one key instead. Goal fields
    (``task``, ``max_new_tokens``, ``stop``, ...) go in ``goal_options``.
    """

    def __init__(self, name: str, prompt: str = "", *, prompt_key: str | None = None,
                 text_key: str = "/llm/text", error_key: str = "/llm/error",
                 namespace: str = "llm", wait_for_server_timeout: float = 10.0,
                 server_timeout: float = 5.0, result_timeout: float = 120.0, **goal_options: Any):
        super().__init__(name, namespace, wait_for_server_timeout, server_timeout, result_timeout)
        if not prompt and prompt_key is None:
            raise ValueError(f"{name}: give a prompt (format string) or a prompt_key")
        self.prompt = prompt
        self.goal_options = goal_options
        self.prompt_key = self._register(prompt_key, Access.READ)
        self.fields = sorted({f for _, f, _, _ in string.Formatter().parse(prompt) if f})
        for f in self.fields:
            self._register(f, Access.READ)
        self.text_key = self._register(text_key, Access.WRITE)
        self.error_key = self._register(error_key, Access.WRITE)
        self.handle: GoalHandle | None = None
        self.outcome: Outcome | None = None

    def render_prompt(self) -> str:
        """The prompt filled from the blackboard (KeyError when a key is not set)."""
        if self.prompt_key is not None:
            return str(self.blackboard.get(self.prompt_key))
        return self.prompt.format_map({f: self.blackboard.get(_key(f)) for f in self.fields})

    def _send(self, prompt: str) -> GoalHandle:
        return self.client.generate_async(prompt, server_timeout=self.server_timeout,
                                          timeout=self.result_timeout, **self.goal_options)

    def initialise(self) -> None:
        self.outcome = None
        self.handle = None
        try:
            self.handle = self._send(self.render_prompt())
        except KeyError as e:
            self.outcome = Outcome("ERROR", error_msg=f"blackboard key not set: {e}")
            return
        except ValueError as e:
            self.outcome = Outcome("ERROR", error_msg=str(e))
            return
        self.feedback_message = "goal sent"

    def update(self) -> Status:
        if self.outcome is None:
            if self.handle is None or not self.handle.done():
                fb = self.handle.feedback if self.handle is not None else None
                self.feedback_message = (
                    f"running: {fb.generated_tokens} tokens" if fb is not None else
                    "waiting for the goal response" if self.handle.accepted is None else
                    "accepted, waiting for the answer")
                return Status.RUNNING
            self.outcome = self.handle.result()
        return self._finish(self.outcome)

    def _finish(self, out: Outcome) -> Status:
        if out.status != STATUS_SUCCEEDED:
            msg = f"{out.status}: {out.error_msg}" if out.error_msg else out.status
            if out.error_code:
                msg = f"{out.status} ({out.error_code}): {out.error_msg}"
            self.blackboard.set(self.error_key, msg, overwrite=True)
            self.feedback_message = msg
            return Status.FAILURE
        self.blackboard.set(self.error_key, "", overwrite=True)
        self._write(out)
        return Status.SUCCESS

    def _write(self, out: Outcome) -> None:
        self.blackboard.set(self.text_key, out.text, overwrite=True)
        self.feedback_message = f"{len(out.text)} characters"

    def terminate(self, new_status: Status) -> None:
        """Interrupted while its goal runs: cancel it (now or when the goal response comes)."""
        if new_status == Status.INVALID and self.handle is not None and self.outcome is None:
            self.handle.cancel()
            self.feedback_message = "canceled (interrupted)"

    def shutdown(self) -> None:
        """tree.shutdown(): never leave a generation running."""
        if self.handle is not None and self.outcome is None:
            self.handle.cancel()


class Choose(Generate):
    """Pick one of ``choices`` (or the list on ``choices_key``); writes the option and its index.

    ``outcomes`` maps options to SUCCESS or FAILURE (options not in it give SUCCESS), so a tree
    can branch on the answer: ``Choose(..., outcomes={"no": Status.FAILURE})``.
    """

    def __init__(self, name: str, prompt: str = "", choices: list[str] | None = None, *,
                 choices_key: str | None = None, choice_key: str = "/llm/choice",
                 index_key: str = "/llm/choice_index", outcomes: dict[str, Status] | None = None,
                 text_key: str | None = None, **kwargs: Any):
        if not choices and choices_key is None:
            raise ValueError(f"{name}: give choices or a choices_key")
        super().__init__(name, prompt, text_key=text_key or choice_key, **kwargs)
        self.choices = list(choices or [])
        self.choices_key = self._register(choices_key, Access.READ)
        self.index_key = self._register(index_key, Access.WRITE)
        self.outcomes = dict(outcomes or {})

    def _send(self, prompt: str) -> GoalHandle:
        choices = (list(self.blackboard.get(self.choices_key)) if self.choices_key is not None
                   else self.choices)
        if not choices:
            raise ValueError(f"no choices on {self.choices_key}")
        return self.client.choose_async(prompt, choices, server_timeout=self.server_timeout,
                                        timeout=self.result_timeout, **self.goal_options)

    def _finish(self, out: Outcome) -> Status:
        status = super()._finish(out)
        if status == Status.SUCCESS:
            return self.outcomes.get(out.text, Status.SUCCESS)
        self.blackboard.set(self.index_key, -1, overwrite=True)
        return status

    def _write(self, out: Outcome) -> None:
        self.blackboard.set(self.text_key, out.text, overwrite=True)
        self.blackboard.set(self.index_key, out.choice_index, overwrite=True)
        self.feedback_message = f"chose {out.text!r} ({out.choice_index})"


class GenerateJSON(Generate):
    """Answer with JSON valid under ``schema`` (a dict or its JSON text); writes the parsed object
    to ``value_key`` (and the text to ``text_key``). FAILURE when the goal fails, is rejected (an
    invalid schema: the reason on ``error_key``) or its answer was cut off before the JSON was
    complete (CUT_OFF); ``value_key`` is then set to None.

    ``GenerateJSON("decide", "Scene: {scene}\\nNext action as JSON:", schema=ACTION_SCHEMA,
    value_key="/action")`` writes e.g. ``{"action": "goto", "target": "kitchen", "speed": 0.5}``.
    """

    def __init__(self, name: str, prompt: str = "", *, schema: dict | str,
                 value_key: str = "/llm/value", text_key: str = "/llm/text", **kwargs: Any):
        if not schema:
            raise ValueError(f"{name}: give a JSON schema")
        super().__init__(name, prompt, text_key=text_key, **kwargs)
        self.schema = schema
        self.value_key = self._register(value_key, Access.WRITE)

    def _send(self, prompt: str) -> GoalHandle:
        return self.client.generate_json_async(prompt, self.schema,
                                               server_timeout=self.server_timeout,
                                               timeout=self.result_timeout, **self.goal_options)

    def _finish(self, out: Outcome) -> Status:
        status = super()._finish(out)
        if status != Status.SUCCESS:
            self.blackboard.set(self.value_key, None, overwrite=True)
        return status

    def _write(self, out: Outcome) -> None:
        self.blackboard.set(self.text_key, out.text, overwrite=True)
        self.blackboard.set(self.value_key, out.value, overwrite=True)
        self.feedback_message = f"parsed {type(out.value).__name__} ({len(out.text)} characters)"


class Chat(Generate):
    """One turn of a conversation kept on the blackboard (``conversation_key``: a list of
    messages in OpenAI's format, started with ``system`` when empty). ``prompt`` (a format string
    of blackboard keys; empty: no new user message, e.g. after a tool result was appended) is
    added as the user's message; the answer is appended as the assistant's (text, or the tool
    calls) and written to ``reply_key`` (the text) and ``tool_calls_key`` (a list of ``{"id",
    "name", "arguments"}``, the arguments parsed). ``tools`` are dicts (name, description,
    parameters: a JSON schema); ``tool_choice`` auto, none, required or a tool's name.
    """

    def __init__(self, name: str, prompt: str = "", *, system: str = "",
                 tools: list[dict] | None = None, tool_choice: str = "",
                 conversation_key: str = "/llm/conversation", reply_key: str = "/llm/reply",
                 tool_calls_key: str = "/llm/tool_calls", **kwargs: Any):
        super().__init__(name, prompt or " ", text_key=reply_key, **kwargs)
        self.prompt = prompt
        self.system, self.tools, self.tool_choice = system, list(tools or []), tool_choice
        self.conversation_key = self._register(conversation_key, Access.WRITE)
        self.tool_calls_key = self._register(tool_calls_key, Access.WRITE)
        self._conversation: list = []

    def render_prompt(self) -> str:
        return super().render_prompt() if self.prompt or self.prompt_key else ""

    def _send(self, prompt: str) -> GoalHandle:
        conv = list(self.blackboard.get(self.conversation_key)
                    if self.blackboard.exists(self.conversation_key) else [])
        if not conv and self.system:
            conv.append({"role": "system", "content": self.system})
        if prompt:
            conv.append({"role": "user", "content": prompt})
        self._conversation = conv
        return self.client.chat_async(conv, tools=self.tools, tool_choice=self.tool_choice,
                                      server_timeout=self.server_timeout,
                                      timeout=self.result_timeout, **self.goal_options)

    def _write(self, out: Outcome) -> None:
        self.blackboard.set(self.conversation_key, self._conversation + [out.message],
                            overwrite=True)
        self.blackboard.set(self.text_key, out.text if not out.tool_calls else "", overwrite=True)
        self.blackboard.set(self.tool_calls_key, [
            {"id": c.id, "name": c.name, "arguments": c.value} for c in out.tool_calls],
            overwrite=True)
        self.feedback_message = (f"called {', '.join(c.name for c in out.tool_calls)}"
                                 if out.tool_calls else f"{len(out.text)} characters")


class CallTool(Chat):
    """Ask for one tool call (``tool_choice`` required, or a tool's name) and write it where a tree
    dispatches it: ``call_key`` ``{"id", "name", "arguments"}``, ``name_key`` the tool's name,
    ``arguments_key`` its parsed arguments (None on failure). ``outcomes`` maps tool names to the
    status returned (a Selector can branch on the tool). The conversation goes on as for
    :class:`Chat` (append the tool's result with :func:`tool_result` before the next turn).
    """

    def __init__(self, name: str, prompt: str = "", *, tools: list[dict],
                 tool_choice: str = "required", call_key: str = "/llm/tool_call",
                 name_key: str = "/llm/tool_name", arguments_key: str = "/llm/tool_arguments",
                 outcomes: dict[str, Status] | None = None, **kwargs: Any):
        if not tools:
            raise ValueError(f"{name}: give the tools it may call")
        if tool_choice in ("auto", "none", ""):
            raise ValueError(f"{name}: tool_choice must be required or a tool's name")
        super().__init__(name, prompt, tools=tools, tool_choice=tool_choice, **kwargs)
        self.call_key = self._register(call_key, Access.WRITE)
        self.name_key = self._register(name_key, Access.WRITE)
        self.arguments_key = self._register(arguments_key, Access.WRITE)
        self.outcomes = dict(outcomes or {})

    def _finish(self, out: Outcome) -> Status:
        status = super()._finish(out)
        if status != Status.SUCCESS:
            for key in (self.call_key, self.name_key, self.arguments_key):
                self.blackboard.set(key, None, overwrite=True)
            return status
        return self.outcomes.get(out.tool_calls[0].name, Status.SUCCESS)

    def _write(self, out: Outcome) -> None:
        super()._write(out)
        c = out.tool_calls[0]
        self.blackboard.set(self.call_key, {"id": c.id, "name": c.name, "arguments": c.value},
                            overwrite=True)
        self.blackboard.set(self.name_key, c.name, overwrite=True)
        self.blackboard.set(self.arguments_key, c.value, overwrite=True)


def tool_result(conversation: list, call: dict, content: str) -> list:
    """``conversation`` with the result ``content`` of ``call`` (as :class:`CallTool` wrote it)
    appended as a tool message: the next :class:`Chat` turn lets the model see it."""
    return list(conversation) + [{"role": "tool", "content": content,
                                  "tool_call_id": call.get("id", "")}]


class SwitchProfile(_LLMBehaviour):
    """Switch the active task profile through the profile manager's ``switch_profile``."""

    def __init__(self, name: str, task: str, *, namespace: str = "llm",
                 wait_for_server_timeout: float = 10.0, result_timeout: float = 60.0,
                 error_key: str = "/llm/error"):
        super().__init__(name, namespace, wait_for_server_timeout, 0.0, result_timeout)
        self.task = task
        self.error_key = self._register(error_key, Access.WRITE)
        self.call: ServiceCall | None = None
        self._deadline = 0.0

    def _wait_for_server(self) -> None:
        c = self.client
        if not c.switch_client.wait_for_service(timeout_sec=self.wait_for_server_timeout):
            raise TimeoutError(f"{self.name}: no service {c.switch_name} within "
                               f"{self.wait_for_server_timeout:g} s")

    def initialise(self) -> None:
        import time
        self.call = self.client.switch_profile_async(self.task)
        self._deadline = time.monotonic() + self.result_timeout
        self.feedback_message = f"switching to {self.task!r}"

    def update(self) -> Status:
        import time
        out = self.call.result()
        if out is None:
            if time.monotonic() < self._deadline:
                return Status.RUNNING
            out = Outcome("TIMEOUT", error_msg=f"no answer within {self.result_timeout:g} s")
        if out.ok:
            self.blackboard.set(self.error_key, "", overwrite=True)
            self.feedback_message = f"active task {out.text!r}"
            return Status.SUCCESS
        msg = f"{out.status}: {out.error_msg}"
        self.blackboard.set(self.error_key, msg, overwrite=True)
        self.feedback_message = msg
        return Status.FAILURE
