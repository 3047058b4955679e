r"""Several callers at once against a running node: time to first feedback and throughput.

    python -m selectinfer_ros.ros.tools.callers --clients 4 --rounds 5 --prompt-tokens 64

Each round, ``--clients`` action clients (each its own ROS context and node, as separate behaviour
trees would be) send one goal each at the same instant, as soon as every client's
``wait_for_server`` has returned; the round ends when all results are in. Prints per round the
time from sending to each goal's first feedback, then p50 / p95 over all goals, and the goals'
tokens together per second of the round (the node's aggregate decode rate, prefills included).
Exit status 1 when a goal did not succeed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def _prompt(i: int, words: int) -> str:
    """A distinct prompt of about ``words`` tokens per caller (a scene description)."""
    things = ["door", "table", "charger", "shelf", "person", "box", "window", "chair", "robot",
              "cup", "cable", "lamp"]
    scene = " ".join(f"a {things[(i + k) % len(things)]} at {k} m," for k in range(words // 5))
    return f"Scene: {scene} and the dock. Caller {i}: what should the robot do next? Answer:"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--namespace", default="llm")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="about this many per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--server-timeout", type=float, default=30.0)
    args = ap.parse_args(argv)

    from ..client import LLMClient
    clients = [LLMClient.start(f"selectinfer_caller{i}", args.namespace)
               for i in range(args.clients)]
    firsts: list[float] = []
    failed = 0
    try:
        for c in clients:
            if not c.action.wait_for_server(timeout_sec=args.server_timeout):
                print(f"no action server {c.action_name}", file=sys.stderr)
                return 1
        for r in range(args.rounds):
            first: dict[int, float] = {}
            lock = threading.Lock()

            def on_feedback(fb, i: int) -> None:
                with lock:
                    first.setdefault(i, time.perf_counter())
            t0 = time.perf_counter()
            handles = [c.generate_async(_prompt(i + r, args.prompt_tokens),
                                        max_new_tokens=args.max_new_tokens, temperature=0.0,
                                        on_feedback=lambda fb, i=i: on_feedback(fb, i))
                       for i, c in enumerate(clients)]
            outcomes = [h.wait() for h in handles]
            wall = time.perf_counter() - t0
            tokens = sum(o.result.generated_tokens for o in outcomes if o.result is not None)
            bad = [o for o in outcomes if not o.ok]
            failed += len(bad)
            waits = [first[i] - t0 for i in sorted(first)]
            firsts += waits
            print(f"round {r}: first feedback {', '.join(f'{w:.2f}' for w in waits)} s; "
                  f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s together)"
                  + (f"; {len(bad)} not succeeded: {bad[0].status} {bad[0].error_msg}" if bad
                     else ""))
        if firsts:
            q = statistics.quantiles(firsts, n=20, method="inclusive")
            print(f"time to first feedback over {len(firsts)} goals ({args.clients} callers at "
                  f"once): p50 {statistics.median(firsts):.2f} s, p95 {q[18]:.2f} s, max "
                  f"{max(firsts):.2f} s")
    finally:
        for c in clients:
            c.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
