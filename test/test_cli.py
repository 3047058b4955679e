"""The `selectinfer` command line: generate (--json, --prompts, --dense), pack, profile show."""
from __future__ import annotations

import json
import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selectinfer_ros.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_generate_json_has_the_documented_keys(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-qwen2"]
    out = _cli("generate", "--model", str(packed), "--profiles", str(tiny_profiles["tiny-qwen2"]),
               "--task", "alpha", "--load-ratio", "0.7", "--compute-ratio", "0.5", "--json",
               "--max-new-tokens", "6", "w5 w6 w7")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    for key in ("text", "prompt_tokens", "generated_tokens", "tokens_per_second", "time_to_first_token",
                "weight_bytes", "ffn_weight_bytes", "bytes_read", "load_seconds"):
        assert key in res
    assert res["prompt_tokens"] == 4 and 1 <= res["generated_tokens"] <= 6
    assert res["load_ratio"] == 0.7 and res["compute_ratio"] == 0.5 and res["task"] == "alpha"


def test_generate_per_token_reports_the_share_computed(tiny_models, token_profiles):
    """`--compute-mode token`: the JSON says which share of the MLP neurons each decode token
    computed (measured); the prompt mode has no such key."""
    _, packed = tiny_models["tiny-llama"]
    common = ("generate", "--model", str(packed), "--profiles", str(token_profiles), "--task",
              "alpha", "--compute-ratio", "0.5", "--static-ratio", "0.3", "--json",
              "--max-new-tokens", "8", "w5 w6 w7")
    token = _cli(*common, "--compute-mode", "token")
    assert token.returncode == 0, token.stderr
    assert 0.2 < json.loads(token.stdout)["computed_share"] < 0.7
    prompt = _cli(*common)
    assert prompt.returncode == 0, prompt.stderr
    assert "computed_share" not in json.loads(prompt.stdout)


def test_prompts_file_and_dense_give_one_line_per_prompt(tiny_models, tmp_path):
    _, packed = tiny_models["tiny-llama"]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) for i in range(5, 8)) + "\n")
    dense = _cli("generate", "--model", str(packed), "--dense", "--prompts", str(f), "--max-new-tokens", "5")
    full = _cli("generate", "--model", str(packed), "--prompts", str(f), "--max-new-tokens", "5")
    assert dense.returncode == 0 and full.returncode == 0, dense.stderr + full.stderr
    a = [json.loads(line) for line in dense.stdout.splitlines()]
    b = [json.loads(line) for line in full.stdout.splitlines()]
    assert len(a) == len(b) == 3
    assert [r["text"] for r in a] == [r["text"] for r in b]  # gamma = phi = 1 is exact


