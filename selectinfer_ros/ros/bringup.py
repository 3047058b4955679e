"""Start ``selectinfer_node`` and ``profile_manager`` in one process, without launch or ros2cli.

    python -m selectinfer_ros.ros.bringup --params config/desktop.yaml

It does what ``launch/jetson.launch.py`` does on a full ROS install: the same parameters YAML
(``<node_name>: ros__parameters:`` blocks, matched by rcl as with ``--params-file``), the same
launch arguments as options (``--model --task --load-ratio --compute-ratio --device --dtype
--namespace``, built from core/options.py: a bad value is refused with the node parameter's
reason, exit 2), and it runs the launch file's bring-up chain (``lifecycle_chain.BRINGUP``)
through the nodes' ``change_state`` services: ``selectinfer_node`` configure (model load) and
activate (the action server appears), then ``profile_manager`` configure and activate. A step
that fails exits 1 with the node, the transition and the reason. Both nodes spin in one
MultiThreadedExecutor. Ctrl-C (or SIGTERM) ends the running goal within a decode step (its
client gets the result with the reason), shuts both nodes down and exits 0.

Arguments after ``--ros-args`` (log levels, remappings, ``-p name:=value`` for both nodes) go
to rcl.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import fields
from pathlib import Path

import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter

from ..core import options
from ..core.options import ManagerSettings, NodeSettings, ParamError, given_values
from .lifecycle_chain import BRINGUP, INFERENCE, MANAGER, Interrupted, StepFailed, run_chain
from .plumbing import init_context, ns_name, spin_in_background

CONFIG_NAMES = ("desktop.yaml", "jetson_orin_nano.yaml")


def config_dir() -> Path:
    """``config/`` of the source checkout, or ``share/selectinfer_ros/config`` when installed."""
    from ..core.format.paths import REPO_ROOT, share_dir
    if (REPO_ROOT / "config").is_dir():
        return REPO_ROOT / "config"
    share = share_dir()
    return share / "config" if share else REPO_ROOT / "config"


def resolve_params_file(name: str | None) -> Path | None:
    """A parameters file by path, or by name in the package's config folder."""
    if not name:
        return None
    p = Path(name)
    if p.is_file():
        return p
    for candidate in (config_dir() / p.name, config_dir() / f"{p.name}.yaml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"parameters file {name} not found (nor in {config_dir()})")


class Bringup:
    """Both nodes in one process, spun by a background MultiThreadedExecutor."""

    def __init__(self, params_file: str | Path | None = None, namespace: str = "llm",
                 overrides: dict | None = None, ros_args: list[str] | None = None,
                 num_threads: int = 8, interrupt: threading.Event | None = None):
        from .client import LLMClient
        from .nodes.inference_node import InferenceNode
        from .nodes.profile_manager import ProfileManager
        args = ["selectinfer_bringup", "--ros-args"]
        if params_file:
            args += ["--params-file", str(params_file)]
        args += list(ros_args or [])
        self.namespace = namespace
        self.interrupt = interrupt or threading.Event()  # set: stop waiting for transitions
        self.context = init_context(args)
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        node_params = [Parameter(k, value=v) for k, v in overrides.items()]
        shared = {f.name for f in fields(ManagerSettings)}
        manager_params = [Parameter(k, value=v) for k, v in overrides.items() if k in shared]
        self.inference = self.manager = self.helper = self.llm = None
        try:
            self.inference = InferenceNode(namespace=namespace, context=self.context,
                                           parameter_overrides=node_params)
            self.manager = ProfileManager(namespace=namespace, context=self.context,
                                          parameter_overrides=manager_params)
            self.helper = Node("selectinfer_bringup", namespace=namespace, context=self.context)
            # Made before the helper spins (rclpy's ActionClient is not safe to create on a
            # node being spun: it registers itself before its lock exists).
            self.llm = LLMClient(self.helper, namespace)
        except Exception:
            self._destroy_nodes()
            rclpy.shutdown(context=self.context)
            raise
        self.executor = MultiThreadedExecutor(num_threads=num_threads, context=self.context)
        for node in (self.inference, self.manager, self.helper):
            self.executor.add_node(node)
        self._thread = spin_in_background(self.executor, "bringup-spin")

    def failure(self, node: str) -> str:
        """Why ``node`` (``selectinfer_node`` or ``profile_manager``) refused its last transition."""
        if node == INFERENCE and self.inference is not None:
            return self.inference.load_error
        if node == MANAGER and self.manager is not None:
            return self.manager.failure
        return ""

    def configure_and_activate(self, steps=BRINGUP) -> None:
        """Run the bring-up chain (:data:`~.lifecycle_chain.BRINGUP`, the launch file's order)
        through the lifecycle services; :class:`StepFailed` names the node, the transition and
        the reason."""
        wait = self.manager.settings.reload_timeout + 150.0  # a reload waits for goals ahead
        run_chain(self.helper, self.namespace, steps, interrupt=self.interrupt,
                  explain=self.failure,
                  timeouts={(MANAGER, "configure"): wait, (MANAGER, "activate"): wait})

    def _destroy_nodes(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        for node in (self.helper, self.manager, self.inference):
            if node is not None:
                node.destroy_node()

    def shutdown(self) -> None:
        """End the goals (the running one within a decode step; clients get the results while
        the executor still spins), shut both lifecycle nodes down, stop the executor, destroy
        the nodes."""
        if self.inference is not None and self.context.ok():
            self.inference.stop()
        for node in (self.manager, self.inference):
            try:
                if node is not None and self.context.ok():
                    node.trigger_shutdown()
            except Exception:  # noqa: BLE001 - already finalized
                pass
        self.executor.shutdown(timeout_sec=5.0)
        self._thread.join(5.0)
        self._destroy_nodes()
        if self.context.ok():
            rclpy.shutdown(context=self.context)

    def __enter__(self) -> "Bringup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


OPTIONS = ("model", "weights", "task", "load_ratio", "compute_ratio", "compute_mode", "device",
           "dtype")  # as the launch's


def overrides_from_args(args) -> dict:
    """Parameter overrides from the options that were given, validated as the node validates its
    parameters (ParamError with the same reason); as the launch file does, with ``--device cpu``
    and no ``--dtype``, dtype becomes float32 (float16 being slow on CPUs)."""
    out = given_values(NodeSettings, args)
    if out.get("device") == "cpu" and "dtype" not in out:
        out["dtype"] = "float32"
    return out


def add_arguments(ap: argparse.ArgumentParser, default_params: str | None = "desktop.yaml") -> None:
    """--params, --namespace and the launch file's arguments (from core/options.py: the same
    names, help and checks as the nodes' parameters; omitted = the parameters file's value)."""
    ap.add_argument("--params", default=default_params,
                    help="parameters YAML (path, or a name in config/: desktop.yaml, "
                         "jetson_orin_nano.yaml)")
    ap.add_argument("--namespace", default="llm", help="namespace of both nodes (default llm)")
    options.add_arguments(ap, NodeSettings, only=OPTIONS, unset="the parameters file's value")


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 after Ctrl-C, 2 for a refused option or parameter, 1 when a step of the
    bring-up failed (the node, the transition and the reason on stderr)."""
    from rclpy.utilities import remove_ros_args

    argv = list(sys.argv[1:] if argv is None else argv)
    ros_args = argv[argv.index("--ros-args") + 1:] if "--ros-args" in argv else []
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.ros.bringup",
                                 description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--no-activate", action="store_true",
                    help="bring up selectinfer_node only; leave the profile manager unconfigured "
                         "(drive it yourself)")
    args = ap.parse_args(remove_ros_args(["x"] + argv)[1:])
    try:
        params_file = resolve_params_file(args.params)
        overrides = overrides_from_args(args)
    except (FileNotFoundError, ParamError) as e:
        print(f"bringup: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[bringup] parameters {params_file or '(node defaults)'}, namespace /{args.namespace}",
          flush=True)
    try:
        bringup = Bringup(params_file, args.namespace, overrides, ros_args, interrupt=stop)
    except ParamError as e:
        print(f"bringup: parameter refused: {e}", file=sys.stderr)
        return 2
    rc = 0
    try:
        steps = [s for s in BRINGUP if s.node == INFERENCE] if args.no_activate else BRINGUP
        bringup.configure_and_activate(steps)
        rt = bringup.inference.runtime
        print(f"[bringup] ready: {ns_name(args.namespace, 'generate')} serving {rt.model_id} "
              f"on {rt.device}, task {rt.task or '-'} (load_ratio {rt.load_ratio:g}, "
              f"compute_ratio {rt.compute_ratio:g}); profile_manager "
              f"{'unconfigured' if args.no_activate else 'active'}; Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            if not bringup.context.ok():
                break
    except Interrupted as e:
        print(f"[bringup] {e}", flush=True)
    except StepFailed as e:
        print(f"bringup: {e}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        print("[bringup] shutting down", flush=True)
        bringup.shutdown()
    return rc


if __name__ == "__main__":
    from .plumbing import exit_now
    exit_now(main())
