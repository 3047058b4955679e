"""Aggregate decode tok/s of goals decoded together over one goal alone, from the batch bench
files in this folder (each one `python -m selectinfer_ros.lab.batch_bench` run, interleaved);
see README.md in this folder, "Several callers: decoded together".

    python docs/results/batch_plot.py       # writes batch-zen4.png beside this file
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
CASES = [("Gemma 3 270M", "batch-gemma3-270m-zen4-t{t}.json", (1, 2)),
         ("Llama-3.2-1B shape", "batch-llama-3.2-1b-zen4-t{t}.json", (1, 2)),
         ("Qwen2.5 1.5B", "batch-qwen2.5-1.5b-zen4-t{t}.json", (2,)),
         ("Gemma, avx2 path", "batch-gemma3-270m-zen4-avx2-t{t}.json", (2,))]


def rows(name: str) -> dict[str, float]:
    return {r["subject"]: r["ratio"] for r in json.loads((HERE / name).read_text())}


def main() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4))
    labels, x = [], 0
    for model, pattern, threads in CASES:
        for t in threads:
            r = rows(pattern.format(t=t))
            for j, b in enumerate(("B=1", "B=2", "B=4")):
                ax.bar(x + (j - 1) * 0.27, r[b], 0.27, color=("tab:gray", "tab:cyan", "tab:blue")[j],
                       label=f"{b[2:]} goal{'s' * (b != 'B=1')} together" if x == 0 else None)
                ax.text(x + (j - 1) * 0.27, r[b] + 0.04, f"{r[b]:.2f}", ha="center", fontsize=7)
            print(f"{model}, {t} thread(s): " + ", ".join(f"{b} {r[b]:.2f}x" for b in r))
            labels.append(f"{model}\n{t} thread{'s' * (t > 1)}")
            x += 1
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("decode tok/s together over one goal alone")
    ax.set_title("int8 records, gamma = phi = 1: goals decoded in one pass over the weights "
                 "(AMD EPYC Zen 4, avx512vnni)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(HERE / "batch-zen4.png", dpi=110)


if __name__ == "__main__":
    main()
