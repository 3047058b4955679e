"""Chat goals through the serving layer on Qwen2.5-0.5B (its template writes tool calls as
``<tool_call>...</tool_call>``): a conversation renders to transformers' token ids, tool calls
are constrained to the tools' schemas, ``auto`` answers text where no tool fits, bad
conversations are refused at once with a reason and the next goal is served."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest

from selectinfer_ros.core.execution.chat import chat_of, render
from selectinfer_ros.core.format.paths import DATA_DIR
from selectinfer_ros.core.options import ModelOptions, NodeSettings
from selectinfer_ros.core.serving import server as serving
from selectinfer_ros.core.serving.runtime import Runtime
from selectinfer_ros.core.serving.server import GoalJob, Rejected, Server

SETTINGS = NodeSettings(max_new_tokens=48, max_new_tokens_limit=256)
AGENT = json.loads((DATA_DIR / "examples" / "robot_agent.json").read_text(encoding="utf-8"))
SYSTEM, TOOLS = AGENT["system"], AGENT["tools"]


def msg(role, content="", tool_calls=(), tool_call_id=""):
    return SimpleNamespace(role=role, content=content, tool_calls=list(tool_calls),
                           tool_call_id=tool_call_id)


def tool(t):
    return SimpleNamespace(name=t["name"], description=t["description"],
                           parameters=json.dumps(t["parameters"]))


def goal(messages, tools=(), tool_choice="", **over):
    base = dict(prompt="", task="", max_new_tokens=0, temperature=0.0, top_k=0, top_p=0.0,
                repetition_penalty=0.0, seed=-1, stop=[], use_chat_template=False,
                compute_ratio=0.0, choices=[], length_normalize=False, json_schema="", grammar="",
                messages=list(messages), tools=[tool(t) for t in tools], tool_choice=tool_choice)
    base.update(over)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def qwen_server(qwen05):
    srv = Server(queue_length=2)
    srv.start()
    try:
        srv.load(lambda: Runtime(ModelOptions(model=str(qwen05), num_threads=2)))
        srv.accepting = True
        srv.runtime.engine.set_prompt_cache(64)  # the system prompt and tools: prefilled once
        yield srv
    finally:
        srv.stop(timeout=10.0)


def check(srv: Server, g) -> int:
    """The goal callback's checks (as the node runs them); the prompt's tokens."""
    cfg, _ = serving.goal_config(g, SETTINGS, srv.runtime)
    prompt = serving.goal_prompt(g)
    n = srv.check_prompt(prompt, False)
    srv.check_tools(prompt)
    srv.check_constraint(cfg)
    return n


def run(srv: Server, g):
    check(srv, g)
    cfg, phi = serving.goal_config(g, SETTINGS, srv.runtime)
    done = threading.Event()
    job = GoalJob(serving.goal_prompt(g), cfg, "", phi, lambda: False, lambda: None,
                  lambda s, n: None, lambda outcome: done.set())
    srv.admit()
    srv.submit(job)
    assert done.wait(300.0)
    return job.outcome


def test_a_conversation_renders_to_the_templates_own_token_ids(qwen_server):
    tok = qwen_server.runtime.engine.tokenizer
    fmt = qwen_server.runtime.engine.tool_format
    assert fmt.native and fmt.call_token
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Where is the red cup?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "navigate_to",
                                                      "arguments": {"room": "kitchen"}}}]},
                {"role": "tool", "content": "arrived in the kitchen"},
                {"role": "assistant", "content": "I am in the kitchen."},
                {"role": "user", "content": "Pick it up."}]
    tools = [{"type": "function", "function": t} for t in TOOLS]
    want = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    got = render(tok, chat_of(messages, TOOLS), fmt)
    assert got.ids == want
    # the system message and the tools end at a mark: the prefix an agent's goals share
    head = tok.apply_chat_template(messages[:1], tools=tools, tokenize=True)
    head = list(head["input_ids"] if hasattr(head, "keys") else head)
    assert got.marks == (len(head),) and want[:len(head)] == head


def test_required_tool_calls_validate_and_auto_answers_text(qwen_server):
    srv = qwen_server
    asks = ["Please go to the kitchen.", "Say hello to the guests.", "Pick up the keys."]
    for ask in asks:
        out = run(srv, goal([msg("system", SYSTEM), msg("user", ask)], TOOLS, "required"))
        r = out.result
        assert out.status == "succeeded" and r.finish_reason == "tool_calls" and r.parsed, r
        assert r.tool_calls
        for c in r.tool_calls:
            spec = next(t for t in TOOLS if t["name"] == c.name)
            jsonschema.validate(json.loads(c.arguments), spec["parameters"])
    out = run(srv, goal([msg("system", SYSTEM), msg("user", "Go to the dock.")], TOOLS, "say"))
    assert [c.name for c in out.result.tool_calls] == ["say"]
    out = run(srv, goal([msg("system", SYSTEM), msg("user", "What is 2 + 3? Answer with the "
                                                             "number only.")], TOOLS, "auto"))
    r = out.result
    assert r.finish_reason == "stop" and r.parsed and r.tool_calls == [] and "5" in r.text, r
    # auto, a request a tool answers: the call the model begins in its own form comes back
    out = run(srv, goal([msg("system", SYSTEM), msg("user", "Please go to the kitchen.")], TOOLS,
                        "auto"))
    r = out.result
    assert r.finish_reason == "tool_calls" and r.parsed and len(r.tool_calls) == 1, r.text
    spec = next(t for t in TOOLS if t["name"] == r.tool_calls[0].name)
    jsonschema.validate(json.loads(r.tool_calls[0].arguments), spec["parameters"])
    out = run(srv, goal([msg("system", SYSTEM), msg("user", "Go to the kitchen.")], TOOLS, "none",
                        max_new_tokens=12))
    assert out.result.tool_calls == [] and "<tool_call>" not in out.result.text


BAD = [
    ("unknown role", dict(messages=[msg("robot", "hi")]), "unknown role 'robot'"),
    ("schema that does not compile", dict(tools=[SimpleNamespace(
        name="go", description="", parameters='{"type": "object", "properties": {"x": '
                                             '{"type": "strnig"}}}')]), "tool 'go'"),
    ("schema that is not JSON", dict(tools=[SimpleNamespace(name="go", description="",
                                                           parameters='{"type":')]),
     "not valid JSON"),
    ("tool_choice naming no tool", dict(tool_choice="fly"), "'fly' is neither"),
    ("a bad tool name", dict(tools=[SimpleNamespace(name="go home", description="",
                                                    parameters="")]), "tool name"),
    ("tools with a json_schema", dict(json_schema='{"type": "object"}'), "mutually exclusive"),
    ("a prompt and messages", dict(prompt="hello"), "not both"),
    ("call arguments that are not an object", dict(messages=[
        msg("user", "go"), msg("assistant", tool_calls=[SimpleNamespace(
            name="navigate_to", arguments="[1]", id="")])]), "must be a JSON object"),
    ("a conversation past the context", dict(messages=[msg("user", "kitchen " * 40000)]),
     "context"),
]


def test_bad_conversations_are_refused_at_once_with_a_reason(qwen_server):
    for name, over, needle in BAD:
        g = goal([msg("system", SYSTEM), msg("user", "Go to the hall.")], TOOLS, "auto")
        for k, v in over.items():
            setattr(g, k, v)
        t0 = time.perf_counter()
        with pytest.raises(Rejected) as e:
            check(qwen_server, g)
        assert time.perf_counter() - t0 < 1.0, name
        assert e.value.code in (serving.INVALID_GOAL, serving.PROMPT_TOO_LONG), name
        assert needle in e.value.reason, (name, e.value.reason)
    # the next goal is served
    out = run(qwen_server, goal([msg("user", "Go to the hall.")], TOOLS, "navigate_to",
                                max_new_tokens=24))
    assert out.status == "succeeded" and out.result.tool_calls[0].name == "navigate_to"
