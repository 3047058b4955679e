"""A robot agent through the real node: ``python -m selectinfer_ros.ros.examples.agent_check``.

Starts ``selectinfer_node`` in this process (``selectinfer_ros.ros.bringup``, node defaults plus
the options given, e.g. ``--model qwen2.5-1.5b --num-threads 2``) and, through the ``Generate``
action and :class:`~selectinfer_ros.ros.client.LLMClient`, prints what issue 40 asks to show:

1. a 3-turn conversation with a system prompt: its token ids equal transformers'
   ``apply_chat_template`` (and the node's ``prompt_tokens``);
2. the prompt cache: a goal sharing the system prompt and 5 tools (~600 tokens) with an earlier
   one, its time to first token against the first goal's (a ratio: the machine decides seconds);
3. 20 goals with ``tool_choice: required``: every call names a tool, its arguments validate;
   with ``auto`` a question no tool answers gets text;
4. bad conversations answered at goal time with a reason, the next goal served.

Exit status 0 when every check held.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOMS = ["kitchen", "hall", "dock", "bedroom", "office", "garage"]
SYSTEM = (
    "You are the control program of Rover, a home service robot with a mobile base, one arm "
    "with a two-finger gripper, a speaker and a camera. Rover works in a flat with six rooms: "
    "the kitchen (fridge, sink, dishwasher, a table with four chairs), the hall (entrance door, "
    "coat rack, shoe cabinet), the dock (Rover's charging station next to the hall), the bedroom "
    "(bed, wardrobe, two night tables), the office (desk, printer, bookshelf) and the garage "
    "(tools, bicycles, recycling bins). Rover drives at most 1 metre per second; it slows down "
    "near people, pets and stairs. Its arm lifts objects up to 2 kilograms; it never lifts "
    "knives, hot pots, glass that is broken or anything alive. Its battery lasts four hours; "
    "below 15 percent it returns to the dock before doing anything else. It speaks short, "
    "friendly sentences in the language it is addressed in and never shares what its camera "
    "sees with anyone but the people who live in the flat. When a request needs an action, call "
    "exactly one tool; when it is a question Rover can answer from what it knows, answer in one "
    "short sentence without a tool. When a request is unsafe, say so with the say tool and do "
    "nothing else. Rooms are named exactly as above. Objects are named with at most three "
    "words. Speeds are between 0.1 and 1.0 metres per second.")
TOOLS = [
    {"name": "navigate_to", "description": "Drive to a room of the flat.",
     "parameters": {"type": "object", "properties": {"room": {"enum": ROOMS}},
                    "required": ["room"], "additionalProperties": False}},
    {"name": "pick", "description": "Pick up an object that Rover sees in front of it.",
     "parameters": {"type": "object", "properties": {"object": {"type": "string",
                                                                "maxLength": 32}},
                    "required": ["object"], "additionalProperties": False}},
    {"name": "place", "description": "Put the held object down at a place in the current room.",
     "parameters": {"type": "object", "properties": {"where": {"type": "string",
                                                               "maxLength": 32}},
                    "required": ["where"], "additionalProperties": False}},
    {"name": "say", "description": "Say one short sentence aloud.",
     "parameters": {"type": "object", "properties": {"text": {"type": "string",
                                                              "maxLength": 120}},
                    "required": ["text"], "additionalProperties": False}},
    {"name": "set_speed", "description": "Set the driving speed in metres per second.",
     "parameters": {"type": "object", "properties": {"speed": {"type": "number", "minimum": 0.1,
                                                               "maximum": 1.0}},
                    "required": ["speed"], "additionalProperties": False}},
]
ASKS = [
    "Go to the kitchen, please.", "Pick up the red cup.", "Tell my son that dinner is ready.",
    "Drive slower, the cat is sleeping in the hall.", "Put the cup on the table.",
    "Your battery is at 9 percent.", "Bring me to the office.", "Grab the newspaper.",
    "Say good night to everyone.", "Go to the bedroom.", "Put it on the night table.",
    "Speed up to full speed.", "Pick up the blue towel.", "Greet the guest at the door.",
    "Drive to the garage.", "Pick up the bicycle helmet.", "Place it on the shelf.",
    "Go back to the hall.", "Announce that the laundry is done.", "Set the speed to 0.3.",
]
CONVERSATION = ["Hello Rover, who are you?", "Which rooms do you know?",
                "Thank you. What do you do when your battery is low?"]


def _validate(value, schema) -> str:
    """'' when ``value`` is valid under ``schema`` (jsonschema, where installed), else why."""
    try:
        import jsonschema
    except ImportError:
        return "" if isinstance(value, dict) else "not an object"
    try:
        jsonschema.validate(value, schema)
        return ""
    except jsonschema.ValidationError as e:
        return e.message


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("SELECTINFER_QUIET", "1")
    from ...core.execution.chat import chat_of, render
    from ...core.options import ParamError
    from ..bringup import Bringup, add_arguments, overrides_from_args, resolve_params_file

    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.ros.examples.agent_check",
                                 description=__doc__.splitlines()[0])
    add_arguments(ap, default_params=None)
    ap.add_argument("--num-threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    try:
        overrides = overrides_from_args(args)
        params = resolve_params_file(args.params)
    except (FileNotFoundError, ParamError) as e:
        print(f"agent_check: {e}", file=sys.stderr)
        return 2
    overrides.update(num_threads=args.num_threads, max_new_tokens=48, prompt_cache_mb=256.0,
                     context_limit=4096)
    ok = True

    def check(cond: bool, what: str) -> None:
        nonlocal ok
        ok &= bool(cond)
        print(f"  [{'ok' if cond else 'FAILED'}] {what}", flush=True)

    with Bringup(params, args.namespace, overrides) as b:
        from ..lifecycle_chain import BRINGUP, INFERENCE
        b.configure_and_activate([s for s in BRINGUP if s.node == INFERENCE])
        rt, llm = b.inference.runtime, b.llm
        assert llm.wait_for_server(10.0)
        tok = rt.engine.tokenizer
        print(f"{rt.model_id}: load_ratio {rt.load_ratio:g}, compute_ratio {rt.compute_ratio:g}, "
              f"{args.num_threads} threads, {rt.engine.decode_path}", flush=True)

        print("1. a 3-turn conversation with a system prompt")
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in CONVERSATION:
            messages.append({"role": "user", "content": turn})
            want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            want = list(want["input_ids"] if hasattr(want, "keys") else want)
            out = llm.chat(messages, max_new_tokens=40)
            got = render(tok, chat_of(messages), rt.engine.tool_format).ids
            check(out.ok and got == want and out.result.prompt_tokens == len(want),
                  f"{len(want)} tokens equal transformers' template (node: "
                  f"{out.result.prompt_tokens}); cached {out.result.cached_tokens}; "
                  f"answer {out.text.strip()[:70]!r}")
            messages.append(out.message)

        print("2. the prompt cache: two goals sharing the system prompt and 5 tools")
        rt.engine.prompt_cache.clear()
        head = render(tok, chat_of([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": ASKS[0]}], TOOLS)).marks[0]
        firsts = []
        for ask in ASKS[:2]:
            out = llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}],
                           tools=TOOLS, tool_choice="required")
            firsts.append(out)
            r = out.result
            print(f"  prompt {r.prompt_tokens} tokens, cached {r.cached_tokens}, first token after "
                  f"{r.time_to_first_token:.3f} s")
        ratio = firsts[1].result.time_to_first_token / firsts[0].result.time_to_first_token
        check(firsts[1].result.cached_tokens >= head >= 600 and ratio <= 0.15,
              f"shared prefix {head} tokens; time to first token {ratio:.3f}x the first goal's")

        print("3. 20 goals over 5 tools, tool_choice required; a question for auto")
        valid = 0
        t0 = time.perf_counter()
        for ask in ASKS:
            out = llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}],
                           tools=TOOLS, tool_choice="required")
            calls = out.tool_calls if out.ok else []
            spec = {t["name"]: t["parameters"] for t in TOOLS}
            why = "no call" if not calls else (
                f"unknown tool {calls[0].name}" if calls[0].name not in spec else
                _validate(calls[0].value, spec[calls[0].name]))
            valid += not why
            print(f"  {ask!r:52} -> " + (f"{calls[0].name} {calls[0].arguments}" if calls else
                                         f"{out.status} {out.error_msg}") + (f" ({why})" if why else ""))
        check(valid == len(ASKS), f"{valid}/{len(ASKS)} calls name a tool and validate "
                                  f"({time.perf_counter() - t0:.0f} s)")
        out = llm.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "What is the capital of France?"}],
                       tools=TOOLS, tool_choice="auto")
        check(out.ok and not out.tool_calls and out.text.strip(),
              f"auto, no tool fits: text {out.text.strip()[:70]!r}")

        print("4. bad conversations, answered at goal time")
        bad = [("unknown role", [{"role": "robot", "content": "hi"}], TOOLS, "auto"),
               ("a schema that does not compile", [{"role": "user", "content": "go"}],
                [{"name": "go", "parameters": {"type": "object",
                                               "properties": {"x": {"type": "strnig"}}}}], "auto"),
               ("tool_choice naming no tool", [{"role": "user", "content": "go"}], TOOLS, "fly"),
               ("past the context", [{"role": "user", "content": "kitchen " * 5000}], TOOLS,
                "auto")]
        for name, msgs, tools, choice in bad:
            t0 = time.perf_counter()
            out = llm.chat(msgs, tools=tools, tool_choice=choice)
            dt = time.perf_counter() - t0
            check(out.status == "REJECTED" and dt < 1.0,
                  f"{name}: {out.status} after {dt:.3f} s: {b.inference.snapshot().last_rejection}")
        out = llm.chat([{"role": "user", "content": "Go to the dock."}], tools=TOOLS,
                       tool_choice="navigate_to")
        check(out.ok and out.tool_calls[0].name == "navigate_to", "the next goal is served")
        print(f"prompt cache: {rt.engine.prompt_cache.snapshot()}")
    print("all checks held" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
