"""Fixtures for tests against a real ROS 2 (rclpy) graph, kept on this machine.

The DDS traffic stays on loopback: ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (kilted+),
ROS_LOCALHOST_ONLY=1 (Humble), and a ROS_DOMAIN_ID chosen at random per run unless the
caller set one (scripts/run_tests.sh does).
"""
import os
import random
import threading
import time

import pytest


@pytest.fixture(scope='session', autouse=True)
def ros_test_env():
    """Set the DDS isolation variables before any rclpy.init of the session."""
    if not os.environ.get('ROS_DOMAIN_ID'):
        rng = random.Random(os.getpid() ^ time.time_ns())
        os.environ['ROS_DOMAIN_ID'] = str(rng.randint(1, 100))
    os.environ['ROS_AUTOMATIC_DISCOVERY_RANGE'] = 'LOCALHOST'
    os.environ.setdefault('ROS_LOCALHOST_ONLY', '1')
    yield {'ROS_DOMAIN_ID': os.environ['ROS_DOMAIN_ID']}


@pytest.fixture
def ros_context(ros_test_env):
    """A fresh rclpy context per test: rclpy.init(context=...) / rclpy.shutdown(context=...)."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    try:
        yield context
    finally:
        if context.ok():
            rclpy.shutdown(context=context)


class SpinningExecutor:
    """A MultiThreadedExecutor spinning in a background thread, with bounded shutdown."""

    def __init__(self, context, num_threads=4):
        from rclpy.executors import MultiThreadedExecutor

        self.executor = MultiThreadedExecutor(num_threads=num_threads, context=context)
        self.nodes = []
        self._thread = threading.Thread(target=self._spin, name='ros-spin', daemon=True)
        self.error = None

    def _spin(self):
        try:
            self.executor.spin()
        except Exception as exc:  # pragma: no cover - surfaced by the fixture
            self.error = exc

    def add_node(self, node):
        self.nodes.append(node)
        self.executor.add_node(node)
        return node

    def start(self):
        self._thread.start()
        return self

    def halt(self, timeout=5.0):
        """Stop spinning; True if the thread ended. Destroy entities only after this: rclpy's
        executor may add a handle destroyed under it to its wait set and raise."""
        self.executor.shutdown(timeout_sec=timeout)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def destroy_nodes(self):
        for node in reversed(self.nodes):
            node.destroy_node()
        self.nodes.clear()

    def stop(self, timeout=5.0):
        stopped = self.halt(timeout)
        self.destroy_nodes()
        return stopped


@pytest.fixture
def spinning_executor(ros_context):
    """Yields a started SpinningExecutor; nodes added to it are destroyed afterwards."""
    spinner = SpinningExecutor(ros_context).start()
    try:
        yield spinner
    finally:
        stopped = spinner.stop()
        assert spinner.error is None, f'executor raised: {spinner.error!r}'
        assert stopped, 'executor thread did not stop within 5 s'


def _wait_until(predicate, timeout, interval=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def _wait_for_future(future, timeout):
    """Block until an rclpy future is done (the executor thread completes it)."""
    if not _wait_until(future.done, timeout):
        raise TimeoutError(f'rclpy future not done within {timeout} s')
    return future.result()


@pytest.fixture
def wait_until():
    """wait_until(predicate, timeout) -> bool, polling; never blocks past timeout."""
    return _wait_until


@pytest.fixture
def wait_for_future():
    """wait_for_future(future, timeout) -> result; raises TimeoutError."""
    return _wait_for_future


# ---------------------------------------------------------------------------------------------
# selectinfer nodes (selectinfer_ros.ros.nodes) on a tiny random model
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope='session')
def tiny_llm(tmp_path_factory):
    """A tiny random llama, packed, with task profiles 'alpha' and 'beta' that differ.

    Returns an object with .model (packed folder), .profiles (folder of *.safetensors) and .hf
    (the checkpoint, for other packs of the same weights).
    """
    import types

    os.environ.setdefault('SELECTINFER_QUIET', '1')
    import torch

    from selectinfer_ros.core.selection.loader import load_dense
    from selectinfer_ros.core.format.pack import pack, read_manifest
    from selectinfer_ros.core.profiling.profiler import activation_scores
    from selectinfer_ros.core.selection.profiles import Profile
    from selectinfer_ros.lab.random_model import make_random_model
    from selectinfer_ros.core.format.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp('tiny-llm')
    hf = make_random_model('tiny-llama', root / 'hf', std=0.1)
    packed = pack(hf, root / 'packed', log=lambda s: None).path
    manifest = read_manifest(packed)
    model, _ = load_dense(packed)
    tok = load_tokenizer(packed)
    gen = torch.Generator().manual_seed(1)
    texts = [' '.join(f'w{int(t)}' for t in torch.randint(4, 500, (24,), generator=gen))
             for _ in range(6)]
    scores, tokens = activation_scores(model, tok, texts, batch_size=3)
    profiles = root / 'profiles'
    Profile('alpha', manifest.model_id, manifest.fingerprint, scores, tokens,
            'test').save(profiles / 'alpha.safetensors')
    beta = torch.rand(scores.shape, generator=gen) * scores.mean()
    Profile('beta', manifest.model_id, manifest.fingerprint, beta, tokens,
            'test').save(profiles / 'beta.safetensors')
    del model
    return types.SimpleNamespace(model=packed, profiles=profiles, model_id=manifest.model_id, hf=hf)


class LLMGraph:
    """selectinfer_node (+ optionally profile_manager) and a client node, in one executor.

    Every instance uses its own namespace so that tests never see each other's endpoints.
    """

    def __init__(self, spinner, namespace, node_params, manager_params=None):
        from rclpy.callback_groups import ReentrantCallbackGroup
        from rclpy.node import Node
        from rclpy.parameter import Parameter

        from selectinfer_msgs.action import Generate
        from selectinfer_ros.ros.nodes.inference_node import InferenceNode
        from selectinfer_ros.ros.nodes.profile_manager import ProfileManager
        from selectinfer_ros.ros.safe_action import SafeActionClient

        self.spinner = spinner
        self.namespace = namespace
        context = spinner.executor.context
        overrides = [Parameter(k, value=v) for k, v in node_params.items()]
        self.node = spinner.add_node(InferenceNode(
            namespace=namespace, context=context, parameter_overrides=overrides))
        self.manager = None
        if manager_params is not None:
            m_overrides = [Parameter(k, value=v) for k, v in manager_params.items()]
            self.manager = spinner.add_node(ProfileManager(
                namespace=namespace, context=context, parameter_overrides=m_overrides))
        self._spinner = spinner
        self.client_node = Node('test_client', namespace=namespace, context=context)
        self.group = ReentrantCallbackGroup()
        # Before the node joins the spinning executor: rclpy's ActionClient registers itself with
        # its node before its lock exists, and a spinning executor may touch it in between.
        # The package's own client class: its feedback callback outlives the result, so a test
        # can compare the streamed text with the result (rclpy's drops the last deltas whenever
        # the result overtakes them; CI saw 4 of 12 go missing).
        self.action = SafeActionClient(self.client_node, Generate, 'generate',
                                       callback_group=self.group)
        spinner.add_node(self.client_node)
        self._clients = []

    def configure(self):
        """The inference node's configure transition (loads the model); True on success."""
        from rclpy.lifecycle import TransitionCallbackReturn
        return self.node.trigger_configure() == TransitionCallbackReturn.SUCCESS

    def bring_up(self, nodes=None):
        """The bring-up chain (selectinfer_ros.ros.lifecycle_chain.BRINGUP, as the launch file and
        bringup run it) through the nodes' lifecycle services; ``nodes`` limits it to those
        nodes (default: the nodes of this graph). StepFailed names the node and the reason."""
        from selectinfer_ros.ros.lifecycle_chain import BRINGUP, INFERENCE, MANAGER, run_chain
        present = {INFERENCE: self.node, MANAGER: self.manager}
        nodes = nodes or [n for n, obj in present.items() if obj is not None]
        reasons = {INFERENCE: lambda: self.node.load_error,
                   MANAGER: lambda: self.manager.failure if self.manager else ''}
        run_chain(self.client_node, self.namespace, [s for s in BRINGUP if s.node in nodes],
                  explain=lambda name: reasons[name]())
        return self

    def ready(self, timeout=20.0):
        """Bring the inference node up (configure, activate), then wait for the action server."""
        from selectinfer_ros.ros.lifecycle_chain import INFERENCE
        self.bring_up([INFERENCE])
        assert self.action.wait_for_server(timeout_sec=timeout), 'generate not discovered'
        return self

    def goal(self, prompt='w5 w6 w7', **fields):
        from selectinfer_msgs.action import Generate
        return Generate.Goal(prompt=prompt, **fields)

    def send(self, goal, timeout=10.0, client=None):
        """Send a goal; returns a GoalRun (accepted, feedback, result futures)."""
        return GoalRun(client or self.action, goal, timeout)

    def run(self, goal, timeout=60.0):
        run = self.send(goal)
        if run.accepted:
            run.wait(timeout)
        return run

    def new_action_clients(self, count):
        """``count`` Generate clients on a node of their own, created before that node joins the
        spinning executor (rclpy's ActionClient registers itself with its node before its lock
        exists, so creating one on a node being spun can crash the executor thread)."""
        import uuid

        from rclpy.action import ActionClient
        from rclpy.node import Node

        from selectinfer_msgs.action import Generate
        node = Node(f'test_clients_{uuid.uuid4().hex[:6]}', namespace=self.client_node.get_namespace(),
                    context=self.client_node.context)
        clients = [ActionClient(node, Generate, 'generate', callback_group=self.group)
                   for _ in range(count)]
        self._clients.extend(clients)
        self._spinner.add_node(node)
        return clients

    def call(self, srv_type, name, request, timeout=30.0):
        client = self.client_node.create_client(srv_type, name, callback_group=self.group)
        try:
            assert client.wait_for_service(timeout_sec=10.0), f'{name} not available'
            return _wait_for_future(client.call_async(request), timeout)
        finally:
            self.client_node.destroy_client(client)

    def close(self):
        for c in self._clients:
            c.destroy()
        self.action.destroy()


