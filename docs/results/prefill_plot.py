"""Prefill of our int8 records (gamma = phi = 1) against llama.cpp Q8_0 on the same weights, from
the bench files in this folder (each one interleaved `selectinfer bench --llama-cpp auto` run),
before and after the blocked integer product of prefills; see README.md in this folder,
"Prefill: a blocked integer product".

    python docs/results/prefill_plot.py       # writes prefill-zen4.png beside this file
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
OURS, PEER = "selectinfer int8 1/1", "llama.cpp Q8_0"
# (label, file of the run with the blocked product, file of the run before it or None), T = 1, 2
CASES = [(f"{label}\n{t} thread{'s' * (t > 1)}", now.format(t=t), before and before.format(t=t))
         for label, now, before in [
             ("Gemma 3 270M\n64 tokens", "bench-gemma3-270m-prefill-zen4-t{t}.json",
              "bench-gemma3-270m-zen4-t{t}.json"),
             ("Gemma 3 270M\n512 tokens", "bench-gemma3-270m-prefill512-zen4-t{t}.json", None),
             ("Llama-3.2-1B\nshape, 48 tokens", "bench-llama-3.2-1b-prefill48-zen4-t{t}.json", None),
             ("Llama-3.2-1B\nshape, 512 tokens", "bench-llama-3.2-1b-prefill512-zen4-t{t}.json",
              None),
             ("Qwen2.5 1.5B\n64 tokens", "bench-qwen2.5-1.5b-prefill-zen4-t{t}.json",
              "bench-qwen2.5-1.5b-zen4-t{t}.json")]
         for t in (1, 2)]


def ratio(name: str) -> tuple[float, float, float]:
    """(our prefill tok/s, llama.cpp Q8_0's, ours over theirs) of one bench file."""
    rows = {r["name"]: r["prefill_tokens_per_second"] for r in json.loads((HERE / name).read_text())}
    return rows[OURS], rows[PEER], rows[OURS] / rows[PEER]


def main() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 4.4))
    for i, (label, now, before) in enumerate(CASES):
        ours, peer, r = ratio(now)
        print(f"{label.replace(chr(10), ', ')}: ours {ours:.1f} tok/s, Q8_0 {peer:.1f}: {r:.2f}x"
              + (f" (before: {ratio(before)[2]:.2f}x)" if before else ""))
        ax.bar(i + 0.2, r, 0.4, color="tab:blue", label="blocked product" if i == 0 else None)
        ax.text(i + 0.2, r + 0.03, f"{r:.2f}", ha="center", fontsize=8)
        if before:
            b = ratio(before)[2]
            ax.bar(i - 0.2, b, 0.4, color="tab:gray", label="row path (before)" if i == 0 else None)
            ax.text(i - 0.2, b + 0.03, f"{b:.2f}", ha="center", fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(CASES)), [c[0] for c in CASES], fontsize=7)
    ax.set_ylabel("prefill tok/s over llama.cpp Q8_0")
    ax.set_title("int8 records, gamma = phi = 1: prefill against llama.cpp Q8_0, same weights, "
                 "one interleaved run each (AMD EPYC Zen 4, avx512vnni)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(HERE / "prefill-zen4.png", dpi=110)


if __name__ == "__main__":
    main()
