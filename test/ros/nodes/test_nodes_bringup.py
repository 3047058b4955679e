"""Starting the nodes without launch/ros2cli: bringup with the shipped YAML layout, the small
commands (generate, switch, diagnostics) as subprocesses, the config files and the launch file.
"""
import ast
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from action_msgs.msg import GoalStatus

ROOT = Path(__file__).resolve().parents[3]
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


def _bringup(tiny_llm, tmp_path, **node_params):
    """Bringup as a subprocess on desktop.yaml with the tiny model (task alpha, 0.7 / 0.5 and
    ``node_params``) in a fresh namespace: (process, namespace)."""
    cfg = yaml.safe_load((CONFIG / 'desktop.yaml').read_text())
    cfg['/**']['ros__parameters'].update(model=str(tiny_llm.model),
                                         profiles=str(tiny_llm.profiles), task='alpha')
    cfg['/**/selectinfer_node']['ros__parameters'].update(load_ratio=0.7, compute_ratio=0.5,
                                                          **node_params)
    params = tmp_path / 'params.yaml'
    params.write_text(yaml.safe_dump(cfg))
    ns = f'llm_{uuid.uuid4().hex[:8]}'
    proc = subprocess.Popen(
        [sys.executable, '-m', 'selectinfer_ros.ros.bringup', '--params', str(params),
         '--namespace', ns], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(), cwd=ROOT)
    return proc, ns


def test_bringup_with_yaml_and_the_small_commands(tiny_llm, tmp_path):
    proc, ns = _bringup(tiny_llm, tmp_path, diagnostics_period=0.5)
    out = Lines(proc)
    try:
        assert out.wait_for('[bringup] ready', 90.0), ''.join(out.lines)
        ready = next(line for line in out.lines if '[bringup] ready' in line)
        assert f'/{ns}/generate' in ready and 'task alpha' in ready
        assert 'load_ratio 0.7' in ready and 'compute_ratio 0.5' in ready  # YAML applied

        gen = _run_tool('selectinfer_ros.ros.tools.generate', 'w5 w6 w7', '--max-new-tokens', '5',
                        '--namespace', ns)
        assert gen.returncode == 0, gen.stdout + gen.stderr
        assert '--- SUCCEEDED' in gen.stdout and 'profile alpha' in gen.stdout

        bad = _run_tool('selectinfer_ros.ros.tools.generate', 'w5', '--task', 'gamma',
                        '--namespace', ns)
        assert bad.returncode == 1 and "REJECTED: unknown task 'gamma'" in bad.stderr

        sw = _run_tool('selectinfer_ros.ros.tools.switch', 'beta', '--namespace', ns)
        assert sw.returncode == 0, sw.stdout + sw.stderr
        assert 'active task beta' in sw.stdout and 'iB read' in sw.stdout
        refused = _run_tool('selectinfer_ros.ros.tools.switch', 'gamma', '--namespace', ns)
        assert refused.returncode == 1 and 'refused' in refused.stdout

        dg = _run_tool('selectinfer_ros.ros.tools.diagnostics', '--namespace', ns)
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


