"""Switch the active task profile through the profile manager (no ros2cli needed).

    python -m selectinfer_ros.ros.tools.switch translation

Prints the reload time and bytes read; exit status 0 on success, 1 when refused (unknown task,
corrupt profile, manager not active), 2 when the service is not found. ``--direct`` calls the
inference node's ``reload_base`` instead (when no profile manager runs).
"""
from __future__ import annotations

import argparse
import sys

from ..plumbing import human_bytes, ns_name


def main(argv: list[str] | None = None) -> int:
    from selectinfer_msgs.srv import ReloadBase

    from ..client import STATUS_NO_SERVER, STATUS_SUCCEEDED, STATUS_TIMEOUT, LLMClient, ServiceCall
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.ros.tools.switch",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("--namespace", default="llm")
    ap.add_argument("--direct", action="store_true",
                    help="call the inference node's reload_base (no profile manager)")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    with LLMClient.start("selectinfer_switch", args.namespace, server_timeout=10.0) as llm:
        if args.direct:
            name = ns_name(args.namespace, "reload_base")
            client = llm.node.create_client(ReloadBase, name)
            if not client.wait_for_service(timeout_sec=10.0):
                print(f"no service {name}", file=sys.stderr)
                return 2
            out = ServiceCall(client.call_async(ReloadBase.Request(task=args.task))).wait(args.timeout)
        else:
            name = llm.switch_name
            out = llm.switch_profile(args.task, args.timeout)
        if out.status == STATUS_NO_SERVER:
            print(f"no service {name} (is the profile manager configured?)", file=sys.stderr)
            return 2
        if out.status == STATUS_TIMEOUT:
            print(f"{name} did not answer within {args.timeout:g} s", file=sys.stderr)
            return 1
        resp = out.result
        if out.status != STATUS_SUCCEEDED:
            active = resp.active_task if resp is not None else ""
            print(f"refused: {out.error_msg} (active task: {active or '-'})")
            return 1
        print(f"active task {resp.active_task}: reload {resp.reload_seconds:.3f} s, "
              f"{human_bytes(resp.bytes_read)} read ({resp.message})")
        return 0


if __name__ == "__main__":
    sys.exit(main())
