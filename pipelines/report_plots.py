"""The PNG plots of `preinfer report` (pipelines/report.py), drawn from `collect`'s data.

progress.png (val perplexity against tokens trained and against wall-clock, by block and
round), loss.png (train loss per step), val_ppl.png (val perplexity per visit, eval lines),
cache_timeline.png (cache built / refreshed / reused and training visits over time),
throughput.png (trainer tokens/s per step). Each `plot_*(data, path)` takes the dict of
pipelines/report_data.collect and writes one file.
"""

from __future__ import annotations

import math
from pathlib import Path

from storage import atomic

FIGSIZE = (6.0, 3.5)
DPI = 100
ACTION_COLOURS = {"built": "tab:red", "refreshed": "tab:orange", "reused": "tab:green"}


# ---- plots (matplotlib Figure objects: no pyplot, no global backend state) ----


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig, path: Path) -> None:
    """The figure as a PNG at `path`, by temp file + rename like every other file (a full disk
    leaves the old plot or none, never a cut one); a write error names `path`."""
    fig.tight_layout()
    try:
        atomic.write_file(path, lambda f: fig.savefig(f, format="png", dpi=DPI))
    except OSError as e:
        if e.filename is None:  # a full disk on write: the file it was
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def _colour(block: int, round_: int, rounds: int):
    """Colour per block (tab10); earlier rounds lighter, the last round full strength."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgb

    base = to_rgb(colormaps["tab10"](block % 10))
    if rounds <= 1:
        return base
    f = 0.55 * (rounds - 1 - round_) / (rounds - 1)  # 0 for the last round
    return tuple(c + (1 - c) * f for c in base)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_progress(data: dict, path: Path) -> None:
    """Two panels: val ppl against tokens trained, and against wall-clock since the run's first
    record (cache builds included); a line through every evaluation in run order, coloured
    points per block (lighter = earlier round), initial / final `preinfer eval` as dashed lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIGSIZE[0] * 1.8, FIGSIZE[1]), dpi=DPI)
    axes = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    pts = [p for p in data["progress"] if isinstance(p["ppl"], int | float)
           and not math.isnan(p["ppl"])]  # fmt: skip
    rounds = max((p["round"] for p in pts), default=0) + 1
    vals = [e for e in data["evals"] if e["split"] == "val" and isinstance(e["ppl"], int | float)]
    for ax, x, label in (
        (axes[0], "tokens", "tokens trained"),
        (axes[1], "time", "wall-clock (s)"),
    ):
        xy = [(p[x], p["ppl"], p) for p in pts if isinstance(p[x], int | float)]
        if not xy:
            _empty(ax, "no evaluations recorded")
            continue
        ax.plot([a for a, _, _ in xy], [b for _, b, _ in xy], color="0.6", lw=1, zorder=1)
        seen = set()
        for a, b, p in xy:
            lab = f"block {p['block']}" if p["block"] not in seen else None
            seen.add(p["block"])
            ax.scatter([a], [b], color=[_colour(p["block"], p["round"], rounds)], s=18, zorder=2,
                       label=lab)  # fmt: skip
        for i, e in enumerate(vals):
            if i in (0, len(vals) - 1):
                ax.axhline(e["ppl"], ls="--", lw=0.8, color="k" if i else "0.5")
        ys = [b for _, b, _ in xy] + [e["ppl"] for e in vals]
        if max(ys) > 20 * min(ys):
            ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("val perplexity")
        ax.legend(fontsize=6)
    fig.suptitle(f"{data['name']}: val perplexity by block and round (lighter = earlier round; "
                 "dashed: initial / final eval)", fontsize=9)  # fmt: skip
    _save(fig, path)


