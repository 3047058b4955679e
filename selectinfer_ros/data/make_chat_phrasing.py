"""Writes ``eval_chat/``: the items of ``eval/`` in a third phrasing, a chat layout used by
neither profiling set (``User:``/``Assistant:`` turns with other few-shot examples, a request
after the text to summarise, lower-case navigation instructions without final punctuation).
References are unchanged; prose is copied. Run from the repository root:
``python selectinfer_ros/data/make_chat_phrasing.py``.

Used to check whether profiles made on several phrasings generalise better to an unseen one
(README, "Across phrasing").
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC, DST = HERE / "eval", HERE / "eval_chat"
ITEMS = 40


def _last(prompt: str, key: str, end: str) -> str:
    m = re.search(rf"{key}: ([^\n]*)\n{end}:$", prompt)
    assert m, prompt
    return m.group(1)


def qa(r: dict) -> dict:
    q = _last(r["prompt"], "Question", "Answer")
    return {"prompt": ("User: What is the tallest mountain on Earth?\nAssistant: Mount Everest\n\n"
                       "User: How many months are in a year?\nAssistant: twelve\n\n"
                       f"User: {q}\nAssistant:"), "reference": r["reference"]}


def translation(r: dict) -> dict:
    s = _last(r["prompt"], "English", "French")
    return {"prompt": ("User: How do I say this in French? The cat is sleeping on the sofa.\n"
                       "Assistant: Le chat dort sur le canapé.\n"
                       f"User: How do I say this in French? {s}\nAssistant:"),
            "reference": r["reference"]}


def summarization(r: dict) -> dict:
    t = _last(r["prompt"], "Text", "Summary")
    return {"prompt": f"User: {t}\nGive me the gist in a single sentence.\nAssistant:",
            "reference": r["reference"]}


def navigation(r: dict) -> dict:
    i = _last(r["prompt"], "Instruction", "Command").lower().rstrip(".!?")
    return {"prompt": f"Q: head over to the garage\nA: goto(garage)\n\nQ: {i}\nA:",
            "reference": r["reference"]}


def main() -> None:
    DST.mkdir(parents=True, exist_ok=True)
    for fn in (qa, translation, summarization, navigation):
        rows = [json.loads(line) for line in (SRC / f"{fn.__name__}.jsonl").read_text().splitlines()
                if line.strip()]
        out = [fn(r) for r in rows][:ITEMS]
        (DST / f"{fn.__name__}.jsonl").write_text(
            "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in out))
        print(f"{fn.__name__}: {len(out)} items -> {DST / (fn.__name__ + '.jsonl')}")
    shutil.copy(SRC / "prose.jsonl", DST / "prose.jsonl")


if __name__ == "__main__":
    main()
