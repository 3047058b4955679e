"""py_trees behaviours and the client facade against the real nodes on the embedded model.

Covers: the example patrol tree (SwitchProfile, Choose, Generate) ticks to SUCCESS with the
blackboard holding what the model answers directly; a branch preempted mid-generation, or before
the goal response came, or by tree.shutdown(), cancels its goal (the node's canceled counter
rises and the next goal is served at once); invalid choices are rejected with a reason.
"""
import operator
import time
import uuid

import py_trees
import pytest
from py_trees.common import Status

from selectinfer_msgs.action import Generate as GenerateAction

R = GenerateAction.Result


@pytest.fixture
def embedded_graph(llm_graph):
    """selectinfer_node on the embedded model (0.7 / 0.5) and an active profile_manager."""
    g = llm_graph(manager={'task': 'navigation'}, model='', profiles='', task='navigation',
                  load_ratio=0.7, compute_ratio=0.5, static_ratio=0.3,
                  max_new_tokens_limit=256).bring_up()
    assert g.action.wait_for_server(timeout_sec=60.0)
    return g


@pytest.fixture(autouse=True)
def clean_blackboard():
    py_trees.blackboard.Blackboard.clear()
    yield
    py_trees.blackboard.Blackboard.clear()


def setup_tree(g, root):
    """A BehaviourTree set up on a node of its own, which then joins the spinning executor."""
    from rclpy.node import Node
    node = Node(f'bt_{uuid.uuid4().hex[:6]}', context=g.client_node.context)
    tree = py_trees.trees.BehaviourTree(root)
    tree.setup(node=node)  # before the node spins: the behaviours make their clients here
    g.spinner.add_node(node)
    return tree