def plot_loss(data: dict, path: Path) -> None:
    fig, ax = _figure()
    rounds = max((v["round"] for v in data["visits"]), default=0) + 1
    any_val = False
    for v in data["visits"]:
        recs = [s for s in v["step_records"] if isinstance(s["loss"], int | float)]
        if not recs:
            continue
        col = _colour(v["block"], v["round"], rounds)
        ax.plot([s["global_step"] for s in recs], [s["loss"] for s in recs], color=col, lw=1.2,
                label=f"r{v['round']} b{v['block']}")  # fmt: skip
        ax.axvline(v["first_global_step"] + 0.5, color="0.85", lw=0.6, zorder=0)
        vals = [s for s in v["step_records"] if isinstance(s["val_loss"], int | float)]
        if vals:
            any_val = True
            ax.plot([s["global_step"] for s in vals], [s["val_loss"] for s in vals], "x",
                    color=col, ms=5, mew=1.5)  # fmt: skip
    if data["num_step_records"]:
        ax.set_xlabel("optimizer step (all visits in order)")
        ax.set_ylabel("train loss" + ("  (x: val loss)" if any_val else ""))
        ax.legend(fontsize=6, ncol=max(1, min(6, len(data["visits"]) // 4 + 1)), loc="upper right")
    else:
        _empty(ax, "no step records")
    ax.set_title(f"{data['name']}: train loss per step, by block and round", fontsize=9)
    _save(fig, path)


def plot_val_ppl(data: dict, path: Path) -> None:
    fig, ax = _figure()
    done = [v for v in data["visits"] if v["finished"] and not math.isnan(v["val_ppl"])]
    rounds = max((v["round"] for v in data["visits"]), default=0) + 1
    if done:
        xs = list(range(len(done)))
        ax.plot(xs, [v["val_ppl"] for v in done], color="0.6", lw=1, zorder=1)
        for x, v in zip(xs, done, strict=True):
            ax.scatter([x], [v["val_ppl"]], color=[_colour(v["block"], v["round"], rounds)],
                       zorder=2, s=30)  # fmt: skip
        ax.set_xticks(xs, [v["key"].replace("-", "\n") for v in done], fontsize=7)
        ax.set_xlabel("block visit")
    vals = [e for e in data["evals"] if e["split"] == "val" and isinstance(e["ppl"], int | float)]
    for i, e in enumerate(vals):
        first, last = i == 0 and len(vals) > 1, i == len(vals) - 1
        ax.axhline(e["ppl"], ls="--", lw=0.9, color="k" if last else "0.5",
                   label=f"eval {'final' if last else 'initial' if first else i}: {e['ppl']:.2f}")  # fmt: skip
    if done or vals:
        ax.set_ylabel("val perplexity")
        if max([v["val_ppl"] for v in done] + [e["ppl"] for e in vals]) > 20 * min(
            [v["val_ppl"] for v in done] + [e["ppl"] for e in vals]
        ):
            ax.set_yscale("log")
        if vals:
            ax.legend(fontsize=7)
    else:
        _empty(ax, "no finished visits or evals")
    ax.set_title("val perplexity after each block visit", fontsize=9)
    _save(fig, path)


def plot_cache_timeline(data: dict, path: Path) -> None:
    from matplotlib.patches import Patch

    fig, ax = _figure()
    caches, visits = data["caches"], [v for v in data["visits"] if v["start"] is not None]
    boundaries = sorted({c["boundary"] for c in caches if c["boundary"] is not None})
    blocks = sorted({v["block"] for v in visits})
    rows = [f"cache {b}" for b in boundaries] + [f"train {b}" for b in blocks]
    rows += ["eval"] if data["evals"] else []
    y = {r: i for i, r in enumerate(rows)}
    span = data["timings"]["wall_seconds"] or 1.0
    for c in caches:
        if c["boundary"] is None:
            continue
        yy, col = y[f"cache {c['boundary']}"], ACTION_COLOURS.get(c["action"], "tab:gray")
        w = max(c["end"] - c["start"], 0.0)
        if w < span * 0.004:  # too short for a bar (a reuse): a marker
            ax.plot([c["end"]], [yy], "D", color=col, ms=6)
        else:
            ax.barh(yy, w, left=c["start"], height=0.6, color=col, edgecolor="k", lw=0.4)
    for v in visits:
        # a visit far shorter than the run still shows (min width: 0.6% of the span)
        ax.barh(y[f"train {v['block']}"], max(v["end"] - v["start"], span * 0.006), left=v["start"],
                height=0.6, color=_colour(v["block"], 0, 1), alpha=0.6, edgecolor="k", lw=0.4)  # fmt: skip
    for e in data["evals"]:
        secs = e["seconds"] if isinstance(e["seconds"], int | float) else 0.0
        ax.barh(y["eval"], max(secs, span * 0.006), left=e["time"] - secs, height=0.6,
                color="0.6", edgecolor="k", lw=0.4)  # fmt: skip
    if rows:
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_xlim(left=0)
        ax.set_xlabel("seconds since the run's first record")
        handles = [Patch(color=ACTION_COLOURS[a], label=a) for a in ACTION_COLOURS
                   if any(c["action"] == a for c in caches)]  # fmt: skip
        handles += [Patch(color="0.6", label="eval")] if data["evals"] else []
        if handles:
            ax.legend(handles=handles, fontsize=7, loc="lower right")
    else:
        _empty(ax, "no cache events or visits")
    ax.set_title("cache build / refresh / reuse and training, over time", fontsize=9)
    _save(fig, path)


def plot_throughput(data: dict, path: Path) -> None:
    fig, ax = _figure()
    rounds = max((v["round"] for v in data["visits"]), default=0) + 1
    drawn = False
    for v in data["visits"]:
        recs = [s for s in v["step_records"] if isinstance(s["tokens_per_s"], int | float)]
        if not recs:
            continue
        drawn = True
        ax.plot([s["global_step"] for s in recs], [s["tokens_per_s"] for s in recs], lw=1.2,
                color=_colour(v["block"], v["round"], rounds), label=f"r{v['round']} b{v['block']}")  # fmt: skip
    if drawn:
        ax.set_xlabel("optimizer step (all visits in order)")
        ax.set_ylabel("tokens/s (running mean in visit)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6, ncol=max(1, min(6, len(data["visits"]) // 4 + 1)), loc="lower right")
    else:
        _empty(ax, "no step records")
    ax.set_title("trainer throughput", fontsize=9)
    _save(fig, path)
