"""A patrol robot's behaviour tree that asks the LLM: ``python -m selectinfer_ros.ros.examples.bt_patrol``.

Against running nodes (``python -m selectinfer_ros.ros.bringup`` in another shell, or the launch
file): switch to the ``navigation`` profile, *choose* the next room from a described scene
(kitchen, hall or dock: an answer the tree can branch on), with ``decide`` also *decide* the
action as a JSON object valid under ACTION_SCHEMA (``GenerateJSON``: ``/action``), switch to the
``scene`` profile, and *generate* the short status line the robot would say. Prints the tree (ASCII) after every tick
that changed it and the blackboard at the end; exit status 0 when the tree succeeded.
"""
from __future__ import annotations

import argparse
import sys
import time

import py_trees
from py_trees.common import Status

from ..behaviours import Choose, Generate, GenerateJSON, SwitchProfile, close_shared_clients

ROOMS = ["kitchen", "hall", "dock"]
NEXT_ROOM_PROMPT = (
    "Where should the robot go next?\n"
    "Scene: The battery is at 8 percent.\nRoom: dock\n"
    "Scene: Someone spilled juice next to the fridge.\nRoom: kitchen\n"
    "Scene: A guest is waiting at the entrance.\nRoom: hall\n"
    "Scene: {scene}\nRoom:")
STATUS_PROMPT = (
    "The robot tells the operator what it does next, in one short sentence.\n"
    "Scene: The battery is at 8 percent. Destination: dock\n"
    "Robot: My battery is low, so I am going to the dock.\n"
    "Scene: {scene} Destination: {next_room}\nRobot:")
# the action decision: an object the tree can act on (GenerateJSON writes it to /action)
ACTION_SCHEMA = {
    "type": "object",
    "properties": {"action": {"enum": ["goto", "dock", "wait"]},
                   "target": {"enum": ROOMS},
                   "speed": {"type": "number", "minimum": 0.1, "maximum": 1.0}},
    "required": ["action", "target", "speed"], "additionalProperties": False}
ACTION_PROMPT = (
    "The robot decides its next action as JSON.\n"
    "Scene: The battery is at 8 percent.\n"
    'Action: {{"action":"dock","target":"dock","speed":0.3}}\n'
    "Scene: A guest is waiting at the entrance.\n"
    'Action: {{"action":"goto","target":"hall","speed":0.8}}\n'
    "Scene: {scene}\nAction: ")
DEFAULT_SCENE = "Two visitors are waiting at the front door of the hall."


def create_root(namespace: str = "llm", choose_task: str = "navigation",
                status_task: str = "scene", max_new_tokens: int = 24,
                result_timeout: float = 120.0, decide: bool = False) -> py_trees.behaviour.Behaviour:
    """The patrol tree; it reads ``/scene`` and writes ``/next_room``, ``/next_room_index``,
    ``/status`` and ``/llm/error`` (with ``decide`` also ``/action``)."""
    common = dict(namespace=namespace, result_timeout=result_timeout)
    root = py_trees.composites.Sequence("patrol", memory=True)
    root.add_children([
        SwitchProfile(f"profile {choose_task}", choose_task, namespace=namespace),
        Choose("where next?", NEXT_ROOM_PROMPT, ROOMS, choice_key="/next_room",
               index_key="/next_room_index", **common),
    ] + ([GenerateJSON("decide action", ACTION_PROMPT, schema=ACTION_SCHEMA, value_key="/action",
                       text_key="/action_text", max_new_tokens=64, **common)] if decide else []) + [
        SwitchProfile(f"profile {status_task}", status_task, namespace=namespace),
        Generate("status line", STATUS_PROMPT, text_key="/status", max_new_tokens=max_new_tokens,
                 stop=["\n"], **common),
    ])
    return root


def main(argv: list[str] | None = None) -> int:
    import rclpy
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.node import Node

    from ..plumbing import init_context, spin_in_background
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.ros.examples.bt_patrol",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--scene", default=DEFAULT_SCENE, help="what the robot sees")
    ap.add_argument("--namespace", default="llm")
    ap.add_argument("--no-decide", action="store_true", help="leave out the JSON action decision")
    ap.add_argument("--period", type=float, default=0.1, help="seconds between ticks")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole tree")
    args = ap.parse_args(argv)

    context = init_context()
    node = Node("bt_patrol", context=context)
    root = create_root(args.namespace, decide=not args.no_decide)
    tree = py_trees.trees.BehaviourTree(root)
    writer = py_trees.blackboard.Client(name="scene input")
    writer.register_key("/scene", access=py_trees.common.Access.WRITE)
    writer.scene = args.scene
    executor = MultiThreadedExecutor(num_threads=2, context=context)
    rc = 1
    try:
        tree.setup(node=node)  # before the node spins: the behaviours make their clients here
    except (TimeoutError, KeyError) as e:
        print(f"bt_patrol: {e} (are the nodes running? python -m selectinfer_ros.ros.bringup)",
              file=sys.stderr)
        node.destroy_node()
        rclpy.shutdown(context=context)
        return 2
    executor.add_node(node)

    spinner = spin_in_background(executor, "bt_patrol-spin")
    try:
        deadline = time.monotonic() + args.timeout
        last: list = []
        while root.status in (Status.INVALID, Status.RUNNING) and time.monotonic() < deadline:
            tree.tick()
            states = [(b.name, b.status) for b in root.iterate()]
            if states != last:  # print when a status changed (not on every streamed token)
                print(py_trees.display.ascii_tree(root, show_status=True), flush=True)
                last = states
            time.sleep(args.period)
        print(py_trees.display.unicode_blackboard())
        rc = 0 if root.status == Status.SUCCESS else 1
    except KeyboardInterrupt:
        pass
    finally:
        tree.shutdown()  # cancels a goal still running
        time.sleep(0.2)  # let the cancel request go out
        executor.shutdown(timeout_sec=3.0)
        spinner.join(3.0)
        close_shared_clients(node)
        node.destroy_node()
        if context.ok():
            rclpy.shutdown(context=context)
    return rc


if __name__ == "__main__":
    sys.exit(main())
