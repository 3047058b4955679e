"""JSON-schema goals on a served model: every parsed answer validated (``jsonschema``), cut-off
answers counted, distinct answers, the grammar mask's share of the decode step, compile times.

    python -m selectinfer_ros.lab.json_goals --goals 200 --threads 1

SCHEMAS are 24 schemas a robot's tree might ask for (nested objects, arrays with minItems and
maxItems, enums, integer and number ranges, required and optional fields, string patterns), each
with a few-shot prompt; the tests use them too (test/core/execution/test_constrain.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

_S = {"type": "string", "maxLength": 24}
_ROOM = {"enum": ["kitchen", "hall", "lab", "dock", "office"]}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


# (name, schema, instruction, example answer): the prompt shows one example, then asks
SCHEMAS: list[tuple[str, dict, str, dict]] = [
    ("action", _obj({"action": {"enum": ["goto", "pick", "stop"]}, "target": _S,
                     "speed": {"type": "number", "minimum": 0, "maximum": 1}}),
     "Go to the kitchen slowly.", {"action": "goto", "target": "dock", "speed": 0.2}),
    ("yes_no", _obj({"answer": {"enum": ["yes", "no"]}, "reason": {"type": "string", "maxLength": 40}}),
     "Is the door open? The camera sees an open door.", {"answer": "no", "reason": "it is closed"}),
    ("room", _obj({"room": _ROOM}), "Where is the fridge?", {"room": "hall"}),
    ("count", _obj({"object": _S, "count": {"type": "integer", "minimum": 0, "maximum": 20}}),
     "Count the chairs: there are three chairs.", {"object": "cup", "count": 2}),
    ("objects", _obj({"objects": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3}}),
     "List what is on the table: a cup, a plate.", {"objects": ["pen"]}),
    ("seen", _obj({"seen": {"type": "array", "minItems": 1, "maxItems": 3,
                            "items": _obj({"name": _S, "count": {"type": "integer", "minimum": 1,
                                                                  "maximum": 9}})}}),
     "Report: two apples and one knife.", {"seen": [{"name": "box", "count": 4}]}),
    ("pose", _obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
                   "y": {"type": "number", "minimum": -10, "maximum": 10},
                   "theta": {"type": "integer", "minimum": -180, "maximum": 180}}),
     "Move to x 2, y 3 facing 90 degrees.", {"x": 1, "y": -4, "theta": 45}),
    ("priority", _obj({"task": _S, "priority": {"enum": ["low", "medium", "high"]}}),
     "The kitchen is on fire!", {"task": "clean desk", "priority": "low"}),
    ("optional_note", _obj({"action": {"enum": ["wait", "go"]}, "note": _S}, ["action"]),
     "The hall is blocked.", {"action": "go"}),
    ("battery", _obj({"dock": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0,
                                                             "maximum": 100}}),
     "Battery at 12 percent.", {"dock": False, "level": 80}),
    ("route", _obj({"route": {"type": "array", "items": _ROOM, "minItems": 2, "maxItems": 4}}),
     "Plan a route from the dock to the lab via the hall.", {"route": ["kitchen", "office"]}),
    ("nested", _obj({"goal": _obj({"room": _ROOM, "object": _S}),
                     "urgent": {"type": "boolean"}}),
     "Fetch the red mug from the kitchen now.", {"goal": {"room": "lab", "object": "pen"},
                                                 "urgent": False}),
    ("code", _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
     "Read the label on shelf AB-123.", {"code": "XY-042"}),
    ("time", _obj({"time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}}),
     "Remind me at half past two in the afternoon.", {"time": "09:15"}),
    ("grip", _obj({"force": {"type": "number", "minimum": 0.5, "maximum": 5},
                   "object": _S}),
     "Pick up the egg gently.", {"force": 3, "object": "brick"}),
    ("speech", _obj({"say": {"type": "string", "maxLength": 60}}),
     "Greet the visitor.", {"say": "Goodbye."}),
    ("tags", _obj({"tags": {"type": "array", "items": {"enum": ["fragile", "heavy", "cold", "hot"]},
                            "minItems": 1, "maxItems": 2}}),
     "Classify a frozen glass bottle.", {"tags": ["heavy"]}),
    ("status", _obj({"ok": {"type": "boolean"}, "errors": {"type": "array", "items": _S,
                                                           "maxItems": 2}}, ["ok"]),
     "Self-test: all motors respond.", {"ok": False, "errors": ["lidar"]}),
    ("door", {"type": "object", "properties": {"door": {"enum": ["open", "closed"]},
                                               "locked": {"type": "boolean"}},
              "required": ["door"], "additionalProperties": False},
     "The door is shut and locked.", {"door": "open"}),
    ("ask", _obj({"question": {"type": "string", "maxLength": 50}, "options": {
        "type": "array", "items": _S, "minItems": 2, "maxItems": 3}}),
     "Ask the user which drink they want.", {"question": "Which box?", "options": ["red", "blue"]}),
    ("waypoints", _obj({"points": {"type": "array", "minItems": 1, "maxItems": 3,
                                   "items": {"type": "array", "items": {"type": "integer",
                                                                         "minimum": 0,
                                                                         "maximum": 50},
                                             "minItems": 2, "maxItems": 2}}}),
     "Visit the points (1, 2) and (5, 6).", {"points": [[9, 9]]}),
    ("person", _obj({"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                     "role": {"enum": ["staff", "visitor", "unknown"]}}),
     "Anna, 34, works here.", {"name": "Tom", "age": 50, "role": "visitor"}),
    ("temperature", _obj({"celsius": {"type": "number", "minimum": -40, "maximum": 60},
                          "alarm": {"type": "boolean"}}),
     "The freezer reads minus eighteen degrees.", {"celsius": 21.5, "alarm": False}),
    ("choice_or_null", _obj({"room": {"anyOf": [_ROOM, {"type": "null"}]}}),
     "Where did I leave my keys? I do not know.", {"room": "office"}),
]


def prompt_for(instruction: str, example: dict) -> str:
    """A few-shot prompt: one example answer (compact JSON), then the instruction."""
    return (f"Answer with one JSON object.\nInstruction: Do the usual.\nJSON: "
            f"{json.dumps(example, separators=(',', ':'))}\nInstruction: {instruction}\nJSON: ")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--goals", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    import jsonschema
    import torch
    from ..core.execution.engine import GenerationConfig
    from ..core.options import ModelOptions
    from ..core.serving.runtime import Runtime
    torch.set_num_threads(args.threads)
    rt = Runtime(ModelOptions(task="general", num_threads=args.threads))
    g = rt.engine.grammars
    g.lltokenizer()
    compile_s = []
    for _, schema, _, _ in SCHEMAS:  # compile times (uncached)
        t0 = time.perf_counter()
        g.compile("json_schema", json.dumps(schema))
        compile_s.append(time.perf_counter() - t0)
    plain_steps, greedy_steps, rows = [], [], []
    for i in range(args.goals):
        name, schema, instruction, example = SCHEMAS[i % len(SCHEMAS)]
        sampled = i >= len(SCHEMAS)  # the first round greedy, then sampled with seeds
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, json_schema=json.dumps(schema),
                               temperature=0.8 if sampled else 0.0, top_p=0.95, seed=i)
        res = rt.generate(prompt_for(instruction, example), cfg)
        valid = False
        if res.parsed:
            jsonschema.validate(json.loads(res.text), schema)  # raises if not valid
            valid = True
        n = res.metrics.generated_tokens
        rows.append((name, res.text, res.finish_reason, res.parsed, valid, n,
                     res.metrics.decode_seconds, res.mask_seconds))
        if i < min(8, len(SCHEMAS)):  # the same prompt unconstrained: the plain decode step
            if n > 1:
                greedy_steps.append(res.metrics.decode_seconds / (n - 1))
            free = rt.generate(prompt_for(instruction, example),
                               GenerationConfig(max_new_tokens=n or 1, ignore_eos=True))
            if free.metrics.generated_tokens > 1:
                plain_steps.append(free.metrics.decode_seconds / (free.metrics.generated_tokens - 1))
    parsed = sum(r[3] for r in rows)
    cut_parsed = sum(1 for r in rows if r[3] and r[2] != "grammar")
    tokens = sum(r[5] for r in rows)
    mask = sum(r[7] for r in rows)
    step = sum(r[6] for r in rows) / max(1, sum(max(0, r[5] - 1) for r in rows))
    cs = sorted(compile_s)
    print(json.dumps({
        "goals": len(rows), "schemas": len({r[0] for r in rows}), "parsed": parsed,
        "validated": sum(r[4] for r in rows), "cut_off": len(rows) - parsed,
        "cut_off_called_parsed": cut_parsed,
        "distinct_answers": len({r[1] for r in rows if r[3]}),
        "threads": args.threads, "mask_ms_per_token": round(1e3 * mask / max(1, tokens), 3),
        "constrained_step_ms": round(1e3 * step, 2),  # sampled goals included (top_p sorts)
        "plain_step_ms": round(1e3 * statistics.mean(plain_steps), 2) if plain_steps else None,
        "greedy_constrained_step_ms": round(1e3 * statistics.mean(greedy_steps), 2)
        if greedy_steps else None,
        "mask_share_of_plain_step": round(mask / max(1, tokens) / statistics.mean(plain_steps), 4)
        if plain_steps else None,
        "compile_ms_p50": round(1e3 * cs[len(cs) // 2], 2),
        "compile_ms_p95": round(1e3 * cs[int(0.95 * (len(cs) - 1))], 2),
        "compile_ms_max": round(1e3 * cs[-1], 2),
        "cut_off_examples": [r[:3] for r in rows if not r[3]][:5]}))


if __name__ == "__main__":
    main()
