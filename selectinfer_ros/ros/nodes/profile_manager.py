"""``profile_manager``: a lifecycle node that owns which task profile is loaded.

* configure  reads and validates the profile catalogue for the model (every profile must match
             the model's fingerprint and shape; the initial task must be one of them); creates
             the ``switch_profile`` service, the ``active_profile`` publisher (transient local)
             and the client of the inference node's ``reload_base``.
* activate   applies the initial task through ``reload_base`` (waiting for the inference node
             and its model load, up to ``reload_timeout``) and starts accepting switches and
             publishing ``active_profile``.
* deactivate stops accepting switches (``switch_profile`` answers success=false with the reason).
* cleanup / shutdown release what configure created.

A switch is carried out by the inference node (base-neuron reload, in order with its goals) and
reports reload seconds and bytes read. A refused switch (unknown task, corrupt profile) leaves
the previous profile working. ``active_profile`` relays the inference node's ``loaded_profile``,
so it also follows switches caused by goals that name another task.

Transitions call ``reload_base`` and wait for its answer: spin this node in a
MultiThreadedExecutor (as ``main`` and ``selectinfer_ros.ros.bringup`` do). The lifecycle services
are in a reentrant callback group, so ``get_state`` answers during a long activate. A reload
waits at most ``reload_timeout`` for the goals ahead of it (the inference node is told the same
timeout); once started it completes, and this node waits for its answer up to
``RELOAD_RUN_LIMIT`` more seconds.
"""
from __future__ import annotations

import threading
from pathlib import Path

from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNodeMixin, TransitionCallbackReturn
from rclpy.node import Node

from selectinfer_msgs.msg import ActiveProfile
from selectinfer_msgs.srv import ReloadBase, SwitchProfile

from ...core.serving.coalesce import LatestWins
from ...core.serving.server import Superseded
from ..plumbing import (BURST_QOS, LATCHED, exit_now, guarded, internal_error,
                        one_transition_at_a_time, run_node)
from .settings import ManagerSettings, ParamError, apply_changes, declare

RELOAD_RUN_LIMIT = 120.0  # seconds a started reload may take before this node stops waiting


