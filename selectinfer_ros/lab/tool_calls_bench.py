"""Tool calls on the Berkeley Function Calling Leaderboard (BFCL): the model as plain
transformers writes it, and the node through the ``Generate`` action.

    python -m selectinfer_ros.lab.tool_calls_bench --model qwen2.5-1.5b --per-category 20 \\
        --threads 1 --out docs/results/tool-calls-bfcl-qwen2.5-1.5b.json

Cases: BFCL v4's ``simple_python``, ``multiple`` (one call of one of 2-4 functions) and
``irrelevance`` (no function fits: the right answer is no call), read from the ``bfcl-eval`` wheel
(:mod:`.datasets`, never installed); ``--per-category`` of each, drawn with
``random.Random(seed).sample`` over the ids, the same cases for every mode.

Tools: BFCL's function docs as OpenAI tools (:func:`to_tool`): ``.`` in a name becomes ``_`` (tool
names are ``[A-Za-z0-9_-]{1,64}``; BFCL does the same for OpenAI's models) and is mapped back
when scoring; types ``dict`` -> object, ``float`` -> number, ``tuple`` -> array, ``any`` -> no
type; enum, description, required and default kept.

Modes:

- ``dense``: the float32 checkpoint with plain transformers (``apply_chat_template`` with the
  tools, greedy ``generate``), its text read as leniently as it can be (:func:`parse_call`): a
  call in ``<tool_call>``, ``<tools>``, ``<function_call>``, ``<response>`` or ``<json>`` tags, a
  ```` ```json ```` or ```` ``` ```` fence, a bare JSON object or list (JSON, else a Python
  literal), else a Python call of an offered function; the first call in the text counts, and the
  form it was written in is recorded (which triggers the node should recognise);
- ``auto`` / ``required``: the node (``selectinfer_node`` in this process, the parameters file's
  defaults with model, num_threads, max_new_tokens, context_limit 4096), ``tool_choice`` auto /
  required, its ``tool_calls``; ``required`` on the call categories only.

Scoring (:func:`check_call`) follows BFCL's AST checker (``eval_checker/ast_eval/ast_checker.py``,
Python): the function's name; every argument a parameter of the function (and of the possible
answer); the required ones present, and the possible answer's too unless ``""`` is among its
values; types by the BFCL parameter types (an int for a float; one level into arrays); values
compared as BFCL does (strings standardized: lowercased, spaces and ``,./-_*^`` removed; lists
element-wise, dicts key by key). The first call is scored (BFCL counts a second call wrong;
the node makes one call per answer). Irrelevance: right when the answer makes no call.

Output: JSON (summary per mode and category, the dense model's call forms, one row per case), a
bar plot beside it (``.png``) and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

CATEGORIES = ("simple_python", "multiple", "irrelevance")
MODES = ("dense", "auto", "required")
DATA = "bfcl_eval/data/BFCL_v4_{}.json"
ANSWERS = "bfcl_eval/data/possible_answer/BFCL_v4_{}.json"


# ---- BFCL function docs as OpenAI tools ------------------------------------------------------
TYPES = {"dict": "object", "object": "object", "float": "number", "number": "number",
         "double": "number", "integer": "integer", "int": "integer", "long": "integer",
         "string": "string", "str": "string", "char": "string", "boolean": "boolean",
         "bool": "boolean", "array": "array", "list": "array", "tuple": "array", "any": None}
KEPT = ("description", "enum", "default")


def tool_name(name: str) -> str:
    """A BFCL function name as a tool name: ``.`` -> ``_``."""
    return name.replace(".", "_")


def to_schema(doc: dict) -> dict:
    """A BFCL parameter doc as JSON schema (recursively: properties, items)."""
    out: dict = {}
    t = doc.get("type")
    if t is not None and TYPES.get(t) is not None:
        out["type"] = TYPES[t]
    for k in KEPT:
        if k in doc:
            out[k] = doc[k]
    if isinstance(doc.get("properties"), dict):
        out["properties"] = {k: to_schema(v) for k, v in doc["properties"].items()}
    if isinstance(doc.get("items"), dict):
        out["items"] = to_schema(doc["items"])
    if isinstance(doc.get("required"), list):
        out["required"] = list(doc["required"])
    return out


def to_tool(fn: dict) -> dict:
    """A BFCL function doc as an OpenAI tool (``{"type": "function", "function": {...}}``, as
    chat templates and the node take it)."""
    params = to_schema(fn.get("parameters") or {})
    params["type"] = "object"
    params.setdefault("properties", {})
    return {"type": "function", "function": {"name": tool_name(fn["name"]),
                                             "description": fn.get("description", ""),
                                             "parameters": params}}


# ---- the most lenient reading of a call ------------------------------------------------------
TAGS = ("tool_call", "tools", "function_call", "response", "json")
_TAG = re.compile(r"<(%s)>(.*?)(?:</\1>|(?=<(?:%s)>)|\Z)" % ("|".join(TAGS), "|".join(TAGS)),
                  re.S)
_FENCE = re.compile(r"```[ \t]*([A-Za-z]*)[^\n]*\n?(.*?)(?:```|\Z)", re.S)
CLOSED = " (unclosed JSON, closed)"  # a form's suffix: the JSON read once its brackets closed
_PYCALL = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*)\s*\(")


def _scan(text: str, i: int, pairs: dict, quotes: str) -> tuple[int, str, str]:
    """The bracketed span that opens at ``text[i]`` (``pairs``: opener -> closer; strings in
    ``quotes`` skipped): (its end, exclusive, or -1 when it does not close, -2 at a mismatched
    bracket; the closers still open at the end; the quote still open at the end)."""
    stack, quote, k = [], "", i
    while k < len(text):
        c = text[k]
        if quote:
            if c == "\\":
                k += 1
            elif c == quote:
                quote = ""
        elif c in quotes:
            quote = c
        elif c in pairs:
            stack.append(pairs[c])
        elif c in pairs.values():
            if not stack or stack.pop() != c:
                return -2, "", quote
            if not stack:
                return k + 1, "", quote
        k += 1
    return -1, "".join(reversed(stack)), quote


def _balanced(text: str, i: int) -> int:
    """The end (exclusive) of the bracketed span that opens at ``text[i]``, strings skipped;
    -1 when it does not close."""
    return max(-1, _scan(text, i, {"{": "}", "[": "]", "(": ")"}, "\"'")[0])


def _closers(text: str, i: int) -> str:
    """The brackets that would close what opens at ``text[i]`` and is still open at the end
    (strings skipped); '' when it closes, or ends inside a string."""
    end, still_open, quote = _scan(text, i, {"{": "}", "[": "]"}, '"')
    return still_open if end == -1 and not quote else ""


def _value_at(text: str, i: int):
    """``(value, closed)``: the JSON value (else Python literal) that starts at ``text[i]``
    (``{`` or ``[``); else the JSON that the rest of ``text`` is with its open brackets closed
    (``closed`` True); else (_NONE, False)."""
    try:
        return json.JSONDecoder().raw_decode(text, i)[0], False
    except ValueError:
        pass
    end = _balanced(text, i)
    if end > 0:
        try:
            return ast.literal_eval(text[i:end]), False
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    tail = _closers(text, i)
    if tail:
        try:
            return json.loads(text[i:].rstrip() + tail), True
        except ValueError:
            pass
    return _NONE, False


_NONE = object()


def is_tool_doc(value) -> bool:
    """A function's definition rather than a call: ``parameters`` that are an object schema
    (models given tools sometimes write one of them out again)."""
    p = value.get("parameters") if isinstance(value, dict) else None
    return (isinstance(p, dict) and p.get("type") in ("object", "dict")
            and isinstance(p.get("properties"), dict) and "arguments" not in value)


def _as_call(value, depth: int = 0):
    """The first ``(name, arguments)`` inside a decoded value: a dict with ``name`` and
    ``arguments`` (or ``parameters``), where arguments may be JSON text; OpenAI's
    ``{"function": {...}}`` and lists of calls looked into; a tool's definition
    (:func:`is_tool_doc`) is no call; None when there is none."""
    if depth > 6:
        return None
    if isinstance(value, dict):
        if is_tool_doc(value):
            return None
        name = value.get("name")
        for key in ("arguments", "parameters"):
            if isinstance(name, str) and key in value:
                args = value[key]
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                return name, args
        for v in value.values():
            if isinstance(v, (dict, list)):
                found = _as_call(v, depth + 1)
                if found:
                    return found
    elif isinstance(value, list):
        for v in value:
            found = _as_call(v, depth + 1)
            if found:
                return found
    return None


def _first_in(text: str):
    """The first call written as JSON (or a Python literal) anywhere in ``text``."""
    for i, c in enumerate(text):
        if c in "{[":
            v, closed = _value_at(text, i)
            if v is not _NONE:
                found = _as_call(v)
                if found:
                    return i, found, closed
    return None


def writes_tool_doc(text: str) -> bool:
    """Whether ``text`` writes out a tool's definition (JSON, see :func:`is_tool_doc`)."""
    def docs(v, depth=0):
        if depth > 4:
            return False
        if is_tool_doc(v):
            return True
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return any(docs(x, depth + 1) for x in items)
    for i, c in enumerate(text):
        if c == "{" and '"parameters"' in text[i:]:
            v, _ = _value_at(text, i)
            if v is not _NONE and docs(v):
                return True
    return False


def _python_call(text: str, names: set[str]):
    """The first Python call of an offered function (``math.factorial(number=5)``) in ``text``."""
    for m in _PYCALL.finditer(text):
        if m.group(1) not in names:
            continue
        end = _balanced(text, m.end() - 1)
        if end < 0:
            continue
        try:
            node = ast.parse(text[m.start(1):end], mode="eval").body
            if isinstance(node, ast.Call) and not node.args:
                return m.start(), (m.group(1), {k.arg: ast.literal_eval(k.value)
                                                for k in node.keywords if k.arg})
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return None


def parse_call(text: str, names: set[str] | frozenset = frozenset()):
    """The first call in ``text``, however it was written: ``(name, arguments, form)`` or None.
    ``form``: the tag (``<tool_call>``, ``<tools>``, ``<function_call>``, ``<response>``,
    ``<json>``; an unclosed tag runs to the next or the end), ```` ```json ```` / ```` ``` ````
    (a fence), ``bare`` (a JSON object or list outside them) or ``python`` (a call of one of
    ``names``, the offered functions, as Python); :data:`CLOSED` appended where the JSON only
    parsed with its open brackets closed at the end of its tag, fence or text. The earliest in
    the text counts."""
    found = []  # (start, name, args, form)
    spans = []
    for m in _TAG.finditer(text):
        spans.append((m.start(), m.end()))
        hit = _first_in(m.group(2))
        if hit:
            found.append((m.start(), *hit[1], f"<{m.group(1)}>" + CLOSED * hit[2]))
    for m in _FENCE.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue
        spans.append((m.start(), m.end()))
        hit = _first_in(m.group(2))
        if hit:
            found.append((m.start(), *hit[1], "```" + m.group(1).lower() + CLOSED * hit[2]))
    masked = list(text)
    for a, b in spans:  # bare JSON: outside the tags and fences
        masked[a:b] = " " * (b - a)
    hit = _first_in("".join(masked))
    if hit:
        found.append((hit[0], *hit[1], "bare" + CLOSED * hit[2]))
    if names:
        hit = _python_call("".join(masked), set(names))
        if hit:
            found.append((hit[0], *hit[1], "python"))
    if not found:
        return None
    _, name, args, form = min(found, key=lambda f: f[0])
    return name, args, form


def marker_without_call(text: str) -> str:
    """A call marker (tag or fence) in ``text`` that holds no readable call, else ''."""
    for t in TAGS:
        if f"<{t}>" in text:
            return f"<{t}>"
    return "```" if "```" in text else ""


# ---- BFCL's AST checker (Python) ---------------------------------------------------------------
PYTHON_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
                "tuple": list, "dict": dict, "any": str}
NESTED = ("array", "tuple")


class Wrong(Exception):
    """A call that does not match: ``kind`` (BFCL's error_type) and the reason."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason


def standardize(s: str) -> str:
    """BFCL's string standardization: spaces and ``,./-_*^`` removed, lowercase, ' -> "."""
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def _answer_type(possible: list):
    for a in possible:
        if a != "":
            return type(a)
    return None


def _type_check(param: str, value, possible: list, described: str, expected, nested) -> bool:
    """BFCL's type_checker: True when ``value`` is a variable (typed as the possible answer,
    not as the doc); raises Wrong on a type error."""
    answer_type = _answer_type(possible)
    is_variable = answer_type is not None and answer_type != expected
    if type(value) is expected:
        if nested is None:
            return is_variable
        for item in possible:  # one level in: every element typed as one possible answer's
            ok = True
            if type(item) is list:
                for v in value:
                    try:
                        _type_check(param, v, item, str(nested), nested, None)
                    except Wrong:
                        ok = False
                        break
            if ok:
                return is_variable
        raise Wrong("type_error:nested" if type(value) is answer_type else "type_error:simple",
                    f"Nested type checking failed for parameter {param!r}. Expected outer type "
                    f"{described} with inner type {nested.__name__}. Parameter value: {value!r}.")
    if answer_type is not None and type(value) is answer_type:
        return True
    raise Wrong("type_error:simple", f"Incorrect type for parameter {param!r}. Expected type "
                                     f"{described}, got {type(value).__name__}. Parameter value: "
                                     f"{value!r}.")


def _check_string(param: str, value: str, possible: list) -> None:
    if standardize(value) not in [standardize(p) for p in possible if type(p) is str]:
        raise Wrong("value_error:string", f"Invalid value for parameter {param!r}: {value!r}. "
                                          f"Expected one of {possible}. Case insensitive.")


def _check_list(param: str, value: list, possible: list) -> None:
    got = [standardize(v) if type(v) is str else v for v in value]
    want = [[standardize(x) if type(x) is str else x for x in p] for p in possible
            if isinstance(p, (list, str))]  # BFCL's loop: "" (may be omitted) is []
    if got not in want:
        raise Wrong("value_error:list/tuple", f"Invalid value for parameter {param!r}: "
                                              f"{value!r}. Expected one of {possible}.")


def _check_dict(param: str, value: dict, possible: list) -> None:
    last = Wrong("dict_checker:unclear", f"no possible dict for parameter {param!r}")
    for answer in possible:
        if answer == "" or not isinstance(answer, dict):
            continue
        try:
            for k, v in value.items():
                if k not in answer:
                    raise Wrong("value_error:dict_key", f"Unexpected dict key parameter: '{k}'.")
                std = standardize(v) if type(v) is str else v
                want = [standardize(x) if type(x) is str else x for x in answer[k]]
                if std not in want:
                    raise Wrong("value_error:dict_value", f"Invalid value for parameter {k!r}: "
                                                          f"{v!r}. Expected one of {want}.")
            for k, v in answer.items():
                if k not in value and "" not in v:
                    raise Wrong("value_error:dict_key", f"Missing dict key parameter: '{k}'.")
            return
        except Wrong as e:
            last = e
    raise last


def _check_list_dict(param: str, value: list, possible: list) -> None:
    last = Wrong("list_dict_checker:unclear", f"no possible list for parameter {param!r}")
    for answer in possible:
        answer = [] if answer == "" else answer  # as BFCL's len("") reads it
        if not isinstance(answer, list) or len(value) != len(answer):
            last = Wrong("value_error:list_dict_count", "Wrong number of dictionaries in the list.")
            continue
        try:
            for v, a in zip(value, answer):
                if not isinstance(v, dict):
                    raise Wrong("type_error:nested", f"{v!r} is not a dict")
                _check_dict(param, v, [a])
            return
        except Wrong as e:
            last = e
    raise last


def _check_function(doc: dict, args: dict, possible: dict) -> None:
    """BFCL's simple_function_checker for a call already known to name ``doc``."""
    details = doc.get("parameters", {}).get("properties", {}) or {}
    for p in doc.get("parameters", {}).get("required", []) or []:
        if p not in args:
            raise Wrong("simple_function_checker:missing_required",
                        f"Missing required parameter: {p!r}.")
    for p, value in args.items():
        if p not in details or p not in possible:
            raise Wrong("simple_function_checker:unexpected_param", f"Unexpected parameter: {p!r}.")
        described = details[p].get("type", "any")
        expected = PYTHON_TYPES.get(described, str)
        nested = None
        if described in NESTED:
            nested = PYTHON_TYPES.get((details[p].get("items") or {}).get("type", "any"), str)
        if described == "tuple" and type(value) is tuple:
            value = list(value)
        if described == "float" and type(value) is int:
            value = float(value)
        if not _type_check(p, value, possible[p], described, expected, nested):
            if expected is dict:
                _check_dict(p, value, possible[p])
                continue
            if expected is list and nested is dict:
                _check_list_dict(p, value, possible[p])
                continue
            if expected is str:
                _check_string(p, value, possible[p])
                continue
            if expected is list:
                _check_list(p, value, possible[p])
                continue
        if value not in possible[p]:
            raise Wrong("value_error:others", f"Invalid value for parameter {p!r}: {value!r}. "
                                              f"Expected one of {possible[p]}.")
    for p, values in possible.items():
        if p not in args and "" not in values:
            raise Wrong("simple_function_checker:missing_optional",
                        f"Optional parameter {p!r} not provided and not marked as optional.")


def check_call(functions: list[dict], name: str, args, ground_truth: list[dict]) -> tuple[bool, str]:
    """BFCL's AST check of one call (``name``: the BFCL name, dots and all; ``args``: the parsed
    arguments) against a case's possible answer (its ``ground_truth``: one ``{name: {param:
    [acceptable values]}}``): ``(correct, reason)``, the reason BFCL's error_type and message."""
    want, possible = next(iter(ground_truth[0].items()))
    if name != want:
        return False, (f"simple_function_checker:wrong_func_name: Function name {want!r} not found "
                       f"in model output (got {name!r}).")
    doc = next((f for f in functions if f["name"] == want), None)
    if doc is None:
        return False, f"no function doc named {want!r}"
    if not isinstance(args, dict):
        return False, f"arguments_not_an_object: {type(args).__name__} {args!r:.80}"
    try:
        _check_function(doc, args, possible)
    except Wrong as e:
        return False, str(e)
    return True, ""


# ---- cases -------------------------------------------------------------------------------------
def load_cases(categories=CATEGORIES, per_category: int = 20, seed: int = 0) -> list[dict]:
    """``per_category`` cases of each category (seeded sample over the ids, file order kept):
    id, category, messages, functions (BFCL's), tools (OpenAI's), names (tool -> BFCL name),
    ground_truth (None for irrelevance)."""
    from .datasets import json_lines
    cases = []
    for cat in categories:
        qs = json_lines("bfcl", DATA.format(cat))
        answers = {} if cat == "irrelevance" else {
            a["id"]: a["ground_truth"] for a in json_lines("bfcl", ANSWERS.format(cat))}
        chosen = set(random.Random(seed).sample([q["id"] for q in qs], min(per_category, len(qs))))
        for q in qs:
            if q["id"] not in chosen:
                continue
            tools = [to_tool(f) for f in q["function"]]
            cases.append({"id": q["id"], "category": cat, "messages": q["question"][0],
                          "functions": q["function"], "tools": tools,
                          "names": {tool_name(f["name"]): f["name"] for f in q["function"]},
                          "ground_truth": answers.get(q["id"])})
    return cases


def schema_error(case: dict, name: str, args) -> str:
    """'' when ``args`` validate under the converted schema of the tool ``name``, else why."""
    import jsonschema
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
    if name not in spec:
        return f"unknown tool {name!r}"
    try:
        jsonschema.validate(args, spec[name])
        return ""
    except jsonschema.ValidationError as e:
        return e.message[:200]
    except jsonschema.SchemaError as e:
        return f"schema error: {e.message[:160]}"


def score(case: dict, call: tuple[str, object] | None) -> dict:
    """The row's verdict for the first call (a tool name, parsed arguments) or None."""
    if call is None:
        if case["category"] == "irrelevance":
            return {"correct": True, "reason": "", "schema_valid": None}
        return {"correct": False, "reason": "no call", "schema_valid": None}
    name, args = call
    why = schema_error(case, name, args)
    if case["category"] == "irrelevance":
        return {"correct": False, "reason": f"called {name}", "schema_valid": not why,
                "schema_error": why}
    bfcl = case["names"].get(name, name)
    ok, reason = check_call(case["functions"], bfcl, args, case["ground_truth"])
    return {"correct": ok, "reason": reason, "schema_valid": not why, "schema_error": why}


# ---- modes -------------------------------------------------------------------------------------
def run_dense(cases: list[dict], model: str, threads: int, max_new_tokens: int,
              log=print) -> list[dict]:
    """Plain transformers on the float32 checkpoint; the lenient reading of its text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ..core.format.models import ensure_hf_checkpoint
    torch.set_num_threads(threads)
    hf = ensure_hf_checkpoint(model, log)
    tok = AutoTokenizer.from_pretrained(hf)
    lm = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    eos = lm.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    rows = []
    try:
        for n, case in enumerate(cases):
            t0 = time.perf_counter()
            ids = tok.apply_chat_template(case["messages"], tools=case["tools"],
                                          add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = lm.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=max_new_tokens, temperature=None, top_p=None,
                                  top_k=None)[0, len(ids):].tolist()
            stopped = bool(out) and out[-1] in eos
            text = tok.decode(out[:-1] if stopped else out, skip_special_tokens=False)
            parsed = parse_call(text, set(case["names"]) | set(case["names"].values()))
            call = None
            if parsed:
                name = parsed[0] if parsed[0] in case["names"] else tool_name(parsed[0])
                call = (name, parsed[1])
            row = {"id": case["id"], "category": case["category"], "mode": "dense",
                   "text": text[:300], "call": None if call is None else
                   {"name": call[0], "arguments": call[1]},
                   "form": parsed[2] if parsed else None,
                   "unread_marker": "" if parsed else marker_without_call(text),
                   "tool_doc_written": writes_tool_doc(text),
                   "calls": int(call is not None),
                   "finish_reason": "stop" if stopped else "length",
                   "prompt_tokens": len(ids), "tokens": len(out),
                   "seconds": round(time.perf_counter() - t0, 2)}
            row.update(score(case, call))
            rows.append(row)
            _progress(log, row, n, len(cases))
    finally:
        del lm
        gc.collect()
    return rows


def run_node(cases: list[dict], modes: list[str], model: str, threads: int, max_new_tokens: int,
             params: str | None, namespace: str = "", log=print) -> tuple[list[dict], dict]:
    """The node in this process (its parameters file, with model, num_threads, max_new_tokens,
    context_limit 4096), each case through the action with each tool_choice of ``modes``.
    ``namespace``: of the node, its own by default (another node on the machine in the same
    namespace would share the action and the lifecycle services)."""
    os.environ.setdefault("SELECTINFER_QUIET", "1")
    from ..ros.bringup import Bringup, resolve_params_file
    from ..ros.lifecycle_chain import BRINGUP, INFERENCE
    overrides = dict(model=model, num_threads=threads, max_new_tokens=max_new_tokens,
                     context_limit=4096)
    rows, info = [], {}
    namespace = namespace or f"tool_calls_bench_{os.getpid()}"
    with Bringup(resolve_params_file(params), namespace, overrides) as b:
        b.configure_and_activate([s for s in BRINGUP if s.node == INFERENCE])
        rt, llm = b.inference.runtime, b.llm
        assert llm.wait_for_server(10.0), "the Generate action server did not come"
        info = {"model_id": rt.model_id, "load_ratio": rt.load_ratio,
                "compute_ratio": rt.compute_ratio, "decode_path": str(rt.engine.decode_path),
                "params": str(resolve_params_file(params)), "overrides": overrides,
                "namespace": namespace}
        log(f"node: {info}")
        for mode in modes:
            todo = [c for c in cases if mode != "required" or c["category"] != "irrelevance"]
            for n, case in enumerate(todo):
                t0 = time.perf_counter()
                out = llm.chat(case["messages"], tools=case["tools"], tool_choice=mode,
                               max_new_tokens=max_new_tokens)
                r = out.result
                calls, call, bad = (out.tool_calls if out.ok else []), None, ""
                if calls:
                    try:
                        call = (calls[0].name, calls[0].value)
                    except ValueError as e:
                        call, bad = (calls[0].name, calls[0].arguments), f"arguments: {e}"
                text = out.text or ""
                seen = parse_call(text, set(case["names"]) | set(case["names"].values())) \
                    if not calls else None
                row = {"id": case["id"], "category": case["category"], "mode": mode,
                       "text": text[:300], "call": None if call is None else
                       {"name": call[0], "arguments": call[1]},
                       "calls": len(calls), "status": out.status,
                       "error_msg": out.error_msg[:200] if out.error_msg else "",
                       "finish_reason": getattr(r, "finish_reason", "") if r is not None else "",
                       "prompt_tokens": int(getattr(r, "prompt_tokens", 0)) if r is not None else 0,
                       "tokens": int(getattr(r, "generated_tokens", 0)) if r is not None else 0,
                       # a call the node did not take, readable in its text answer
                       "text_call_form": seen[2] if seen else None,
                       "tool_doc_written": writes_tool_doc(text),
                       "seconds": round(time.perf_counter() - t0, 2)}
                row.update(score(case, call))
                if bad:
                    row["reason"] = (row["reason"] + "; " if row["reason"] else "") + bad
                rows.append(row)
                _progress(log, row, n, len(todo))
    gc.collect()
    return rows, info


def _progress(log, row: dict, n: int, total: int) -> None:
    call = row["call"]
    what = (f"{call['name']} {json.dumps(call['arguments'], default=str)[:90]}" if call
            else f"text {row['text'].strip()[:60]!r}")
    if row.get("status", "SUCCEEDED") != "SUCCEEDED":
        what += f" {row['status']} {row.get('error_msg', '')[:80]}"
    form = f" [{row['form']}]" if row.get("form") else ""
    log(f"[{row['mode']}] {n + 1}/{total} {row['id']}: {'ok  ' if row['correct'] else 'WRONG'} "
        f"{what}{form} ({row['tokens']} tok, {row['finish_reason']}, {row['seconds']:.1f} s)"
        + (f" -- {row['reason'][:120]}" if row["reason"] else ""), flush=True)


# ---- report ------------------------------------------------------------------------------------
def summarize(rows: list[dict]) -> list[dict]:
    """Per mode and category: accuracy, calls returned, calls valid under their schema, finish
    reasons, tokens and seconds per answer."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for cat in CATEGORIES:
            rs = [r for r in rows if r["mode"] == mode and r["category"] == cat]
            if not rs:
                continue
            n = len(rs)
            s = {"mode": mode, "category": cat, "cases": n,
                 "correct": sum(r["correct"] for r in rs),
                 "accuracy": round(sum(r["correct"] for r in rs) / n, 4),
                 "calls": sum(r["call"] is not None for r in rs),
                 "schema_valid": sum(bool(r.get("schema_valid")) for r in rs),
                 "finish_reasons": dict(Counter(r["finish_reason"] for r in rs)),
                 "tokens_per_answer": round(sum(r["tokens"] for r in rs) / n, 1),
                 "seconds": round(sum(r["seconds"] for r in rs), 1),
                 "seconds_per_answer": round(sum(r["seconds"] for r in rs) / n, 2)}
            s["tool_docs_written"] = sum(bool(r.get("tool_doc_written")) for r in rs)
            if mode == "dense":
                s["call_forms"] = dict(Counter(r["form"] for r in rs if r["form"]))
            else:
                s["statuses"] = dict(Counter(r["status"] for r in rs))
                s["calls_left_in_text"] = dict(Counter(r["text_call_form"] for r in rs
                                                       if r.get("text_call_form")))
            out.append(s)
    return out


def table(summary: list[dict]) -> str:
    lines = ["| mode | category | cases | accuracy | calls | schema-valid | finish reasons | "
             "tokens/answer | s/answer |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        fr = ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items()))
        lines.append(f"| {s['mode']} | {s['category']} | {s['cases']} | "
                     f"{s['correct']}/{s['cases']} ({s['accuracy']:.0%}) | {s['calls']} | "
                     f"{s['schema_valid']}/{s['calls']} | {fr} | {s['tokens_per_answer']:g} | "
                     f"{s['seconds_per_answer']:.1f} |")
    return "\n".join(lines)


def plot(summary: list[dict], forms: dict, path: str | Path, title: str = "") -> Path:
    """Accuracy per category, one bar per mode (labelled); beside it the dense model's call
    forms."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted(dict.fromkeys(s["mode"] for s in summary),
                   key=lambda m: MODES.index(m) if m in MODES else len(MODES))
    cats = [c for c in CATEGORIES if any(s["category"] == c for s in summary)]
    fig, axes = plt.subplots(1, 2 if forms else 1, figsize=(11 if forms else 7.5, 5),
                             gridspec_kw={"width_ratios": [2, 1]} if forms else None)
    ax = axes[0] if forms else axes
    w = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs, ys, labels = [], [], []
        for i, c in enumerate(cats):
            s = next((s for s in summary if s["mode"] == mode and s["category"] == c), None)
            if s is None:
                continue
            xs.append(i + (j - (len(modes) - 1) / 2) * w)
            ys.append(s["accuracy"])
            labels.append(f"{s['correct']}/{s['cases']}")
        bars = ax.bar(xs, ys, w, label=mode, color=f"C{MODES.index(mode) if mode in MODES else j}")
        for b, lab in zip(bars, labels):
            ax.annotate(lab, (b.get_x() + b.get_width() / 2, b.get_height()),
                        textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels([c + (" (no call is right)" if c == "irrelevance" else "") for c in cats],
                       fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("BFCL AST accuracy")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    if forms:
        ax2 = axes[1]
        items = sorted(forms.items(), key=lambda kv: -kv[1])
        ax2.barh([k for k, _ in items], [v for _, v in items], color="C0")
        ax2.invert_yaxis()
        from matplotlib.ticker import MaxNLocator
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_xlabel("calls the dense model wrote")
        ax2.set_title("dense: the form of its calls", fontsize=9)
        ax2.grid(alpha=0.3, axis="x")
    fig.suptitle("\n".join(textwrap.fill(line, 110) for line in title.splitlines()), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.lab.tool_calls_bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b", help="catalog model name")
    ap.add_argument("--per-category", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="dense,auto,required",
                    help="comma-separated: dense, auto, required (node modes run first, "
                         "together, then dense)")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--params", default="desktop.yaml",
                    help="the node's parameters file (path or a name in config/)")
    ap.add_argument("--namespace", default="",
                    help="the node's namespace (default: tool_calls_bench_<pid>, its own)")
    ap.add_argument("--out", default="", help="JSON path (a .png plot beside it)")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cats = [c.strip() for c in args.categories.split(",") if c.strip()]
    bad = [m for m in modes if m not in MODES] + [c for c in cats if c not in CATEGORIES]
    if bad or not modes:
        print(f"tool_calls_bench: unknown mode or category {bad}; modes {MODES}, categories "
              f"{CATEGORIES}", file=sys.stderr)
        return 2
    cases = load_cases(cats, args.per_category, args.seed)
    print(f"{len(cases)} cases: " + ", ".join(f"{c} {sum(x['category'] == c for x in cases)}"
                                              for c in cats), flush=True)
    t0 = time.time()
    rows, node = [], {}
    from ..core.format.kernel import cpu_description
    cpu = cpu_description()

    def report(done: bool) -> dict:
        summary = summarize(rows)
        forms = dict(Counter(r["form"] for r in rows if r["mode"] == "dense" and r["form"]))
        unread = Counter(r["unread_marker"] for r in rows
                         if r["mode"] == "dense" and r.get("unread_marker"))
        rep = {"benchmark": "BFCL v4 (bfcl-eval 2026.3.23), AST rules", "model": args.model,
               "per_category": args.per_category, "seed": args.seed, "threads": args.threads,
               "max_new_tokens": args.max_new_tokens, "modes": modes, "categories": cats,
               "cpu": cpu, "node": node, "complete": done,
               "wall_seconds": round(time.time() - t0, 1), "summary": summary,
               "dense_call_forms": forms, "dense_unread_markers": dict(unread), "rows": rows}
        if args.out:  # written after each phase: a crash later keeps what was measured
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rep, indent=1, default=str) + "\n", encoding="utf-8")
        return rep

    node_modes = [m for m in modes if m != "dense"]
    if node_modes:
        got, node = run_node(cases, node_modes, args.model, args.threads, args.max_new_tokens,
                             args.params, args.namespace)
        rows += got
        report(False)
    if "dense" in modes:
        rows += run_dense(cases, args.model, args.threads, args.max_new_tokens)
    rep = report(True)
    summary, forms = rep["summary"], rep["dense_call_forms"]
    print(table(summary))
    if forms:
        print("dense call forms: " + ", ".join(f"{k} {v}" for k, v in
                                               sorted(forms.items(), key=lambda kv: -kv[1])))
    if args.out:
        png = plot(summary, forms, Path(args.out).with_suffix(".png"),
                   f"BFCL tool calls, {args.model}: {args.per_category} cases per category, "
                   f"greedy, max {args.max_new_tokens} new tokens\n{args.threads} thread(s), {cpu}")
        print(f"wrote {args.out} and {png}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
