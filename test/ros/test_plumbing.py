"""The shared rclpy plumbing: an executor whose callbacks keep failing ends the process with a
message and a non-zero status (it used to stop spinning silently and leave the process deaf)."""
import subprocess
import sys
import textwrap


def test_spin_in_background_logs_and_ends_the_process_when_it_cannot_go_on(ros_test_env):
    script = textwrap.dedent("""
        import time
        from rclpy.executors import MultiThreadedExecutor
        from rclpy.node import Node
        from selectinfer_ros.ros.plumbing import init_context, spin_in_background

        context = init_context()
        node = Node("failing_timer", context=context)
        calls = []

        def fail():
            calls.append(1)
            if len(calls) == 1 or len(calls) > 3:
                raise RuntimeError(f"injected {len(calls)}")
        node.create_timer(0.01, fail)
        executor = MultiThreadedExecutor(num_threads=2, context=context)
        executor.add_node(node)
        spin_in_background(executor, "test-spin")
        time.sleep(60)
        print("still running")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 70, out.stderr[-2000:]
    assert "still running" not in out.stdout
    assert "[test-spin] a callback raised RuntimeError: injected 1" in out.stderr
    assert "Traceback" in out.stderr
    assert "the executor cannot go on; ending the process (status 70)" in out.stderr
    # after the first failure it went on spinning: calls 2 and 3 ran (they did not raise)
    assert "injected 2\n" not in out.stderr and "injected 4\n" in out.stderr
