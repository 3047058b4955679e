"""``selectinfer eval-choices``: multiple-choice answers (``Engine.choose``) against free text.

On ``data/eval/choices.jsonl`` (the held-out navigation prompts with four command options, and
scene questions over listed objects), per configuration (dense, then SelectInfer gamma/phi pairs):

* choice accuracy: ``choose`` picks the answer (total log-prob; the length-normalised pick too);
* free-text accuracy: greedy generation (one line) parsed for an option;
* agreement: how often ``choose`` picks what the dense model's ``choose`` picks;
* latency: ``choose`` seconds against the time to first token of the same prompt.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ..core.execution.engine import GenerationConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "eval" / "choices.jsonl"
ROOM_PROMPT = ("Where should the robot go next?\nScene: The battery is at 8 percent.\nRoom: dock\n"
               "Scene: Someone spilled juice next to the fridge.\nRoom: kitchen\n"
               "Scene: A guest is waiting at the entrance.\nRoom: hall\n"
               "Scene: The charge level dropped to 5 percent.\nRoom:")
ROOMS = ["kitchen", "hall", "dock", "office"]


def parse_option(text: str, options: list[str]) -> str | None:
    """The option a free-text answer names: its first line when that is an option, else the
    option found earliest in the text (the longest at the same place), else None."""
    line = text.strip().split("\n", 1)[0].strip().rstrip(".")
    if line in options:
        return line
    found = [(text.find(o), -len(o), o) for o in options if o in text]
    return min(found)[2] if found else None


def read_items(path: str | Path, limit: int | None = None) -> list[dict]:
    with open(path) as f:
        items = [json.loads(line) for line in f if line.strip()]
    return items[:limit] if limit else items


def run_config(rt, items: list[dict], max_new_tokens: int, dense: bool) -> list[dict]:
    """Per item: choice (raw and normalised), free-text answer, seconds."""
    out = []
    for it in items:
        task = "" if dense else it.get("task", "")
        res = rt.choose(it["prompt"], it["options"], task=task)
        norm = max(range(len(res.choices)), key=res.logprobs_normalized.__getitem__)
        gen = rt.generate(it["prompt"], GenerationConfig(max_new_tokens=max_new_tokens, stop=["\n"]),
                          task=task)
        out.append({"choice": res.choice, "choice_normalized": res.choices[norm],
                    "free_text": gen.text, "free_choice": parse_option(gen.text, it["options"]),
                    "choose_seconds": res.seconds, "ttft": gen.metrics.time_to_first_token,
                    "options": len(it["options"]), "choice_tokens": res.token_counts})
    return out


def room_latency(rt, repeats: int, task: str) -> dict:
    """4 one-token options: choose seconds vs time to first token, interleaved, medians."""
    ch, tt = [], []
    for _ in range(repeats):
        ch.append(rt.choose(ROOM_PROMPT, ROOMS, task=task).seconds)
        t0 = time.perf_counter()
        g = rt.generate(ROOM_PROMPT, GenerationConfig(max_new_tokens=1), task=task)
        tt.append(g.metrics.time_to_first_token or time.perf_counter() - t0)
    return {"choose_seconds": statistics.median(ch), "ttft": statistics.median(tt),
            "ratio": statistics.median(ch) / statistics.median(tt)}


def summarize(items: list[dict], rows: list[dict], dense_rows: list[dict] | None) -> dict:
    n = len(items)
    four = [i for i, r in enumerate(rows) if r["options"] == 4]
    s = {"items": n,
         "choice_accuracy": sum(r["choice"] == it["answer"] for r, it in zip(rows, items)) / n,
         "choice_normalized_accuracy": sum(r["choice_normalized"] == it["answer"]
                                           for r, it in zip(rows, items)) / n,
         "free_text_accuracy": sum(r["free_choice"] == it["answer"] for r, it in zip(rows, items)) / n,
         "free_text_unparsed": sum(r["free_choice"] is None for r in rows) / n,
         "choose_seconds_median": statistics.median(r["choose_seconds"] for r in rows),
         "ttft_median": statistics.median(r["ttft"] for r in rows),
         "ratio_median_4_options": statistics.median(rows[i]["choose_seconds"] / rows[i]["ttft"]
                                                     for i in four) if four else None}
    if dense_rows is not None:
        s["agreement_with_dense"] = sum(a["choice"] == b["choice"] for a, b in zip(rows, dense_rows)) / n
    return s


def cmd_eval_choices(args: argparse.Namespace) -> int:
    import torch

    from ..core.format.progress import log_line as _log
    from ..core.options import ModelOptions
    from ..core.serving.runtime import Runtime, model_path
    torch.set_num_threads(args.threads)
    items = read_items(args.data, args.limit)
    model = model_path(ModelOptions(model=args.model or ""), _log)
    configs = [("dense", None, None)] + [(f"{g:g}/{p:g}", g, p) for g, p in
                                          (tuple(float(x) for x in pair.split(",")) for pair in args.grid)]
    report: dict = {"data": str(args.data), "threads": args.threads, "configs": {}}
    dense_rows = None
    for name, gamma, phi in configs:
        _log(f"[eval-choices] {name}: {len(items)} items")
        rt = Runtime(ModelOptions(model=model, profiles=args.profiles or "",
                                  task=items[0].get("task", ""), load_ratio=gamma or 1.0,
                                  compute_ratio=phi or 0.0), log=_log, dense=gamma is None)
        rows = run_config(rt, items, args.max_new_tokens, dense=gamma is None)
        summary = summarize(items, rows, dense_rows)
        if gamma is not None:
            summary["room_latency"] = room_latency(rt, args.repeats, "navigation")
        report["configs"][name] = {"summary": summary, "items": rows}
        if gamma is None:
            dense_rows = rows
        _log(f"[eval-choices] {name}: {json.dumps(summary)}")
        del rt
    print(format_table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def format_table(report: dict) -> str:
    lines = ["| configuration | choices right | choices (length-normalised) | free text right | "
             "free text unparsed | choices = dense choice | choose s | TTFT s | ratio (4 options) |"
             " ratio (4 one-token rooms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in report["configs"].items():
        s = c["summary"]
        room = s.get("room_latency")
        lines.append(
            f"| {name} | {s['choice_accuracy']:.3f} | {s['choice_normalized_accuracy']:.3f} | "
            f"{s['free_text_accuracy']:.3f} | {s['free_text_unparsed']:.3f} | "
            f"{s.get('agreement_with_dense', 1.0):.3f} | {s['choose_seconds_median']:.3f} | "
            f"{s['ttft_median']:.3f} | {s['ratio_median_4_options'] or 0:.2f} | "
            f"{room['ratio']:.2f} |" if room else
            f"| {name} | {s['choice_accuracy']:.3f} | {s['choice_normalized_accuracy']:.3f} | "
            f"{s['free_text_accuracy']:.3f} | {s['free_text_unparsed']:.3f} | - | "
            f"{s['choose_seconds_median']:.3f} | {s['ttft_median']:.3f} | "
            f"{s['ratio_median_4_options'] or 0:.2f} | - |")
    return "\n".join(lines)
