r"""Send a Generate goal and print the streamed text and the result (no ros2cli needed).

    python -m selectinfer_ros.tools.generate "The three primary colors are" --task qa
    python -m selectinfer_ros.tools.generate "Question: What is the capital of France?\nAnswer:"

Escape sequences in the prompt and stop strings (``\n``, ``\t``, ``\xHH`` ...) become the
characters they name, as llama.cpp does; ``--no-escape`` keeps the text as typed.

Exit status 0 when the goal SUCCEEDED; 1 when it was rejected, aborted or canceled; 2 when the
server was not found. Ctrl-C cancels the goal and prints the partial text.
"""
from __future__ import annotations

import argparse
import sys
import time

from .common import RosClient, format_result, ns_name


def build_goal(args):
    from selectinfer_msgs.action import Generate

    from ..core.escapes import process_escapes
    text = (lambda s: s) if args.no_escape else process_escapes
    return Generate.Goal(
        prompt=text(args.prompt), task=args.task, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
        stop=[text(s) for s in args.stop], use_chat_template=args.chat,
        compute_ratio=args.compute_ratio)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.tools.generate",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--task", default="", help="task profile (default: the active one)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = the node's default")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.0, help="0 = off")
    ap.add_argument("--repetition-penalty", type=float, default=0.0, help="0 = off")
    ap.add_argument("--seed", type=int, default=-1, help="-1 = random")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--chat", action="store_true", help="apply the model's chat template")
    ap.add_argument("--compute-ratio", type=float, default=0.0, help="0 = the node's default")
    ap.add_argument("--no-escape", action="store_true",
                    help="keep \\n, \\t, \\xHH ... in the prompt and stop strings as typed")
    ap.add_argument("--namespace", default="llm")
    ap.add_argument("--server-timeout", type=float, default=10.0,
                    help="seconds to wait for the action server")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the result")
    return ap


def main(argv: list[str] | None = None) -> int:
    from rclpy.action import ActionClient

    from selectinfer_msgs.action import Generate
    args = parser().parse_args(argv)
    out = sys.stdout
    name = ns_name(args.namespace, "generate")
    with RosClient("selectinfer_generate", before_spin=lambda n: ActionClient(n, Generate, name)) as c:
        client = c.prepared
        if not client.wait_for_server(timeout_sec=args.server_timeout):
            print(f"no action server {name} (is selectinfer_node running on this "
                  f"ROS_DOMAIN_ID?)", file=sys.stderr)
            return 2

        def on_feedback(msg):
            out.write(msg.feedback.text_delta)
            out.flush()

        handle = c.wait(client.send_goal_async(build_goal(args), feedback_callback=on_feedback),
                        args.server_timeout)
        if handle is None or not handle.accepted:
            print(f"goal rejected by {name} (the node's log says why: empty prompt, unknown "
                  f"task, prompt too long, limits, or queue full)", file=sys.stderr)
            return 1
        future = handle.get_result_async()
        try:
            response = c.wait(future, args.timeout)
        except KeyboardInterrupt:
            c.wait(handle.cancel_goal_async(), 5.0)
            response = c.wait(future, 10.0)
        if response is None:
            print(f"\nno result within {args.timeout:g} s; canceling", file=sys.stderr)
            c.wait(handle.cancel_goal_async(), 5.0)
            return 1
        time.sleep(0.05)  # let the last feedback messages print before the summary
        out.write("\n")
        print("--- " + format_result(response.status, response.result))
        client.destroy()
        from action_msgs.msg import GoalStatus
        return 0 if response.status == GoalStatus.STATUS_SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
