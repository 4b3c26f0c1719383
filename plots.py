"""
plots.py: the figures of fit.py and study.py.
"""
import os
import re

import numpy as np

from runs import replace_file

TRAIN_SERIES = ("reward", "pass_rate", "trunc", "intr", "drift")
TRUNC_BAND = 0.10
SMOOTH_MAX = 10
PANELS = (
    ("reward, pass@1", (("reward", "reward (batch)"), ("pass_rate", "pass@1 (batch)"))),
    ("fraction of samples", (("trunc", "hard-truncated (trunc)"), ("intr", "interrupted (intr)"))),
    ("kept prompts", (("kept", "kept_prompts / prompts"),)),
    ("held-out pass rate", (("eval_pass_rate", "held-out pass rate (eval)"),)),
    ("drift", (("drift", "mean |log rho|, oldest lag"),)),
)


def moving_average(y, half):
    """Centered, over 2 * half + 1 points."""
    y = np.asarray(y, dtype=float)
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(len(y))
    lo, hi = np.maximum(i - half, 0), np.minimum(i + half + 1, len(y))
    return (c[hi] - c[lo]) / (hi - lo)


def pyplot():
    """matplotlib.pyplot without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw_curves(curves, png, name):
    """PANELS against the step -> png."""
    plt = pyplot()
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(6.5, 8.5), sharex=True)
    half = min(SMOOTH_MAX, max(len(curves[k][0]) for k in TRAIN_SERIES) // 20)
    for ax, (ylabel, series) in zip(axes, PANELS):
        for k, (key, label) in enumerate(series):
            (x, y), col = curves[key], f"C{k}"
            if key == "eval_pass_rate":
                ax.plot(x, y, "o-", ms=3, color=col, label=label)
                continue
            if not half:
                ax.plot(x, y, ".-", ms=5, lw=1.2, color=col, label=label)
                continue
            ax.plot(x, y, ".", ms=3, alpha=0.3, color=col)
            ax.plot(x, moving_average(y, half), color=col, lw=1.2, label=label)
        if any(key == "trunc" for key, _ in series):
            ax.axhline(TRUNC_BAND, ls="--", lw=0.8, color="C3",
                       label=f"{TRUNC_BAND:.0%}: instability band starts")
            ax.set_ylim(0, max(1.5 * TRUNC_BAND,
                               1.1 * max(curves[k][1].max(initial=0) for k, _ in series)))
        if not any(len(curves[key][0]) for key, _ in series):
            ax.text(0.5, 0.5, "not in metrics.jsonl", transform=ax.transAxes, ha="center",
                    va="center", color="gray")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    steps = np.concatenate([x for x, _ in curves.values()])
    if len(steps) and steps.min() == steps.max():
        axes[-1].set_xlim(steps[0] - 1, steps[0] + 1)
    fig.suptitle(f"{name}: training curves", fontsize=10)
    fig.tight_layout()
    savefig(fig, png)
    plt.close(fig)
    return png


def draw_extrapolation(recipes, path, cut, xlabel, ylabel, title):
    """The paper's Figure 2 in form: each recipe's pass rate against compute (points), its fit up
    to `cut` of its compute (solid) and extrapolated to its end (dashed), the cut marked. recipes:
    [{name, C, R, fit_from, curve: compute -> pass rate}] -> {name: (solid x, dashed x)}."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = {}
    for k, r in enumerate(recipes):
        col, C, R = color(plt, k, len(recipes)), np.asarray(r["C"]), np.asarray(r["R"])
        at = cut * C[-1]
        solid, dashed = np.geomspace(r["fit_from"], at, 60), np.geomspace(at, C[-1], 60)
        ax.scatter(C[C > 0], R[C > 0], s=6, color=col, alpha=0.5,
                   label=None if r["curve"] else f"{r['name']} (too few points to fit)")
        if not r["curve"]:
            continue
        ax.plot(solid, r["curve"](solid), "-", lw=1.4, color=col, label=r["name"])
        ax.plot(dashed, r["curve"](dashed), "--", lw=1.4, color=col)
        drawn[r["name"]] = (solid, dashed)
    for at in sorted({cut * np.asarray(r["C"])[-1] for r in recipes}):
        ax.axvline(at, ls=":", lw=0.9, color="gray")
    ax.plot([], [], ":", color="gray", label=f"the cut: {cut:g} of the compute (fitted left of it)")
    ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ticker = plt.matplotlib.ticker  # ticks at 1, 2, 5 of each decade, as numbers: labels apart
    ax.xaxis.set_minor_locator(ticker.LogLocator(subs=(2, 5)))
    for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
        axis(ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    save_figure(fig, ax, path, len(recipes) + 1)
    plt.close(fig)
    return drawn


def color(plt, k, n):
    return f"C{k}" if n <= 10 else plt.get_cmap("tab20")(k % 20)


def save_figure(fig, ax, path, n):
    if ax.get_legend_handles_labels()[0]:
        beside = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0)) if n > 4 else {}
        ax.legend(fontsize=7, **beside)
    savefig(fig, path, bbox_inches="tight")


def savefig(fig, path, **kw):
    """fig.savefig through runs.replace_file."""
    kind = os.path.splitext(path)[1][1:].lower() or "png"
    replace_file(path, lambda f: fig.savefig(f, format=kind, dpi=90, **kw), "wb")


def figure_name(compute, metric):
    """The fit figure's name, by unit and metric."""
    unit = {"compute_s": "device_s", "flops": "flops"}[compute]
    tail = "" if metric == "pass_rate" else "_" + re.sub(r"[^\w.-]+", "_", metric)
    return f"fit_{unit}{tail}.png"
