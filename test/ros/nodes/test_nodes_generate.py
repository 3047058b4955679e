"""selectinfer_node's Generate action with real rclpy clients (tiny random model).

Covers: goal -> streamed feedback -> SUCCEEDED with text and metrics; invalid goals rejected at
once and the node keeps serving; cancel mid-stream -> CANCELED with the partial text; 8 clients
at once with queue length 4; arrival order; a failing goal ABORTED with a code; 100 goals with
flat RSS; parameters refused at start and at runtime with a reason.
"""
import math
import shutil
import time

import pytest
from action_msgs.msg import GoalStatus
from rcl_interfaces.msg import Parameter as ParameterMsg
from rcl_interfaces.msg import ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters

from selectinfer_msgs.action import Generate

R = Generate.Result


def test_goal_streams_feedback_and_succeeds_with_metrics(llm_graph, wait_until):
    g = llm_graph().ready()
    run = g.run(g.goal(max_new_tokens=12), timeout=30.0)
    assert run.accepted
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    r = run.result
    assert r.error_code == R.NONE and r.error_msg == ''
    assert r.finish_reason in ('length', 'stop')
    assert r.text.strip()
    assert r.prompt_tokens == 4  # <bos> w5 w6 w7
    assert 1 <= r.generated_tokens <= 12
    assert r.time_to_first_token > 0
    if r.generated_tokens > 1:
        assert r.tokens_per_second > 0
    assert r.profile == 'alpha'
    assert math.isclose(r.load_ratio, 0.7, rel_tol=1e-5)
    assert math.isclose(r.compute_ratio, 0.5, rel_tol=1e-5)
    # The text streamed as feedback, in order, adds up to the result. Feedback (a topic) and the
    # result (a service response) are separate channels: the result may arrive first.
    assert wait_until(lambda: run.text() == r.text, 5.0), (run.text(), r.text)
    counts = [f.generated_tokens for _, f in run.feedback]
    assert len(counts) >= 2 and counts == sorted(counts) and counts[-1] == r.generated_tokens
    stats = g.node.runtime.stats
    assert (stats.succeeded, stats.canceled, stats.aborted, stats.rejected) == (1, 0, 0, 0)


INVALID_GOALS = [
    ('empty prompt', dict(prompt='')),
    ('blank prompt', dict(prompt='   \n')),
    ('unknown task', dict(task='gamma')),
    ('prompt longer than the context', dict(prompt=' '.join(['w9'] * 80))),
    ('max_new_tokens over the limit', dict(max_new_tokens=65)),
    ('negative temperature', dict(temperature=-0.5)),
    ('NaN temperature', dict(temperature=float('nan'))),
    ('negative top_k', dict(top_k=-1)),
    ('top_p above 1', dict(top_p=1.5)),
    ('negative repetition_penalty', dict(repetition_penalty=-1.0)),
    ('compute_ratio above load_ratio', dict(compute_ratio=0.9)),
    ('compute_ratio below static_ratio', dict(compute_ratio=0.1)),
    ('chat template the model lacks', dict(use_chat_template=True)),
]


