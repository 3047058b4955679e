"""The whole flow on the embedded model, through ROS 2: ``python -m selectinfer_ros.ros.demo``.

Starts ``selectinfer_node`` and ``profile_manager`` in this process (``selectinfer_ros.ros.bringup``
with config/desktop.yaml: the embedded Gemma 3 270M on the CPU), configures and activates the
profile manager, sends a Generate goal and prints the text as it streams in, switches the task
profile once (reload seconds and bytes read against the full model load), prints one
diagnostics message, and shuts everything down. Exit status 0 when every step worked.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("SELECTINFER_QUIET", "1")
    from diagnostic_msgs.msg import DiagnosticArray

    from ..core.options import ParamError
    from .bringup import Bringup, add_arguments, overrides_from_args, resolve_params_file
    from .plumbing import format_array, format_result, human_bytes

    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.ros.demo",
                                 description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--prompt", default="The three primary colors are", help="the goal's prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="the goal's max_new_tokens")
    ap.add_argument("--switch-to", default="", help="task to switch to (default: another one)")
    args = ap.parse_args(argv)
    out = sys.stdout

    def say(msg: str = "") -> None:
        print(msg, file=out, flush=True)

    try:
        params_file = resolve_params_file(args.params)
        overrides = overrides_from_args(args)  # refused as the node refuses its parameters
    except (FileNotFoundError, ParamError) as e:
        say(f"demo: {e}")
        return 2
    say(f"== selectinfer ROS 2 demo: parameters {params_file}, namespace /{args.namespace} ==")
    t0 = time.perf_counter()
    try:
        bringup = Bringup(params_file, args.namespace, overrides)
    except ParamError as e:
        say(f"parameter refused: {e}")
        return 2
    try:
        say("[1/4] starting selectinfer_node and profile_manager (configure -> activate) ...")
        bringup.configure_and_activate()
        node, manager = bringup.inference, bringup.manager
        rt = node.runtime
        say(f"      {rt.model_id} on {rt.device}: {human_bytes(rt.bytes_read)} read in "
            f"{rt.load_seconds:.2f} s (load_ratio {rt.load_ratio:g}, compute_ratio "
            f"{rt.compute_ratio:g}); tasks {', '.join(rt.tasks) or '-'}; active "
            f"{manager.active_task!r}; ready after {time.perf_counter() - t0:.1f} s")
        client_node = bringup.helper

        # ---- a Generate goal, streamed -------------------------------------------------------
        llm = bringup.llm
        if not llm.wait_for_server(10.0):
            raise RuntimeError("generate action server not found")
        task = rt.task
        say(f"[2/4] goal on {node.get_namespace()}/generate (task {task!r}): {args.prompt!r}")
        out.write("      >>> " + args.prompt)
        out.flush()

        def on_feedback(fb):
            out.write(fb.text_delta.replace("\n", "\n          "))
            out.flush()

        outcome = llm.generate_async(args.prompt, on_feedback=on_feedback, task=task,
                                     max_new_tokens=args.max_new_tokens, stop=["\n\n"]).wait(600.0)
        out.write("\n")
        if outcome.result is None:
            raise RuntimeError(f"{outcome.status}: {outcome.error_msg}")
        say("      " + format_result(outcome.status, outcome.result))
        if not outcome.ok:
            raise RuntimeError("the goal did not succeed")

        # ---- one profile switch ----------------------------------------------------------------
        others = [t for t in rt.tasks if t != rt.task]
        target = args.switch_to or next((t for t in ("navigation", "translation", "summarization",
                                                     "scene") if t in others), others[0] if others else "")
        if not target:
            say("[3/4] only one task profile is installed: no switch to show")
        else:
            say(f"[3/4] switch_profile {rt.task!r} -> {target!r} (base-neuron reload)")
            switched = llm.switch_profile(target, 300.0)
            if not switched.ok:
                raise RuntimeError(f"switch refused: {switched.status}: {switched.error_msg}")
            resp = switched.result
            rep = rt.last_switch
            share = resp.bytes_read / rt.bytes_read if rt.bytes_read else 0.0
            say(f"      active {resp.active_task!r}: reload {resp.reload_seconds:.3f} s, "
                f"{human_bytes(resp.bytes_read)} read ({rep.neurons_read} neurons read, "
                f"{rep.neurons_dropped} dropped)")
            say(f"      full model load: {rt.load_seconds:.2f} s, {human_bytes(rt.bytes_read)} read -> the "
                f"switch read {100 * share:.3g} % of the bytes in "
                f"{100 * resp.reload_seconds / max(rt.load_seconds, 1e-9):.3g} % of the time")
            if rep.neurons_read == 0:
                say("      (nothing to read: every neuron is resident at one precision, the fastest "
                    "point at this agreement here; load_ratio < 1, or int8_ratio > 0 on a 4-bit "
                    "pack, makes the switch read the task's neurons)")

        # ---- one diagnostics message ---------------------------------------------------------
        topic = f"{node.get_namespace().rstrip('/')}/diagnostics"
        say(f"[4/4] one message on {topic} (also published on /diagnostics):")
        got: list = []
        event = threading.Event()

        def on_diag(msg):
            if not got:
                got.append(msg)
                event.set()

        sub = client_node.create_subscription(DiagnosticArray, topic, on_diag, 10)
        if not event.wait(10.0):
            raise RuntimeError(f"no diagnostics on {topic}")
        client_node.destroy_subscription(sub)
        for line in format_array(got[0]).splitlines():
            say("      " + line)
        say(f"== done in {time.perf_counter() - t0:.1f} s; shutting down ==")
        return 0
    except (RuntimeError, TimeoutError) as e:
        say(f"demo failed: {e}")
        return 1
    finally:
        bringup.shutdown()


if __name__ == "__main__":
    sys.exit(main())
