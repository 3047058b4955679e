"""Writes ``profiling_alt/`` and ``eval_alt/``: the same items as ``profiling/`` and ``eval/`` in a
clearly different phrasing (no instruction line, other separators, statements to complete
instead of questions). Run from the repository root: ``python selectinfer_ros/data/make_alt_phrasing.py``.

Used by the cross-phrasing evaluation (``selectinfer eval --cross-phrasing``): profile on one
phrasing, evaluate on the other, both directions.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

# QA: questions become statements to complete, the answer last (few-shot, no "Question:/Answer:").
QA_RULES = [
    (r"What is the capital of (.+)\?", r"The capital of \1 is"),
    (r"What is (\d+) (plus|minus|times|divided by) (\d+)\?", r"\1 \2 \3 equals"),
    (r"What is the square root of (\d+)\?", r"The square root of \1 is"),
    (r"What is the chemical symbol for (.+)\?", r"The chemical symbol for \1 is"),
    (r"What is the opposite of (.+)\?", r"The opposite of \1 is"),
    (r"What is the currency of (.+)\?", r"The currency of \1 is the"),
    (r"What language is mainly spoken in (.+)\?", r"The main language spoken in \1 is"),
    (r"How many (\w+) does an? (.+) have\?", r"The number of \1 of a \2 is"),
    (r"How many (\w+) are in an? (.+)\?", r"The number of \1 in a \2 is"),
    (r"Who wrote (.+)\?", r"\1 was written by"),
    (r"Who painted (.+)\?", r"\1 was painted by"),
    (r"What color is (.+)\?", r"The color of \1 is"),
    (r"What color are (.+)\?", r"The color of \1 is"),
    (r"Which planet is (.+)\?", r"The planet \1 is"),
    (r"What is the (.+)\?", r"The \1 is"),
]
QA_MANUAL = {
    "What gas do plants absorb from the air?": "The gas that plants absorb from the air is",
    "How many continents are there?": "The number of continents is",
    "What star is at the center of our solar system?": "The star at the center of our solar system is the",
    "What animal is known as the king of the jungle?": "The animal known as the king of the jungle is the",
    "What do bees make?": "Bees make",
    "What is frozen water called?": "Frozen water is called",
    "What metal is liquid at room temperature?": "The metal that is liquid at room temperature is",
    "What organ pumps blood through the body?": "The organ that pumps blood through the body is the",
    "How many players does a soccer team have on the field?":
        "The number of players a soccer team has on the field is",
    "What planet do we live on?": "The planet we live on is",
    "In which country are the pyramids of Giza?": "The pyramids of Giza are in",
    "Who was the first President of the United States?": "The first President of the United States was",
    "What gas do humans need to breathe to stay alive?": "The gas humans need to breathe to stay alive is",
    "Who developed the theory of relativity?": "The theory of relativity was developed by",
    "What does a caterpillar turn into?": "A caterpillar turns into a",
    "What organs do humans use to breathe?": "The organs humans use to breathe are the",
    "How many planets are in the solar system?": "The number of planets in the solar system is",
    "What force pulls objects toward the Earth?": "The force that pulls objects toward the Earth is",
    "Who painted the ceiling of the Sistine Chapel?": "The ceiling of the Sistine Chapel was painted by",
    "How many legs does an insect have?": "The number of legs of an insect is",
    "How many minutes are in an hour?": "The number of minutes in an hour is",
    "Who painted the Mona Lisa?": "The Mona Lisa was painted by",
    "Which planet is the hottest in the solar system?": "The hottest planet in the solar system is",
    "Which planet is closest to the Sun?": "The planet closest to the Sun is",
}
QA_SHOTS = {"profiling": "The capital of Italy is Rome.\nThe number of legs of a spider is eight.\n",
            "eval": "The capital of Spain is Madrid.\nThe number of days in a week is seven.\n"}


def qa_statement(question: str) -> str:
    if question in QA_MANUAL:
        return QA_MANUAL[question]
    for pat, rep in QA_RULES:
        if re.fullmatch(pat, question):
            return re.sub(pat, rep, question)
    raise ValueError(f"no statement for {question!r}")


def alt_qa(rec: dict, split: str) -> dict:
    question = rec["prompt"].rstrip().split("\n")[-2].removeprefix("Question: ")
    return {"prompt": QA_SHOTS[split] + qa_statement(question), "reference": rec["reference"],
            "stop": ["\n", "."]}


def _split_pairs(prompt: str, src: str, dst: str) -> tuple[list[tuple[str, str]], str]:
    """The few-shot (source, target) pairs and the final source of an ``src:``/``dst:`` prompt."""
    lines = prompt.split("\n")[1:]  # drop the instruction line
    pairs, cur = [], None
    for line in lines:
        if line.startswith(f"{src}: "):
            cur = line[len(src) + 2:]
        elif line.startswith(f"{dst}:") and line[len(dst) + 1:].strip():
            pairs.append((cur, line[len(dst) + 2:]))
            cur = None
    return pairs, cur


def alt_translation(rec: dict, split: str) -> dict:
    pairs, last = _split_pairs(rec["prompt"], "English", "French")
    body = "".join(f"{e} => {f}\n" for e, f in pairs)
    return {"prompt": f"{body}{last} =>", "reference": rec["reference"]}


def alt_summarization(rec: dict, split: str) -> dict:
    text = rec["prompt"].split("\nText: ", 1)[1].rsplit("\nSummary:", 1)[0]
    return {"prompt": f"{text}\nTL;DR:", "reference": rec["reference"]}


def alt_navigation(rec: dict, split: str) -> dict:
    pairs, last = _split_pairs(rec["prompt"], "Instruction", "Command")
    body = "".join(f"user> {i}\nrobot> {c}\n" for i, c in pairs)
    return {"prompt": f"{body}user> {last}\nrobot>", "reference": rec["reference"]}


def alt_scene(rec: dict, split: str) -> dict:
    pairs, last = _split_pairs(rec["prompt"], "Objects", "Description")
    body = "".join(f"[{o}] -> {d}\n" for o, d in pairs)
    return {"prompt": f"{body}[{last}] ->", "reference": rec["reference"]}


ALT = {"qa": alt_qa, "translation": alt_translation, "summarization": alt_summarization,
       "navigation": alt_navigation, "scene": alt_scene}


def main() -> None:
    for split in ("profiling", "eval"):
        out = HERE / f"{split}_alt"
        out.mkdir(exist_ok=True)
        for task, fn in ALT.items():
            src = HERE / split / f"{task}.jsonl"
            if not src.exists():
                continue
            recs = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
            with open(out / f"{task}.jsonl", "w") as f:
                for rec in recs:
                    f.write(json.dumps(fn(rec, split), ensure_ascii=False) + "\n")
        if split == "eval":  # prose has no phrasing: the same held-out text
            (out / "prose.jsonl").write_text((HERE / split / "prose.jsonl").read_text())


if __name__ == "__main__":
    main()
