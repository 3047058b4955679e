"""Starting the nodes without launch/ros2cli: bringup with the shipped YAML layout, the small
commands (generate, switch, diagnostics) as subprocesses, the config files and the launch file.
"""
import ast
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / 'config'
LAUNCH = ROOT / 'launch' / 'jetson.launch.py'


def _env():
    env = dict(os.environ)
    env['SELECTINFER_QUIET'] = '1'
    env['PYTHONUNBUFFERED'] = '1'
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH', '')]))
    return env


def _run_tool(module, *args, timeout=60):
    return subprocess.run([sys.executable, '-m', module, *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT)


class Lines:
    """Collects a subprocess's stdout lines in a thread."""

    def __init__(self, proc):
        self.lines = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, needle, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False


def test_bringup_with_yaml_and_the_small_commands(tiny_llm, tmp_path):
    cfg = yaml.safe_load((CONFIG / 'desktop.yaml').read_text())
    cfg['/**']['ros__parameters'].update(model=str(tiny_llm.model),
                                         profiles=str(tiny_llm.profiles), task='alpha')
    cfg['/**/selectinfer_node']['ros__parameters'].update(load_ratio=0.7, compute_ratio=0.5,
                                                          diagnostics_period=0.5)
    params = tmp_path / 'params.yaml'
    params.write_text(yaml.safe_dump(cfg))
    ns = f'llm_{uuid.uuid4().hex[:8]}'
    proc = subprocess.Popen(
        [sys.executable, '-m', 'selectinfer_ros.bringup', '--params', str(params),
         '--namespace', ns], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(), cwd=ROOT)
    out = Lines(proc)
    try:
        assert out.wait_for('[bringup] ready', 90.0), ''.join(out.lines)
        ready = next(line for line in out.lines if '[bringup] ready' in line)
        assert f'/{ns}/generate' in ready and 'task alpha' in ready
        assert 'load_ratio 0.7' in ready and 'compute_ratio 0.5' in ready  # YAML applied

        gen = _run_tool('selectinfer_ros.tools.generate', 'w5 w6 w7', '--max-new-tokens', '5',
                        '--namespace', ns)
        assert gen.returncode == 0, gen.stdout + gen.stderr
        assert '--- SUCCEEDED' in gen.stdout and 'profile alpha' in gen.stdout

        bad = _run_tool('selectinfer_ros.tools.generate', 'w5', '--task', 'gamma',
                        '--namespace', ns)
        assert bad.returncode == 1 and 'rejected' in bad.stderr

        sw = _run_tool('selectinfer_ros.tools.switch', 'beta', '--namespace', ns)
        assert sw.returncode == 0, sw.stdout + sw.stderr
        assert 'active task beta' in sw.stdout and 'iB read' in sw.stdout
        refused = _run_tool('selectinfer_ros.tools.switch', 'gamma', '--namespace', ns)
        assert refused.returncode == 1 and 'refused' in refused.stdout

        dg = _run_tool('selectinfer_ros.tools.diagnostics', '--namespace', ns)
        assert dg.returncode == 0, dg.stdout + dg.stderr
        assert '[OK] selectinfer_node: memory (hardware_id=cpu)' in dg.stdout
        assert 'active_task' in dg.stdout and 'beta' in dg.stdout

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, ''.join(out.lines)
        assert out.wait_for('[bringup] shutting down', 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_bringup_refuses_bad_parameters(tiny_llm):
    res = subprocess.run(
        [sys.executable, '-m', 'selectinfer_ros.bringup', '--params', 'desktop.yaml',
         '--model', str(tiny_llm.model), '--task', 'alpha', '--load-ratio', '1.5',
         '--namespace', f'llm_{uuid.uuid4().hex[:8]}'],
        capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'load_ratio must be in (0.0, 1.0]' in res.stderr


def _params_of(specs):
    return {s.name for s in specs}


@pytest.mark.parametrize('name', ['desktop.yaml', 'jetson_orin_nano.yaml'])
def test_config_files_use_known_parameters_and_valid_ratios(name):
    from selectinfer_ros.nodes.settings import (INFERENCE_PARAMS, MANAGER_PARAMS,
                                                InferenceSettings, coerce)
    cfg = yaml.safe_load((CONFIG / name).read_text())
    shared = cfg['/**']['ros__parameters']
    node = cfg['/**/selectinfer_node']['ros__parameters']
    manager = cfg['/**/profile_manager']['ros__parameters']
    assert set(shared) <= _params_of(INFERENCE_PARAMS) & _params_of(MANAGER_PARAMS)
    assert set(node) <= _params_of(INFERENCE_PARAMS)
    assert set(manager) <= _params_of(MANAGER_PARAMS)
    specs = {s.name: s for s in INFERENCE_PARAMS}
    values = {k: coerce(specs[k], v) for k, v in {**shared, **node}.items()
              if k != 'device'}  # cuda is checked on the robot
    settings = InferenceSettings(**values)
    settings.check(files=False)
    if name == 'jetson_orin_nano.yaml':
        assert (node['device'], node['dtype']) == ('cuda', 'float16')
        assert (node['load_ratio'], node['compute_ratio'], node['static_ratio']) == (0.7, 0.5, 0.3)
    else:
        assert (node['device'], node['dtype'], shared['model']) == ('cpu', 'float32', '')


def test_launch_file_declares_the_arguments_and_wires_the_lifecycle():
    tree = ast.parse(LAUNCH.read_text())
    args = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], 'id', '') == 'ARGUMENTS')
    assert {a[0] for a in args} == {'namespace', 'params_file', 'model', 'task', 'load_ratio',
                                    'compute_ratio', 'device', 'dtype'}
    setup_py = (ROOT / 'setup.py').read_text()
    for exe in ('selectinfer_node = selectinfer_ros.nodes.inference_node:main',
                'profile_manager = selectinfer_ros.nodes.profile_manager:main'):
        assert exe in setup_py


