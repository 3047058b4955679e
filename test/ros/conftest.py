"""Fixtures for tests against a real ROS 2 (rclpy) graph, kept on this machine.

The DDS traffic stays on loopback: ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (kilted+),
ROS_LOCALHOST_ONLY=1 (Humble), and a ROS_DOMAIN_ID chosen at random per run unless the
caller set one (scripts/run_tests.sh does).
"""
import os
import random
import threading
import time

import pytest


@pytest.fixture(scope='session', autouse=True)
def ros_test_env():
    """Set the DDS isolation variables before any rclpy.init of the session."""
    if not os.environ.get('ROS_DOMAIN_ID'):
        rng = random.Random(os.getpid() ^ time.time_ns())
        os.environ['ROS_DOMAIN_ID'] = str(rng.randint(1, 100))
    os.environ['ROS_AUTOMATIC_DISCOVERY_RANGE'] = 'LOCALHOST'
    os.environ.setdefault('ROS_LOCALHOST_ONLY', '1')
    yield {'ROS_DOMAIN_ID': os.environ['ROS_DOMAIN_ID']}


@pytest.fixture
def ros_context(ros_test_env):
    """A fresh rclpy context per test: rclpy.init(context=...) / rclpy.shutdown(context=...)."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    try:
        yield context
    finally:
        if context.ok():
            rclpy.shutdown(context=context)


class SpinningExecutor:
    """A MultiThreadedExecutor spinning in a background thread, with bounded shutdown."""

    def __init__(self, context, num_threads=4):
        from rclpy.executors import MultiThreadedExecutor

        self.executor = MultiThreadedExecutor(num_threads=num_threads, context=context)
        self.nodes = []
        self._thread = threading.Thread(target=self._spin, name='ros-spin', daemon=True)
        self.error = None

    def _spin(self):
        try:
            self.executor.spin()
        except Exception as exc:  # pragma: no cover - surfaced by the fixture
            self.error = exc

    def add_node(self, node):
        self.nodes.append(node)
        self.executor.add_node(node)
        return node

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout=5.0):
        self.executor.shutdown(timeout_sec=timeout)
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        for node in reversed(self.nodes):
            node.destroy_node()
        self.nodes.clear()
        return not alive


@pytest.fixture
def spinning_executor(ros_context):
    """Yields a started SpinningExecutor; nodes added to it are destroyed afterwards."""
    spinner = SpinningExecutor(ros_context).start()
    try:
        yield spinner
    finally:
        stopped = spinner.stop()
        assert spinner.error is None, f'executor raised: {spinner.error!r}'
        assert stopped, 'executor thread did not stop within 5 s'


def _wait_until(predicate, timeout, interval=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def _wait_for_future(future, timeout):
    """Block until an rclpy future is done (the executor thread completes it)."""
    if not _wait_until(future.done, timeout):
        raise TimeoutError(f'rclpy future not done within {timeout} s')
    return future.result()


@pytest.fixture
def wait_until():
    """wait_until(predicate, timeout) -> bool, polling; never blocks past timeout."""
    return _wait_until


@pytest.fixture
def wait_for_future():
    """wait_for_future(future, timeout) -> result; raises TimeoutError."""
    return _wait_for_future
