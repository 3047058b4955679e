"""selectinfer_ros.ros.safe_action: action entities destroyed while a real executor spins their node.

In this loop rclpy's own ActionClient.destroy() kills the executor thread within the first
~100 rounds (``RCLError: ... action client pointer is invalid``); the safe classes must not.
"""
import time
import uuid

import pytest

from selectinfer_msgs.action import Generate
from selectinfer_ros.ros.safe_action import SafeActionClient, SafeActionServer

ROUNDS = 200


def _make_client(node):
    return SafeActionClient(node, Generate, 'generate')


def _make_server(node):
    return SafeActionServer(node, Generate, 'generate', execute_callback=lambda handle: None)


@pytest.mark.parametrize('make', [_make_client, _make_server], ids=['client', 'server'])
def test_destroy_while_the_executor_spins_leaves_it_running(spinning_executor, make):
    from rclpy.node import Node

    context = spinning_executor.executor.context
    prefix = f'safe_{uuid.uuid4().hex[:6]}'
    for i in range(ROUNDS):
        node = Node(f'{prefix}_{i}', context=context)
        entity = make(node)  # made before the node spins (rclpy's construction is not safe)
        spinning_executor.add_node(node)
        time.sleep(0.002)
        entity.destroy()
        spinning_executor.executor.remove_node(node)
        assert spinning_executor.error is None, f'round {i}: {spinning_executor.error!r}'
    entity.destroy()  # a second destroy is a no-op
    assert not entity.is_ready(None) and entity.take_data() == {}


def test_a_destroyed_client_leaves_the_graph(spinning_executor, wait_until):
    from rclpy.action.graph import get_action_client_names_and_types_by_node
    from rclpy.node import Node

    context = spinning_executor.executor.context
    name = f'safe_{uuid.uuid4().hex[:6]}'
    holder = Node(name, context=context)
    client = _make_client(holder)
    observer = spinning_executor.add_node(Node(f'{name}_observer', context=context))
    spinning_executor.add_node(holder)

    def listed():
        return get_action_client_names_and_types_by_node(observer, name, '/')

    assert wait_until(lambda: listed() != [], 10.0)
    client.destroy()
    assert wait_until(lambda: listed() == [], 10.0)