class _Rec:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _fake_launch_modules(share):
    class LaunchConfiguration:
        def __init__(self, name):
            self.name = name

        def perform(self, context):
            return context[self.name]

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    rec = {n: type(n, (_Rec,), {}) for n in (
        'LaunchDescription', 'DeclareLaunchArgument', 'EmitEvent', 'LogInfo', 'OpaqueFunction',
        'RegisterEventHandler', 'LifecycleNode', 'Node', 'OnStateTransition', 'ChangeState')}
    return {
        'launch': mod('launch', LaunchDescription=rec['LaunchDescription']),
        'launch.actions': mod('launch.actions', **{k: rec[k] for k in (
            'DeclareLaunchArgument', 'EmitEvent', 'LogInfo', 'OpaqueFunction',
            'RegisterEventHandler')}),
        'launch.events': mod('launch.events', matches_action=lambda a: ('matches', a)),
        'launch.substitutions': mod('launch.substitutions', LaunchConfiguration=LaunchConfiguration),
        'launch_ros': mod('launch_ros'),
        'launch_ros.actions': mod('launch_ros.actions', LifecycleNode=rec['LifecycleNode'],
                                  Node=rec['Node']),
        'launch_ros.event_handlers': mod('launch_ros.event_handlers',
                                         OnStateTransition=rec['OnStateTransition']),
        'launch_ros.events': mod('launch_ros.events'),
        'launch_ros.events.lifecycle': mod('launch_ros.events.lifecycle',
                                           ChangeState=rec['ChangeState']),
        'ament_index_python.packages': mod('ament_index_python.packages',
                                           get_package_share_directory=lambda p: share),
    }


def test_launch_file_logic_with_stand_in_launch_modules(monkeypatch, tmp_path):
    """launch/launch_ros are not installable here: run the launch file against recording
    stand-ins to check what it builds (the real thing is tested where launch is installed)."""
    from lifecycle_msgs.msg import Transition
    for name, module in _fake_launch_modules(str(tmp_path)).items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location('jetson_launch', LAUNCH)
    launch_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch_file)
    ld = launch_file.generate_launch_description()
    entities = ld.args[0]
    declared = {e.args[0]: e.kwargs['default_value'] for e in entities
                if type(e).__name__ == 'DeclareLaunchArgument'}
    assert declared['namespace'] == 'llm' and declared['device'] == ''
    setup = next(e for e in entities if type(e).__name__ == 'OpaqueFunction').kwargs['function']

    context = dict(namespace='robot1', params_file='', model='/data/m', task='navigation',
                   load_ratio='0.6', compute_ratio='', device='cpu', dtype='')
    actions = setup(context)
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ['LogInfo', 'Node', 'RegisterEventHandler', 'LifecycleNode', 'EmitEvent']
    node, handler, manager, configure = actions[1], actions[2], actions[3], actions[4]
    default_yaml = str(tmp_path / 'config' / 'jetson_orin_nano.yaml')
    assert node.kwargs['executable'] == 'selectinfer_node'
    assert node.kwargs['namespace'] == 'robot1'
    assert node.kwargs['parameters'] == [default_yaml, {
        'model': '/data/m', 'task': 'navigation', 'device': 'cpu', 'dtype': 'float32',
        'load_ratio': 0.6}]
    assert manager.kwargs['name'] == 'profile_manager'
    assert manager.kwargs['parameters'] == [default_yaml, {'model': '/data/m',
                                                           'task': 'navigation'}]
    assert configure.args == () and configure.kwargs['event'].kwargs['transition_id'] == \
        Transition.TRANSITION_CONFIGURE
    assert configure.kwargs['event'].kwargs['lifecycle_node_matcher'] == ('matches', manager)
    on_inactive = handler.args[0]
    assert on_inactive.kwargs['target_lifecycle_node'] is manager
    assert (on_inactive.kwargs['start_state'], on_inactive.kwargs['goal_state']) == \
        ('configuring', 'inactive')
    activate = on_inactive.kwargs['entities'][-1]
    assert activate.kwargs['event'].kwargs['transition_id'] == Transition.TRANSITION_ACTIVATE

    # nothing given: the YAML's values stay (no overrides), explicit dtype kept on cpu
    context.update(model='', task='', load_ratio='', device='', params_file='/x.yaml')
    assert setup(context)[1].kwargs['parameters'] == ['/x.yaml', {}]
    context.update(device='cpu', dtype='bfloat16')
    assert setup(context)[1].kwargs['parameters'][1] == {'device': 'cpu', 'dtype': 'bfloat16'}


def test_launch_file_with_real_launch():
    """Where launch_ros is installed: the description builds and parses its arguments."""
    pytest.importorskip('launch_ros')
    from launch import LaunchContext
    from launch.launch_description_sources import get_launch_description_from_python_launch_file
    ld = get_launch_description_from_python_launch_file(str(LAUNCH))
    names = {a.name for a in ld.get_launch_arguments()}
    assert {'model', 'task', 'load_ratio', 'compute_ratio', 'device', 'dtype', 'namespace',
            'params_file'} <= names
    assert LaunchContext is not None
