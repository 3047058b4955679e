"""Launch selectinfer_node and the profile_manager lifecycle node (configured, then activated).

    ros2 launch selectinfer_ros jetson.launch.py
    ros2 launch selectinfer_ros jetson.launch.py model:=/data/llama-3.2-1b-packed task:=navigation
    ros2 launch selectinfer_ros jetson.launch.py device:=cpu          # a machine without CUDA
    ros2 launch selectinfer_ros jetson.launch.py \
        params_file:=$(ros2 pkg prefix selectinfer_ros)/share/selectinfer_ros/config/desktop.yaml

Parameters come from ``params_file`` (default: config/jetson_orin_nano.yaml); a launch argument
left empty keeps the file's value, a given one overrides it for both nodes. With ``device:=cpu``
and no ``dtype``, dtype becomes float32 (float16 matmuls are slow on CPUs).

Both nodes are lifecycle nodes, brought up in the order of ``BRINGUP``
(selectinfer_ros/ros/lifecycle_chain.py, which ``python -m selectinfer_ros.ros.bringup`` and the
tests run too) by ChangeState events chained with OnStateTransition handlers: selectinfer_node
configure (loads the model; a first run prepares the embedded one) -> activate (the generate
action server appears only now, so a client whose ``wait_for_server()`` returns is served) ->
profile_manager configure -> activate. The chain runs once: later ``ros2 lifecycle set``
transitions move only the node they name.

The launch ends with an error (exit status 1, the node and its reason) when a step of the
bring-up fails (a missing model folder, an unknown task) or a node exits (a parameter out of
range: ``load_ratio:=1.7``); it also ends when a node exits later.
"""
import os
import re

from launch import LaunchDescription
from launch.actions import (DeclareLaunchArgument, EmitEvent, LogInfo, OpaqueFunction,
                            RegisterEventHandler, Shutdown, TimerAction)
from launch.event_handlers import OnProcessExit, OnProcessIO
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState

from selectinfer_ros.ros.lifecycle_chain import BRINGUP, NODES, failures, handoffs, step_message

PACKAGE = 'selectinfer_ros'

# (name, default, description); '' = keep the value of params_file
ARGUMENTS = (
    ('namespace', 'llm', 'namespace of both nodes (the action is <namespace>/generate)'),
    ('params_file', '', 'parameters YAML (default: config/jetson_orin_nano.yaml of the package)'),
    ('model', '', 'a model name (qwen2.5-1.5b, qwen2.5-0.5b, smollm2-135m, gemma3-270m: '
                  'fetched and packed on first use) or a packed model folder (params_file '
                  'value if empty; there, empty = the embedded Gemma 3 270M)'),
    ('weights', '', 'records of the embedded model or a model by name: int8, int8-q4emb, q4, '
                    'float, ... '
                    '(params_file value if empty; '
                    'there, empty = int8 on a CPU, float on CUDA)'),
    ('task', '', 'initial task profile (params_file value if empty; there, empty = general)'),
    ('load_ratio', '', 'gamma: share of MLP neurons resident (params_file value if empty)'),
    ('compute_ratio', '', 'phi: share of neurons computed per token (params_file value if empty)'),
    ('compute_mode', '', 'prompt or token: phi\'s neurons chosen at the prompt, or per token by '
                         'calibrated thresholds (params_file value if empty)'),
    ('device', '', 'cpu, cuda or cuda:N (params_file value if empty)'),
    ('dtype', '', 'float32, float16 or bfloat16 (params_file value if empty; float32 when '
                  'device:=cpu)'),
)


def _default_params_file():
    from ament_index_python.packages import get_package_share_directory
    return os.path.join(get_package_share_directory(PACKAGE), 'config', 'jetson_orin_nano.yaml')


def _overrides(context):
    """Parameter overrides from the launch arguments that were given."""
    def arg(name):
        return LaunchConfiguration(name).perform(context).strip()

    out = {}
    for name in ('model', 'weights', 'task', 'compute_mode', 'device', 'dtype'):
        if arg(name):
            out[name] = arg(name)
    for name in ('load_ratio', 'compute_ratio'):
        if arg(name):
            out[name] = float(arg(name))
    if out.get('device') == 'cpu' and 'dtype' not in out:
        out['dtype'] = 'float32'
    return out


class BringupFailed(RuntimeError):
    """A node of the launch failed: raised in launch's event loop, it ends the launch with exit
    status 1 and the message ("Caught exception in launch ...: <message>")."""


