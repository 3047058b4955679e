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
