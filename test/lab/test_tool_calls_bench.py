"""The BFCL tool-call bench (lab/tool_calls_bench.py) without a model: BFCL's function docs as
OpenAI tools, the AST checker against BFCL's possible answers (real entries of the bfcl-eval
wheel, fetched once into the cache), the lenient reading of calls in every form, the report."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from selectinfer_ros.lab import tool_calls_bench as tcb


@pytest.fixture(scope="module")
def bfcl() -> dict[str, dict]:
    """id -> the entry of simple_python, multiple and irrelevance (with its ground truth)."""
    from selectinfer_ros.lab.datasets import json_lines
    out = {}
    for cat in tcb.CATEGORIES:
        for q in json_lines("bfcl", tcb.DATA.format(cat)):
            out[q["id"]] = dict(q, category=cat)
        if cat != "irrelevance":
            for a in json_lines("bfcl", tcb.ANSWERS.format(cat)):
                out[a["id"]]["ground_truth"] = a["ground_truth"]
    return out


def _case(q: dict) -> dict:
    tools = [tcb.to_tool(f) for f in q["function"]]
    return {"id": q["id"], "category": q["category"], "functions": q["function"], "tools": tools,
            "names": {tcb.tool_name(f["name"]): f["name"] for f in q["function"]},
            "ground_truth": q.get("ground_truth")}


def _check(q: dict, name: str, args) -> tuple[bool, str]:
    return tcb.check_call(q["function"], name, args, q["ground_truth"])


# ---- the converter -----------------------------------------------------------------------------
def test_every_function_doc_converts_to_a_valid_tool(bfcl):
    for q in bfcl.values():
        for f in q["function"]:
            t = tcb.to_tool(f)
            assert t["type"] == "function"
            fn = t["function"]
            assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fn["name"]), fn["name"]
            assert fn["parameters"]["type"] == "object"
            jsonschema.Draft202012Validator.check_schema(fn["parameters"])
            text = json.dumps(fn["parameters"])
            for bfcl_only in ('"dict"', '"float"', '"tuple"', '"any"', '"optional"'):
                assert f'"type": {bfcl_only}' not in text and f"{bfcl_only}:" not in text


def test_converter_types_names_and_kept_keys(bfcl):
    t = tcb.to_tool(bfcl["multiple_0"]["function"][0])["function"]  # triangle_properties.get
    assert t["name"] == "triangle_properties_get"
    p = t["parameters"]
    assert p["required"] == ["side1", "side2", "side3"]
    assert p["properties"]["side1"] == {"type": "integer",
                                        "description": "The length of first side of the triangle."}
    area = p["properties"]["get_area"]
    assert area["type"] == "boolean" and area["default"] is True and "optional" not in area
    circle = tcb.to_tool(bfcl["multiple_0"]["function"][1])["function"]["parameters"]
    assert circle["properties"]["radius"]["type"] == "number"  # float
    coord = tcb.to_tool(bfcl["simple_python_83"]["function"][0])["function"]["parameters"]
    assert coord["properties"]["coord1"]["type"] == "array"  # tuple
    assert coord["properties"]["coord1"]["items"] == {"type": "number"}
    data = tcb.to_tool(bfcl["simple_python_109"]["function"][0])["function"]["parameters"]
    assert "type" not in data["properties"]["data"]  # any: no constraint
    cond = tcb.to_tool(bfcl["simple_python_89"]["function"][0])["function"]["parameters"]
    assert cond["properties"]["conditions"]["type"] == "object"  # nested dict
    assert cond["properties"]["conditions"]["properties"]["school"]["type"] == "string"


# ---- the AST checker ---------------------------------------------------------------------------
def test_ground_truth_calls_score_correct(bfcl):
    q = bfcl["simple_python_0"]  # calculate_triangle_area(base, height, unit optional)
    assert _check(q, "calculate_triangle_area", {"base": 10, "height": 5}) == (True, "")
    assert _check(q, "calculate_triangle_area", {"base": 10, "height": 5, "unit": "Units"})[0]
    q = bfcl["simple_python_14"]  # strings standardized; an int for a float
    assert _check(q, "calculate_derivative", {"function": "3x^2 + 2x - 1", "x_value": 0})[0]
    q = bfcl["simple_python_83"]  # tuples of floats
    assert _check(q, "calculate_distance", {"coord1": [33.4484, -112.074],
                                            "coord2": [34.0522, -118.2437], "unit": "Miles"})[0]
    q = bfcl["simple_python_89"]  # a dict, key by key, standardized
    assert _check(q, "db_fetch_records", {"database_name": "StudentDB", "table_name": "students",
                                          "conditions": {"department": "science",
                                                         "school": "Bluebird HS"}})[0]
    q = bfcl["multiple_3"]  # the expected one of two functions
    assert _check(q, "EuclideanDistance.calculate", {"pointA": [3, 4], "pointB": [1, 2]})[0]


@pytest.mark.parametrize("args, kind", [
    ({"base": 10, "height": 6}, "value_error:others"),
    ({"height": 5}, "simple_function_checker:missing_required"),
    ({"base": 10, "height": 5, "colour": "red"}, "simple_function_checker:unexpected_param"),
    ({"base": 10.0, "height": 5}, "type_error:simple"),  # a float for an integer
    ({"base": 10, "height": 5, "unit": "inches"}, "value_error:string"),
    ([10, 5], "arguments_not_an_object"),
])
def test_wrong_calls_score_wrong_with_a_reason(bfcl, args, kind):
    ok, reason = _check(bfcl["simple_python_0"], "calculate_triangle_area", args)
    assert not ok and reason.startswith(kind), reason


def test_wrong_name_and_wrong_values_in_nested_params(bfcl):
    ok, reason = _check(bfcl["simple_python_0"], "calculate_circle_area", {"base": 10, "height": 5})
    assert not ok and "wrong_func_name" in reason
    q = bfcl["multiple_3"]  # the other offered function
    ok, reason = _check(q, "angleToXAxis.calculate", {"pointA": [3, 4], "pointB": [1, 2]})
    assert not ok and "wrong_func_name" in reason
    ok, reason = _check(q, "EuclideanDistance.calculate", {"pointA": [4, 3], "pointB": [1, 2]})
    assert not ok and reason.startswith("value_error:list/tuple")
    ok, reason = _check(bfcl["simple_python_89"], "db_fetch_records", {
        "database_name": "StudentDB", "table_name": "students",
        "conditions": {"department": "Maths", "school": "Bluebird HS"}})
    assert not ok and reason.startswith("value_error:dict_value")


def test_score_maps_tool_names_back_and_irrelevance_wants_no_call(bfcl):
    case = _case(bfcl["simple_python_109"])  # random_forest.train
    right = {"n_estimators": 100, "max_depth": 5, "data": "my_data"}
    v = tcb.score(case, ("random_forest_train", right))
    assert v["correct"] and v["schema_valid"]
    v = tcb.score(case, ("random_forest_train", {"n_estimators": "100", "max_depth": 5,
                                                 "data": "my_data"}))
    assert not v["correct"] and not v["schema_valid"]  # a string for an integer
    assert tcb.score(case, None) == {"correct": False, "reason": "no call", "schema_valid": None}
    irr = _case(next(q for q in bfcl.values() if q["category"] == "irrelevance"))
    assert tcb.score(irr, None)["correct"]
    name = irr["tools"][0]["function"]["name"]
    v = tcb.score(irr, (name, {}))
    assert not v["correct"] and v["reason"] == f"called {name}"


def test_cases_are_a_seeded_sample(bfcl):
    a = tcb.load_cases(per_category=3, seed=0)
    b = tcb.load_cases(per_category=3, seed=0)
    assert [c["id"] for c in a] == [c["id"] for c in b]
    assert [c["category"] for c in a] == [c for c in tcb.CATEGORIES for _ in range(3)]
    assert all(c["ground_truth"] for c in a if c["category"] != "irrelevance")
    assert [c["id"] for c in tcb.load_cases(per_category=3, seed=1)] != [c["id"] for c in a]


# ---- the lenient reader ------------------------------------------------------------------------
CALL = '{"name": "math_factorial", "arguments": {"number": 5}}'


@pytest.mark.parametrize("text, form", [
    (f"<tool_call>\n{CALL}\n</tool_call>", "<tool_call>"),
    (f"Sure.\n<tools>\n{CALL}\n</tools>", "<tools>"),
    (f"<function_call>{CALL}</function_call>", "<function_call>"),
    (f"<response>[{CALL}]</response>", "<response>"),
    (f"<json>{CALL}", "<json>"),  # unclosed tag
    (f"Here it is:\n```json\n{CALL}\n```", "```json"),
    (f"```\n{CALL}\n```", "```"),
    (f"I will call {CALL} now.", "bare"),
    (f"[{CALL}, {{\"name\": \"other\", \"arguments\": {{}}}}]", "bare"),  # the first counts
    ('{"name": "math_factorial", "parameters": {"number": 5}}', "bare"),
    ('{"type": "function", "function": {"name": "math_factorial", "arguments": "{\\"number\\": 5}"}}',
     "bare"),  # OpenAI's form, arguments as JSON text
    ("{'name': 'math_factorial', 'arguments': {'number': 5}}", "bare"),  # a Python literal
    ("Call math_factorial(number=5).", "python"),
    ('<tool_call>\n{"name": "math_factorial", "arguments": {"number": 5}\n</tool_call>',
     "<tool_call>" + tcb.CLOSED),
])
def test_lenient_parser_reads_every_form(text, form):
    assert tcb.parse_call(text, {"math_factorial"}) == ("math_factorial", {"number": 5}, form)


def test_lenient_parser_takes_the_earliest_call_and_finds_none_in_prose():
    text = f'First {{"name": "a", "arguments": {{}}}} then <tool_call>{CALL}</tool_call>'
    assert tcb.parse_call(text) == ("a", {}, "bare")
    for prose in ("The capital of France is Paris.", 'A JSON object: {"x": 1}.',
                  "Use factorial(5) in Python.", "<tool_call>\nnot json\n</tool_call>"):
        assert tcb.parse_call(prose, {"math_factorial"}) is None
    assert tcb.marker_without_call("<tool_call>\nnot json\n</tool_call>") == "<tool_call>"


# ---- the report --------------------------------------------------------------------------------
def test_summary_table_and_plot(tmp_path):
    def row(mode, cat, correct, form=None, call=True):
        return {"id": "x", "mode": mode, "category": cat, "correct": correct,
                "call": {"name": "f", "arguments": {}} if call else None, "schema_valid": call,
                "finish_reason": "tool_calls" if call else "stop", "tokens": 10, "seconds": 1.0,
                "form": form, "status": "SUCCEEDED", "text_call_form": None}
    rows = [row("auto", "simple_python", True), row("auto", "irrelevance", True, call=False),
            row("dense", "simple_python", False, "```json"),
            row("dense", "simple_python", True, "<tool_call>")]
    s = tcb.summarize(rows)
    dense = next(x for x in s if x["mode"] == "dense")
    assert dense["accuracy"] == 0.5 and dense["calls"] == 2
    assert dense["call_forms"] == {"```json": 1, "<tool_call>": 1}
    assert "| auto | irrelevance | 1 | 1/1 (100%) | 0 |" in tcb.table(s)
    png = tcb.plot(s, {"```json": 1, "<tool_call>": 1}, tmp_path / "p.png", "title")
    assert png.stat().st_size > 1000


def test_a_tool_definition_written_out_is_no_call():
    doc = json.dumps({"type": "function", "function": {
        "name": "math_factorial", "description": "n!", "parameters": {
            "type": "object", "properties": {"number": {"type": "integer"}}}}})
    assert tcb.parse_call(f"<tools>\n{doc}\n</tools>") is None
    assert tcb.parse_call(f"<tools>\n{doc}\n</tools>\n<tool_call>{CALL}</tool_call>") == (
        "math_factorial", {"number": 5}, "<tool_call>")
    assert tcb.writes_tool_doc(f"<tools>\n{doc}\n</tools>")
    assert not tcb.writes_tool_doc(f"<tool_call>{CALL}</tool_call>")
