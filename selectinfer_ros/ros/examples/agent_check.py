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
import json
import os
import sys
import time

from ...core.format.paths import DATA_DIR

AGENT = DATA_DIR / "examples" / "robot_agent.json"  # system prompt, 5 tools, 20 requests, 3 turns


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
    agent = json.loads(AGENT.read_text(encoding="utf-8"))
    system, tools, asks = agent["system"], agent["tools"], agent["requests"]
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
        messages = [{"role": "system", "content": system}]
        for turn in agent["conversation"]:
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
        head = render(tok, chat_of([{"role": "system", "content": system},
                                    {"role": "user", "content": asks[0]}], tools)).marks[0]
        firsts = []
        for ask in asks[:2]:
            out = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": ask}],
                           tools=tools, tool_choice="required")
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
        for ask in asks:
            out = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": ask}],
                           tools=tools, tool_choice="required")
            calls = out.tool_calls if out.ok else []
            spec = {t["name"]: t["parameters"] for t in tools}
            why = "no call" if not calls else (
                f"unknown tool {calls[0].name}" if calls[0].name not in spec else
                _validate(calls[0].value, spec[calls[0].name]))
            valid += not why
            print(f"  {ask!r:52} -> " + (f"{calls[0].name} {calls[0].arguments}" if calls else
                                         f"{out.status} {out.error_msg}") + (f" ({why})" if why else ""))
        check(valid == len(asks), f"{valid}/{len(asks)} calls name a tool and validate "
                                  f"({time.perf_counter() - t0:.0f} s)")
        out = llm.chat([{"role": "system", "content": system},
                        {"role": "user", "content": "What is the capital of France?"}],
                       tools=tools, tool_choice="auto")
        check(out.ok and not out.tool_calls and out.text.strip(),
              f"auto, no tool fits: text {out.text.strip()[:70]!r}")

        print("4. bad conversations, answered at goal time")
        bad = [("unknown role", [{"role": "robot", "content": "hi"}], tools, "auto"),
               ("a schema that does not compile", [{"role": "user", "content": "go"}],
                [{"name": "go", "parameters": {"type": "object",
                                               "properties": {"x": {"type": "strnig"}}}}], "auto"),
               ("tool_choice naming no tool", [{"role": "user", "content": "go"}], tools, "fly"),
               ("past the context", [{"role": "user", "content": "kitchen " * 5000}], tools,
                "auto")]
        for name, msgs, offered, choice in bad:
            t0 = time.perf_counter()
            out = llm.chat(msgs, tools=offered, tool_choice=choice)
            dt = time.perf_counter() - t0
            check(out.status == "REJECTED" and dt < 1.0,
                  f"{name}: {out.status} after {dt:.3f} s: {b.inference.snapshot().last_rejection}")
        out = llm.chat([{"role": "user", "content": "Go to the dock."}], tools=tools,
                       tool_choice="navigate_to")
        check(out.ok and out.tool_calls[0].name == "navigate_to", "the next goal is served")
        print(f"prompt cache: {rt.engine.prompt_cache.snapshot()}")
    print("all checks held" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