ANSI = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')
LOG_PREFIX = re.compile(r'^\[(ERROR|FATAL)\] \[[0-9.]+\] \[[^\]]*\]: ')  # rcutils' line head
REASON_WAIT = 2.0  # seconds a failed step waits for its node's error line (stderr may trail)


class _Reasons:
    """The last line each node wrote to stderr that is not an INFO/DEBUG/WARN log line (a refused
    parameter, ``configure failed: ...``): the reason a failure is reported with. A failed step
    whose node has not printed its reason yet is reported when the line comes, or after
    REASON_WAIT seconds."""

    def __init__(self):
        self.last, self.pending = {}, {}

    def on_stderr(self, name):
        def remember(event):
            for line in ANSI.sub('', event.text.decode(errors='replace')).splitlines():
                line = line.strip()
                if line and not re.match(r'\[(INFO|DEBUG|WARN)\]', line):
                    self.last[name] = LOG_PREFIX.sub('', line)
            if name in self.pending and name in self.last:
                raise BringupFailed(f'{self.pending.pop(name)}: {self.last[name]}')
        return remember

    def fail(self, name, message):
        """Entities that end the launch with ``message`` and the node's reason."""
        if name in self.last:
            raise BringupFailed(f'{message}: {self.last[name]}')
        self.pending[name] = message

        def late(_context):
            if name in self.pending:
                raise BringupFailed(f'{self.pending.pop(name)}: see its log above')
        return [TimerAction(period=REASON_WAIT, actions=[OpaqueFunction(function=late)])]

    def of(self, name):
        return self.last.get(name, 'see its log above')


def _launch_setup(context, *args, **kwargs):
    namespace = LaunchConfiguration('namespace').perform(context)
    params_file = LaunchConfiguration('params_file').perform(context) or _default_params_file()
    overrides = _overrides(context)
    manager_overrides = {k: v for k, v in overrides.items() if k in ('model', 'task')}

    inference = LifecycleNode(
        package=PACKAGE, executable='selectinfer_node', name='selectinfer_node',
        namespace=namespace, output='screen', emulate_tty=True,
        parameters=[params_file, overrides])
    manager = LifecycleNode(
        package=PACKAGE, executable='profile_manager', name='profile_manager',
        namespace=namespace, output='screen', emulate_tty=True,
        parameters=[params_file, manager_overrides])
    nodes = {'selectinfer_node': inference, 'profile_manager': manager}
    assert set(nodes) == set(NODES), NODES
    progress = {'done': False}
    reasons = _Reasons()

    def change(step):
        return EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(nodes[step.node]),
                                           transition_id=step.transition_id))

    def finished(_context):
        progress['done'] = True

    def fail(message, name):
        def failed(_context):
            if not progress['done']:  # a later failed transition is the user's to handle
                return reasons.fail(name, message)
            return None
        return OpaqueFunction(function=failed)

    def on_exit(event, _context):
        if _context.is_shutdown:
            return None
        name = next((n for n, a in nodes.items() if a is event.action), event.process_name)
        when = 'during bring-up' if not progress['done'] else 'while serving'
        message = f'{name} exited with code {event.returncode} {when}: {reasons.of(name)}'
        if event.returncode != 0 or not progress['done']:
            raise BringupFailed(message)
        return [Shutdown(reason=message)]

    handlers = []
    # Once: the bring-up chain. Later transitions (ros2 lifecycle set ...) are the user's, so a
    # reactivated selectinfer_node does not reconfigure an active profile_manager.
    for step, following in handoffs(BRINGUP):
        then = [change(following)] if following else [OpaqueFunction(function=finished)]
        handlers.append(RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=nodes[step.node], start_state=step.start_state,
            goal_state=step.goal_state, entities=[LogInfo(msg=step_message(step, following)),
                                                  *then], handle_once=True)))
    for step, message in failures(BRINGUP):
        handlers.append(RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=nodes[step.node], start_state=step.start_state,
            goal_state=step.failed_state, entities=[fail(message, step.node)], handle_once=True)))
    for name, node in nodes.items():
        handlers.append(RegisterEventHandler(OnProcessIO(target_action=node,
                                                         on_stderr=reasons.on_stderr(name))))
        handlers.append(RegisterEventHandler(OnProcessExit(target_action=node, on_exit=on_exit)))

    return [
        LogInfo(msg=f'selectinfer: params {params_file}, overrides {overrides}, '
                    f'namespace /{namespace}'),
        *handlers,
        inference,
        manager,
        change(BRINGUP[0]),
    ]


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=_launch_setup)])
