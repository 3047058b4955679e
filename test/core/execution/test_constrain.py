"""Constrained decoding on the embedded model (int8, the decode kernel): JSON-schema answers that
parse and validate over 24 schemas, Lark grammars, cut-off answers never called parsed, stop
strings and cancel inside constrained decoding, the transformers forward path, and the compiler's
refusals (invalid schema, grammar syntax error, a schema over the compile bound) with reasons."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from selectinfer_ros.core.execution import constrain
from selectinfer_ros.core.execution.constrain import GrammarError
from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
from selectinfer_ros.core.options import ModelOptions
from selectinfer_ros.core.serving.runtime import Runtime
from selectinfer_ros.lab.json_goals import SCHEMAS, prompt_for

ACTION = SCHEMAS[0][1]
ACTION_PROMPT = prompt_for(SCHEMAS[0][2], SCHEMAS[0][3])


@pytest.fixture(scope="module")
def rt():
    torch.set_num_threads(1)
    rt = Runtime(ModelOptions(task="general"))
    assert rt.engine.decode_path.endswith("int8 decode kernel")
    rt.engine.grammars.lltokenizer()  # the vocabulary (seconds), once for the module
    return rt


def _json(cfg_schema: dict, **kw) -> GenerationConfig:
    return GenerationConfig(json_schema=json.dumps(cfg_schema), **{"max_new_tokens": 64, **kw})


def test_every_schema_gives_json_that_validates(rt):
    """24 schemas (nested objects, arrays with minItems/maxItems, enums, integer and number ranges,
    required and optional fields, string patterns), greedy: each answer is complete (finish_reason
    grammar, parsed) and valid under its schema; the answers are the model's (all differ)."""
    answers = []
    for name, schema, instruction, example in SCHEMAS:
        res = rt.generate(prompt_for(instruction, example), _json(schema))
        assert res.finish_reason == "grammar" and res.parsed, (name, res.text, res.finish_reason)
        value = json.loads(res.text)
        jsonschema.validate(value, schema)
        answers.append(res.text)
        assert res.mask_seconds > 0
    assert len(SCHEMAS) >= 20 and len(set(answers)) == len(answers)


def test_sampled_answers_validate_and_follow_the_seed(rt):
    schema = SCHEMAS[5][1]  # a list of objects with integer ranges
    prompt = prompt_for(SCHEMAS[5][2], SCHEMAS[5][3])
    texts = []
    for seed in (1, 2, 3, 1):
        res = rt.generate(prompt, _json(schema, temperature=1.0, top_k=40, top_p=0.95,
                                        repetition_penalty=1.1, seed=seed))
        assert res.parsed and res.finish_reason == "grammar", res.text
        jsonschema.validate(json.loads(res.text), schema)
        texts.append(res.text)
    assert texts[0] == texts[3]


def test_a_cut_off_answer_is_length_and_never_parsed(rt):
    res = rt.generate(ACTION_PROMPT, _json(ACTION, max_new_tokens=4))
    assert res.finish_reason == "length" and not res.parsed
    with pytest.raises(ValueError):
        json.loads(res.text)
    assert res.text.startswith('{"')


def test_stop_strings_apply_and_the_answer_is_then_not_parsed(rt):
    res = rt.generate(ACTION_PROMPT, _json(ACTION, stop=['"target"']))
    assert res.finish_reason == "stop" and not res.parsed
    assert res.text.startswith('{"action":') and '"target"' not in res.text


def test_cancel_inside_constrained_decoding(rt):
    pieces: list[str] = []
    polls = []

    def cancel() -> bool:
        polls.append(1)
        return len(polls) > 4

    res = rt.engine.generate(ACTION_PROMPT, _json(ACTION), on_text=lambda s, n: pieces.append(s),
                             cancel=cancel)
    assert res.finish_reason == "canceled" and not res.parsed
    assert res.text == "".join(pieces) and len(res.token_ids) <= 4


def test_a_lark_grammar_ends_generation_at_its_end(rt):
    grammar = 'start: ("yes" | "no") ", because " /[a-z ]{1,30}/ "."'
    res = rt.generate("Is the floor wet? Answer yes or no and say why.\nAnswer: ",
                      GenerationConfig(max_new_tokens=40, grammar=grammar))
    assert res.finish_reason == "grammar" and res.parsed
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", res.text), res.text


def test_the_transformers_forward_path_is_masked_too(rt):
    e = rt.engine
    slow = Engine(e.model, e.tokenizer, e.selective, e.context_limit, lean=False)
    assert slow.decode_path.startswith("transformers forward")
    slow._grammars = e.grammars  # the same compiled vocabulary
    for name, schema, instruction, example in SCHEMAS[:3]:
        res = slow.generate(prompt_for(instruction, example), _json(schema))
        assert res.parsed, (name, res.text)
        jsonschema.validate(json.loads(res.text), schema)


