"""Hostile input to a real selectinfer_node (issue 19): the worst goals and service calls an
outside tester sent, each answered, and a normal goal served after every one; a failure inside
a callback is answered with an error and the executor keeps serving."""
import math
import time

from action_msgs.msg import GoalStatus

from selectinfer_msgs.action import Generate
from selectinfer_msgs.srv import ReloadBase

R = Generate.Result


def _normal_goal_succeeds(g):
    run = g.run(g.goal(max_new_tokens=4), timeout=60.0)
    return run.accepted and run.status == GoalStatus.STATUS_SUCCEEDED


def test_worst_goals_and_calls_are_answered_and_the_node_keeps_serving(llm_graph):
    g = llm_graph(max_new_tokens=8, max_new_tokens_limit=64, context_limit=64).ready()
    reload = f'/{g.namespace}/reload_base'
    seen = []
    for timeout in (math.inf, 1e300, math.nan, -1.0):  # inf used to leave the node deaf
        t0 = time.monotonic()
        resp = g.call(ReloadBase, reload, ReloadBase.Request(task='beta', timeout=timeout))
        seen.append((f'reload_base timeout {timeout}', resp.success, time.monotonic() - t0))
        assert resp.success == (timeout > 0), resp.message
        assert resp.success or 'timeout must be >= 0' in resp.message
        assert _normal_goal_succeeds(g), seen[-1]
    resp = g.call(ReloadBase, reload, ReloadBase.Request(task='x' * 10_000, timeout=5.0))
    assert not resp.success and len(resp.message) < 300 and 'x' * 64 + '...' in resp.message
    assert _normal_goal_succeeds(g)

    refused = [
        ('8 options x 250,000 characters', dict(choices=[c * 250_000 for c in 'abcdefgh'])),
        ('64 options x 2,000 characters', dict(choices=[f'o{i} ' + 'w7 ' * 666 for i in range(64)])),
        ('10,000-character task', dict(task='t' * 10_000)),
        ('prompt over the context', dict(prompt='w9 ' * 5_000)),
        ('temperature inf', dict(temperature=math.inf)),
        ('1,000 stop strings', dict(stop=['w5'] * 1_000)),
    ]
    for reason, fields in refused:
        fields = dict(fields)
        t0 = time.monotonic()
        run = g.send(g.goal(fields.pop('prompt', 'w5 w6 w7'), **fields), timeout=30.0)
        assert run.refused(), f'{reason}: served'
        last = g.node.snapshot().last_rejection
        assert len(last) <= 410 and ('task' not in reason or 't' * 64 + '...' in last), last
        assert _normal_goal_succeeds(g), reason

    # accepted and served: a tiny temperature decodes greedily; max_new_tokens is ignored with
    # choices (Generate.action); a prompt filling the context says the context cut it
    run = g.run(g.goal(temperature=1e-40, max_new_tokens=6), timeout=60.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED, run.result.error_msg
    run = g.run(g.goal(choices=['w5', 'w6 w7'], max_new_tokens=2**32 - 1), timeout=60.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED and run.result.choice_index in (0, 1)
    run = g.run(g.goal(' '.join(f'w{i}' for i in range(10, 68)), max_new_tokens=60,
                       temperature=0.0), timeout=60.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert run.result.finish_reason in ('context_length', 'stop')
    assert _normal_goal_succeeds(g)


def test_a_failing_callback_is_answered_and_goals_are_still_served(llm_graph, monkeypatch):
    g = llm_graph().ready()

    def broken(*args, **kwargs):
        raise ZeroDivisionError('injected')

    monkeypatch.setattr(g.node.server, 'reload', broken)
    resp = g.call(ReloadBase, f'/{g.namespace}/reload_base', ReloadBase.Request(task='beta'))
    assert not resp.success and 'internal error: ZeroDivisionError: injected' in resp.message
    assert _normal_goal_succeeds(g)
    monkeypatch.setattr(g.node.server, 'check_prompt', broken)  # inside the goal callback
    assert 'internal error: ZeroDivisionError' in g.send(g.goal()).refused()
    assert g.node.snapshot().last_rejection.startswith('UNKNOWN: internal error: ZeroDivisionError')
    monkeypatch.undo()
    monkeypatch.setattr(g.node.server, 'submit', broken)  # inside the accepted callback
    run = g.send(g.goal())
    assert run.accepted
    run.wait(30.0)
    assert run.status == GoalStatus.STATUS_ABORTED and 'injected' in run.result.error_msg
    monkeypatch.undo()
    assert g.node.server.waiting == 0  # the failed goal's place in the queue was given back
    assert _normal_goal_succeeds(g)
    # the executor never saw an exception (the fixture checks spinner.error too)
    assert g.spinner.error is None
