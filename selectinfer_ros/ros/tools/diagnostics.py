"""Print one diagnostics message of the inference node (no ros2cli needed).

    python -m selectinfer_ros.ros.tools.diagnostics            # /llm/diagnostics
    python -m selectinfer_ros.ros.tools.diagnostics --topic /diagnostics

Exit status 0 when a message arrived, 1 after the timeout.
"""
from __future__ import annotations

import argparse
import sys
import threading

from ..plumbing import RosClient, ns_name


def main(argv: list[str] | None = None) -> int:
    from diagnostic_msgs.msg import DiagnosticArray

    from ..plumbing import format_array
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.ros.tools.diagnostics",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--namespace", default="llm")
    ap.add_argument("--topic", default="", help="topic (default: <namespace>/diagnostics)")
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    topic = args.topic or ns_name(args.namespace, "diagnostics")
    got: list = []
    event = threading.Event()

    def on_msg(msg):
        if not got:
            got.append(msg)
            event.set()

    with RosClient("selectinfer_diagnostics") as c:
        c.node.create_subscription(DiagnosticArray, topic, on_msg, 10)
        if not event.wait(args.timeout):
            print(f"no message on {topic} within {args.timeout:g} s", file=sys.stderr)
            return 1
    print(f"{topic}:")
    print(format_array(got[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
