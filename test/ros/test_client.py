"""The client facade (selectinfer_ros.ros.client.LLMClient) against the real nodes (tiny model).

Covers: blocking generate/choose with streamed feedback; errors as data (rejection, no server,
result timeout, refused switch) instead of exceptions; cancel mid-stream and before the goal
response came; switch_profile through the profile manager.
"""
import time
import uuid

import pytest

from selectinfer_msgs.action import Generate
from selectinfer_ros.ros import client as client_module
from selectinfer_ros.ros.client import (STATUS_CANCELED, STATUS_CUT_OFF, STATUS_FAILED,
                                    STATUS_NO_SERVER,
                                    STATUS_REJECTED, STATUS_SUCCEEDED, STATUS_TIMEOUT, LLMClient,
                                    Outcome, _Stream)

R = Generate.Result


def make_client(g, namespace=None, **kwargs):
    """An LLMClient on a node of its own, made before that node joins the spinning executor."""
    from rclpy.node import Node
    node = Node(f'facade_{uuid.uuid4().hex[:6]}', context=g.client_node.context)
    client = LLMClient(node, namespace or g.namespace, **kwargs)
    g.spinner.add_node(node)
    return client


def test_generate_and_choose_block_until_the_outcome(llm_graph):
    g = llm_graph().ready()
    llm = make_client(g)
    assert llm.wait_for_server(10.0)
    pieces = []
    out = llm.generate('w5 w6 w7', max_new_tokens=8, on_feedback=lambda fb: pieces.append(fb))
    assert out.ok and out.status == STATUS_SUCCEEDED and out.error_code == R.NONE
    assert out.text and out.result.generated_tokens >= 1 and out.choice_index == -1
    assert out.choice is None
    assert ''.join(fb.text_delta for fb in pieces) == out.text
    ch = llm.choose('w5 w6 w7', ['w8', 'w9 w10', 'w11'])
    assert ch.ok and ch.choice == ['w8', 'w9 w10', 'w11'][ch.choice_index] == ch.text
    assert len(ch.result.choice_logprobs) == 3
    with pytest.raises(TypeError, match='unknown Generate goal field'):
        llm.generate_async('w5', max_tokens=3)
    stats = g.node.runtime.stats
    assert (stats.succeeded, stats.canceled, stats.rejected) == (2, 0, 0)


def test_a_result_that_overtakes_its_feedback_is_held_until_the_text_has_streamed(monkeypatch):
    # The result and the feedback come on separate channels: a CI run saw the result before the
    # last three deltas, so a client adding up on_feedback deltas got a short text.
    s = _Stream()
    s.add('w264')
    s.hold(Outcome(STATUS_SUCCEEDED, 'w264 w219'))
    assert s.release() is None
    s.add(' w219')
    assert s.release().text == 'w264 w219' and s.held is None
    s.hold(Outcome(STATUS_SUCCEEDED, 'w8', choice_index=0))  # a choice streams no text
    assert s.release().choice_index == 0
    monkeypatch.setattr(client_module, 'FEEDBACK_GRACE_S', 0.0)  # feedback lost for good
    s.hold(Outcome(STATUS_SUCCEEDED, 'w264 w219 w346'))
    time.sleep(0.01)
    assert s.release().text == 'w264 w219 w346'


def test_feedback_still_arrives_after_its_result_on_a_slow_client(llm_graph, monkeypatch):
    # A slow on_feedback keeps the feedback queued while the result comes: rclpy's ActionClient
    # drops a goal's feedback callback as soon as the result arrives, and the queued deltas were
    # lost (a CI run lost the last three of a canceled goal); SafeActionClient keeps delivering,
    # and feedback queues of FEEDBACK_DEPTH (rclpy's default of 10 dropped the oldest here).
    monkeypatch.setattr(client_module, 'FEEDBACK_GRACE_S', 30.0)  # the hold is not what is tested
    g = llm_graph().ready()
    llm = make_client(g)
    assert llm.wait_for_server(10.0)
    pieces = []

    def slow(fb):
        time.sleep(0.05)
        pieces.append(fb.text_delta)

    out = llm.generate('w5 w6 w7', max_new_tokens=16, on_feedback=slow)  # more than 10 queued
    assert out.ok and out.result.generated_tokens == 16
    assert ''.join(pieces) == out.text and len(pieces) >= 12
    assert llm.action._feedback_callbacks == {}  # forgotten once the outcome is known


