"""selectinfer_node as a lifecycle node: "action server available" means "goals will be served".

Through its real lifecycle services (change_state, get_state) and the real action server: no
server before activate, a goal sent as soon as wait_for_server() returns is served, get_state
answers during a long configure, deactivate ends goals with a reason and removes the server,
cleanup frees the model, and a canceled waiting goal frees its queue slot at once.
"""
import threading
import time

from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import State, Transition
from lifecycle_msgs.srv import ChangeState, GetState

from selectinfer_msgs.action import Generate

R = Generate.Result


def _change(g, transition_id, timeout=60.0):
    req = ChangeState.Request()
    req.transition.id = transition_id
    return g.call(ChangeState, 'selectinfer_node/change_state', req, timeout=timeout).success


def test_goal_sent_right_after_wait_for_server_is_served(llm_graph):
    g = llm_graph()
    assert not g.action.wait_for_server(timeout_sec=0.5)  # unconfigured: no server
    served = {}

    def client():  # what a behaviour tree does: wait for the server, then send at once
        if g.action.wait_for_server(timeout_sec=60.0):
            run = g.send(g.goal(max_new_tokens=4))
            served['accepted'] = run.accepted
            if run.accepted:
                served['status'] = run.wait(30.0).status

    t = threading.Thread(target=client)
    t.start()
    assert _change(g, Transition.TRANSITION_CONFIGURE)
    assert g.node.lifecycle_state == 'inactive'
    time.sleep(1.0)
    assert not served  # configured but inactive: still no server
    assert _change(g, Transition.TRANSITION_ACTIVATE)
    t.join(60.0)
    assert served == {'accepted': True, 'status': GoalStatus.STATUS_SUCCEEDED}


def test_get_state_answers_during_a_long_configure(llm_graph, monkeypatch):
    from selectinfer_ros.core.serving import runtime
    real_init = runtime.Runtime.__init__
    loading, release = threading.Event(), threading.Event()

    def held_init(self, *a, **k):  # the real load, held until the test has its answer
        loading.set()
        assert release.wait(60.0)
        real_init(self, *a, **k)

    monkeypatch.setattr(runtime.Runtime, '__init__', held_init)
    g = llm_graph()
    done = {}
    t = threading.Thread(target=lambda: done.update(ok=_change(g, Transition.TRANSITION_CONFIGURE)))
    t.start()
    try:
        assert loading.wait(30.0)  # configure is running and cannot end before release
        state = g.call(GetState, 'selectinfer_node/get_state', GetState.Request(), timeout=30.0)
        assert state.current_state.id == State.TRANSITION_STATE_CONFIGURING
        arr = g.node.publish_diagnostics()  # diagnostics say why nothing is served yet
        assert 'no model loaded (loading)' in arr.status[0].message
    finally:
        release.set()
        t.join(60.0)
    assert done == {'ok': True}
    state = g.call(GetState, 'selectinfer_node/get_state', GetState.Request())
    assert state.current_state.id == State.PRIMARY_STATE_INACTIVE


def test_deactivate_ends_goals_with_a_reason_then_reactivate_and_cleanup(llm_graph, wait_until):
    g = llm_graph(max_new_tokens_limit=2048, queue_length=2).ready()
    running = g.send(g.goal(max_new_tokens=2000))
    waiting = g.send(g.goal('w8 w9', max_new_tokens=4))
    assert running.accepted and waiting.accepted
    assert running.wait_feedback(2, 30.0)
    assert _change(g, Transition.TRANSITION_DEACTIVATE)
    running.wait(30.0)
    waiting.wait(30.0)
    for run in (running, waiting):
        assert run.status == GoalStatus.STATUS_ABORTED
        assert run.result.error_code == R.NO_MODEL
        assert run.result.error_msg.startswith('node deactivating')
        assert run.result.finish_reason == 'aborted'  # agrees with the status
    assert 0 < running.result.generated_tokens < 2000  # ended within a few steps, not at 2000
    assert wait_until(lambda: running.result.text == running.text(), 5.0)  # feedback may trail
    assert wait_until(lambda: not g.action.server_is_ready(), 10.0)  # the server is gone
    assert g.node.runtime is not None  # inactive keeps the model
    assert _change(g, Transition.TRANSITION_ACTIVATE)
    assert g.action.wait_for_server(timeout_sec=10.0)
    assert g.run(g.goal(max_new_tokens=3)).status == GoalStatus.STATUS_SUCCEEDED
    assert _change(g, Transition.TRANSITION_DEACTIVATE)
    assert _change(g, Transition.TRANSITION_CLEANUP)
    assert g.node.runtime is None and g.node.lifecycle_state == 'unconfigured'


def test_canceled_waiting_goal_frees_its_slot_at_once(llm_graph):
    g = llm_graph(max_new_tokens_limit=2048, queue_length=1).ready()
    running = g.send(g.goal(max_new_tokens=2000))
    assert running.accepted and running.wait_feedback(1, 30.0)
    waiting = g.send(g.goal('w8 w9', max_new_tokens=4))
    assert waiting.accepted
    assert 'queue' in g.send(g.goal('w1', max_new_tokens=4)).refused()  # queue full
    waiting.cancel()
    waiting.wait(10.0)
    assert waiting.status == GoalStatus.STATUS_CANCELED and waiting.feedback == []
    third = g.send(g.goal('w2', max_new_tokens=4))
    assert third.accepted  # the canceled goal's slot, while the first still runs
    assert running.result_future.done() is False
    running.cancel()
    assert running.wait(30.0).status == GoalStatus.STATUS_CANCELED
    assert third.wait(30.0).status == GoalStatus.STATUS_SUCCEEDED
