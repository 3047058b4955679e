"""The LangChain chat model (selectinfer_ros.ros.langchain_chat) against the real node.

Covers: LangChain messages to the goal's messages and back; Qwen2.5-0.5B behind the node answers
a question with text, calls one of the tools bound with ``bind_tools`` (a LangChain tool, a
pydantic model, a dict) with arguments valid under its schema, continues after a ToolMessage,
and a tool_choice naming no tool raises with the node's reason.
"""
import uuid
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

from selectinfer_ros.ros.client import STATUS_REJECTED, LLMClient
from selectinfer_ros.ros.langchain_chat import (ChatSelectInfer, SelectInferError,
                                                to_dict, tool_choice_of)


@tool
def navigate_to(room: Literal["kitchen", "hall", "dock", "bedroom"]) -> str:
    """Drive to a room of the flat."""
    return f"arrived in the {room}"


class Say(BaseModel):
    """Say a sentence aloud."""

    text: str = Field(max_length=60, description="the sentence")


PICK = {"name": "pick", "description": "Pick up an object in front of the robot.",
        "parameters": {"type": "object",
                       "properties": {"object": {"type": "string", "maxLength": 24}},
                       "required": ["object"], "additionalProperties": False}}
TOOLS = [navigate_to, Say, PICK]
SYSTEM = SystemMessage("You control Rover, a home robot. When a request needs an action, call "
                       "exactly one tool.")


def make_model(g, **fields):
    """A ChatSelectInfer over an LLMClient on a node of its own (made before the node spins)."""
    from rclpy.node import Node
    node = Node(f'lc_{uuid.uuid4().hex[:6]}', context=g.client_node.context)
    client = LLMClient(node, g.namespace)
    g.spinner.add_node(node)
    return ChatSelectInfer(client=client, **fields)


def test_langchain_messages_become_the_goals_messages():
    call = {"name": "navigate_to", "args": {"room": "hall"}, "id": "call_1", "type": "tool_call"}
    assert to_dict(SYSTEM)["role"] == "system"
    assert to_dict(HumanMessage([{"type": "text", "text": "Go "}, "now"])) == \
        {"role": "user", "content": "Go now"}
    assert to_dict(AIMessage("", tool_calls=[call])) == {
        "role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "navigate_to", "arguments": '{"room": "hall"}'}}]}
    assert to_dict(ToolMessage("arrived", tool_call_id="call_1")) == \
        {"role": "tool", "content": "arrived", "tool_call_id": "call_1"}
    assert [tool_choice_of(c) for c in (None, "auto", "none", "any", True, "required", "Say",
                                        {"type": "function", "function": {"name": "pick"}})] == \
        ["", "", "none", "required", "required", "required", "Say", "pick"]


def test_chat_model_answers_calls_tools_and_continues_against_the_node(qwen_graph):
    import jsonschema

    g = qwen_graph
    model = make_model(g, max_new_tokens=48)
    assert model.client.wait_for_server(10.0)

    answer = model.invoke("What is the capital of France? Answer in one word.", max_new_tokens=6)
    assert isinstance(answer, AIMessage) and answer.content.strip() and not answer.tool_calls
    assert answer.usage_metadata["output_tokens"] >= 1

    schemas = {t["function"]["name"]: t["function"]["parameters"]
               for t in map(convert_to_openai_tool, TOOLS)}
    assert sorted(schemas) == ["Say", "navigate_to", "pick"]
    agent = model.bind_tools(TOOLS, tool_choice="required")
    chat = [SYSTEM, HumanMessage("Please drive to the kitchen.")]
    ai = agent.invoke(chat)
    assert isinstance(ai, AIMessage) and ai.content == "" and len(ai.tool_calls) == 1, ai
    call = ai.tool_calls[0]
    assert call["name"] in schemas and call["id"].startswith("call_"), call
    jsonschema.validate(call["args"], schemas[call["name"]])
    assert ai.response_metadata["finish_reason"] == "tool_calls"

    # the tool's result goes back as a ToolMessage; the next answer calls the tool named
    chat += [ai, ToolMessage("Rover is in the kitchen now.", tool_call_id=call["id"]),
             HumanMessage("Tell me where you are.")]
    reply = model.bind_tools(TOOLS, tool_choice="Say").invoke(chat, max_new_tokens=64)
    assert [c["name"] for c in reply.tool_calls] == ["Say"], reply
    assert Say(**reply.tool_calls[0]["args"]).text
    assert reply.response_metadata["cached_tokens"] > 0  # the conversation so far was cached

    # a model with a client of its own (context, node, executor: start/close)
    own = ChatSelectInfer.start(namespace=g.namespace)
    try:
        with pytest.raises(SelectInferError) as err:
            own.bind_tools(TOOLS, tool_choice="fly").invoke(chat)
    finally:
        own.close()
    assert err.value.status == STATUS_REJECTED
    assert "'fly' is neither auto, none, required nor a tool" in str(err.value)
    assert err.value.reason in g.node.snapshot().last_rejection  # the node's own reason
    assert own.client.action is None  # closed