def test_mask_buffers_are_reused_between_steps(rt):
    c = rt.engine.grammars.constraint("json_schema", json.dumps(ACTION))
    bits = c._bits
    logits = torch.zeros(rt.engine.model.config.vocab_size)
    c.mask_logits(logits)
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    assert allowed and all(rt.engine.tokenizer.decode([t]).startswith("{") for t in allowed)
    c.advance(allowed[0])
    c.mask_logits(torch.zeros_like(logits))
    assert c._bits is bits and c.steps == 2


# ---- the compiler's refusals --------------------------------------------------------------
def _refused(g, kind: str, source: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as e:
        g.compile(kind, source)
    return str(e.value), time.perf_counter() - t0


# 6000 optional properties: about 3 s to compile on a Zen 4 core, under 64 KiB of text
OVER_BOUND = json.dumps({"type": "object", "properties": {f"q{i}": {} for i in range(6000)}},
                        separators=(",", ":"))


def test_invalid_schemas_and_grammars_are_refused_at_once_with_reasons(rt):
    g = rt.engine.grammars
    for kind, source, needle in [
            ("json_schema", '{"type": "objekt"}', "objekt"),
            ("json_schema", '{"type": "object"', "not valid JSON"),
            ("json_schema", "[1, 2]", "must be a JSON object"),
            ("json_schema", '{"type": "string", "pattern": "("}', "regex"),
            ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
            ("grammar", 'start: "yes" | (', "Expected"),
            ("grammar", "start: foo", "unknown name"),
            ("grammar", " ", "empty grammar"),
            ("json_schema", "x" * (constrain.MAX_SOURCE_CHARS + 1), "at most")]:
        reason, seconds = _refused(g, kind, source)
        assert needle in reason and seconds < 1.0, (kind, source[:40], reason, seconds)


def test_a_schema_over_the_compile_bound_is_refused_within_a_second_and_cached(rt):
    assert len(OVER_BOUND) <= constrain.MAX_SOURCE_CHARS
    g = rt.engine.grammars
    reason, seconds = _refused(g, "json_schema", OVER_BOUND)
    assert "too costly" in reason and f"{constrain.COMPILE_SECONDS:g} s" in reason
    assert constrain.COMPILE_SECONDS <= seconds < 1.0
    reason2, seconds2 = _refused(g, "json_schema", OVER_BOUND)  # the verdict is cached
    assert reason2 == reason and seconds2 < 0.05
    res = rt.generate(ACTION_PROMPT, _json(ACTION))  # and the next goal is served
    assert res.parsed


def test_compiled_constraints_are_cached_by_content_and_bounded(rt):
    g = rt.engine.grammars
    source = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    a = g.compile("json_schema", source)
    assert g.compile("json_schema", source) is a
    for i in range(g.cache_size):
        g.compile("grammar", f'start: "x{i}"')
    assert g.compile("json_schema", source) is not a  # evicted (least recently used), recompiled
    assert len(g._cache) <= g.cache_size


def test_json_schema_and_grammar_are_mutually_exclusive():
    with pytest.raises(ValueError, match="mutually exclusive"):
        GenerationConfig(json_schema="{}", grammar='start: "a"').validate()


# ---- answers that end within their budget, loops, lenient schemas --------------------------
RAMBLE = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"},
                                         "minItems": 2},
    "n": {"type": "integer", "minimum": 5},
    "o": {"type": "object", "properties": {"a": {"enum": ["xx", "yy"]}}, "required": ["a"]}},
    "required": ["name", "tags", "n", "o"]}
RAMBLE_PROMPT = "Write a long description of a robot as JSON: "


def test_closing_paths_end_every_prefix_of_an_answer(rt):
    """From every token prefix of each schema's example answer, the closing path (forced tokens,
    closers, shortest values) ends the answer: prefix and path parse and validate."""
    g, tok = rt.engine.grammars, rt.engine.tokenizer
    eos = set(rt.engine.eos_ids)
    checked = 0
    for name, schema, _, example in SCHEMAS:
        ids = tok(json.dumps(example, separators=(",", ":")), add_special_tokens=False)["input_ids"]
        for k in range(len(ids)):
            c = g.constraint("json_schema", json.dumps(schema))
            assert c.matcher.try_consume_tokens(ids[:k]) == k, (name, k)
            path = c.closing_path(64)
            assert path is not None, (name, tok.decode(ids[:k]))
            text = tok.decode(ids[:k] + [t for t in path if t not in eos])
            jsonschema.validate(json.loads(text), schema)
            checked += 1
    assert checked > 200


