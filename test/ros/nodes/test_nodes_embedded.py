"""End to end on the embedded Gemma 3 270M: a real answer streamed through the action, cancel
within one decode step, a profile switch that reads a small share of a full load, and the
README's main command (``python -m selectinfer_ros.ros.demo``)."""
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from action_msgs.msg import GoalStatus

from selectinfer_msgs.srv import ReloadBase

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope='module')
def embedded_ready():
    from selectinfer_ros.core.format.default_model import MODEL_ID
    from selectinfer_ros.core.format.paths import default_profiles_dir
    from selectinfer_ros.ros.nodes.settings import embedded_model_path
    path = embedded_model_path(convert=True, log=lambda s: None)
    tasks = sorted(p.stem for p in default_profiles_dir(MODEL_ID).glob('*.safetensors'))
    assert tasks, 'no shipped profiles for the embedded model'
    return path, tasks


def test_embedded_model_end_to_end(llm_graph, embedded_ready, wait_until):
    _, tasks = embedded_ready
    task = 'qa' if 'qa' in tasks else tasks[0]
    g = llm_graph(model='', profiles='', task=task, load_ratio=0.9, compute_ratio=0.9,
                  static_ratio=0.3, max_new_tokens_limit=256).ready(timeout=180.0)
    rt = g.node.runtime
    assert rt.model_id == 'gemma3-270m' and rt.task == task

    # a goal: streamed answer, SUCCEEDED, metrics
    run = g.run(g.goal('The three primary colors are', max_new_tokens=8), timeout=120.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    r = run.result
    assert r.text.strip() and r.generated_tokens >= 2
    assert r.tokens_per_second > 0 and r.time_to_first_token > 0 and r.prompt_tokens >= 6
    assert wait_until(lambda: run.text() == r.text, 5.0)
    assert len(run.feedback) >= 2

    # cancel mid-stream: honoured within one decode step
    run = g.send(g.goal('Once upon a time, in a small village by the sea,', max_new_tokens=200))
    assert run.accepted and run.wait_feedback(3, 60.0)
    times = [t for t, _ in run.feedback]
    step = (times[-1] - times[0]) / (len(times) - 1)
    n_at_cancel = run.feedback[-1][1].generated_tokens
    run.cancel()
    t_ack = time.monotonic()
    run.wait(60.0)
    assert run.status == GoalStatus.STATUS_CANCELED
    assert run.result.finish_reason == 'canceled' and run.result.text
    assert run.result.generated_tokens <= n_at_cancel + 2, (run.result.generated_tokens,
                                                           n_at_cancel)
    assert run.t_done - t_ack < 2 * step + 0.5, (run.t_done - t_ack, step)

    # a base-neuron switch reads a small share of what a full load reads
    others = [t for t in tasks if t != rt.task]
    if not others:
        pytest.skip('only one shipped profile: no switch to measure')
    resp = g.call(ReloadBase, 'reload_base', ReloadBase.Request(task=others[0]), timeout=120.0)
    assert resp.success, resp.message
    assert resp.active_task == others[0]
    assert 0 < resp.bytes_read < 0.05 * rt.bytes_read
    assert resp.reload_seconds < rt.load_seconds
    print(f'\n[switch] {task} -> {others[0]}: {resp.reload_seconds:.3f} s, {resp.bytes_read} bytes '
          f'({resp.neurons_read} neurons) vs full load {rt.load_seconds:.2f} s, '
          f'{rt.bytes_read} bytes')
    run = g.run(g.goal('The capital of France is', max_new_tokens=4), timeout=120.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED and run.result.profile == others[0]


def test_demo_command(embedded_ready):
    """The README's main command: nodes on the embedded model, a streamed answer, one switch,
    one diagnostics message, clean exit."""
    env = dict(os.environ, SELECTINFER_QUIET='1', PYTHONUNBUFFERED='1')
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH', '')]))
    res = subprocess.run(
        [sys.executable, '-m', 'selectinfer_ros.ros.demo', '--namespace',
         f'llm_demo_{uuid.uuid4().hex[:8]}', '--max-new-tokens', '12'],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr[-3000:]
    for needle in ('[1/4]', '[2/4]', '>>> The three primary colors are', 'SUCCEEDED',
                   '[3/4]', 'full model load', '[4/4]', '[OK] selectinfer_node: memory',
                   'selectinfer_node: throughput', 'selectinfer_node: profile', '== done'):
        assert needle in out, f'{needle!r} missing from:\n{out}'


def test_min_agreement_parameter_and_expected_agreement_in_diagnostics(llm_graph, embedded_ready):
    """`min_agreement` picks gamma from the shipped profiles' quality curves (int8 records, whose
    curve is their own); the diagnostics say which bound chose it and the agreement the curve
    expects at the running gamma/phi."""
    from selectinfer_ros.ros.nodes import diagnostics as diag
    g = llm_graph(model='', profiles='', weights='int8', task='qa', load_ratio=1.0,
                  compute_ratio=0.0, static_ratio=0.3, min_agreement=0.6).ready(timeout=180.0)
    rt = g.node.runtime
    curve = rt.selective.catalog.quality_curve('qa', rt.selective.manifest.weights)
    assert curve is not None
    assert rt.load_choice.bound == 'min_agreement' and rt.load_ratio < 1.0
    assert rt.load_ratio == curve.load_ratio_for(0.6, rt.load_choice.compute_share)
    prof = diag.as_dict(g.node.publish_diagnostics().status[2])
    assert prof['load_ratio_bound'] == 'min_agreement'
    expected = float(prof['expected_agreement'])
    assert 0.6 <= expected <= 1.0
    assert abs(expected - curve.expected_agreement(rt.load_ratio, rt.compute_ratio)) < 1e-6


def test_a_model_by_name_is_served_and_switches_task(llm_graph, smollm2, smollm2_profiles):
    """`model: smollm2-135m` (a real Llama-architecture model by name, fetched into the cache):
    the node loads its int8 pack, answers through the action and a switch reads base neurons."""
    g = llm_graph(model='smollm2-135m', profiles=str(smollm2_profiles), task='navigation',
                  load_ratio=0.7, compute_ratio=0.5, static_ratio=0.3).ready(timeout=180.0)
    rt = g.node.runtime
    assert rt.model_id == 'smollm2-135m' and rt.selective.manifest.weights == 'int8'
    run = g.run(g.goal('What is the capital of France? Answer in one word.', max_new_tokens=8,
                       use_chat_template=True), timeout=120.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED and run.result.text.strip()
    resp = g.call(ReloadBase, 'reload_base', ReloadBase.Request(task='qa'), timeout=120.0)
    assert resp.success and resp.active_task == 'qa', resp.message
    assert 0 < resp.bytes_read < rt.bytes_read and resp.neurons_read > 0


def test_per_token_selection_is_served_and_reports_the_share_computed(llm_graph, embedded_ready):
    """`compute_mode: token` with the shipped (calibrated) profiles: a goal is answered through the
    decode kernel choosing its neurons per token, and the diagnostics report the share of MLP
    neurons the last goal computed per token; a goal asking for fewer computes fewer."""
    from selectinfer_ros.ros.nodes import diagnostics as diag
    g = llm_graph(model='', profiles='', weights='int8', task='qa', load_ratio=1.0,
                  compute_ratio=0.7, static_ratio=0.3, compute_mode='token').ready(timeout=180.0)
    rt = g.node.runtime
    assert rt.selective.state.per_token and rt.engine.decode_path.endswith('int8 decode kernel')
    shares = []
    for phi in (0.0, 0.4):  # 0: the node's compute_ratio
        run = g.run(g.goal('Question: What is the capital of France?\nAnswer:', max_new_tokens=8,
                           compute_ratio=phi), timeout=120.0)
        assert run.status == GoalStatus.STATUS_SUCCEEDED and run.result.text.strip()
        thr = diag.as_dict(g.node.publish_diagnostics().status[1])
        shares.append(float(thr['last_computed_share']))
    assert 0.3 < shares[0] < 0.8 and 0.1 < shares[1] < shares[0], shares