class GoalRun:
    """One goal as a client sees it: acceptance, feedback messages, final status and result."""

    def __init__(self, client, goal, timeout):
        self.feedback = []
        self.lock = threading.Lock()
        self.t_sent = time.monotonic()
        future = client.send_goal_async(goal, feedback_callback=self._on_feedback)
        self.handle = _wait_for_future(future, timeout)
        self.accepted = bool(self.handle.accepted)
        self.result_future = self.handle.get_result_async() if self.accepted else None
        self.status = None
        self.result = None
        self.t_done = None

    def _on_feedback(self, msg):
        with self.lock:
            self.feedback.append((time.monotonic(), msg.feedback))

    def text(self):
        with self.lock:
            return ''.join(f.text_delta for _, f in self.feedback)

    def wait_feedback(self, n, timeout):
        return _wait_until(lambda: len(self.feedback) >= n, timeout)

    def cancel(self, timeout=10.0):
        return _wait_for_future(self.handle.cancel_goal_async(), timeout)

    def wait(self, timeout):
        response = _wait_for_future(self.result_future, timeout)
        self.t_done = time.monotonic()
        self.status, self.result = response.status, response.result
        return self

    def refused(self, timeout=10.0):
        """The node would not serve the goal: accepted and ended at once ABORTED, its result
        carrying the error code and the reason (finish_reason ``rejected``); the reason, else
        None."""
        from action_msgs.msg import GoalStatus
        if not self.accepted:
            return None
        self.wait(timeout)
        r = self.result
        if self.status != GoalStatus.STATUS_ABORTED or r.finish_reason != 'rejected':
            return None
        assert r.error_code != 0 and r.error_msg and r.text == '' and r.generated_tokens == 0
        return r.error_msg