def test_answers_end_complete_within_small_budgets(rt):
    """max_new_tokens below what the model would write: where the schema's shortest answer fits,
    the answer is complete and valid within the budget, closed early (finish_reason closed)
    when the model's own tokens would not have ended in time."""
    g = rt.engine.grammars
    closed = 0
    cases = [(prompt_for(i, e), s) for _, s, i, e in SCHEMAS[:10]] + [(RAMBLE_PROMPT, RAMBLE)]
    for prompt, schema in cases:
        shortest = g.constraint("json_schema", json.dumps(schema)).closing_path(64)
        for budget in (6, 9, 12, 18, 30):
            res = rt.generate(prompt, _json(schema, max_new_tokens=budget))
            assert len(res.token_ids) <= budget
            if len(shortest) > budget:
                continue
            assert res.parsed and res.finish_reason in ("grammar", "closed"), (budget, res.text)
            jsonschema.validate(json.loads(res.text), schema)
            assert res.closed_early == (res.finish_reason == "closed")
            closed += res.closed_early
    assert closed >= 2
    res = rt.generate(RAMBLE_PROMPT, _json(RAMBLE, max_new_tokens=30))
    assert res.finish_reason == "closed" and res.closed_early and len(res.budget_seconds) > 0


def test_free_text_and_answers_that_fit_are_unchanged(rt):
    """No budget tracking without a constraint; an answer that ends well within its budget is
    the same with a larger budget (the tracking only acts near the end)."""
    free = rt.generate(ACTION_PROMPT, GenerationConfig(max_new_tokens=12))
    assert free.budget_seconds == [] and not free.closed_early and free.loops_broken == 0
    a = rt.generate(ACTION_PROMPT, _json(ACTION, max_new_tokens=64))
    b = rt.generate(ACTION_PROMPT, _json(ACTION, max_new_tokens=200))
    assert a.finish_reason == b.finish_reason == "grammar" and a.text == b.text


def test_repeating_token_finds_loops():
    rep = constrain.repeating_token
    assert rep([5] * 12) == 5 and rep([5] * 11) is None
    assert rep([1, 2, 3] + [7, 8] * 6) == 7 and rep([7, 8] * 5) is None
    span = list(range(10, 25))  # a 15-token span (keys of an object) three times
    assert rep([1] + span * 3) == 10 and rep(span * 2) is None
    assert rep(list(range(60))) is None


def test_a_looping_answer_is_kept_from_repeating_and_still_parses(rt):
    """The rambling answer repeats a span in its string; the guard forbids the repeat (counted),
    and the answer stays complete and valid."""
    res = rt.generate(RAMBLE_PROMPT, _json(RAMBLE, max_new_tokens=64))
    assert res.parsed and res.loops_broken >= 1, res.text
    jsonschema.validate(json.loads(res.text), RAMBLE)


def test_lenient_schemas_ignore_what_the_library_lacks_and_say_so(rt):
    g = rt.engine.grammars
    schema = json.dumps({"type": "object", "properties": {"ids": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}},
        "required": ["ids"]})
    with pytest.raises(GrammarError, match=r'uniqueItems.*lenient mode ignores it'):
        g.compile("json_schema", schema)
    assert "uniqueItems" in " ".join(g.compile("json_schema", schema, lenient=True).warnings)
    res = rt.generate("IDs of the robots as JSON: ", _json(json.loads(schema), lenient=True))
    assert res.parsed and "uniqueItems" in " ".join(res.warnings)
    in_schema = json.loads(schema) | {"x-guidance": {"lenient": True}}  # the schema opts in
    assert g.compile("json_schema", json.dumps(in_schema)).warnings


def test_json_keys_refuse_a_key_written_twice_into_one_object():
    k = constrain.JsonKeys()
    k.feed('{"a":1,"b":{"a":2,"c":[{"a":1}]},')
    assert not k.allows('"a"') and not k.allows('"b":') and k.allows('"d":')
    assert k.allows('"a') and k.allows('"')  # not complete yet
    k.feed('"d":"x\\"y","')  # an escaped quote inside a value; a key opened
    assert not k.allows('a":') and k.allows('e":')
    k.feed('a')
    assert not k.allows('":') and k.allows('b":')  # "a" again; "ab" is new
    fresh = constrain.JsonKeys()
    fresh.feed('{"majors":[],"departments":[],')
    assert not fresh.allows('"majors":') and not fresh.allows('"x":1,"x":')
    assert fresh.allows('"x":1,"y":')