def test_goal_right_after_wait_for_server_then_ctrl_c_ends_it_with_a_reason(ros_context):
    """On the embedded model with the shipped desktop.yaml: a client that sends as soon as
    wait_for_server() returns is served (the server exists only once the model is loaded and the
    node active); SIGINT to the bringup then ends the running goal within a few decode steps, and
    its client receives the result with the reason."""
    from rclpy.action import ActionClient
    from rclpy.node import Node

    from selectinfer_msgs.action import Generate

    from conftest import GoalRun, SpinningExecutor
    ns = f'llm_{uuid.uuid4().hex[:8]}'
    proc = subprocess.Popen(
        [sys.executable, '-m', 'selectinfer_ros.ros.bringup', '--params', 'desktop.yaml',
         '--namespace', ns], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=_env(), cwd=ROOT)
    out = Lines(proc)
    spinner = SpinningExecutor(ros_context)
    node = Node('bt_like_client', namespace=ns, context=ros_context)
    client = ActionClient(node, Generate, 'generate')
    spinner.add_node(node)
    spinner.start()
    try:
        assert client.wait_for_server(timeout_sec=120.0), ''.join(out.lines)
        goal = Generate.Goal(prompt='Write a long story about a robot.', max_new_tokens=500)
        run = GoalRun(client, goal, 10.0)
        assert run.accepted, ''.join(out.lines)
        assert run.wait_feedback(3, 30.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        run.wait(30.0)
        assert time.monotonic() - t0 < 10.0
        assert run.status == GoalStatus.STATUS_ABORTED
        assert run.result.error_msg.startswith('node shutting down')
        assert run.result.finish_reason == 'aborted'  # agrees with the status
        assert 3 <= run.result.generated_tokens < 500
        assert proc.wait(30) == 0, ''.join(out.lines)
    finally:
        spinner.halt()
        client.destroy()
        spinner.destroy_nodes()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_bringup_refuses_bad_parameters(tiny_llm):
    """An option out of range is refused with the node parameter's reason, before any node."""
    res = subprocess.run(
        [sys.executable, '-m', 'selectinfer_ros.ros.bringup', '--params', 'desktop.yaml',
         '--model', str(tiny_llm.model), '--task', 'alpha', '--load-ratio', '1.5',
         '--namespace', f'llm_{uuid.uuid4().hex[:8]}'],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'load_ratio must be in (0.0, 1.0], got 1.5' in res.stderr
    assert '[bringup] parameters' not in res.stdout  # refused before the nodes were made


def test_options_come_from_the_core_settings():
    import argparse

    from selectinfer_ros.core.options import ParamError, coerce
    from selectinfer_ros.core.options import NodeSettings
    from selectinfer_ros.ros.bringup import add_arguments, overrides_from_args
    from dataclasses import fields
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert overrides_from_args(ap.parse_args([])) == {}  # omitted: the parameters file's values
    assert overrides_from_args(ap.parse_args(['--device', 'cpu', '--load-ratio', '0.6'])) == \
        {'device': 'cpu', 'load_ratio': 0.6, 'dtype': 'float32'}
    load_ratio = next(f for f in fields(NodeSettings) if f.name == 'load_ratio')
    for bad in ('0', '1.7', 'nan'):
        with pytest.raises(ParamError) as e:
            overrides_from_args(ap.parse_args(['--load-ratio', bad]))
        with pytest.raises(ParamError) as node_reason:
            coerce(load_ratio, float(bad))
        assert str(e.value) == str(node_reason.value)
    with pytest.raises(ParamError, match='dtype must be one of'):
        overrides_from_args(ap.parse_args(['--dtype', 'int8']))
    assert 'gamma: share of MLP neurons' in ap.format_help()  # the core's help text


def test_bringup_exits_1_naming_the_node_and_reason_when_a_transition_fails(tiny_llm, tmp_path):
    """A file the nodes refuse at configure (an unknown task): exit 1, with the node, the
    transition and the reason, and both nodes shut down."""
    res = subprocess.run(
        [sys.executable, '-m', 'selectinfer_ros.ros.bringup', '--params', 'desktop.yaml',
         '--model', str(tiny_llm.model), '--task', 'gamma', '--load-ratio', '0.7',
         '--compute-ratio', '0.5',
         '--namespace', f'llm_{uuid.uuid4().hex[:8]}', '--ros-args', '-p',
         f'profiles:={tiny_llm.profiles}'],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert res.returncode == 1, res.stdout + res.stderr
    line = next((ln for ln in res.stderr.splitlines() if ln.startswith('bringup: ')), '')
    assert line.startswith('bringup: selectinfer_node failed to configure (now unconfigured): '
                           'load failed: ParamError: task: unknown task \'gamma\''), res.stderr
    assert '[bringup] shutting down' in res.stdout


def test_the_bringup_chain_order_and_its_failure_states():
    from selectinfer_ros.ros.lifecycle_chain import BRINGUP, failures, handoffs
    assert [(s.node, s.transition) for s in BRINGUP] == [
        ('selectinfer_node', 'configure'), ('selectinfer_node', 'activate'),
        ('profile_manager', 'configure'), ('profile_manager', 'activate')]
    assert [(a.node, a.start_state, a.goal_state, b and (b.node, b.transition))
            for a, b in handoffs()] == [
        ('selectinfer_node', 'configuring', 'inactive', ('selectinfer_node', 'activate')),
        ('selectinfer_node', 'activating', 'active', ('profile_manager', 'configure')),
        ('profile_manager', 'configuring', 'inactive', ('profile_manager', 'activate')),
        ('profile_manager', 'activating', 'active', None)]
    assert [(s.start_state, s.failed_state) for s, _ in failures()] == [
        ('configuring', 'unconfigured'), ('activating', 'inactive')] * 2
    assert all(s.node in msg and s.transition in msg for s, msg in failures())


@pytest.mark.parametrize('name', ['desktop.yaml', 'jetson_orin_nano.yaml'])
def test_config_files_use_known_parameters_and_valid_ratios(name):
    from dataclasses import fields

    from selectinfer_ros.core.options import from_values
    from selectinfer_ros.ros.nodes.settings import ManagerSettings, NodeSettings
    cfg = yaml.safe_load((CONFIG / name).read_text())
    shared = cfg['/**']['ros__parameters']
    node = cfg['/**/selectinfer_node']['ros__parameters']
    manager = cfg['/**/profile_manager']['ros__parameters']
    node_names = {f.name for f in fields(NodeSettings)}
    manager_names = {f.name for f in fields(ManagerSettings)}
    assert set(shared) <= node_names & manager_names
    assert set(node) <= node_names
    assert set(manager) <= manager_names
    values = {k: v for k, v in {**shared, **node}.items() if k != 'device'}  # cuda: on the robot
    from_values(NodeSettings, values)  # every value and the ratios accepted
    from_values(ManagerSettings, {**shared, **manager})
    if name == 'jetson_orin_nano.yaml':
        assert (node['device'], node['dtype']) == ('cuda', 'float16')
        assert (node['load_ratio'], node['compute_ratio'], node['static_ratio']) == (1.0, 0.0, 0.3)
        # the robot default is a model by name whose profiles ship with the package
        from selectinfer_ros.core.format.models import CATALOG
        from selectinfer_ros.core.format.paths import default_profiles_dir
        assert shared['model'] in CATALOG
        assert (default_profiles_dir(shared['model']) / 'general.safetensors').exists()
    else:
        assert (node['device'], node['dtype'], shared['model']) == ('cpu', 'float32', '')


def test_launch_file_declares_the_arguments_and_chains_both_lifecycles():
    """launch/launch_ros are not on the package registries (the launch file was checked by hand
    with them built from source, see the README): here its declarations are read from the file.
    The chain itself is BRINGUP's (test_the_bringup_chain_order_and_its_failure_states)."""
    text = LAUNCH.read_text()
    tree = ast.parse(text)
    args = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], 'id', '') == 'ARGUMENTS')
    assert {a[0] for a in args} == {'namespace', 'params_file', 'model', 'weights', 'task',
                                    'load_ratio', 'compute_ratio', 'compute_mode', 'device',
                                    'dtype'}
    setup_py = (ROOT / 'setup.py').read_text()
    for exe in ('selectinfer_node = selectinfer_ros.ros.nodes.inference_node:main',
                'profile_manager = selectinfer_ros.ros.nodes.profile_manager:main'):
        assert exe in setup_py
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    lifecycle = [c for c in calls if getattr(c.func, 'id', '') == 'LifecycleNode']
    assert sorted(kw.value.value for c in lifecycle for kw in c.keywords if kw.arg == 'name') == \
        ['profile_manager', 'selectinfer_node']
    # the chain comes from the one ordered list the bringup and the tests run
    imported = {a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                and n.module == 'selectinfer_ros.ros.lifecycle_chain' for a in n.names}
    assert {'BRINGUP', 'handoffs', 'failures'} <= imported
    # handoffs and failures each become OnStateTransition handlers that run once (a later
    # deactivate/activate must not reconfigure an active manager)
    handlers = [c for c in calls if getattr(c.func, 'id', '') == 'OnStateTransition']
    assert [kw.value.value for c in handlers for kw in c.keywords if kw.arg == 'handle_once'] \
        == [True, True]
    assert any(getattr(c.func, 'id', '') == 'OnProcessExit' for c in calls)  # a node that dies
    raised = [n.exc.func.id for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None
              and isinstance(n.exc, ast.Call)]
    assert raised and set(raised) == {'BringupFailed'}  # ends the launch with exit status 1