class ProfileManager(LifecycleNodeMixin, Node):
    def __init__(self, node_name: str = "profile_manager", *, namespace: str = "llm", **kwargs):
        Node.__init__(self, node_name, namespace=namespace, **kwargs)
        LifecycleNodeMixin.__init__(self, callback_group=ReentrantCallbackGroup())
        one_transition_at_a_time(self)
        try:
            self.settings: ManagerSettings = declare(self, ManagerSettings)
        except ParamError as e:
            self.get_logger().error(f"refusing to start: {e}")
            Node.destroy_node(self)
            raise
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._group = ReentrantCallbackGroup()
        self._lock = threading.Lock()
        self._active = False
        self._catalog = None
        self._manifest = None
        self._reload_client = None
        self._switch_srv = None
        self._switches = LatestWins()  # one switch at a time; a waiting one is replaced by a newer
        self._in_flight = 0  # reload_base calls waiting for their answer
        self._retired_client = None  # released while a call was in flight: destroyed after it
        self._last_loaded: ActiveProfile | None = None
        self.active_task = ""
        self.failure = ""  # why the last transition failed ('' after a success)
        # For the node's whole life: rclpy's executor can die on a publisher's or subscription's
        # event handler destroyed while it spins (a cleanup transition), unlike on a service.
        self._active_pub = self.create_lifecycle_publisher(ActiveProfile, "active_profile", LATCHED)
        self._loaded_sub = self.create_subscription(ActiveProfile, "loaded_profile", self._on_loaded,
                                                    LATCHED, callback_group=self._group)

    # ---- lifecycle --------------------------------------------------------------------------
    @guarded(lambda self, e, state: TransitionCallbackReturn.FAILURE)
    def on_configure(self, state) -> TransitionCallbackReturn:
        from ...core.format.pack import read_manifest
        from ...core.format.paths import default_profiles_dir
        from ...core.selection.profiles import ProfileCatalog
        from ...core.format.models import is_model_name
        from .settings import embedded_model_path
        s = self.settings
        log = self.get_logger()
        try:
            path = Path(s.model) if s.model and not is_model_name(s.model) else \
                embedded_model_path(convert=True, log=log.info, name=s.model)
            manifest = read_manifest(path)
            folder = Path(s.profiles) if s.profiles else default_profiles_dir(manifest.model_id)
            catalog = ProfileCatalog(folder, manifest)
            if s.task and s.task not in catalog.tasks:
                raise KeyError(f"initial task {s.task!r} is not in {folder} "
                               f"({', '.join(catalog.tasks)})")
        except (OSError, ValueError, KeyError) as e:
            reason = e.args[0] if isinstance(e, KeyError) and e.args else e
            self.failure = f"{type(e).__name__}: {reason}"
            log.error(f"configure failed: {reason}")
            return TransitionCallbackReturn.FAILURE
        self.failure = ""
        self._manifest, self._catalog = manifest, catalog
        self._reload_client = self.create_client(ReloadBase, "reload_base", callback_group=self._group)
        self._switch_srv = self.create_service(SwitchProfile, "switch_profile", self._on_switch,
                                               qos_profile=BURST_QOS, callback_group=self._group)
        log.info(f"configured: {manifest.model_id}, {len(catalog.tasks)} profiles in {folder}: "
                 f"{', '.join(catalog.tasks)}")
        return TransitionCallbackReturn.SUCCESS

    @guarded(lambda self, e, state: TransitionCallbackReturn.FAILURE)
    def on_activate(self, state) -> TransitionCallbackReturn:
        ret = super().on_activate(state)  # activates the lifecycle publisher
        if ret != TransitionCallbackReturn.SUCCESS:
            return ret
        task = self.settings.task
        resp = self.reload(task)
        self.failure = "" if resp.success else f"initial task {task!r}: {resp.message}"
        if not resp.success:
            self.get_logger().error(f"activate failed: {resp.message}")
            super().on_deactivate(state)
            return TransitionCallbackReturn.FAILURE
        with self._lock:
            self._active = True
            self.active_task = resp.active_task
            last = self._last_loaded
        if last is not None and last.task == resp.active_task:
            self._publish(last)
        self.get_logger().info(f"active: task {resp.active_task!r}" + (
            f" ({resp.bytes_read} bytes read in {resp.reload_seconds:.3f} s)" if resp.bytes_read else ""))
        return TransitionCallbackReturn.SUCCESS

    @guarded(lambda self, e, state: TransitionCallbackReturn.ERROR)
    def on_deactivate(self, state) -> TransitionCallbackReturn:
        with self._lock:
            self._active = False
        self.get_logger().info("inactive: switch_profile refuses switches")
        return super().on_deactivate(state)

    @guarded(lambda self, e, state: TransitionCallbackReturn.ERROR)
    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._release()
        return TransitionCallbackReturn.SUCCESS

    @guarded(lambda self, e, state: TransitionCallbackReturn.ERROR)
    def on_shutdown(self, state) -> TransitionCallbackReturn:
        with self._lock:
            self._active = False
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def _release(self) -> None:
        if self._switch_srv is not None:
            self.destroy_service(self._switch_srv)
        with self._lock:  # a call in flight keeps the client until its answer (or its timeout)
            client, self._reload_client = self._reload_client, None
            if client is not None and self._in_flight:
                self._retired_client, client = client, None
        if client is not None:
            self.destroy_client(client)
        self._switch_srv = None
        self._catalog = self._manifest = None

    # ---- switching ----------------------------------------------------------------------------
    @property
    def tasks(self) -> list[str]:
        return self._catalog.tasks if self._catalog is not None else []

    def reload(self, task: str) -> ReloadBase.Response:
        """Call the inference node's reload_base and wait (bounded) for the answer."""
        timeout = self.settings.reload_timeout
        client = self._reload_client
        if client is None:
            return ReloadBase.Response(success=False, message="profile_manager is not configured")
        if not client.wait_for_service(timeout_sec=min(timeout, 30.0)):
            return ReloadBase.Response(
                success=False, message=f"inference node service {client.srv_name} not available")
        done = threading.Event()
        with self._lock:
            self._in_flight += 1
        try:
            future = client.call_async(ReloadBase.Request(task=task, timeout=float(timeout)))
            future.add_done_callback(lambda _f: done.set())
            answered = done.wait(timeout + RELOAD_RUN_LIMIT)
        finally:
            with self._lock:
                self._in_flight -= 1
                retired = self._retired_client if not self._in_flight else None
                if retired is not None:
                    self._retired_client = None
            if retired is not None:
                self.destroy_client(retired)
        if not answered:
            remove = getattr(client, "remove_pending_request", None)
            if remove is not None:
                remove(future)
            return ReloadBase.Response(
                success=False, message=f"{client.srv_name} did not answer within "
                                       f"{timeout + RELOAD_RUN_LIMIT:g} s")
        resp = future.result()
        if resp is None:
            return ReloadBase.Response(success=False, message=f"{client.srv_name} call failed")
        return resp

    def _switch_failed(self, e: Exception, request, response):
        response.success, response.message = False, internal_error(e)
        response.active_task = self.active_task
        return response

    @guarded(_switch_failed)
    def _on_switch(self, request, response):
        task = request.task.strip()
        with self._lock:
            active = self._active
        if not active:
            response.success = False
            response.message = "profile_manager is not active; activate it to switch profiles"
            response.active_task = self.active_task
            return response
        if not task:
            response.success, response.message = False, "task is empty"
            response.active_task = self.active_task
            return response
        try:  # one at a time; a waiting switch is answered at once when a newer one comes
            resp = self._switches.run(task, self.reload, timeout=self.settings.reload_timeout)
        except (Superseded, TimeoutError) as e:
            response.success, response.message = False, str(e)
            response.active_task = self.active_task
            return response
        response.success, response.message = resp.success, resp.message
        response.active_task = resp.active_task or self.active_task
        response.reload_seconds, response.bytes_read = resp.reload_seconds, resp.bytes_read
        response.neurons_read, response.neurons_retiered = resp.neurons_read, resp.neurons_retiered
        if resp.success:
            self.active_task = resp.active_task
        return response

    @guarded(lambda self, e, msg: None)
    def _on_loaded(self, msg: ActiveProfile) -> None:
        with self._lock:
            self._last_loaded = msg
            active = self._active
            if active:
                self.active_task = msg.task
        if active:
            self._publish(msg)

    def _publish(self, msg: ActiveProfile) -> None:
        self._active_pub.publish(msg)

    @guarded(lambda self, e, params: SetParametersResult(successful=False,
                                                         reason=internal_error(e)))
    def _on_set_parameters(self, params) -> SetParametersResult:
        new, reason = apply_changes(self.settings, params, self)
        if reason is not None:
            self.get_logger().warning(f"parameter change refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        self.settings = new
        return SetParametersResult(successful=True)


def main(args: list[str] | None = None) -> int:
    exit_now(run_node(ProfileManager, "profile_manager", args, num_threads=4))


if __name__ == "__main__":
    main()
