"""A LangChain chat model over the ``Generate`` action: a thin adapter over :class:`LLMClient`.

    from selectinfer_ros.ros.client import LLMClient
    from selectinfer_ros.ros.langchain_chat import ChatSelectInfer
    with LLMClient.start(namespace="llm") as llm:
        model = ChatSelectInfer(client=llm, max_new_tokens=64)
        print(model.invoke("Name a room of a flat.").content)
        ai = model.bind_tools([navigate_to, Say], tool_choice="required").invoke(messages)
        print(ai.tool_calls)                          # [{'name': 'navigate_to', 'args': {...}}]

Messages (system, human, AI with its ``tool_calls``, tool) become the goal's ``messages``;
``bind_tools`` takes LangChain tools, pydantic models, functions or dicts (converted with
``convert_to_openai_tool``) and ``tool_choice`` auto, none, required (or ``any``, ``True``) or a
tool's name. A goal that does not succeed (rejected, aborted, canceled, timed out, a call cut
off) raises :class:`SelectInferError` with its outcome. Calls block: scripts and agents, never
inside a callback of the executor that spins the client's node (see :mod:`.client`).

Needs ``langchain-core`` (requirements-dev.txt); nothing else in the package imports this module.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (AIMessage, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, PrivateAttr

from .client import STATUS_REJECTED, LLMClient, Outcome

ROLES = {SystemMessage: "system", HumanMessage: "user", AIMessage: "assistant",
         ToolMessage: "tool"}
CHAT_ROLES = {"human": "user", "ai": "assistant"}  # a ChatMessage's LangChain role names


class SelectInferError(RuntimeError):
    """A goal that did not succeed; ``outcome`` is the client's :class:`Outcome`."""

    def __init__(self, outcome: Outcome, reason: str = ""):
        self.outcome, self.status, self.reason = outcome, outcome.status, reason
        detail = f": {reason}" if reason else ""
        super().__init__(f"{outcome.status}{detail} ({outcome.error_msg})" if outcome.error_msg
                         else f"{outcome.status}{detail}")


def _text(content: str | list) -> str:
    """A message's content as text (the text parts of a list of content blocks)."""
    if isinstance(content, str):
        return content
    return "".join(b if isinstance(b, str) else str(b.get("text", "")) for b in content
                   if isinstance(b, str) or b.get("type") == "text")


def to_dict(message: BaseMessage) -> dict:
    """A LangChain message as the dict (OpenAI's format) :meth:`LLMClient.chat` takes."""
    if isinstance(message, ChatMessage):
        role = CHAT_ROLES.get(message.role, message.role)
    else:
        role = next((r for cls, r in ROLES.items() if isinstance(message, cls)), None)
    if role is None:
        raise TypeError(f"cannot send a {type(message).__name__} to the Generate action")
    out: dict[str, Any] = {"role": role, "content": _text(message.content)}
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [{"id": c.get("id") or "", "type": "function",
                              "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
                             for c in message.tool_calls]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    return out


def to_ai_message(outcome: Outcome) -> AIMessage:
    """A successful outcome as an AIMessage: its text, or its tool calls (name, args, id)."""
    r = outcome.result
    meta = {"finish_reason": r.finish_reason, "profile": r.profile,
            "cached_tokens": int(r.cached_tokens)} if r is not None else {}
    usage = {"input_tokens": int(r.prompt_tokens), "output_tokens": int(r.generated_tokens),
             "total_tokens": int(r.prompt_tokens + r.generated_tokens)} if r is not None else None
    calls = [{"name": c.name, "args": c.value, "id": c.id, "type": "tool_call"}
             for c in outcome.tool_calls]
    return AIMessage(content="" if calls else outcome.text, tool_calls=calls,
                     response_metadata=meta, usage_metadata=usage)


def tool_choice_of(choice: str | bool | dict | None) -> str:
    """LangChain's tool_choice as the goal's: "" (auto), none, required or a tool's name."""
    if choice is None or choice is False or choice == "auto":
        return ""
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
        return str((choice.get("function") or choice).get("name", ""))
    return str(choice)


class ChatSelectInfer(BaseChatModel):
    """A LangChain chat model served by a selectinfer node's ``Generate`` action.

    ``client`` is an :class:`LLMClient` (on a node of yours, or ``ChatSelectInfer.start()``'s
    own); the goal fields below are sent when set (None: the node's default), ``options`` holds
    any other Generate goal field (``task``, ``seed``, ``compute_ratio``, ...)."""

    client: Any = Field(exclude=True)
    max_new_tokens: int | None = None
    temperature: float | None = None
    timeout: float | None = None  # seconds for the result (None: the client's result_timeout)
    options: dict = Field(default_factory=dict)
    _owned: bool = PrivateAttr(default=False)

    @classmethod
    def start(cls, namespace: str = "llm", **fields: Any) -> "ChatSelectInfer":
        """A model with its own :meth:`LLMClient.start` client (``close()`` ends it)."""
        model = cls(client=LLMClient.start(namespace=namespace), **fields)
        model._owned = True
        return model

    def close(self) -> None:
        """Close the client if :meth:`start` made it."""
        if self._owned:
            self.client.close()

    @property
    def _llm_type(self) -> str:
        return "selectinfer"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"action": self.client.action_name, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, **self.options}

    def bind_tools(self, tools: Sequence[dict | type | Callable | Any], *,
                   tool_choice: str | bool | dict | None = None, **kwargs: Any):
        """The model with ``tools`` (converted to OpenAI's format) and ``tool_choice`` bound."""
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools],
                         tool_choice=tool_choice_of(tool_choice), **kwargs)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        chat = [to_dict(m) for m in messages]
        tools = kwargs.pop("tools", None) or []
        choice = tool_choice_of(kwargs.pop("tool_choice", None))
        goal = {k: v for k, v in (("max_new_tokens", self.max_new_tokens),
                                  ("temperature", self.temperature), ("stop", stop),
                                  ("timeout", self.timeout)) if v is not None}
        goal.update(self.options)
        goal.update(kwargs)
        out = self.client.chat(chat, tools=tools, tool_choice=choice, **goal)
        if not out.ok:
            raise SelectInferError(out, _reason(out, chat, tools, choice))
        return ChatResult(generations=[ChatGeneration(message=to_ai_message(out))])


def _reason(out: Outcome, chat: list[dict], tools: list, choice: str) -> str:
    """Why the node refused a conversation: the reason its result carries (the node ends a goal
    it will not serve at once with it); empty for other outcomes."""
    return out.error_msg if out.status == STATUS_REJECTED else ""


__all__ = ["ChatSelectInfer", "SelectInferError", "to_ai_message", "to_dict", "tool_choice_of"]