def test_bad_ratio_is_refused_with_a_reason(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-llama"]
    out = _cli("generate", "--model", str(packed), "--profiles", str(tiny_profiles["tiny-llama"]),
               "--load-ratio", "0.5", "--compute-ratio", "0.8", "w5")
    assert out.returncode == 2
    assert "compute_ratio must be in" in out.stderr


def test_profile_show_summarises_shipped_profiles(embedded_profiles):
    out = _cli("profile", "show", str(embedded_profiles))
    assert out.returncode == 0, out.stderr
    assert "task qa" in out.stdout and "base-set overlap" in out.stdout


def test_console_script_is_on_path_after_env():
    """`selectinfer ...` works as the README writes it after `source scripts/env.sh`."""
    import shutil
    exe = shutil.which("selectinfer")
    assert exe, "selectinfer not on PATH (scripts/setup.sh writes it into .venv/bin)"
    out = subprocess.run([exe, "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--load-ratio" in out.stdout and "--no-escape" in out.stdout


def test_escape_sequences_in_command_line_prompts(tiny_models):
    from selectinfer_ros.core.execution.escapes import process_escapes
    assert process_escapes(r"Question: Why?\nAnswer:") == "Question: Why?\nAnswer:"
    assert process_escapes(r"a\tb\\n\x41\q") == "a\tb\\nA\\q"
    _, packed = tiny_models["tiny-llama"]
    runs = {}
    for flags in ((), ("--no-escape",)):
        out = _cli("generate", "--model", str(packed), "--json", "--max-new-tokens", "1",
                   *flags, r"w5\nw6")
        assert out.returncode == 0, out.stderr
        runs[flags] = json.loads(out.stdout)["prompt_tokens"]
    from selectinfer_ros.core.format.tokenizer import load_tokenizer
    tok = load_tokenizer(packed)
    assert runs[()] == len(tok("w5\nw6")["input_ids"])
    assert runs[("--no-escape",)] == len(tok(r"w5\nw6")["input_ids"])
    assert runs[()] != runs[("--no-escape",)]


def test_verify_command(tiny_models):
    _, packed = tiny_models["tiny-qwen2"]
    out = _cli("verify", "--model", str(packed))
    assert out.returncode == 0 and "intact" in out.stderr


def test_users_own_task_from_plain_text_gets_a_curve_and_min_agreement_uses_it(tiny_models, tiny_profiles,
                                                                              tmp_path):
    """`profile --task my_task --data my_prompts.txt`: plain text lines, a quality curve measured on
    held-out lines, shown by `profile show`; `generate --min-agreement` picks gamma from it."""
    import shutil
    _, packed = tiny_models["tiny-llama"]
    d = tmp_path / "profiles"
    shutil.copytree(tiny_profiles["tiny-llama"], d)
    prompts = tmp_path / "my_prompts.txt"
    prompts.write_text("\n".join(f"w{i} w{i + 3} w{i + 7} w{i + 1} w{i + 2} w{i + 9}" for i in range(5, 25)) + "\n")
    out = _cli("profile", "--model", str(packed), "--task", "my_task", "--data", str(prompts), "--out", str(d),
               "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "task my_task: float records, next-token agreement with dense" in out.stdout
    assert "warning" in out.stderr and "held-out tokens (< 2000)" in out.stderr  # a small file
    assert "(95 % CI)" in out.stderr and "[95 % CI]" in out.stdout
    assert (d / "my_task.safetensors").exists()
    plot = tmp_path / "curves.png"
    show = _cli("profile", "show", str(d), "--plot", str(plot))
    assert show.returncode == 0, show.stderr
    assert "task my_task: float records, next-token agreement" in show.stdout
    assert plot.stat().st_size > 0
    gen = _cli("generate", "--model", str(packed), "--profiles", str(d), "--task", "my_task",
               "--min-agreement", "0.5", "--json", "--max-new-tokens", "2", "w5 w6")
    assert gen.returncode == 0, gen.stderr
    assert "min_agreement 0.50 -> load_ratio" in gen.stderr
    res = json.loads(gen.stdout)
    from selectinfer_ros.core.selection.profiles import load_profile
    curve = load_profile(d / "my_task.safetensors").quality_curve()
    share = round(res["compute_ratio"] / res["load_ratio"], 6)  # phi chosen with gamma
    assert res["task"] == "my_task" and res["load_ratio"] == curve.load_ratio_for(0.5, share)
    both = _cli("generate", "--model", str(packed), "--profiles", str(d), "--task", "my_task",
                "--min-agreement", "1.0", "--memory-budget", "0.0001", "--json", "w5")
    assert "bound: memory_budget" in both.stderr or "leaves no room" in both.stderr


def _subcommands() -> dict:
    """``{name: parser}`` of every ``selectinfer`` subcommand, ``profile show`` included."""
    import argparse

    from selectinfer_ros.cli import build_parser, profile_show_parser
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return {**sub.choices, "profile show": profile_show_parser()}


def test_every_option_of_every_subcommand_has_help():
    import argparse
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in _subcommands().items()
               for a in p._actions if not isinstance(a, argparse._HelpAction)
               and (not a.help or a.help == argparse.SUPPRESS)]
    assert missing == []
    assert len(_subcommands()) >= 9


def test_one_spelling_per_concept_across_subcommands():
    """--model and --threads everywhere (no positional model, no --num-threads); --grid G,P lists
    pairs and single ratios are --load-ratio/--compute-ratio."""
    cmds = _subcommands()
    flags = {name: {s for a in p._actions for s in a.option_strings} for name, p in cmds.items()}
    positionals = {name: [a.dest for a in p._actions if not a.option_strings] for name, p in cmds.items()}
    assert all("--num-threads" not in f for f in flags.values())
    assert all("model" not in pos for pos in positionals.values())
    for name in ("profile", "generate", "verify", "bench", "eval", "eval-choices"):
        assert "--model" in flags[name], name
    for name in ("profile", "generate", "bench", "eval", "eval-choices"):
        assert "--threads" in flags[name], name
    assert {"--load-ratio", "--compute-ratio"} <= flags["generate"] and "--grid" not in flags["generate"]
    for name in ("bench", "eval", "eval-choices"):
        assert "--grid" in flags[name] and "--load-ratio" not in flags[name], name


def test_profile_help_lists_profile_show():
    out = _cli("profile", "--help")
    assert out.returncode == 0, out.stderr
    assert "selectinfer profile show" in out.stdout and "--plot" in out.stdout


def test_help_imports_neither_torch_nor_transformers():
    """`selectinfer --help` builds the whole parser (every subcommand, lab's included) without
    importing torch, transformers or numpy: -X importtime lists every module imported."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "selectinfer_ros.cli", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "eval-choices" in out.stdout, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "selectinfer_ros.lab.commands" in imported  # the lab's options were built
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers", "numpy"))
    assert heavy == []


def _doc_commands(prefix: str) -> list[str]:
    """The command lines in the README's and docs/'s bash blocks that start with ``prefix``."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    lines = []
    for doc in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        block = False
        for line in doc.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
            if line.startswith("```"):
                block = line.strip() == "```bash"
            elif block and line.startswith(prefix):
                lines.append(line)
    return lines


def test_every_selectinfer_command_in_the_docs_parses():
    """Each `selectinfer ...` line of README.md and docs/ names a real subcommand with real options."""
    import shlex

    from selectinfer_ros.cli import build_parser, profile_show_parser
    lines = _doc_commands("selectinfer ") + [line.split(" ", 3)[3] for line in
                                             _doc_commands("ros2 run selectinfer_ros selectinfer ")]
    assert len(lines) >= 10
    for line in lines:
        argv = shlex.split(line, comments=True)[1:] if line.startswith("selectinfer ") else \
            shlex.split(line, comments=True)
        try:
            if argv[:2] == ["profile", "show"]:
                profile_show_parser().parse_args(argv[2:])
            else:
                build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"does not parse: {line}") from None


def test_modules_and_files_the_readme_names_exist():
    import importlib.util
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    modules = set(re.findall(r"python -m (selectinfer_ros[\w.]+)", text))
    assert len(modules) >= 5 and all(importlib.util.find_spec(m) for m in modules), modules
    links = set(re.findall(r"\]\(([\w./-]+)\)", text))
    named = {"launch/jetson.launch.py", "config/desktop.yaml", "config/jetson_orin_nano.yaml",
             "selectinfer_ros/data/examples/robot_commands.txt", "profiles/gemma3-270m"}
    assert len(links) >= 4 and all(p.removeprefix("launch/") in text for p in named)
    assert [p for p in sorted(links | named) if not (root / p).exists()] == []


def test_generate_json_schema_prints_the_parsed_value(tmp_path):
    """`--json-schema FILE` on the embedded model: a complete answer, valid under the schema, its
    parsed value in the JSON; with --choices as well it is refused before loading anything."""
    import jsonschema
    schema = {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall", "dock"]},
                                               "count": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
              "required": ["room", "count"], "additionalProperties": False}
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    out = _cli("generate", "--json-schema", str(f), "--json", "--max-new-tokens", "32",
               'Example: {"room":"hall","count":2}\nThere are three cups in the kitchen.\nJSON: ')
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["finish_reason"] == "grammar" and res["parsed"] is True
    jsonschema.validate(res["value"], schema)
    assert res["value"] == json.loads(res["text"])
    both = _cli("generate", "--json-schema", str(f), "--choices", "a,b", "x")
    assert both.returncode == 2 and "mutually exclusive" in both.stderr


def test_generate_chat_answers_a_messages_file_with_a_tool_call(tmp_path):
    """`--chat FILE` (OpenAI's chat-completions fields) on SmolLM2, whose template has no tool
    format (the documented default): the call names a tool, its arguments are valid; an
    unknown role is refused before loading anything."""
    import jsonschema
    params = {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall", "dock"]}},
              "required": ["room"], "additionalProperties": False}
    f = tmp_path / "chat.json"
    f.write_text(json.dumps({
        "messages": [{"role": "system", "content": "You control a home robot."},
                     {"role": "user", "content": "Drive to the kitchen."}],
        "tools": [{"type": "function", "function": {"name": "navigate_to",
                                                    "description": "Drive to a room.",
                                                    "parameters": params}}],
        "tool_choice": "required"}))
    out = _cli("generate", "--model", "smollm2-135m", "--chat", str(f), "--json",
               "--max-new-tokens", "40")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["finish_reason"] == "tool_calls" and res["parsed"] is True
    [call] = res["tool_calls"]
    assert call["name"] == "navigate_to"
    jsonschema.validate(call["arguments"], params)
    f.write_text(json.dumps([{"role": "robot", "content": "hi"}]))
    bad = _cli("generate", "--chat", str(f))
    assert bad.returncode == 2 and "unknown role 'robot'" in bad.stderr
