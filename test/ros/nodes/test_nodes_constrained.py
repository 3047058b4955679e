"""json_schema and grammar goals against the real inference node on the embedded model: a
constrained answer end to end (streamed, parsed, valid under its schema), an invalid schema, a
grammar with a syntax error and a schema over the compile bound rejected at once with the reason,
the next goal served, and a cut-off answer reported as length, never as parsed."""
import json
import time

import jsonschema
from action_msgs.msg import GoalStatus

from selectinfer_msgs.action import Generate
from selectinfer_ros.lab.json_goals import SCHEMAS, prompt_for

R = Generate.Result
OVER_BOUND = json.dumps({'type': 'object', 'properties': {f'q{i}': {} for i in range(6000)}},
                        separators=(',', ':'))


def test_json_schema_goals_end_to_end_and_bad_ones_rejected_at_once(llm_graph, wait_until):
    g = llm_graph(model='', profiles='', task='general', load_ratio=1.0, compute_ratio=1.0,
                  max_new_tokens_limit=256).ready(timeout=180.0)
    rt = g.node.runtime
    assert rt.engine.decode_path.endswith('int8 decode kernel')
    assert rt.engine.grammars.wait_ready(60.0)  # prepared in the background since configure

    name, schema, instruction, example = SCHEMAS[0]
    run = g.run(g.goal(prompt_for(instruction, example), max_new_tokens=64,
                       json_schema=json.dumps(schema)), timeout=120.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    r = run.result
    assert r.error_code == R.NONE and r.finish_reason == 'grammar' and r.parsed
    jsonschema.validate(json.loads(r.text), schema)
    assert wait_until(lambda: run.text() == r.text, 5.0)  # streamed as usual

    for fields, reason in ((dict(json_schema='{"type": "objekt"}'), 'invalid json_schema'),
                           (dict(grammar='start: "yes" | ('), 'invalid grammar'),
                           (dict(json_schema=OVER_BOUND), 'json_schema too costly'),
                           (dict(json_schema='{}', grammar='start: "a"'), 'mutually exclusive'),
                           (dict(json_schema='{}', choices=['a', 'b']), 'mutually exclusive')):
        t0 = time.monotonic()
        run = g.send(g.goal('Answer: ', **fields))
        why = run.refused()  # ended at once, the reason in the result
        seconds = time.monotonic() - t0
        assert why and reason in why and run.result.error_code == R.INVALID_GOAL, (fields, why)
        assert seconds < 1.0, (reason, seconds)
        last = g.node.snapshot().last_rejection
        assert last.startswith('INVALID_GOAL: ') and reason in last, last

    # the next goal is served; a grammar goal; a cut-off answer is length, not parsed
    run = g.run(g.goal('Is the floor wet? Answer: ', max_new_tokens=8,
                       grammar='start: "yes" | "no"'), timeout=60.0)
    assert run.result.finish_reason == 'grammar' and run.result.parsed
    assert run.result.text in ('yes', 'no')
    run = g.run(g.goal(prompt_for(instruction, example), max_new_tokens=3,
                       json_schema=json.dumps(schema)), timeout=60.0)
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert run.result.finish_reason == 'length' and not run.result.parsed

    # a long answer ends complete within its budget (closed early, flagged and counted); a
    # lenient schema is answered and says what it ignored
    ramble = {'type': 'object', 'required': ['name', 'tags', 'n'], 'properties': {
        'name': {'type': 'string'}, 'tags': {'type': 'array', 'items': {'type': 'string'},
                                             'minItems': 2},
        'n': {'type': 'integer', 'minimum': 5}}}
    run = g.run(g.goal('Write a long description of a robot as JSON: ', max_new_tokens=24,
                       json_schema=json.dumps(ramble)), timeout=60.0)
    r = run.result
    assert r.finish_reason == 'closed' and r.parsed and r.closed_early, r.text
    assert r.generated_tokens <= 24
    jsonschema.validate(json.loads(r.text), ramble)
    assert rt.stats.closed_early == 1 and g.node.snapshot().closed_early == 1
    lenient = {'type': 'object', 'required': ['ids'], 'x-guidance': {'lenient': True},
               'properties': {'ids': {'type': 'array', 'items': {'type': 'integer'},
                                      'uniqueItems': True, 'maxItems': 3}}}
    run = g.run(g.goal('IDs of the robots as JSON: ', max_new_tokens=32,
                       json_schema=json.dumps(lenient)), timeout=60.0)
    assert run.result.parsed and any('uniqueItems' in w for w in run.result.warnings)
    assert not run.result.closed_early
    assert rt.stats.rejected == 5 and rt.stats.succeeded == 5
