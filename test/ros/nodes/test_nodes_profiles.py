"""profile_manager (rclpy LifecycleNode) with selectinfer_node, through real services/topics.

Covers: lifecycle transitions in order work and out of order are refused; a failing configure
stays unconfigured; switch_profile reports reload time and bytes read; active_profile (transient
local) follows switches, also those caused by goals; a switch during a generation waits for it;
a corrupt profile is refused and the previous one keeps working.
"""
import shutil
import threading
import time

from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import State, Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from selectinfer_msgs.msg import ActiveProfile
from selectinfer_msgs.srv import SwitchProfile

T = Transition


def change(g, transition_id, timeout=60.0):
    req = ChangeState.Request()
    req.transition.id = transition_id
    return g.call(ChangeState, 'profile_manager/change_state', req, timeout).success


def state(g):
    return g.call(GetState, 'profile_manager/get_state', GetState.Request()).current_state.id


def switch(g, task, timeout=60.0):
    return g.call(SwitchProfile, 'switch_profile', SwitchProfile.Request(task=task), timeout)


class ProfileLog:
    """Subscription to active_profile with the transient-local QoS (late joiner gets the last)."""

    def __init__(self, g):
        self.msgs = []
        self.lock = threading.Lock()
        qos = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL,
                         reliability=ReliabilityPolicy.RELIABLE)
        self.sub = g.client_node.create_subscription(ActiveProfile, 'active_profile',
                                                     self._on_msg, qos, callback_group=g.group)

    def _on_msg(self, msg):
        with self.lock:
            self.msgs.append(msg)

    def last_task(self):
        with self.lock:
            return self.msgs[-1].task if self.msgs else None


def test_lifecycle_in_order_works_and_out_of_order_is_refused(llm_graph, wait_until, tiny_llm):
    g = llm_graph(manager={'task': 'beta'}).ready()
    assert state(g) == State.PRIMARY_STATE_UNCONFIGURED
    # out of order from unconfigured
    assert not change(g, T.TRANSITION_ACTIVATE)
    assert not change(g, T.TRANSITION_DEACTIVATE)
    assert not change(g, T.TRANSITION_CLEANUP)
    assert state(g) == State.PRIMARY_STATE_UNCONFIGURED
    # configure
    assert change(g, T.TRANSITION_CONFIGURE)
    assert state(g) == State.PRIMARY_STATE_INACTIVE
    assert g.manager.tasks == ['alpha', 'beta']
    assert not change(g, T.TRANSITION_CONFIGURE)  # already configured
    refused = switch(g, 'alpha')
    assert not refused.success and 'not active' in refused.message
    assert g.node.runtime.task == 'alpha'  # nothing applied while inactive
    # activate: applies the initial task and publishes active_profile (transient local)
    assert change(g, T.TRANSITION_ACTIVATE)
    assert state(g) == State.PRIMARY_STATE_ACTIVE
    assert g.node.runtime.task == 'beta'
    log = ProfileLog(g)
    assert wait_until(lambda: log.last_task() == 'beta', 10.0), 'no latched active_profile'
    msg = log.msgs[-1]
    assert msg.model_id == tiny_llm.model_id and abs(msg.load_ratio - 0.7) < 1e-6
    assert abs(msg.static_ratio - 0.3) < 1e-6
    # switches while active
    resp = switch(g, 'alpha')
    assert resp.success, resp.message
    assert resp.active_task == 'alpha' and resp.bytes_read > 0 and resp.reload_seconds > 0
    assert wait_until(lambda: log.last_task() == 'alpha', 10.0)
    unknown = switch(g, 'gamma')
    assert not unknown.success and 'gamma' in unknown.message and unknown.active_task == 'alpha'
    # a goal naming another task switches too; active_profile follows
    run = g.run(g.goal(task='beta', max_new_tokens=3))
    assert run.status == GoalStatus.STATUS_SUCCEEDED and run.result.profile == 'beta'
    assert wait_until(lambda: log.last_task() == 'beta', 10.0)
    # deactivate: switches refused
    assert change(g, T.TRANSITION_DEACTIVATE)
    assert state(g) == State.PRIMARY_STATE_INACTIVE
    refused = switch(g, 'alpha')
    assert not refused.success and 'not active' in refused.message
    assert not change(g, T.TRANSITION_DEACTIVATE)
    # cleanup releases; back to unconfigured, activate refused again
    assert change(g, T.TRANSITION_CLEANUP)
    assert state(g) == State.PRIMARY_STATE_UNCONFIGURED
    assert g.manager.tasks == []
    assert not change(g, T.TRANSITION_ACTIVATE)
    # and the whole cycle works again (active_profile published anew), then shutdown
    published = len(log.msgs)
    assert change(g, T.TRANSITION_CONFIGURE) and change(g, T.TRANSITION_ACTIVATE)
    assert wait_until(lambda: len(log.msgs) > published, 10.0), 'no active_profile after cleanup'
    assert log.last_task() == 'beta'
    assert change(g, T.TRANSITION_ACTIVE_SHUTDOWN)
    assert state(g) == State.PRIMARY_STATE_FINALIZED
    assert not change(g, T.TRANSITION_CONFIGURE)


