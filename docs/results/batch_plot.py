"""Aggregate decode tok/s of goals decoded together over one goal alone, from the batch bench
files in this folder (each one `python -m selectinfer_ros.lab.batch_bench` run, interleaved);
see README.md in this folder, "Several callers: decoded together".

    python docs/results/batch_plot.py       # writes batch-zen4.png beside this file
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
# (label, file before the tiles (rows), file with the int8 weights held as tiles, threads)
CASES = [("Gemma 3 270M", "batch-gemma3-270m-zen4-t{t}.json",
          "batch-gemma3-270m-zen4-tiles-t{t}.json", (1, 2)),
         ("Llama-3.2-1B shape", "batch-llama-3.2-1b-zen4-t{t}.json",
          "batch-llama-3.2-1b-zen4-tiles-t{t}.json", (1, 2)),
         ("Qwen2.5 1.5B", "batch-qwen2.5-1.5b-zen4-t{t}.json",
          "batch-qwen2.5-1.5b-zen4-tiles-t{t}.json", (2,)),
         ("Gemma, avx2 path", "batch-gemma3-270m-zen4-avx2-t{t}.json",
          "batch-gemma3-270m-zen4-avx2-tiles-t{t}.json", (2,))]


def rows(name: str) -> dict[str, float]:
    return {r["subject"]: r["ratio"] for r in json.loads((HERE / name).read_text())}


def main() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4))
    labels, x, w = [], 0, 0.2
    bars = (("rows", "B=2", "tab:olive"), ("rows", "B=4", "tab:green"),
            ("tiles", "B=2", "tab:cyan"), ("tiles", "B=4", "tab:blue"))
    for model, before, after, threads in CASES:
        for t in threads:
            got = {"rows": rows(before.format(t=t)), "tiles": rows(after.format(t=t))}
            for j, (layout, b, color) in enumerate(bars):
                v = got[layout][b]
                ax.bar(x + (j - 1.5) * w, v, w, color=color,
                       label=f"{b[2:]} goals, {layout}" if x == 0 else None)
                ax.text(x + (j - 1.5) * w, v + 0.04, f"{v:.2f}", ha="center", fontsize=6)
            print(f"{model}, {t} thread(s): " + "; ".join(
                f"{k}: " + ", ".join(f"{b} {r[b]:.2f}x" for b in r) for k, r in got.items()))
            labels.append(f"{model}\n{t} thread{'s' * (t > 1)}")
            x += 1
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(3.0, color="gray", lw=0.6, ls="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("decode tok/s together over one goal alone")
    ax.set_title("int8, gamma = phi = 1: goals decoded in one pass over the weights, weights "
                 "as rows and as tiles (AMD EPYC Zen 4)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(HERE / "batch-zen4.png", dpi=110)


if __name__ == "__main__":
    main()
