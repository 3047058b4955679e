"""A real rclpy ActionServer/ActionClient pair speaking selectinfer_msgs/action/Generate.

The text source is a stand-in generator defined here (not part of the package); the point
is the ROS contract: goal -> several feedback messages (text deltas) -> result, and
cancellation mid-stream ending CANCELED with the partial text.
"""
import threading
import time

import pytest
from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient, ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup

from selectinfer_msgs.action import Generate

ACTION_NAME = 'test_generate'
WORDS = ('the robot moves the red cup to the table and then returns to its dock '
         'waiting for the next instruction from the operator').split()


def stand_in_text_source(prompt, max_new_tokens):
    """Yields ' word' deltas like a token streamer (deterministic, prompt-independent)."""
    for i in range(max_new_tokens):
        yield (' ' if i else '') + WORDS[i % len(WORDS)]


class StandInGenerateServer:
    """Generate action server over the stand-in source; step_s paces the stream."""

    def __init__(self, node, step_s):
        self.node = node
        self.step_s = step_s
        self.executed = threading.Event()
        self._server = ActionServer(
            node, Generate, ACTION_NAME,
            execute_callback=self.execute,
            goal_callback=self.on_goal,
            cancel_callback=lambda _goal_handle: CancelResponse.ACCEPT,
            callback_group=ReentrantCallbackGroup())

    def on_goal(self, goal):
        if not goal.prompt:
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def execute(self, goal_handle):
        goal = goal_handle.request
        limit = goal.max_new_tokens or 16
        result = Generate.Result(profile=goal.task or 'default', load_ratio=1.0,
                                 compute_ratio=goal.compute_ratio or 1.0,
                                 prompt_tokens=len(goal.prompt.split()))
        t0 = time.monotonic()
        text, n = '', 0
        for delta in stand_in_text_source(goal.prompt, limit):
            if goal_handle.is_cancel_requested:
                break
            if n == 0:
                result.time_to_first_token = time.monotonic() - t0
            text += delta
            n += 1
            tps = n / max(time.monotonic() - t0, 1e-6)
            goal_handle.publish_feedback(Generate.Feedback(
                text_delta=delta, generated_tokens=n, tokens_per_second=tps))
            time.sleep(self.step_s)
        result.text = text
        result.generated_tokens = n
        result.tokens_per_second = n / max(time.monotonic() - t0, 1e-6)
        if goal_handle.is_cancel_requested:
            result.finish_reason = 'canceled'
            result.error_code = Generate.Result.CANCELED
            result.error_msg = 'canceled by client'
            goal_handle.canceled()
        else:
            result.finish_reason = 'length'
            goal_handle.succeed()
        self.executed.set()
        return result

    def destroy(self):
        self._server.destroy()


@pytest.fixture
def action_pair(spinning_executor, wait_until):
    from rclpy.node import Node

    context = spinning_executor.executor.context
    server_node = spinning_executor.add_node(
        Node('generate_server', context=context))
    server = StandInGenerateServer(server_node, step_s=0.02)
    client_node = Node('generate_client', context=context)
    # before the node spins: rclpy's ActionClient registers itself before its lock exists
    client = ActionClient(client_node, Generate, ACTION_NAME,
                          callback_group=ReentrantCallbackGroup())
    spinning_executor.add_node(client_node)
    assert client.wait_for_server(timeout_sec=10.0), 'action server not discovered'
    try:
        yield server, client
    finally:
        client.destroy()
        server.destroy()


class FeedbackLog:
    def __init__(self):
        self.lock = threading.Lock()
        self.items = []

    def __call__(self, feedback_msg):
        with self.lock:
            self.items.append(feedback_msg.feedback)

    def __len__(self):
        with self.lock:
            return len(self.items)

    def text(self):
        with self.lock:
            return ''.join(f.text_delta for f in self.items)


@pytest.mark.timeout(60)
def test_goal_feedback_result(action_pair, wait_for_future, wait_until):
    server, client = action_pair
    feedback = FeedbackLog()
    goal = Generate.Goal(prompt='Where is the cup?', task='qa', max_new_tokens=8,
                         seed=-1, compute_ratio=0.5)
    goal_handle = wait_for_future(
        client.send_goal_async(goal, feedback_callback=feedback), timeout=10.0)
    assert goal_handle.accepted
    response = wait_for_future(goal_handle.get_result_async(), timeout=20.0)

    assert response.status == GoalStatus.STATUS_SUCCEEDED
    result = response.result
    expected = ''.join(stand_in_text_source(goal.prompt, 8))
    assert result.text == expected
    assert result.error_code == Generate.Result.NONE
    assert result.finish_reason == 'length'
    assert result.generated_tokens == 8
    assert result.prompt_tokens == 4
    assert result.profile == 'qa'
    assert result.compute_ratio == 0.5
    assert result.tokens_per_second > 0.0
    assert result.time_to_first_token >= 0.0

    # Feedback is best effort (a separate topic): all of it arrives on loopback in practice,
    # but only the in-order prefix property is a contract.
    assert wait_until(lambda: len(feedback) >= 8, timeout=5.0), len(feedback)
    assert feedback.text() == expected
    counts = [f.generated_tokens for f in feedback.items]
    assert counts == sorted(counts) and counts[-1] == 8


@pytest.mark.timeout(60)
def test_rejected_goal(action_pair, wait_for_future):
    _server, client = action_pair
    goal_handle = wait_for_future(client.send_goal_async(Generate.Goal(prompt='')),
                                  timeout=10.0)
    assert not goal_handle.accepted


@pytest.mark.timeout(60)
def test_cancel_mid_stream(action_pair, wait_for_future, wait_until):
    server, client = action_pair
    server.step_s = 0.05
    feedback = FeedbackLog()
    goal = Generate.Goal(prompt='Tell a long story.', max_new_tokens=400)
    goal_handle = wait_for_future(
        client.send_goal_async(goal, feedback_callback=feedback), timeout=10.0)
    assert goal_handle.accepted
    result_future = goal_handle.get_result_async()

    assert wait_until(lambda: len(feedback) >= 3, timeout=15.0), 'no feedback stream'
    cancel_response = wait_for_future(goal_handle.cancel_goal_async(), timeout=10.0)
    assert len(cancel_response.goals_canceling) == 1

    response = wait_for_future(result_future, timeout=20.0)
    assert response.status == GoalStatus.STATUS_CANCELED
    result = response.result
    full = ''.join(stand_in_text_source(goal.prompt, 400))
    assert result.finish_reason == 'canceled'
    assert result.error_code == Generate.Result.CANCELED
    assert 3 <= result.generated_tokens < 400
    assert result.text and full.startswith(result.text)
    assert len(result.text.split()) == result.generated_tokens
    assert wait_until(lambda: len(feedback) >= result.generated_tokens, timeout=5.0)
    assert feedback.text() == result.text