def tick_until(tree, done, timeout, period=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree.tick()
        if done():
            return True
        time.sleep(period)
    return False


def write(key, value):
    bb = py_trees.blackboard.Client(name=f'test writer {key}')
    bb.register_key(key, access=py_trees.common.Access.WRITE)
    bb.set(key, value, overwrite=True)


def read(key):
    return py_trees.blackboard.Blackboard.get(key)


def test_patrol_tree_ticks_to_success_with_the_answers_on_the_blackboard(embedded_graph):
    from selectinfer_ros.core.execution.engine import GenerationConfig
    from selectinfer_ros.ros.examples import bt_patrol
    g = embedded_graph
    scene = 'The battery is at 4 percent and the robot is in the kitchen.'
    write('/scene', scene)
    root = bt_patrol.create_root(g.namespace, max_new_tokens=16)
    tree = setup_tree(g, root)
    assert tick_until(tree, lambda: root.status != Status.RUNNING, 180.0)
    assert root.status == Status.SUCCESS, py_trees.display.unicode_tree(root, show_status=True)
    print('\n' + py_trees.display.ascii_tree(root, show_status=True))
    print(py_trees.display.unicode_blackboard())
    # what the model answers for the same prompts, asked directly (greedy, deterministic)
    rt = g.node.runtime
    rt.switch_task('navigation')
    direct = rt.choose(bt_patrol.NEXT_ROOM_PROMPT.format(scene=scene), bt_patrol.ROOMS)
    assert read('/next_room') == direct.choice in bt_patrol.ROOMS
    assert read('/next_room_index') == direct.index
    rt.switch_task('scene')
    status = rt.generate(bt_patrol.STATUS_PROMPT.format(scene=scene, next_room=direct.choice),
                         GenerationConfig(max_new_tokens=16, stop=['\n']))
    assert read('/status') == status.text and status.text.strip()
    assert read('/llm/error') == ''
    assert rt.stats.succeeded == 2 and rt.stats.canceled == 0


def long_generation_tree(namespace):
    """A selector whose higher-priority branch fires when /interrupt becomes true."""
    from selectinfer_ros.ros.behaviours import Generate
    interrupt = py_trees.behaviours.CheckBlackboardVariableValue(
        'interrupt?', check=py_trees.common.ComparisonExpression('/interrupt', True, operator.eq))
    gen = Generate('story', 'Once upon a time, in a small village by the sea,', namespace=namespace,
                   max_new_tokens=200, text_key='/story')
    root = py_trees.composites.Selector('root', memory=False, children=[interrupt, gen])
    return root, gen


def assert_canceled_and_next_goal_served_at_once(g, wait_until, canceled):
    assert wait_until(lambda: g.node.runtime.stats.canceled == canceled, 5.0), \
        'the preempted goal was not canceled'
    assert wait_until(lambda: not g.node.snapshot().generating, 2.0)
    t0 = time.monotonic()
    run = g.run(g.goal('The capital of France is', max_new_tokens=2), timeout=60.0)
    assert run.result.error_code == R.NONE
    assert time.monotonic() - t0 < 15.0, 'the next goal waited for a generation left running'


def test_preempted_branch_cancels_its_goal_mid_generation(embedded_graph, wait_until):
    g = embedded_graph
    write('/interrupt', False)
    root, gen = long_generation_tree(g.namespace)
    tree = setup_tree(g, root)
    assert tick_until(tree, lambda: gen.handle is not None and gen.handle.feedback is not None
                      and gen.handle.feedback.generated_tokens >= 3, 120.0)
    assert gen.status == Status.RUNNING
    write('/interrupt', True)
    tree.tick()
    assert root.status == Status.SUCCESS and gen.status == Status.INVALID
    assert gen.handle.cancel_requested
    assert_canceled_and_next_goal_served_at_once(g, wait_until, canceled=1)
    assert g.node.runtime.stats.succeeded == 1


def test_preempted_before_the_goal_response_and_tree_shutdown_cancel(embedded_graph, wait_until):
    g = embedded_graph
    write('/interrupt', False)
    root, gen = long_generation_tree(g.namespace)
    tree = setup_tree(g, root)
    tree.tick()  # sends the goal
    write('/interrupt', True)
    tree.tick()  # preempted at once: the goal response has most likely not come yet
    assert gen.status == Status.INVALID and gen.handle.cancel_requested
    print(f'\n[preempt] goal response had come at the interrupt: {gen.handle.accepted is not None}')
    assert_canceled_and_next_goal_served_at_once(g, wait_until, canceled=1)

    write('/interrupt', False)
    assert tick_until(tree, lambda: gen.handle.feedback is not None, 120.0)
    tree.shutdown()
    assert_canceled_and_next_goal_served_at_once(g, wait_until, canceled=2)


def test_invalid_choices_are_rejected_with_a_reason(embedded_graph):
    from selectinfer_ros.ros.behaviours import Choose
    from selectinfer_ros.ros.client import STATUS_REJECTED
    g = embedded_graph
    too_many = Choose('65 options', 'Pick a number:', [f'n{i}' for i in range(65)],
                      namespace=g.namespace, error_key='/err')
    root = py_trees.composites.Sequence('root', memory=True, children=[too_many])
    tree = setup_tree(g, root)
    assert tick_until(tree, lambda: root.status != Status.RUNNING, 30.0)
    assert root.status == Status.FAILURE
    assert too_many.outcome.status == STATUS_REJECTED
    assert read('/err').startswith('REJECTED') and read('/llm/choice_index') == -1
    assert g.node.snapshot().last_rejection == (
        'INVALID_GOAL: invalid choices: 65 choices; at most 64 are allowed')
    for choices, reason in ((['dock', ''], 'choice 1 is empty'),
                            (['dock', 'hall', 'dock'], "choice 2 'dock' repeats choice 0"),
                            (['dock', 'hall ' * 40000], 'choice 1 has ')):
        run = g.send(g.goal('Where next?', choices=choices))
        assert reason in (run.refused() or ''), reason
        assert g.node.snapshot().last_rejection.startswith(
            f'INVALID_GOAL: invalid choices: {reason}'), g.node.snapshot().last_rejection
    assert g.node.runtime.stats.rejected == 4
    # a valid choices goal through the same action: text is the option, logprobs per option
    run = g.run(g.goal('The robot battery is empty. It goes to the', choices=['dock', 'kitchen']))
    r = run.result
    assert r.error_code == R.NONE and r.finish_reason == 'choice'
    assert r.text == ['dock', 'kitchen'][r.choice_index]
    assert len(r.choice_logprobs) == len(r.choice_logprobs_normalized) == 2
    assert max(r.choice_logprobs) == r.choice_logprobs[r.choice_index]


def test_blackboard_inputs_and_outcome_mapping(llm_graph):
    """Tiny model: prompt and choices from blackboard keys, options mapped to FAILURE, and
    a missing key or an empty choices list failing without a goal."""
    from selectinfer_ros.ros.behaviours import Choose, Generate
    g = llm_graph().ready()
    write('/question', 'w5 w6 w7')
    write('/rooms', ['w8', 'w9 w10', 'w11'])
    pick = Choose('pick', prompt_key='/question', choices_key='/rooms', namespace=g.namespace,
                  choice_key='/room', index_key='/room_index',
                  outcomes={'w8': Status.FAILURE, 'w9 w10': Status.FAILURE, 'w11': Status.FAILURE})
    say = Generate('say', '{question} w12', namespace=g.namespace, text_key='/said',
                   max_new_tokens=4)
    root = py_trees.composites.Sequence('both', memory=True, children=[say, pick])
    tree = setup_tree(g, root)
    assert tick_until(tree, lambda: root.status != Status.RUNNING, 60.0)
    assert pick.status == Status.FAILURE and say.status == Status.SUCCESS
    assert read('/room') == ['w8', 'w9 w10', 'w11'][read('/room_index')]
    assert read('/llm/error') == '' and read('/said') == say.outcome.text
    assert g.node.runtime.stats.succeeded == 2

    missing = Generate('missing', '{nowhere}', namespace=g.namespace)
    write('/rooms', [])
    empty = Choose('empty', 'w5', choices_key='/rooms', namespace=g.namespace)
    for b in (missing, empty):
        t = setup_tree(g, py_trees.composites.Sequence('s', memory=True, children=[b]))
        t.tick()
        assert b.status == Status.FAILURE and b.handle is None
    assert 'blackboard key not set' in missing.feedback_message
    assert 'no choices on /rooms' in empty.feedback_message
    assert g.node.runtime.stats.succeeded == 2 and g.node.runtime.stats.rejected == 0


def test_generate_json_writes_the_object_to_the_blackboard(embedded_graph):
    """The example tree with its GenerateJSON action decision, end to end against the nodes: the
    decision is an object on /action valid under the schema, and the one the model gives for that
    prompt directly; an invalid schema fails with the reason and leaves None."""
    import json

    import jsonschema

    from selectinfer_ros.core.execution.engine import GenerationConfig
    from selectinfer_ros.ros.behaviours import GenerateJSON
    from selectinfer_ros.ros.examples import bt_patrol
    g = embedded_graph
    assert g.node.runtime.engine.grammars.wait_ready(60.0)  # prepared in the background
    scene = 'The battery is at 4 percent and the robot is in the kitchen.'
    write('/scene', scene)
    root = bt_patrol.create_root(g.namespace, max_new_tokens=8, decide=True)
    tree = setup_tree(g, root)
    assert tick_until(tree, lambda: root.status != Status.RUNNING, 180.0)
    assert root.status == Status.SUCCESS, py_trees.display.unicode_tree(root, show_status=True)
    action = read('/action')
    jsonschema.validate(action, bt_patrol.ACTION_SCHEMA)
    rt = g.node.runtime
    rt.switch_task('navigation')
    direct = rt.generate(bt_patrol.ACTION_PROMPT.format(scene=scene), GenerationConfig(
        max_new_tokens=64, json_schema=json.dumps(bt_patrol.ACTION_SCHEMA)))
    assert direct.parsed and json.loads(direct.text) == action == json.loads(read('/action_text'))
    bad = GenerateJSON('bad', 'Scene: {scene}', schema={'type': 'objekt'},
                       namespace=g.namespace, value_key='/bad', error_key='/err')
    root2 = py_trees.composites.Sequence('root2', memory=True, children=[bad])
    tree2 = setup_tree(g, root2)
    assert tick_until(tree2, lambda: root2.status != Status.RUNNING, 30.0)
    assert root2.status == Status.FAILURE and read('/bad') is None
    assert read('/err').startswith('REJECTED')
    assert 'invalid json_schema' in g.node.snapshot().last_rejection


def test_chat_and_call_tool_behaviours_keep_the_conversation(qwen_graph, robot_agent):
    """CallTool writes the call a tree dispatches (name, parsed arguments) and the conversation;
    after the tool's result is appended, Chat continues it with a text answer."""
    SYSTEM, TOOLS = robot_agent.system, robot_agent.tools

    from selectinfer_ros.ros.behaviours import CallTool, Chat, tool_result
    g = qwen_graph
    act = CallTool('act', 'Please drive to the dock.', system=SYSTEM, tools=TOOLS,
                   namespace=g.namespace, outcomes={'say': Status.FAILURE})
    tree = setup_tree(g, act)
    assert tick_until(tree, lambda: act.status != Status.RUNNING, 180.0)
    assert act.status == Status.SUCCESS, act.feedback_message
    call = read('/llm/tool_call')
    assert call['name'] == read('/llm/tool_name') == 'navigate_to'
    assert read('/llm/tool_arguments') == call['arguments'] and call['arguments']['room'] in (
        'kitchen', 'hall', 'dock', 'bedroom')
    conv = read('/llm/conversation')
    assert [m['role'] for m in conv] == ['system', 'user', 'assistant']
    assert conv[2]['tool_calls'][0]['function']['name'] == 'navigate_to'
    # the tree ran the tool; the conversation goes on with its result
    bb = py_trees.blackboard.Client(name='test tool runner')
    bb.register_key('/llm/conversation', access=py_trees.common.Access.WRITE)
    bb.set('/llm/conversation', tool_result(conv, call, 'arrived at the dock'), overwrite=True)
    talk = Chat('talk', 'Where are you now? Answer in one short sentence.', tools=TOOLS,
                tool_choice='none', namespace=g.namespace, max_new_tokens=24)
    tree = setup_tree(g, talk)
    assert tick_until(tree, lambda: talk.status != Status.RUNNING, 180.0)
    assert talk.status == Status.SUCCESS, talk.feedback_message
    conv = read('/llm/conversation')
    assert [m['role'] for m in conv] == ['system', 'user', 'assistant', 'tool', 'user',
                                        'assistant']
    assert read('/llm/reply') == conv[-1]['content'] and read('/llm/reply').strip()
    assert read('/llm/tool_calls') == []
