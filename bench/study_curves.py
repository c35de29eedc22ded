"""The study's arithmetic on whole-val curves (pure: no torch, no pipeline; bench/study.py).

A curve is a list of points {"steps", "seconds", "ppl", ...} in training order: cumulative
optimizer steps, the arm's clock (benchmark evaluations excluded) and whole-val perplexity.

    plateau(curve, patience, min_rel_delta)   full's best point and whether it stopped improving
    first_reach(curve, target)                the first point at or below a target ppl
    multiplier(bcd_point, full_best)          B-F multiplier and wall-clock ratio
    select_lr(runs, score)                    the lr whose median score over seeds is best
    summarize(values)                         median and spread of per-seed figures
"""

from __future__ import annotations

import math
import statistics


def improves(ppl: float, best: float, min_rel_delta: float) -> bool:
    """ppl counts as an improvement on best when it is lower by more than min_rel_delta x best."""
    return ppl < best * (1.0 - min_rel_delta)


def plateau(curve: list[dict], patience: int, min_rel_delta: float = 0.0,
            min_steps: int = 0) -> dict:  # fmt: skip
    """Where val ppl stops improving. Walks the curve keeping the best point; after `patience`
    consecutive points that do not improve on it (improves()), the run has plateaued, but not
    at a point before min_steps (a small LM sits on a unigram plateau early in training).
    Returns {"best": the best point (the lowest ppl seen, even below min_rel_delta steps),
    "plateaued": bool, "stop_index": index of the point where patience ran out, or None}."""
    if patience < 1:
        raise ValueError(f"patience must be >= 1 evaluations, got {patience}")
    if not curve:
        raise ValueError("an empty curve has no plateau: the arm recorded no evaluation")
    ref = math.inf  # the ppl that later points must beat by min_rel_delta
    best = None
    bad = 0
    for i, p in enumerate(curve):
        if best is None or p["ppl"] < best["ppl"]:
            best = p
        if improves(p["ppl"], ref, min_rel_delta):
            ref, bad = p["ppl"], 0
        else:
            bad += 1
            if bad >= patience and p["steps"] >= min_steps:
                return {"best": best, "plateaued": True, "stop_index": i}
    return {"best": best, "plateaued": False, "stop_index": None}


def first_reach(curve: list[dict], target: float) -> dict | None:
    """The first point whose ppl is at or below target, else None."""
    for p in curve:
        if p["ppl"] <= target:
            return p
    return None


def multiplier(reach: dict | None, full_best: dict) -> dict:
    """B-F multiplier (steps to reach full's best / full's steps to its best) and wall-clock
    ratio (seconds to reach it / full's seconds to its best); None where it was not reached."""
    if full_best["steps"] <= 0 or full_best["seconds"] <= 0:
        raise ValueError(f"full's best point must have steps and seconds > 0, got {full_best}")
    if reach is None:
        return {"bf_multiplier": None, "time_ratio": None, "reached": False}
    return {
        "bf_multiplier": reach["steps"] / full_best["steps"],
        "time_ratio": reach["seconds"] / full_best["seconds"],
        "reached": True,
    }


def _median_key(values: list[float | None]) -> float:
    """Median with None (not reached) as +inf, so a lr that misses on most seeds loses."""
    return statistics.median([math.inf if v is None else v for v in values])


def select_lr(runs: dict[float, list[dict]], score: str, tie: str | None = None) -> dict:
    """Best lr of one arm: runs maps lr -> that lr's per-seed records; the lr with the lowest
    median `score` over seeds wins (None counts as +inf), ties broken by the lowest median `tie`.
    Returns {"lr", "median": its median score, "edge": the winner is the grid's lowest or
    highest lr (widen the sweep), "by_lr": {lr: median score}}."""
    if not runs:
        raise ValueError("no lr was run: nothing to select")
    by_lr = {lr: _median_key([r[score] for r in recs]) for lr, recs in runs.items()}
    ties = {lr: _median_key([r[tie] for r in recs]) if tie else 0.0 for lr, recs in runs.items()}
    lr = min(runs, key=lambda x: (by_lr[x], ties[x], x))
    grid = sorted(runs)
    return {
        "lr": lr,
        "median": None if math.isinf(by_lr[lr]) else by_lr[lr],
        "edge": len(grid) > 1 and lr in (grid[0], grid[-1]),
        "by_lr": {k: (None if math.isinf(v) else v) for k, v in sorted(by_lr.items())},
    }


def summarize(values: list[float | None]) -> dict:
    """Median, min and max over seeds of the values that exist, and how many exist."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0, "of": len(values)}
    return {
        "median": statistics.median(got),
        "min": min(got),
        "max": max(got),
        "n": len(got),
        "of": len(values),
    }


def cap_steps(full_best: dict, factor: float) -> int:
    """The BCD arms' step budget: factor x full's steps to its best (so B-F <= factor is measurable)."""
    return math.ceil(factor * full_best["steps"])


def interleave(items: list, shift: int) -> list:
    """items rotated by `shift` (per seed), so no arm always runs first on a shared machine."""
    if not items:
        return []
    s = shift % len(items)
    return items[s:] + items[:s]
