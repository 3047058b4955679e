r"""Send a Generate goal and print the streamed text and the result (no ros2cli needed).

    python -m selectinfer_ros.ros.tools.generate "The three primary colors are" --task qa
    python -m selectinfer_ros.ros.tools.generate "Question: What is the capital of France?\nAnswer:"
    python -m selectinfer_ros.ros.tools.generate "The battery is empty. The robot goes to the" \
        --choices kitchen,hall,dock

Escape sequences in the prompt, stop strings and choices (``\n``, ``\t``, ``\xHH`` ...) become
the characters they name, as llama.cpp does; ``--no-escape`` keeps the text as typed.

Exit status 0 when the goal SUCCEEDED; 1 when it was rejected, aborted, canceled or timed out;
2 when the server was not found. Ctrl-C cancels the goal and prints the partial text.
"""
from __future__ import annotations

import argparse
import sys

from ..plumbing import format_result


def text_of(args, text: str) -> str:
    """A string from the command line, escape sequences processed unless --no-escape."""
    from ...core.execution.escapes import process_escapes
    return text if args.no_escape else process_escapes(text)


def goal_options(args) -> dict:
    """The Generate goal fields the options give (for LLMClient)."""
    return dict(task=args.task, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                seed=args.seed, stop=[text_of(args, s) for s in args.stop],
                use_chat_template=args.chat, compute_ratio=args.compute_ratio,
                choices=[text_of(args, c.strip()) for c in args.choices.split(",")]
                if args.choices else [], length_normalize=args.length_normalize,
                json_schema=_file_text(args.json_schema), grammar=_file_text(args.grammar))


def _file_text(path: str | None) -> str:
    """The text of a schema or grammar file ("" for none)."""
    from pathlib import Path
    return Path(path).read_text(encoding="utf-8") if path else ""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.ros.tools.generate",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--task", default="", help="task profile (default: the active one)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = the node's default")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.0, help="0 = off")
    ap.add_argument("--repetition-penalty", type=float, default=0.0, help="0 = off")
    ap.add_argument("--seed", type=int, default=-1, help="-1 = random")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--chat", action="store_true", help="apply the model's chat template")
    ap.add_argument("--compute-ratio", type=float, default=0.0, help="0 = the node's default")
    ap.add_argument("--no-escape", action="store_true",
                    help="keep \\n, \\t, \\xHH ... in the prompt, stop strings and choices as typed")
    ap.add_argument("--choices", default="", help="comma-separated options: answer with one")
    ap.add_argument("--length-normalize", action="store_true",
                    help="rank choices by mean log-prob per token")
    ap.add_argument("--json-schema", metavar="FILE", help="answer with JSON valid under this schema")
    ap.add_argument("--grammar", metavar="FILE", help="answer in this Lark grammar (llguidance)")
    ap.add_argument("--namespace", default="llm")
    ap.add_argument("--server-timeout", type=float, default=10.0,
                    help="seconds to wait for the action server and the goal response")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the result")
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..client import STATUS_NO_SERVER, STATUS_REJECTED, STATUS_TIMEOUT, LLMClient
    args = parser().parse_args(argv)
    out = sys.stdout
    with LLMClient.start("selectinfer_generate", args.namespace,
                         server_timeout=args.server_timeout, result_timeout=args.timeout) as llm:
        if not llm.wait_for_server(args.server_timeout):
            print(f"no action server {llm.action_name} (is selectinfer_node running on this "
                  f"ROS_DOMAIN_ID?)", file=sys.stderr)
            return 2

        def on_feedback(fb) -> None:
            out.write(fb.text_delta)
            out.flush()

        handle = llm.generate_async(text_of(args, args.prompt), on_feedback=on_feedback,
                                    **goal_options(args))
        try:
            outcome = handle.wait()
        except KeyboardInterrupt:
            handle.cancel()
            outcome = handle.wait(10.0)
        if outcome.status == STATUS_NO_SERVER:
            print(outcome.error_msg, file=sys.stderr)
            return 2
        if outcome.status == STATUS_REJECTED or (outcome.status == STATUS_TIMEOUT
                                                 and outcome.result is None):
            print(f"\n{outcome.status}: {outcome.error_msg}", file=sys.stderr)
            return 1
        if outcome.choice_index >= 0:
            out.write(outcome.text)
        out.write("\n")
        print("--- " + format_result(outcome.status, outcome.result))
        return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