def test_invalid_goals_are_rejected_at_once_and_node_keeps_serving(llm_graph):
    g = llm_graph(max_new_tokens=8, max_new_tokens_limit=64, context_limit=64).ready()
    for reason, fields in INVALID_GOALS:
        fields = dict(fields)
        prompt = fields.pop('prompt', 'w5 w6 w7')
        t0 = time.monotonic()
        run = g.send(g.goal(prompt, **fields))
        why = run.refused()  # accepted, ended at once ABORTED with the code and the reason
        assert why, f'{reason}: goal served'
        assert time.monotonic() - t0 < 5.0, f'{reason}: the refusal took too long'
        assert run.result.error_code in (R.INVALID_GOAL, R.UNKNOWN_TASK, R.PROMPT_TOO_LONG), why
    assert g.node.runtime.stats.rejected == len(INVALID_GOALS)
    assert g.node.snapshot().last_rejection.startswith('INVALID_GOAL: ')
    # still serving, and the limits themselves are accepted
    run = g.run(g.goal(max_new_tokens=64, compute_ratio=0.3), timeout=30.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert math.isclose(run.result.compute_ratio, 0.3, rel_tol=1e-5)
    assert g.node.runtime.stats.succeeded == 1


def test_cancel_mid_stream_returns_partial_text(llm_graph, wait_until):
    g = llm_graph(max_new_tokens_limit=1024).ready()
    run = g.send(g.goal(max_new_tokens=240))
    assert run.accepted
    assert run.wait_feedback(3, 30.0), 'no feedback streamed'
    cancel = run.cancel()
    t_ack = time.monotonic()
    assert len(cancel.goals_canceling) == 1
    run.wait(30.0)
    assert run.status == GoalStatus.STATUS_CANCELED
    r = run.result
    assert r.error_code == R.CANCELED and r.finish_reason == 'canceled'
    assert 3 <= r.generated_tokens < 240
    assert r.text  # the stream may still trail the result (separate channels): wait for it
    assert wait_until(lambda: run.text() == r.text, 5.0), 'partial text differs from the stream'
    # honoured within a decode step (a few tens of ms here) plus message latency
    assert run.t_done - t_ack < 1.0
    assert g.node.runtime.stats.canceled == 1
    # the node keeps serving
    assert g.run(g.goal(max_new_tokens=4)).status == GoalStatus.STATUS_SUCCEEDED


def test_cancel_while_queued_ends_canceled_without_running(llm_graph):
    g = llm_graph().ready()
    first = g.send(g.goal(max_new_tokens=120))
    second = g.send(g.goal('w8 w9', max_new_tokens=120))
    assert first.accepted and second.accepted
    second.cancel()
    first.cancel()
    first.wait(30.0)
    second.wait(30.0)
    assert second.status == GoalStatus.STATUS_CANCELED
    assert second.result.generated_tokens == 0 and second.feedback == []
    assert first.status == GoalStatus.STATUS_CANCELED


def test_eight_clients_at_once_with_queue_of_four(llm_graph):
    g = llm_graph(queue_length=4).ready()
    clients = g.new_action_clients(8)
    for c in clients:
        assert c.wait_for_server(timeout_sec=10.0)
    futures = [c.send_goal_async(g.goal(f'w{10 + i} w7', max_new_tokens=120)) for i, c in
               enumerate(clients)]
    deadline = time.monotonic() + 60.0
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, 'a goal got no response'
        time.sleep(0.01)
    handles = [f.result() for f in futures]
    assert all(h.accepted for h in handles)  # a refusal ends at once with its reason
    results = [h.get_result_async() for h in handles]
    deadline = time.monotonic() + 120.0
    while not all(f.done() for f in results):
        assert time.monotonic() < deadline, 'a goal never finished'
        time.sleep(0.02)
    served = [f.result() for f in results if f.result().result.finish_reason != 'rejected']
    rejected = [f.result() for f in results if f.result().result.finish_reason == 'rejected']
    accepted = served
    assert 1 <= len(served) <= 5  # running one + queue_length
    assert len(rejected) >= 3, 'goals beyond the queue were not refused'
    assert all(r.status == GoalStatus.STATUS_ABORTED and r.result.error_code == R.QUEUE_FULL
               and 'queue' in r.result.error_msg for r in rejected)
    statuses = [r.status for r in served]
    assert statuses == [GoalStatus.STATUS_SUCCEEDED] * len(accepted)
    stats = g.node.runtime.stats
    assert stats.succeeded == len(accepted) and stats.rejected == len(rejected)
    snap = g.node.snapshot()
    assert snap.queue_depth == 0 and not snap.generating
    # capacity is free again
    assert g.run(g.goal(max_new_tokens=2)).status == GoalStatus.STATUS_SUCCEEDED


def test_goals_run_one_at_a_time_in_arrival_order(llm_graph):
    g = llm_graph().ready()
    runs = [g.send(g.goal(f'w{20 + i}', max_new_tokens=15)) for i in range(3)]
    assert all(r.accepted for r in runs)
    for r in runs:
        r.wait(60.0)
    assert [r.status for r in runs] == [GoalStatus.STATUS_SUCCEEDED] * 3
    # each goal's first feedback comes after the previous goal's last one: no overlap
    for a, b in zip(runs, runs[1:]):
        assert a.feedback[-1][0] <= b.feedback[0][0]
        assert a.t_done <= b.t_done + 0.05


def test_failing_goal_is_aborted_with_code_and_node_keeps_serving(llm_graph, tiny_llm, tmp_path):
    profiles = tmp_path / 'profiles'
    shutil.copytree(tiny_llm.profiles, profiles)
    g = llm_graph(profiles=str(profiles)).ready()
    (profiles / 'beta.safetensors').write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00{"a":1}')
    run = g.run(g.goal(task='beta', max_new_tokens=4))
    assert run.accepted and run.status == GoalStatus.STATUS_ABORTED
    assert run.result.error_code == R.PROFILE_SWITCH_FAILED
    assert 'beta.safetensors' in run.result.error_msg
    assert run.result.finish_reason == 'error'
    assert run.result.profile == 'alpha'
    ok = g.run(g.goal(max_new_tokens=4))
    assert ok.status == GoalStatus.STATUS_SUCCEEDED and ok.result.profile == 'alpha'
    stats = g.node.runtime.stats
    assert (stats.aborted, stats.succeeded) == (1, 1)


def test_goal_with_another_task_switches_before_it_runs(llm_graph):
    g = llm_graph().ready()
    run = g.run(g.goal(task='beta', max_new_tokens=4))
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert run.result.profile == 'beta'
    rt = g.node.runtime
    assert rt.task == 'beta' and rt.switches == 1 and rt.last_switch.bytes_read > 0


def test_hundred_goals_leave_rss_flat(llm_graph):
    from selectinfer_ros.core.execution.metrics import process_rss_bytes
    g = llm_graph(max_new_tokens=3).ready()
    rss = []
    for i in range(100):
        run = g.run(g.goal(f'w{5 + i % 50} w6'), timeout=30.0)
        assert run.status == GoalStatus.STATUS_SUCCEEDED, (i, run.status)
        if i in (9, 99):
            rss.append(process_rss_bytes())
    growth = (rss[1] - rss[0]) / rss[0]
    assert growth < 0.02, f'RSS grew {100 * growth:.2f} % from goal 10 to goal 100'
    assert g.node.runtime.stats.succeeded == 100


def _set_params(g, **values):
    msgs = []
    for name, value in values.items():
        if isinstance(value, bool):
            pv = ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=value)
        elif isinstance(value, int):
            pv = ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
        elif isinstance(value, float):
            pv = ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=value)
        else:
            pv = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)
        msgs.append(ParameterMsg(name=name, value=pv))
    resp = g.call(SetParameters, 'selectinfer_node/set_parameters',
                  SetParameters.Request(parameters=msgs))
    return resp.results


