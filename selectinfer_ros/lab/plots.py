"""Trade-off plots: one point per configuration, a metric against resident weight memory."""
from __future__ import annotations

import textwrap
from pathlib import Path

MARKERS = {"dense": "s", "hf_generate": "D", "selectinfer": "o", "int8": "^", "int4": "v",
           "llama.cpp": "*"}


def _labelled_scatter(points: list[tuple[float, float, str, str]], x_label: str, y_label: str,
                      path: str | Path, title: str = "", vlines=()) -> Path:
    """Scatter ``(x, y, method, label)`` points, one marker and legend entry per method, each
    point labelled, with optional vertical lines at ``vlines``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    seen = set()
    for x, y, method, label in points:
        ax.scatter(x, y, marker=MARKERS.get(method, "o"), s=60,
                   label=method if method not in seen else None)
        seen.add(method)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for v in vlines:
        ax.axvline(v, color="grey", alpha=0.3, lw=1)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title("\n".join(textwrap.fill(line, 80) for line in title.splitlines()), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def tradeoff_plot(rows: list[dict], y_key: str, y_label: str, path: str | Path, title: str = "") -> Path:
    """Scatter ``y_key`` against resident weight MiB, labelled by configuration name."""
    points = [(r["weight_bytes"] / 2**20, r[y_key], r.get("method", ""),
               r.get("name", r.get("method", ""))) for r in rows
              if r.get(y_key) is not None and r.get("weight_bytes")]
    return _labelled_scatter(points, "resident weights (MiB)", y_label, path, title)


def speed_quality_plot(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Decode tok/s against agreement with the dense model, ours and llama.cpp's points, with the
    speed-at-quality thresholds as vertical lines (the rows need ``agreement``)."""
    from .speed_quality import AGREEMENTS
    points = [(r["agreement"], r["decode_tokens_per_second"], r.get("method", r.get("source", "")),
               r["name"].replace("selectinfer ", "")) for r in rows if r.get("agreement") is not None]
    return _labelled_scatter(points, "top-token agreement with the dense model (frontier.json)",
                             "decode tokens/s", path, title, vlines=AGREEMENTS)


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


SOURCE_MARKERS = {"selectinfer": "o", "torch": "^", "llama.cpp": "*"}


