"""The quality study's figures (docs/quality_*.png; bench/quality.py is the entry point).

val ppl vs tokens / wall-clock per arm (`plot_curves`), the block-count sweep's memory and
multiplier (`plot_sweep`), SGD vs AdamW inside BCD (`plot_sgd`); matplotlib with the Agg backend.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Report: figures

ARM_STYLE = {
    "full": ("full AdamW", "C0"),
    "bcd": ("BCD cache M=3", "C1"),
    "bcd-recompute": ("BCD recompute M=3", "C2"),
}


def _mean_curve(sel: list[dict], xkey: str) -> tuple[list, list, list, list]:
    """Mean x, mean / min / max ppl over seeds, aligned by eval index."""
    n = min(len(a["curve"]) for a in sel)
    xs, ys, lo, hi = [], [], [], []
    for i in range(n):
        pts = [a["curve"][i] for a in sel]
        xs.append(statistics.fmean(p[xkey] for p in pts))
        v = [p["ppl"] for p in pts]
        ys.append(statistics.fmean(v))
        lo.append(min(v))
        hi.append(max(v))
    return xs, ys, lo, hi


def _plain_log_axis(ax) -> None:
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.yaxis.get_minor_formatter().set_scientific(False)
    ax.yaxis.get_major_formatter().set_scientific(False)
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=()))


def plot_curves(results: dict, docs: Path, xkey: str, fname: str, xlabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = results["scale"]
    models = scale["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6, 3.5), dpi=100, squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        init = [
            v["ppl"] for k, v in results["prep"]["initial"].items() if k.startswith(model + "-")
        ]
        for mode, (label, color) in ARM_STYLE.items():
            sel = [
                a
                for a in results["arms"]
                if a["model"] == model
                and a["mode"] == mode
                and a["group"] == "main"
                and a["optimizer"] == "adamw"
                and a["M"] == scale["M"]
                and a["curve"]
            ]
            if not sel:
                continue
            xs, ys, lo, hi = _mean_curve(sel, xkey)
            if init:
                xs, ys = [0.0, *xs], [statistics.fmean(init), *ys]
                lo, hi = [min(init), *lo], [max(init), *hi]
            if xkey == "tokens":
                xs = [x / 1e6 for x in xs]
            ax.plot(xs, ys, color=color, label=label, lw=1.2)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
            if mode == "full":
                ax.axhline(ys[-1], color=color, ls=":", lw=0.8)
        ax.set_yscale("log")
        _plain_log_axis(ax)
        ax.set_title(f"{model} ({len(scale['seeds'])} seeds)", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, which="both", lw=0.4)
        lows = [
            p["ppl"]
            for a in results["arms"]
            if a["model"] == model and a["group"] == "main"
            for p in a["curve"]
        ]
        if lows:
            ax.set_ylim(min(lows) * 0.9, min(max(lows), min(lows) * 6))
    axes[0][0].set_ylabel("val perplexity", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = docs / fname
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(results: dict, summary: dict, docs: Path) -> Path | None:
    """Left: trainer memory per M as a fraction of full training's (RSS growth and exact state,
    max over all blocks and over blocks >= 1). Right: BCD steps to full's final ppl / full's
    steps per M (hollow triangles at the budget: not reached within it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["sweep"]
    if not rows:
        return None
    model0 = results["scale"]["models"][0]
    full = summary["models"].get(model0, {}).get("arms", {}).get("full", {})
    f_rss = full.get("mem_rss", {}).get("max")
    f_st = full.get("mem_state", {}).get("max")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(6, 3.5), dpi=100)
    Ms = [r["M"] for r in rows]

    def frac(vals, ref):
        return [v / ref if (v is not None and ref) else float("nan") for v in vals]

    series = (
        ("RSS growth, max block", [r["mem_rss"]["max"] for r in rows], f_rss, "C1", "o-"),
        (
            "RSS growth, blocks ≥ 1",
            [r["mem_rss"].get("later_max") for r in rows],
            f_rss,
            "C3",
            "o--",
        ),
        ("params+grads+opt, max block", [r["mem_state"]["max"] for r in rows], f_st, "C7", "s-"),
        (
            "params+grads+opt, blocks ≥ 1",
            [r["mem_state"].get("later_max") for r in rows],
            f_st,
            "C2",
            "s--",
        ),
    )
    for label, vals, ref, color, style in series:
        a1.plot(Ms, frac(vals, ref), style, color=color, label=label, ms=4, lw=1)
    a1.axhline(1.0, color="C0", lw=0.8, ls=":")
    a1.axhline(0.5, color="grey", lw=0.6, ls=":")
    a1.set_ylim(0, 1.3)
    a1.set_xticks(Ms)
    a1.set_xlabel("blocks M", fontsize=8)
    a1.set_ylabel("trainer memory / full AdamW", fontsize=8)
    a1.legend(fontsize=6, loc="lower left")
    a1.tick_params(labelsize=7)
    bound = max((r["bound"] or 0) for r in rows)
    for key, color, marker, label in (
        ("multiplier", "C1", "o", "to full's final ppl"),
        ("multiplier_close", "C2", "s", "to 1.05 x full's final"),
    ):
        ys = [r[key][0] if r[key][2] else float("nan") for r in rows]
        a2.plot(Ms, ys, marker + "-", color=color, label=label, ms=4, lw=1)
        cens = [m for m, y in zip(Ms, ys, strict=True) if math.isnan(y)]
        if cens:
            a2.plot(cens, [bound] * len(cens), "^", mfc="none", color=color, ms=7)
    a2.axhline(1.39, color="grey", ls=":", lw=0.8)
    a2.axhline(2.89, color="grey", ls=":", lw=0.8)
    a2.text(Ms[0], 1.42, "paper avg 1.39", fontsize=6, color="grey")
    a2.text(Ms[0], 2.92, "paper worst 2.89", fontsize=6, color="grey")
    a2.set_xticks(Ms)
    a2.set_xlabel("blocks M", fontsize=8)
    a2.set_ylabel("BCD steps / full steps (^ = not reached)", fontsize=8)
    a2.set_ylim(0.8, max(3.2, bound + 0.3))
    a2.legend(fontsize=6, loc="lower right")
    a2.tick_params(labelsize=7)
    fig.suptitle(f"{model0}: block count M, memory vs extra steps", fontsize=9)
    fig.tight_layout()
    path = docs / "quality_m_sweep.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sgd(results: dict, docs: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = results["scale"]
    model0 = scale["models"][0]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    any_ = False
    for opt, mode, color, label in (
        ("adamw", "full", "C0", "full AdamW"),
        ("adamw", "bcd", "C1", "BCD cache, AdamW"),
        ("sgd", "bcd", "C4", "BCD cache, SGD"),
    ):
        sel = [
            a
            for a in results["arms"]
            if a["model"] == model0
            and a["mode"] == mode
            and a["optimizer"] == opt
            and a["M"] == scale["M"]
            and a["seed"] in scale["sgd_seeds"]
            and a["curve"]
        ]
        if not sel:
            continue
        any_ = True
        xs, ys, lo, hi = _mean_curve(sel, "step")
        ax.plot(xs, ys, color=color, label=f"{label} (lr {sel[0]['lr']:g})", lw=1.2)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
    if not any_:
        plt.close(fig)
        return None
    ax.set_yscale("log")
    _plain_log_axis(ax)
    ax.set_xlabel("optimizer steps", fontsize=8)
    ax.set_ylabel("val perplexity", fontsize=8)
    ax.set_title(f"{model0}: SGD vs AdamW inside BCD", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both", lw=0.4)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    path = docs / "quality_sgd_adam.png"
    fig.savefig(path)
    plt.close(fig)
    return path