def test_bad_parameters_at_runtime_are_refused_with_reason(llm_graph):
    g = llm_graph(max_new_tokens=8, max_new_tokens_limit=64).ready()
    refused = {
        'compute_ratio': 0.9,  # above load_ratio 0.7
        'load_ratio': 0.5,  # fixed once started
        'max_new_tokens': 100,  # above max_new_tokens_limit
        'queue_length': -1,
        'diagnostics_period': 0.0,
        'device': 'cuda:7',
    }
    for name, value in refused.items():
        (res,) = _set_params(g, **{name: value})
        assert not res.successful, f'{name}={value} accepted'
        assert name in res.reason, (name, res.reason)
    (res,) = _set_params(g, compute_ratio='half')
    assert not res.successful and 'number' in res.reason
    assert g.node.settings.compute_ratio == 0.5
    # good values apply at once
    results = _set_params(g, compute_ratio=0.4, max_new_tokens=3, queue_length=1)
    assert all(r.successful for r in results), [r.reason for r in results]
    run = g.run(g.goal())
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert run.result.generated_tokens <= 3
    assert math.isclose(run.result.compute_ratio, 0.4, rel_tol=1e-5)
    (res,) = _set_params(g, compute_ratio=1)  # an integer for a double: converted, then checked
    assert not res.successful and 'compute_ratio' in res.reason


def _start_node(ros_context, **params):
    from rclpy.parameter import Parameter

    from selectinfer_ros.ros.nodes.inference_node import InferenceNode
    overrides = [Parameter(k, value=v) for k, v in params.items()]
    return InferenceNode(namespace='llm_refused', context=ros_context, parameter_overrides=overrides)