def frontier_plot(rows: list[dict], front: list[int], path: str | Path, title: str = "") -> Path:
    """Agreement with dense (95% interval bars) against resident weight MiB: marker by source,
    colour by decode tok/s, the Pareto front as a step line; front and llama.cpp points labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors

    fig, ax = plt.subplots(figsize=(9, 6))
    speeds = [r["decode_tokens_per_second"] for r in rows]
    norm = colors.Normalize(vmin=min(speeds), vmax=max(speeds))
    cmap = cm.viridis
    for source, marker in SOURCE_MARKERS.items():
        pts = [r for r in rows if r["source"] == source]
        if not pts:
            continue
        x = [r["weight_bytes"] / 2**20 for r in pts]
        y = [r["agreement"] for r in pts]
        err = [[r["agreement"] - r["agreement_ci_low"] for r in pts],
               [r["agreement_ci_high"] - r["agreement"] for r in pts]]
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor="0.7", elinewidth=0.8, zorder=1)
        ax.scatter(x, y, c=[r["decode_tokens_per_second"] for r in pts], cmap=cmap, norm=norm,
                   marker=marker, s=140 if marker == "*" else 50, edgecolors="k", linewidths=0.4,
                   label=source, zorder=2)
    on = [rows[i] for i in front]
    ax.step([r["weight_bytes"] / 2**20 for r in on], [r["agreement"] for r in on], where="post",
            color="C3", lw=1.2, label="Pareto front", zorder=0)
    for i, r in enumerate(rows):
        if i in front or r["source"] == "llama.cpp":
            ax.annotate(r["name"].replace("selectinfer ", ""), (r["weight_bytes"] / 2**20, r["agreement"]),
                        textcoords="offset points", xytext=(4, -9), fontsize=6.5)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax,
                 label=f"decode tokens/s ({rows[0].get('threads', 1)} thread(s))")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("resident weights (MiB, log scale)")
    ax.set_ylabel("top-token agreement with the dense float model")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def tier_plot(rows: list[dict], front: list[int], path: str | Path, title: str = "") -> Path:
    """The 4-bit records' rows with their int8 tiers against llama.cpp's quants, where they meet:
    agreement against resident MiB (linear), one line per records format through its int8 tiers
    (the profile's order), the random-ranking ablation as crosses, the Pareto front; every point
    labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = lambda r: r["weight_bytes"] / 2**20  # noqa: E731
    ours = [r for r in rows if r.get("source") == "selectinfer" and r.get("load_ratio") == 1.0
            and r.get("compute_ratio") == 1.0 and r.get("compute_mode", "prompt") == "prompt"
            and r.get("weights", "").startswith("q4")]
    llama = [r for r in rows if r.get("source") == "llama.cpp"]
    shown = ours + llama
    lo = min((mib(r) for r in ours), default=0) * 0.8
    hi = max((mib(r) for r in ours), default=1) * 1.15
    shown = [r for r in shown if lo <= mib(r) <= hi]
    fig, ax = plt.subplots(figsize=(9, 6))
    on = [rows[i] for i in front if lo <= mib(rows[i]) <= hi]
    ax.step([mib(r) for r in on], [r["agreement"] for r in on], where="post", color="C3", lw=1.0,
            label="Pareto front (all rows)", zorder=0)
    for k, w in enumerate(sorted({r["weights"] for r in ours})):
        line = sorted((r for r in ours if r["weights"] == w and r.get("ranking", "profile") == "profile"),
                      key=mib)
        ax.plot([mib(r) for r in line], [r["agreement"] for r in line], "o-", color=f"C{k}",
                label=f"ours {w}: int8 tier 0 .. r (profile's order)", zorder=2)
        rnd = [r for r in ours if r["weights"] == w and r.get("ranking") == "random"]
        if rnd:
            ax.plot([mib(r) for r in rnd], [r["agreement"] for r in rnd], "x", color=f"C{k}",
                    ms=9, mew=2, label=f"ours {w}: random order (ablation)", zorder=2)
    lr = [r for r in llama if lo <= mib(r) <= hi]
    ax.plot([mib(r) for r in lr], [r["agreement"] for r in lr], "s", color="0.3",
            label="llama.cpp (same weights)", zorder=2)
    for r in shown:
        ax.errorbar([mib(r)], [r["agreement"]], yerr=[[r["agreement"] - r["agreement_ci_low"]],
                                                     [r["agreement_ci_high"] - r["agreement"]]],
                    fmt="none", ecolor="0.75", elinewidth=0.7, zorder=1)
        ax.annotate(r["name"].replace("selectinfer ", "").replace("llama.cpp ", ""),
                    (mib(r), r["agreement"]), textcoords="offset points", xytext=(4, -9),
                    fontsize=6.5)
    ax.set_xlabel("resident weights (MiB)")
    ax.set_ylabel("top-token agreement with the dense float model")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def compute_mode_plot(rows: list[dict], path: str | Path, weights: str = "int8", title: str = "") -> Path:
    """Frontier rows of one records format: agreement with dense against the MLP rows read per
    decode token (a share of all neurons: phi for the prompt mode, (gamma + candidates +
    computed) / 3 for the per-token mode), one line per gamma and mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    ours = [r for r in rows if r.get("source") == "selectinfer" and r.get("weights") == weights]
    for gamma in sorted({r["load_ratio"] for r in ours}, reverse=True):
        full = [r for r in ours if r["load_ratio"] == gamma and r["compute_ratio"] >= gamma]
        for mode, style in (("prompt", "o--"), ("token", "s-")):
            pts = [r for r in ours if r["load_ratio"] == gamma
                   and r.get("compute_mode", "prompt") == mode and r["compute_ratio"] < gamma]
            if not pts:
                continue
            pts = sorted(full + pts, key=lambda r: r.get("read_share", r["compute_ratio"]))
            x = [r.get("read_share", r["compute_ratio"]) for r in pts]
            ax.plot(x, [r["agreement"] for r in pts], style, label=f"gamma {gamma:g}, {mode} mode")
            for r, xi in zip(pts, x):
                ax.annotate(f"{r['compute_ratio']:g}", (xi, r["agreement"]), textcoords="offset points",
                            xytext=(4, -10), fontsize=7)
    ax.set_xlabel("MLP neuron rows read per decode token (share of all; labels: phi)")
    ax.set_ylabel("top-token agreement with the dense model")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