def test_errors_are_data(llm_graph, wait_until):
    g = llm_graph(max_new_tokens_limit=1024).ready()
    llm = make_client(g)
    assert llm.wait_for_server(10.0)
    rejected = llm.generate('w5 w6', task='gamma')  # the reason reaches the caller
    assert rejected.status == STATUS_REJECTED and "unknown task 'gamma'" in rejected.error_msg
    assert not rejected.ok and rejected.result.error_code == rejected.error_code != 0
    bad = llm.choose('w5 w6', ['w7', 'w7'])
    assert bad.status == STATUS_REJECTED and "choice 1 'w7' repeats choice 0" in bad.error_msg
    assert g.node.snapshot().last_rejection.endswith("choice 1 'w7' repeats choice 0")

    nobody = make_client(g, namespace=f'nobody_{uuid.uuid4().hex[:6]}', server_timeout=0.5)
    handle = nobody.generate_async('w5')
    assert handle.done() and handle.result().status == STATUS_NO_SERVER
    t0 = time.monotonic()
    assert nobody.generate('w5').status == STATUS_NO_SERVER
    assert time.monotonic() - t0 < 4.5  # its server_timeout 0.5 s, not the default 5 s
    assert nobody.switch_profile('alpha', timeout=1.0).status == STATUS_NO_SERVER

    # a result that misses its timeout: TIMEOUT, and the goal is canceled on the server
    slow = llm.generate('w5 w6', max_new_tokens=250, timeout=0.05)
    assert slow.status == STATUS_TIMEOUT and 'canceled' in slow.error_msg
    assert wait_until(lambda: g.node.runtime.stats.canceled == 1, 10.0)


def test_cancel_mid_stream_and_before_the_goal_response(llm_graph, wait_until):
    g = llm_graph(max_new_tokens_limit=1024).ready()
    llm = make_client(g)
    assert llm.wait_for_server(10.0)
    handle = llm.generate_async('w5 w6 w7', max_new_tokens=900)
    assert not handle.done() and handle.result() is None
    assert wait_until(lambda: handle.feedback is not None and handle.feedback.generated_tokens >= 3,
                      30.0)
    handle.cancel()
    out = handle.wait(30.0)
    assert out.status == STATUS_CANCELED and out.error_code == R.CANCELED
    assert out.text and handle.text.startswith(out.text)
    assert 3 <= out.result.generated_tokens < 900

    early = llm.generate_async('w5 w6 w7', max_new_tokens=900)
    early.cancel()  # before the goal response: sent as soon as the handle comes
    assert early.accepted is None
    out = early.wait(30.0)
    assert out.status == STATUS_CANCELED
    assert out.result.generated_tokens < 900
    assert wait_until(lambda: g.node.runtime.stats.canceled == 2, 5.0)


def test_switch_profile_through_the_profile_manager(llm_graph):
    g = llm_graph(manager={'task': 'alpha'}).bring_up()
    llm = make_client(g)
    out = llm.switch_profile('beta', timeout=60.0)
    assert out.ok and out.text == 'beta' and out.result.bytes_read > 0
    assert g.node.runtime.task == 'beta'
    refused = llm.switch_profile('gamma', timeout=60.0)
    assert refused.status == STATUS_FAILED and 'gamma' in refused.error_msg
    call = llm.switch_profile_async('alpha')
    assert call.wait(60.0).ok and g.node.runtime.task == 'alpha'


