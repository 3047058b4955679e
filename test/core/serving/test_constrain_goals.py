"""json_schema and grammar goals through the serving layer: the goal checks (mutually exclusive with
choices and each other; invalid, syntax error and over-bound refused at once with reasons, the
next goal served) and a constrained goal run by the worker (parsed, valid)."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest

from selectinfer_ros.core.options import ModelOptions, NodeSettings
from selectinfer_ros.core.serving import server as serving
from selectinfer_ros.core.serving.runtime import Runtime
from selectinfer_ros.core.serving.server import GoalJob, Rejected, Server
from selectinfer_ros.lab.json_goals import SCHEMAS, prompt_for

SETTINGS = NodeSettings(max_new_tokens=64, max_new_tokens_limit=256)
OVER_BOUND = json.dumps({"type": "object", "properties": {f"q{i}": {} for i in range(6000)}},
                        separators=(",", ":"))


@pytest.fixture(scope="module")
def embedded_server():
    """A started Server holding the embedded model (int8, the decode kernel)."""
    srv = Server(queue_length=2)
    srv.start()
    try:
        srv.load(lambda: Runtime(ModelOptions(task="general", num_threads=1)))
        srv.accepting = True
        srv.runtime.engine.grammars.lltokenizer()  # built by load()
        yield srv
    finally:
        srv.stop(timeout=10.0)


def goal(**over):
    base = dict(prompt="Answer in JSON: ", task="", max_new_tokens=0, temperature=0.0, top_k=0,
                top_p=0.0, repetition_penalty=0.0, seed=-1, stop=[], use_chat_template=False,
                compute_ratio=0.0, choices=[], length_normalize=False, json_schema="", grammar="")
    base.update(over)
    return SimpleNamespace(**base)


def _check(srv: Server, g) -> float:
    """Seconds the goal callback's checks take (goal_config, prompt, constraint)."""
    t0 = time.perf_counter()
    cfg, _ = serving.goal_config(g, SETTINGS, srv.runtime)
    srv.check_prompt(g.prompt, False)
    srv.check_constraint(cfg)
    return time.perf_counter() - t0


def _run(srv: Server, g):
    cfg, phi = serving.goal_config(g, SETTINGS, srv.runtime)
    done = threading.Event()
    job = GoalJob(g.prompt, cfg, "", phi, lambda: False, lambda: None, lambda s, n: None,
                  lambda outcome: done.set())
    srv.admit()
    srv.submit(job)
    assert done.wait(120.0)
    return job.outcome


def test_constraints_exclude_choices_and_each_other(embedded_server):
    for over in (dict(json_schema="{}", choices=["a", "b"]), dict(grammar='start: "a"', choices=["a"]),
                 dict(json_schema="{}", grammar='start: "a"')):
        with pytest.raises(Rejected) as e:
            serving.goal_config(goal(**over), SETTINGS, embedded_server.runtime)
        assert e.value.code == serving.INVALID_GOAL and "mutually exclusive" in e.value.reason


def test_bad_constraints_are_rejected_in_under_a_second_and_the_next_goal_is_served(embedded_server):
    srv = embedded_server
    for over, needle in [(dict(json_schema='{"type": "objekt"}'), "invalid json_schema"),
                         (dict(json_schema='{"type": '), "not valid JSON"),
                         (dict(grammar='start: "yes" | ('), "invalid grammar"),
                         (dict(json_schema=OVER_BOUND), "too costly")]:
        t0 = time.perf_counter()
        with pytest.raises(Rejected) as e:
            _check(srv, goal(**over))
        seconds = time.perf_counter() - t0
        assert e.value.code == serving.INVALID_GOAL and needle in e.value.reason, e.value.reason
        assert seconds < 1.0, (needle, seconds)
    name, schema, instruction, example = SCHEMAS[3]
    g = goal(prompt=prompt_for(instruction, example), json_schema=json.dumps(schema))
    assert _check(srv, g) < 1.0
    out = _run(srv, g)
    assert out.status == "succeeded" and out.result.parsed
    assert out.result.finish_reason == "grammar"
    jsonschema.validate(json.loads(out.result.text), schema)


def test_a_cut_off_constrained_goal_succeeds_as_length_never_parsed(embedded_server):
    name, schema, instruction, example = SCHEMAS[0]
    out = _run(embedded_server, goal(prompt=prompt_for(instruction, example), max_new_tokens=3,
                                     json_schema=json.dumps(schema)))
    assert out.result.finish_reason == "length" and not out.result.parsed


def test_a_tokenizer_llguidance_cannot_read_refuses_constraints_with_the_reason(module_server):
    """The tiny test models have a WordPiece tokenizer: constrained goals are refused, with why."""
    cfg, _ = serving.goal_config(goal(prompt="w10 w11", grammar='start: "w1"'), SETTINGS,
                                 module_server.runtime)
    with pytest.raises(Rejected) as e:
        module_server.check_constraint(cfg)
    assert e.value.code == serving.INVALID_GOAL and "unavailable" in e.value.reason


def test_the_load_returns_with_the_vocabulary_built(monkeypatch):
    """The load waits for llguidance's vocabulary (its build holds the GIL for seconds: built in
    the background it stalled the node's callbacks as the node became active), so a constrained
    goal right after the load is checked without waiting (no vocabulary cached before)."""
    import collections

    from selectinfer_ros.core.execution import constrain
    monkeypatch.setattr(constrain, "_VOCABS", collections.OrderedDict())
    srv = Server(queue_length=1)
    srv.start()
    try:
        srv.load(lambda: Runtime(ModelOptions(task="general", num_threads=1)))
        grammars = srv.runtime.engine.grammars
        assert grammars.wait_ready(0.0)
        assert grammars.lltokenizer(wait=0.0) is not None
    finally:
        srv.stop(timeout=10.0)


def test_a_constrained_goal_while_the_vocabulary_is_prepared_is_refused_to_retry(embedded_server):
    """A vocabulary still being prepared (its build ran past the load's wait): the goal
    callback does not wait for it, it refuses with NO_MODEL (retry) within VOCAB_WAIT_SECONDS."""
    from selectinfer_ros.core.execution.constrain import Grammars
    e = embedded_server.runtime.engine
    ready = e._grammars
    e._grammars = Grammars(e.tokenizer, ready.vocab_size, e.eos_ids)
    e._grammars._started = True  # being prepared (its build never finishes here)
    try:
        t0 = time.perf_counter()
        with pytest.raises(Rejected) as ex:
            _check(embedded_server, goal(json_schema='{"type": "integer"}'))
        assert time.perf_counter() - t0 < serving.VOCAB_WAIT_SECONDS + 0.3
        assert ex.value.code == serving.NO_MODEL and "retry" in ex.value.reason
    finally:
        e._grammars = ready
    _check(embedded_server, goal(json_schema='{"type": "integer"}'))  # prepared: accepted