def test_bad_parameters_at_start_are_refused_with_reason(ros_context, tiny_llm, tmp_path):
    import torch

    from selectinfer_ros.core.selection.profiles import Profile
    from selectinfer_ros.ros.nodes.settings import ParamError
    base = dict(model=str(tiny_llm.model), profiles=str(tiny_llm.profiles), load_ratio=0.7)
    other = tmp_path / 'other-profiles'
    Profile('alpha', 'another-model', 'f' * 16, torch.ones(3, 256), 10, 'x').save(
        other / 'alpha.safetensors')
    cases = [  # values: refused when the node is made
        (dict(load_ratio=1.5), 'load_ratio'),
        (dict(load_ratio=0.0), 'load_ratio'),
        (dict(static_ratio=0.6, compute_ratio=0.5), 'static_ratio'),
        (dict(compute_ratio=0.9), 'compute_ratio'),
        (dict(max_new_tokens=2000, max_new_tokens_limit=1000), 'max_new_tokens'),
        (dict(queue_length=-2), 'queue_length'),
        (dict(dtype='int8'), 'dtype'),
        (dict(load_ratio='high'), 'load_ratio must be a number'),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device='cuda'), 'CUDA is not available'))
    for params, needle in cases:
        with pytest.raises(ParamError) as info:
            _start_node(ros_context, **{**base, **params})
        assert needle in str(info.value), (params, str(info.value))
    from rclpy.lifecycle import TransitionCallbackReturn
    files = [  # files: the node starts, its configure fails with the reason, nothing loaded
        (dict(model=str(tmp_path / 'missing')), 'does not exist'),
        (dict(model=str(tmp_path)), 'model'),
        (dict(profiles=str(other)), 'fingerprint'),
        (dict(task='gamma'), 'unknown task'),
    ]
    for params, needle in files:
        node = _start_node(ros_context, **{**base, **params})
        try:
            assert node.trigger_configure() == TransitionCallbackReturn.FAILURE, params
            assert node.load_error.startswith('load failed: ParamError: ') and \
                needle in node.load_error, (params, node.load_error)
            assert node.runtime is None and node.lifecycle_state == 'unconfigured'
        finally:
            node.destroy_node()
    node = _start_node(ros_context, **base)  # the good values start
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS, node.load_error
    finally:
        node.destroy_node()


def test_four_clients_at_once_decode_together(llm_graph):
    """Every loaded neuron computed (goals may batch), max_batch 4: four clients' goals sent at
    once all succeed, run together (each one's first feedback comes before any goal's last),
    each with the text it gets alone; diagnostics saw the batch."""
    g = llm_graph(load_ratio=1.0, compute_ratio=1.0, max_batch=4, queue_length=0).ready()
    clients = g.new_action_clients(4)
    for c in clients:
        assert c.wait_for_server(timeout_sec=10.0)
    goals = [g.goal(f'w{30 + i} w{40 + i} w7', max_new_tokens=40) for i in range(4)]
    runs = [g.send(goal, client=c) for goal, c in zip(goals, clients)]
    assert all(r.accepted for r in runs)  # queue_length 0: room for the 4 running ones
    for r in runs:
        r.wait(120.0)
    assert [r.status for r in runs] == [GoalStatus.STATUS_SUCCEEDED] * 4
    last_first = max(r.feedback[0][0] for r in runs)
    assert all(last_first < r.feedback[-1][0] for r in runs), 'the goals did not overlap'
    assert g.node.server.aggregate_tokens_per_second > 0
    for goal, r in zip(goals, runs):
        assert g.run(goal).result.text == r.result.text  # alone: the same text


def test_goals_of_different_compute_ratios_decode_together(llm_graph):
    """gamma 0.7, max_batch 3: three clients' goals asking compute ratios 0.3, 0.5 and 0.7 (each
    prompt chooses its own neurons) run together, each result reports the ratio it asked, and
    each text equals the goal's run alone."""
    g = llm_graph(max_batch=3, queue_length=0).ready()
    clients = g.new_action_clients(3)
    for c in clients:
        assert c.wait_for_server(timeout_sec=10.0)
    goals = [g.goal(f'w{50 + i} w{20 + i} w9', max_new_tokens=40) for i in range(3)]
    for goal, phi in zip(goals, (0.3, 0.5, 0.7)):
        goal.compute_ratio = phi
    runs = [g.send(goal, client=c) for goal, c in zip(goals, clients)]
    assert all(r.accepted for r in runs)
    for r in runs:
        r.wait(120.0)
    assert [r.status for r in runs] == [GoalStatus.STATUS_SUCCEEDED] * 3
    assert [round(r.result.compute_ratio, 3) for r in runs] == [0.3, 0.5, 0.7]
    last_first = max(r.feedback[0][0] for r in runs)
    assert all(last_first < r.feedback[-1][0] for r in runs), 'the goals did not overlap'
    for goal, r in zip(goals, runs):
        assert g.run(goal).result.text == r.result.text  # alone: the same text
