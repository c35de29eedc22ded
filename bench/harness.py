"""What every benchmark shares, pure (no torch, no pipeline): where results go (written
atomically), the machine's load, a markdown table, arms timed interleaved, and the arithmetic on
curves and seeds (bench/arms.py runs the arms). A curve is a list of points {"steps",
"seconds", "ppl" and/or "loss", ...} in training order.

    spread(values)                    THE summary of per-seed (or repeated) figures: one rule
    first_reach(curve, target, key)   the first point at or below a target
    plateau(curve, patience, ...)     full's best point and whether it stopped improving
    multiplier(reach, full_best)      B-F multiplier and wall-clock ratio
    select_lr(runs, score)            the lr whose median score over seeds is best
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from storage.atomic import write_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def quiet(*_a, **_k) -> None:
    return None


def clean(o):
    """o with every non-finite float as a string (JSON has none), keys as strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [clean(v) for v in o]
    return o


def write_results(path: Path, res: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, json.dumps(clean(res), indent=1, default=str).encode())
    return path


def publish(res: dict, text: str, out: str | None, name: str) -> Path:
    """Print a bench's table; write its results to `out` or bench/results/<name>-<time>.json."""
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = write_results(Path(out) if out else RESULTS / f"{name}-{stamp}.json", res)
    print(f"results: {rel(path)}")
    return path


