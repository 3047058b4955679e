"""The `selectinfer` command line: generate (--json, --prompts, --dense), pack, profile show."""
from __future__ import annotations

import json
import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selectinfer_ros.core.cli", *args], capture_output=True,
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
    from selectinfer_ros.core.escapes import process_escapes
    assert process_escapes(r"Question: Why?\nAnswer:") == "Question: Why?\nAnswer:"
    assert process_escapes(r"a\tb\\n\x41\q") == "a\tb\\nA\\q"
    _, packed = tiny_models["tiny-llama"]
    runs = {}
    for flags in ((), ("--no-escape",)):
        out = _cli("generate", "--model", str(packed), "--json", "--max-new-tokens", "1",
                   *flags, r"w5\nw6")
        assert out.returncode == 0, out.stderr
        runs[flags] = json.loads(out.stdout)["prompt_tokens"]
    from selectinfer_ros.core.tokenizer import load_tokenizer
    tok = load_tokenizer(packed)
    assert runs[()] == len(tok("w5\nw6")["input_ids"])
    assert runs[("--no-escape",)] == len(tok(r"w5\nw6")["input_ids"])
    assert runs[()] != runs[("--no-escape",)]


def test_verify_command(tiny_models):
    _, packed = tiny_models["tiny-qwen2"]
    out = _cli("verify", str(packed))
    assert out.returncode == 0 and "intact" in out.stderr