@pytest.fixture
def llm_graph(ros_context, tiny_llm):
    """Factory: llm_graph(manager=None|dict, **node_params) -> started LLMGraph (tiny model).

    Node parameters default to the tiny model and its profiles, task 'alpha' (load_ratio 0.7,
    compute_ratio 0.5; ``task=''`` serves the general profile); ``manager`` gives the profile
    manager's parameters (model/profiles filled in). A node whose compute ratio is below its load
    ratio runs goals one at a time unless ``max_batch`` is given (the queue and lifecycle tests
    on it count on a goal waiting behind the running one; such goals batch since they may).
    """
    import uuid

    spinner = SpinningExecutor(ros_context, num_threads=8).start()
    graphs = []

    def make(manager=None, **params):
        node_params = dict(model=str(tiny_llm.model), profiles=str(tiny_llm.profiles),
                           task='alpha', load_ratio=0.7, compute_ratio=0.5,
                           diagnostics_period=0.5)
        node_params.update(params)
        phi, gamma = node_params['compute_ratio'], node_params['load_ratio']
        if 'max_batch' not in params and 0 < phi < gamma:
            node_params['max_batch'] = 1
        manager_params = None
        if manager is not None:
            manager_params = dict(model=node_params['model'], profiles=node_params['profiles'])
            manager_params.update(manager)
        graph = LLMGraph(spinner, f'llm_{uuid.uuid4().hex[:8]}', node_params, manager_params)
        graphs.append(graph)
        return graph

    try:
        yield make
    finally:
        stopped = spinner.halt(timeout=10.0)
        for g in graphs:
            g.close()
        spinner.destroy_nodes()
        assert spinner.error is None, f'executor raised: {spinner.error!r}'
        assert stopped, 'executor thread did not stop within 10 s'


# ---------------------------------------------------------------------------------------------
# a robot agent: a system prompt, tools, Qwen2.5-0.5B behind the node
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def robot_agent():
    """The agent's system prompt and tools (dicts: name, description, parameters), as
    selectinfer_ros/data/examples/robot_agent.json holds them."""
    import json
    import types

    from selectinfer_ros.core.format.paths import DATA_DIR
    agent = json.loads((DATA_DIR / "examples" / "robot_agent.json").read_text(encoding="utf-8"))
    return types.SimpleNamespace(system=agent["system"], tools=agent["tools"])


@pytest.fixture
def qwen_graph(llm_graph, qwen05):
    """selectinfer_node on Qwen2.5-0.5B (its template's tool-call format), the prompt cache on."""
    g = llm_graph(model=str(qwen05), profiles='', task='', load_ratio=1.0, compute_ratio=1.0,
                  max_new_tokens=32, context_limit=2048, prompt_cache_mb=64.0)
    return g.ready(timeout=180.0)