def without_paths(res: dict, labels: dict[str, str]) -> dict:
    """res with every occurrence of each machine path replaced by its label ({"/tmp/x": "<work>"}),
    so a results file names no directory of the machine that wrote it. Longer paths first."""
    text = json.dumps(clean(res), default=str)
    for path, label in sorted(labels.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(json.dumps(path)[1:-1], label)
    return json.loads(text)


def rel(p) -> str:
    """p relative to the repo root where it is inside it."""
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (what else the machine was doing), None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def headline_table(rows: list[tuple]) -> str:
    """A markdown table: the first row is the header."""
    head, *body = rows
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Seeds and curves


def spread(values: list[float | None]) -> dict:
    """The one summary rule (#42): the median over ALL values, a None (a seed that never
    reached its target) ranked above every value, so the median is None ("not reached") when
    half or more did not reach; min and max likewise (max None when any missed). n of `of`
    reached; the values as given. Repeated timings (no None) get their plain median."""
    got = sorted(v for v in values if v is not None)
    n, of = len(got), len(values)
    ranked = got + [math.inf] * (of - n)

    def fin(x):
        return None if math.isinf(x) else x

    if not of:
        return {"median": None, "min": None, "max": None, "n": 0, "of": 0, "values": []}
    return {"median": fin(statistics.median(ranked)), "min": fin(ranked[0]),
            "max": fin(ranked[-1]), "n": n, "of": of, "values": list(values)}  # fmt: skip


def show(s: dict, fmt: str = "{:.2f}") -> str:
    """A spread as 'median [min, max]' ('median' alone for one value), None as not reached."""

    def f(x):
        return "not reached" if x is None else fmt.format(x)

    return f(s["median"]) if s["of"] <= 1 else f"{f(s['median'])} [{f(s['min'])}, {f(s['max'])}]"


def reached(s: dict) -> str:
    return f"{s['n']} of {s['of']} reached"


def first_reach(curve: list[dict], target: float, key: str = "ppl") -> dict | None:
    """The first point whose `key` is at or below target, else None."""
    return next((p for p in curve if p[key] <= target), None)


def plateau(curve: list[dict], patience: int, min_rel_delta: float = 0.0,
            min_steps: int = 0) -> dict:  # fmt: skip
    """Where val ppl stops improving: after `patience` consecutive points none lower than the
    last improvement by more than min_rel_delta x it, the run has plateaued, but not at a point
    before min_steps (a small LM sits on a unigram plateau early in training).
    Returns {"best": the best point (the lowest ppl seen, even below min_rel_delta steps),
    "plateaued": bool, "stop_index": index of the point where patience ran out, or None}."""
    if patience < 1:
        raise ValueError(f"patience must be >= 1 evaluations, got {patience}")
    if not curve:
        raise ValueError("an empty curve has no plateau: the arm recorded no evaluation")
    ref, best, bad = math.inf, None, 0  # ref: the ppl later points must beat by min_rel_delta
    for i, p in enumerate(curve):
        if best is None or p["ppl"] < best["ppl"]:
            best = p
        if p["ppl"] < ref * (1.0 - min_rel_delta):
            ref, bad = p["ppl"], 0
        else:
            bad += 1
            if bad >= patience and p["steps"] >= min_steps:
                return {"best": best, "plateaued": True, "stop_index": i}
    return {"best": best, "plateaued": False, "stop_index": None}


def multiplier(reach: dict | None, full_best: dict) -> dict:
    """B-F multiplier (steps to reach full's best / full's steps to its best) and wall-clock
    ratio (seconds to reach it / full's seconds to its best); None where it was not reached."""
    if full_best["steps"] <= 0 or full_best["seconds"] <= 0:
        raise ValueError(f"full's best point must have steps and seconds > 0, got {full_best}")
    if reach is None:
        return {"bf_multiplier": None, "time_ratio": None, "reached": False}
    return {"bf_multiplier": reach["steps"] / full_best["steps"],
            "time_ratio": reach["seconds"] / full_best["seconds"], "reached": True}  # fmt: skip


def select_lr(runs: dict[float, list[dict]], score: str, tie: str | None = None) -> dict:
    """Best lr of one arm: runs maps lr -> that lr's per-seed records; the lr with the lowest
    median `score` over seeds (spread's rule: None is not reached) wins, ties broken by the
    lowest median `tie`, then the lowest lr. Returns {"lr", "median": its median score, "edge":
    the winner is the grid's lowest or highest lr (widen the sweep), "by_lr": {lr: median}}."""
    if not runs:
        raise ValueError("no lr was run: nothing to select")

    def med(recs, key):
        m = spread([r[key] for r in recs])["median"] if key else 0.0
        return math.inf if m is None else m

    by_lr = {lr: med(recs, score) for lr, recs in runs.items()}
    lr = min(runs, key=lambda x: (by_lr[x], med(runs[x], tie), x))
    grid = sorted(runs)
    return {"lr": lr, "median": None if math.isinf(by_lr[lr]) else by_lr[lr],
            "edge": len(grid) > 1 and lr in (grid[0], grid[-1]),
            "by_lr": {k: (None if math.isinf(v) else v) for k, v in sorted(by_lr.items())}}  # fmt: skip


def interleaved(arms: dict, repeats: int, warm_up: bool = True) -> dict[str, list]:
    """{name: [what arms[name]() returned, per repeat]}: each arm once untimed first (kernels
    per shape, pools), then `repeats` rounds in A B / B A order, so a drift of the machine's
    speed lands on every arm alike."""
    if warm_up:
        for fn in arms.values():
            fn()
    out: dict[str, list] = {k: [] for k in arms}
    for r in range(repeats):
        for k in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            out[k].append(arms[k]())
    return out


def interleave(items: list, shift: int) -> list:
    """items rotated by `shift` (per seed), so no arm always runs first on a shared machine."""
    s = shift % len(items) if items else 0
    return items[s:] + items[:s]


def add_omp_wait(ap) -> None:
    """The --omp-wait option of a bench whose arms compare thread-parallel work (see
    omp_wait_policy)."""
    ap.add_argument("--omp-wait", default="passive", choices=["passive", "active", "default"],
                    help="OMP_WAIT_POLICY of the bench process (default: libgomp's own)")  # fmt: skip


def omp_wait_policy(policy: str, module: str, argv: list[str]) -> None:
    """Restart `python -m module argv` with OMP_WAIT_POLICY=policy unless it is set already
    ("default": as it is). libgomp reads it once, at start; under its default (spin) one arm's
    threads spin at every barrier while another, with more threads than CPUs, throttles (the
    bare forward beside the build: 2x the build's CPU seconds on a busy machine)."""
    if policy != "default" and os.environ.get("OMP_WAIT_POLICY", "").lower() != policy:
        env = {**os.environ, "OMP_WAIT_POLICY": policy.upper()}
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
