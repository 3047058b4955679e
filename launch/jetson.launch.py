"""Launch selectinfer_node and the profile_manager lifecycle node (configured, then activated).

    ros2 launch selectinfer_ros jetson.launch.py
    ros2 launch selectinfer_ros jetson.launch.py model:=/data/llama-3.2-1b-packed task:=navigation
    ros2 launch selectinfer_ros jetson.launch.py device:=cpu          # a machine without CUDA
    ros2 launch selectinfer_ros jetson.launch.py \
        params_file:=$(ros2 pkg prefix selectinfer_ros)/share/selectinfer_ros/config/desktop.yaml

Parameters come from ``params_file`` (default: config/jetson_orin_nano.yaml); a launch argument
left empty keeps the file's value, a given one overrides it for both nodes. With ``device:=cpu``
and no ``dtype``, dtype becomes float32 (float16 matmuls are slow on CPUs).

Both nodes are lifecycle nodes, brought up in order by ChangeState events chained with
OnStateTransition handlers: selectinfer_node configure (loads the model; a first run prepares
the embedded one) -> activate (the generate action server appears only now, so a client whose
``wait_for_server()`` returns is served) -> profile_manager configure -> activate. The chain
runs once: later ``ros2 lifecycle set`` transitions move only the node they name. Without
launch installed, ``python -m selectinfer_ros.ros.bringup --params <yaml>`` does the same.
"""
import os

from launch import LaunchDescription
from launch.actions import (DeclareLaunchArgument, EmitEvent, LogInfo, OpaqueFunction,
                            RegisterEventHandler)
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition

PACKAGE = 'selectinfer_ros'

# (name, default, description); '' = keep the value of params_file
ARGUMENTS = (
    ('namespace', 'llm', 'namespace of both nodes (the action is <namespace>/generate)'),
    ('params_file', '', 'parameters YAML (default: config/jetson_orin_nano.yaml of the package)'),
    ('model', '', 'packed model folder (params_file value if empty; there, empty = the '
                  'embedded Gemma 3 270M)'),
    ('task', '', 'initial task profile (params_file value if empty)'),
    ('load_ratio', '', 'gamma: share of MLP neurons resident (params_file value if empty)'),
    ('compute_ratio', '', 'phi: share of neurons computed per token (params_file value if empty)'),
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
    for name in ('model', 'task', 'device', 'dtype'):
        if arg(name):
            out[name] = arg(name)
    for name in ('load_ratio', 'compute_ratio'):
        if arg(name):
            out[name] = float(arg(name))
    if out.get('device') == 'cpu' and 'dtype' not in out:
        out['dtype'] = 'float32'
    return out


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

    def change(node, transition_id):
        return EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                           transition_id=transition_id))

    def after(node, start, goal, message, *entities):
        # Once: the bring-up chain. Later transitions (ros2 lifecycle set ...) are the user's, so
        # a reactivated selectinfer_node does not reconfigure an active profile_manager.
        return RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=node, start_state=start, goal_state=goal,
            entities=[LogInfo(msg=message), *entities], handle_once=True))

    return [
        LogInfo(msg=f'selectinfer: params {params_file}, overrides {overrides}, '
                    f'namespace /{namespace}'),
        after(inference, 'configuring', 'inactive', 'selectinfer_node: model loaded; activating',
              change(inference, Transition.TRANSITION_ACTIVATE)),
        after(inference, 'activating', 'active', 'selectinfer_node: serving; configuring '
              'profile_manager', change(manager, Transition.TRANSITION_CONFIGURE)),
        after(manager, 'configuring', 'inactive', 'profile_manager: configured; activating '
              '(applies the initial task)', change(manager, Transition.TRANSITION_ACTIVATE)),
        inference,
        manager,
        change(inference, Transition.TRANSITION_CONFIGURE),
    ]


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=_launch_setup)])