def test_configure_fails_on_bad_catalogue_and_stays_unconfigured(llm_graph, tmp_path):
    g = llm_graph(manager={'profiles': str(tmp_path / 'nowhere')}).ready()
    assert not change(g, T.TRANSITION_CONFIGURE)
    assert state(g) == State.PRIMARY_STATE_UNCONFIGURED
    g2 = llm_graph(manager={'task': 'gamma'}).ready()
    assert not change(g2, T.TRANSITION_CONFIGURE)
    assert state(g2) == State.PRIMARY_STATE_UNCONFIGURED


def test_switch_during_generation_waits_for_it(llm_graph, wait_for_future):
    g = llm_graph(manager={}).ready()
    assert change(g, T.TRANSITION_CONFIGURE) and change(g, T.TRANSITION_ACTIVATE)
    assert g.node.runtime.task == 'alpha'
    client = g.client_node.create_client(SwitchProfile, 'switch_profile', callback_group=g.group)
    assert client.wait_for_service(timeout_sec=10.0)
    run = g.send(g.goal(max_new_tokens=160))
    assert run.wait_feedback(2, 30.0)
    t_sent = time.monotonic()
    future = client.call_async(SwitchProfile.Request(task='beta'))
    resp = wait_for_future(future, 120.0)
    t_answered = time.monotonic()
    run.wait(120.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert run.result.profile == 'alpha'  # the running goal kept its profile to the end
    assert run.result.generated_tokens == 160 or run.result.finish_reason == 'stop'
    assert t_sent < run.feedback[-1][0], 'the goal had finished before the switch was asked'
    assert resp.success and resp.active_task == 'beta'
    assert t_answered >= run.feedback[-1][0], 'switch answered while the goal was streaming'
    assert g.node.runtime.task == 'beta'
    g.client_node.destroy_client(client)


def test_corrupt_profile_is_refused_and_previous_keeps_working(llm_graph, tiny_llm, tmp_path):
    profiles = tmp_path / 'profiles'
    shutil.copytree(tiny_llm.profiles, profiles)
    g = llm_graph(profiles=str(profiles), manager={}).ready()
    assert change(g, T.TRANSITION_CONFIGURE) and change(g, T.TRANSITION_ACTIVATE)
    rt = g.node.runtime
    loaded_before = [ids.clone() for ids in rt.selective.loaded_neuron_ids()]
    good = (profiles / 'beta.safetensors').read_bytes()
    (profiles / 'beta.safetensors').write_bytes(good[:len(good) // 2])  # truncated
    resp = switch(g, 'beta')
    assert not resp.success
    assert 'beta.safetensors' in resp.message and resp.active_task == 'alpha'
    assert rt.task == 'alpha' and rt.switches == 0
    after = rt.selective.loaded_neuron_ids()
    assert all((a == b).all() for a, b in zip(loaded_before, after)), 'resident set changed'
    run = g.run(g.goal(max_new_tokens=4))
    assert run.status == GoalStatus.STATUS_SUCCEEDED and run.result.profile == 'alpha'
    # repaired file: the switch goes through
    (profiles / 'beta.safetensors').write_bytes(good)
    resp = switch(g, 'beta')
    assert resp.success and resp.active_task == 'beta', resp.message


def test_no_task_parameter_serves_the_general_profile(llm_graph):
    """`task` left empty: the general profile (the fused ranking of every task), not the
    alphabetically first task; the profile manager keeps it."""
    g = llm_graph(manager={}, task='').ready()
    assert change(g, T.TRANSITION_CONFIGURE) and change(g, T.TRANSITION_ACTIVATE)
    rt = g.node.runtime
    assert rt.task == 'general' and 'general' in rt.tasks
    run = g.run(g.goal(max_new_tokens=2), timeout=60.0)
    assert run.result.profile == 'general'