def test_generate_json_returns_the_parsed_object(llm_graph):
    """On the embedded model: the outcome's value is the parsed object, valid under the schema;
    a cut-off answer is CUT_OFF (not ok, no value); an invalid schema is REJECTED with why."""
    import json

    import jsonschema

    from selectinfer_ros.lab.json_goals import SCHEMAS, prompt_for
    g = llm_graph(model='', profiles='', task='general', load_ratio=1.0,
                  compute_ratio=1.0).ready(timeout=180.0)
    assert g.node.runtime.engine.grammars.wait_ready(60.0)  # prepared in the background
    llm = make_client(g)
    name, schema, instruction, example = SCHEMAS[5]  # a list of objects
    out = llm.generate_json(prompt_for(instruction, example), schema, max_new_tokens=64)
    assert out.ok and out.parsed and out.result.finish_reason == 'grammar', out
    jsonschema.validate(out.value, schema)
    assert out.value == json.loads(out.text) and isinstance(out.value['seen'], list)
    cut = llm.generate_json(prompt_for(instruction, example), json.dumps(schema), max_new_tokens=3)
    assert cut.status == STATUS_CUT_OFF and not cut.ok and cut.value is None
    assert 'cut off (finish_reason length)' in cut.error_msg
    bad = llm.generate_json('Answer: ', {'type': 'objekt'})
    assert bad.status == STATUS_REJECTED and bad.value is None
    assert 'invalid json_schema' in g.node.snapshot().last_rejection


def test_chat_calls_tools_reuses_the_prompt_and_refuses_bad_conversations(qwen_graph,
                                                                        robot_agent):
    """Qwen2.5-0.5B behind the node: chat() calls tools with valid arguments, a goal sharing the
    system prompt and tools reuses their keys and values (cached_tokens, the diagnostics' prompt
    cache), bad conversations are rejected at once with a reason, the next goal is served."""
    import json

    import jsonschema

    SYSTEM, TOOLS = robot_agent.system, robot_agent.tools
    g = qwen_graph
    llm = make_client(g)
    first = llm.chat([{'role': 'system', 'content': SYSTEM},
                      {'role': 'user', 'content': 'Please drive to the kitchen.'}],
                     tools=TOOLS, tool_choice='required')
    assert first.ok and first.parsed and first.result.finish_reason == 'tool_calls', first
    call = first.tool_calls[0]
    spec = next(t for t in TOOLS if t['name'] == call.name)
    jsonschema.validate(call.value, spec['parameters'])
    assert json.loads(call.arguments) == call.value and call.id.startswith('call_')
    assert first.result.cached_tokens == 0
    # the next goal shares the system prompt and the tools: they come from the prompt cache
    second = llm.chat([{'role': 'system', 'content': SYSTEM},
                       {'role': 'user', 'content': 'Tell the guests that dinner is ready.'}],
                      tools=TOOLS, tool_choice='say')
    assert second.ok and [c.name for c in second.tool_calls] == ['say']
    assert second.result.cached_tokens > 200
    snap = g.node.snapshot()
    assert snap.prompt_cache['prompt_cache_hits'] >= 1
    assert 0 < snap.prompt_cache['prompt_cache_bytes'] <= 64 * 2**20
    bad = [
        ([{'role': 'robot', 'content': 'hi'}], TOOLS, 'auto', "unknown role 'robot'"),
        ([{'role': 'user', 'content': 'go'}],
         [{'name': 'go', 'parameters': {'type': 'object', 'properties': {'x': {'type': 'strnig'}}}}],
         'auto', "tool 'go'"),
        ([{'role': 'user', 'content': 'go'}], TOOLS, 'fly', "'fly' is neither"),
        ([{'role': 'user', 'content': 'kitchen ' * 3000}], TOOLS, 'auto', 'context limit is 2048'),
    ]
    for messages, tools, choice, needle in bad:
        t0 = time.monotonic()
        out = llm.chat(messages, tools=tools, tool_choice=choice)
        assert out.status == STATUS_REJECTED and needle in out.error_msg, (needle, out)
        assert time.monotonic() - t0 < 5.0
        assert needle in g.node.snapshot().last_rejection, g.node.snapshot().last_rejection
    out = llm.chat([{'role': 'user', 'content': 'Go to the hall.'}], tools=TOOLS,
                   tool_choice='navigate_to')
    assert out.ok and out.tool_calls[0].name == 'navigate_to'
