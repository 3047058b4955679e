"""Trade-off plots: one point per configuration, a metric against resident weight memory."""
from __future__ import annotations

from pathlib import Path

MARKERS = {"dense": "s", "hf_generate": "D", "selectinfer": "o", "int8": "^", "int4": "v",
           "llama.cpp": "*"}


def tradeoff_plot(rows: list[dict], y_key: str, y_label: str, path: str | Path, title: str = "") -> Path:
    """Scatter ``y_key`` against resident weight MiB, labelled by configuration name."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    methods = []
    for r in rows:
        if r.get(y_key) is None or not r.get("weight_bytes"):
            continue
        method = r.get("method", "")
        marker = MARKERS.get(method, "o")
        label = method if method not in methods else None
        methods.append(method)
        x = r["weight_bytes"] / 2**20
        ax.scatter(x, r[y_key], marker=marker, s=60, label=label)
        ax.annotate(r.get("name", method), (x, r[y_key]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    ax.set_xlabel("resident weights (MiB)")
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def quality_curve_plot(curves: dict, path: str | Path, title: str = "") -> Path:
    """Agreement with dense against gamma, one line per task and compute share phi/gamma."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for n, (task, c) in enumerate(sorted(curves.items())):
        color = f"C{n % 10}"
        for j, share in enumerate(c.compute_shares):
            style = "-" if share >= 1.0 else "--"
            label = f"{task} (loading only)" if share >= 1.0 else f"{task} (phi = {share:g} gamma)"
            ax.plot(c.load_ratios, [float(a) for a in c.agreement[:, j]], style, color=color,
                    marker="o", ms=3, label=label)
    ax.set_xlabel("load ratio gamma")
    ax.set_ylabel("next-token agreement with dense (held-out prompts)")
    ax.set_title(title or "measured quality curves (stored in the profiles)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
