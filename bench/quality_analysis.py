"""The quality study's analysis: pure functions of the raw records (tested on synthetic data).

`analyse(results)` -> per model the final ppl, B-F multipliers, time to target, speed vs
recompute and memory; the M sweep; SGD vs AdamW; the targets. bench/quality.py is the entry
point, bench/quality_markdown.py and bench/quality_figures.py render what this returns.
"""

from __future__ import annotations

import math
import statistics

from bench.quality_arms import TARGET_CLOSE

# ---------------------------------------------------------------------------------------------
# Analysis (pure functions of the raw records; tested on synthetic data)


def first_reach(curve: list[dict], target: float) -> dict | None:
    """The first eval point whose ppl is <= target, or None."""
    for p in curve:
        if p["ppl"] <= target:
            return p
    return None


def at_step(curve: list[dict], step: int) -> dict | None:
    """The eval point at exactly `step` (or the last one before it)."""
    best = None
    for p in curve:
        if p["step"] <= step:
            best = p
    return best


def mean_std(values: list[float]) -> tuple[float, float, int]:
    v = [x for x in values if x is not None and not math.isnan(x)]
    if not v:
        return float("nan"), float("nan"), 0
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0), len(v)


def _wall_at(arm: dict, point: dict | None, key: str = "wall_s") -> float | None:
    return None if point is None else point.get(key)


def _round_end(arm: dict, rounds: int) -> dict | None:
    """The last visit of round `rounds - 1` (end of `rounds` rounds) of a bcd arm."""
    ends = [v for v in arm["visits"] if v["round"] == rounds - 1]
    return ends[-1] if ends else None


def analyse(results: dict) -> dict:
    """Per model: final ppl, B-F multipliers, time to target, speed vs recompute, memory;
    the M sweep and SGD vs AdamW; the four targets."""
    arms = results["arms"]
    by_id = {a["id"]: a for a in arms}
    scale = results["scale"]
    M = scale["M"]
    out: dict = {"models": {}, "sweep": [], "sgd": {}, "targets": {}}

    def full_of(model: str, seed: int) -> dict | None:
        return by_id.get(f"{model}-full-adamw-M{M}-s{seed}")

    def vs_full(a: dict, max_step: int | None = None) -> dict:
        """Multiplier / time-to-target of arm `a` against the full arm of its seed (only the
        part of a's curve up to max_step, when given)."""
        f = full_of(a["model"], a["seed"])
        if max_step is not None:
            a = {**a, "curve": [p for p in a["curve"] if p["step"] <= max_step]}
        if f is None or not f["curve"] or not a["curve"]:
            return {}
        target = f["curve"][-1]["ppl"]
        full_steps, full_wall = f["curve"][-1]["step"], f["wall_s"]
        full_robust = f["robust_s"]
        r = {"target_ppl": target, "full_steps": full_steps, "full_wall_s": full_wall}
        hit = first_reach(a["curve"], target)
        close = first_reach(a["curve"], target * TARGET_CLOSE)
        same = at_step(a["curve"], full_steps)
        r["ppl_at_full_steps"] = same["ppl"] if same else None
        r["ppl_ratio_at_full_steps"] = same["ppl"] / target if same else None
        r["best_ppl"] = min(p["ppl"] for p in a["curve"])
        r["steps_max"] = a["curve"][-1]["step"]
        r["multiplier"] = hit["step"] / full_steps if hit else None
        r["multiplier_censored"] = hit is None
        r["multiplier_bound"] = a["curve"][-1]["step"] / full_steps
        r["multiplier_close"] = close["step"] / full_steps if close else None
        r["time_to_target_s"] = _wall_at(a, hit)
        r["time_to_close_s"] = _wall_at(a, close)
        r["time_ratio_target"] = hit["wall_s"] / full_wall if hit else None
        r["time_ratio_close"] = close["wall_s"] / full_wall if close else None
        r["robust_ratio_close"] = close["robust_s"] / full_robust if close else None
        return r

    for a in arms:
        if a["mode"] != "full":
            a["vs_full"] = vs_full(a)

    probes = results.get("probes", [])

    def probe(model, mode, opt, m, k):
        if mode == "full":
            want = (model, "full", "adamw", None, 0)
        elif k == 0:
            want = (model, "bcd", opt, m, 0)  # block 0: probed once for both bcd modes
        else:
            want = (model, mode, opt, m, k)
        for p in probes:
            if "error" in p:
                continue
            got = (
                p["model"],
                p["mode"],
                p["optimizer"],
                None if mode == "full" else p["M"],
                p["block"],
            )
            if got == want:
                return p
        return None

    def mem(model, mode, opt, m, what="rss_growth_mb"):
        if mode == "full":
            p = probe(model, "full", opt, 0, 0)
            return {"max": p[what] if p else None, "per_block": [p[what]] if p else []}
        per = [probe(model, mode, opt, m, k) for k in range(m)]
        vals = [p[what] if p else None for p in per]
        ok = [v for v in vals if v is not None]
        later = [v for v in vals[1:] if v is not None]
        return {
            "max": max(ok) if ok else None,
            "per_block": vals,
            "later_max": max(later) if later else None,
        }

    for model in scale["models"]:
        rows = {}
        for mode in ("full", "bcd", "bcd-recompute"):
            sel = [
                a
                for a in arms
                if a["model"] == model
                and a["mode"] == mode
                and a["group"] == "main"
                and a["optimizer"] == "adamw"
                and a["M"] == M
            ]
            if not sel:
                continue
            same_steps_whole = []
            for a in sel:
                f = [
                    x
                    for x in a["final"]
                    if x["step"] == scale["full_rounds"] * M * a["steps_per_visit"]
                ]
                same_steps_whole.append(f[0]["ppl"] if f else None)
            row = {
                "n": len(sel),
                "steps": sel[0]["total_steps"],
                "final_ppl": mean_std([a["final"][-1]["ppl"] for a in sel]),
                "ppl_at_full_steps_whole": mean_std(same_steps_whole),
                "wall_s": mean_std([a["wall_s"] for a in sel]),
                "robust_s": mean_std([a["robust_s"] for a in sel]),
                "cache_s": mean_std([a["cache_s"] for a in sel]),
                "mem_rss": mem(model, mode, "adamw", M),
                "mem_state": mem(model, mode, "adamw", M, "state_mb"),
            }
            if mode != "full":
                vf = [a["vs_full"] for a in sel]
                row["multiplier"] = mean_std([v.get("multiplier") for v in vf])
                row["multiplier_worst"] = max(
                    (v["multiplier"] if v.get("multiplier") is not None else math.inf) for v in vf
                )
                row["multiplier_censored"] = sum(1 for v in vf if v.get("multiplier_censored"))
                row["multiplier_bound"] = vf[0].get("multiplier_bound")
                row["multiplier_close"] = mean_std([v.get("multiplier_close") for v in vf])
                row["ppl_ratio_at_full_steps"] = mean_std(
                    [v.get("ppl_ratio_at_full_steps") for v in vf]
                )
                row["time_to_target_s"] = mean_std([v.get("time_to_target_s") for v in vf])
                row["time_to_close_s"] = mean_std([v.get("time_to_close_s") for v in vf])
                row["time_ratio_target"] = mean_std([v.get("time_ratio_target") for v in vf])
                row["time_ratio_close"] = mean_std([v.get("time_ratio_close") for v in vf])
                row["robust_ratio_close"] = mean_std([v.get("robust_ratio_close") for v in vf])
                # per-block median step time (later blocks are where the cache acts)
                row["median_step_s"] = [
                    statistics.median(
                        [v["median_step_s"] for a in sel for v in a["visits"] if v["block"] == k]
                    )
                    for k in range(M)
                ]
            else:
                row["median_step_s"] = [
                    statistics.median([v["median_step_s"] for a in sel for v in a["visits"]])
                ]
            rows[mode] = row
        # cache vs recompute over the same steps (recompute_rounds rounds)
        speed = []
        speed_robust = []
        ppl_gap = []
        for seed in scale["seeds"]:
            c = by_id.get(f"{model}-bcd-adamw-M{M}-s{seed}")
            r = by_id.get(f"{model}-bcd-recompute-adamw-M{M}-s{seed}")
            if not c or not r:
                continue
            same = scale["recompute_rounds"] * M * r["steps_per_visit"]
            pc, pr = _final_at(c, same), _final_at(r, same)
            if pc and pr:
                ppl_gap.append(pc / pr)
            end = _round_end(c, scale["recompute_rounds"])
            if end and r["visits"]:
                speed.append(r["visits"][-1]["end_wall_s"] / end["end_wall_s"])
                speed_robust.append(r["visits"][-1]["end_robust_s"] / end["end_robust_s"])
        extra = {
            "recompute_over_cache_time": mean_std(speed),
            "recompute_over_cache_robust": mean_std(speed_robust),
            "cache_over_recompute_ppl": mean_std(ppl_gap),
        }
        if "bcd" in rows and "bcd-recompute" in rows:
            extra["later_block_step_speedup"] = [
                r / c if c else None
                for r, c in zip(
                    rows["bcd-recompute"]["median_step_s"][1:],
                    rows["bcd"]["median_step_s"][1:],
                    strict=True,
                )
            ]
        if "full" in rows:
            fm = rows["full"]["mem_rss"]["max"]
            fs = rows["full"]["mem_state"]["max"]
            for mode in ("bcd", "bcd-recompute"):
                if mode in rows and fm:
                    mr, ms = rows[mode]["mem_rss"], rows[mode]["mem_state"]
                    rows[mode]["mem_ratio_max"] = mr["max"] / fm if mr["max"] else None
                    rows[mode]["mem_ratio_later"] = (
                        mr["later_max"] / fm if mr.get("later_max") else None
                    )
                    rows[mode]["state_ratio_max"] = ms["max"] / fs if ms["max"] and fs else None
                    rows[mode]["state_ratio_later"] = (
                        ms["later_max"] / fs if ms.get("later_max") and fs else None
                    )
        out["models"][model] = {"arms": rows, **extra}
        b = rows.get("bcd", {})
        out["targets"][model] = {
            "ppl_within_5pct": _target(b.get("ppl_ratio_at_full_steps"), TARGET_CLOSE),
            "ppl_within_5pct_any": _target(
                b.get("multiplier_close"), b.get("multiplier_bound") or 0
            ),
            "time_to_close_le_full": _target(b.get("time_ratio_close"), 1.0),
            "faster_than_recompute_1p5x": _target(extra["recompute_over_cache_time"], 1.5, ge=True),
            "peak_mem_le_half_full": _target_val(b.get("mem_ratio_max"), 0.5),
            "later_block_mem_le_half_full": _target_val(b.get("mem_ratio_later"), 0.5),
        }

    # M sweep
    model0 = scale["models"][0]
    for m in scale["sweep_M"]:
        sel = [
            a
            for a in arms
            if a["model"] == model0
            and a["mode"] == "bcd"
            and a["optimizer"] == "adamw"
            and a["M"] == m
            and a["seed"] in scale["sweep_seeds"]
        ]
        if not sel:
            continue
        budget = scale.get("sweep_rounds", scale["bcd_rounds"]) * M * scale["steps_per_visit"]
        vf = [vs_full(a, budget) for a in sel]  # every M on the sweep's step budget
        out["sweep"].append(
            {
                "M": m,
                "n": len(sel),
                "steps_per_visit": sel[0]["steps_per_visit"],
                "multiplier": mean_std([v.get("multiplier") for v in vf]),
                "multiplier_close": mean_std([v.get("multiplier_close") for v in vf]),
                "censored": sum(1 for v in vf if v.get("multiplier_censored")),
                "bound": vf[0].get("multiplier_bound"),
                "ppl_at_full_steps": mean_std([v.get("ppl_at_full_steps") for v in vf]),
                "final_ppl": mean_std(
                    [_final_at(a, budget) for a in sel]
                ),  # whole val at the end of the sweep's budget
                "wall_s": mean_std([_wall_end(a, budget) for a in sel]),
                "cache_s": mean_std(
                    [
                        sum(
                            c["seconds"]
                            for c in a["cache_events"]
                            if c["round"] < budget // (M * scale["steps_per_visit"])
                        )
                        for a in sel
                    ]
                ),
                "mem_rss": mem(model0, "bcd", "adamw", m),
                "mem_state": mem(model0, "bcd", "adamw", m, "state_mb"),
            }
        )
    # SGD vs AdamW inside BCD
    for opt in ("adamw", "sgd"):
        sel = [
            a
            for a in arms
            if a["model"] == model0
            and a["mode"] == "bcd"
            and a["optimizer"] == opt
            and a["M"] == M
            and a["seed"] in scale["sgd_seeds"]
        ]
        if not sel:
            continue
        vf = [a["vs_full"] for a in sel]
        out["sgd"][opt] = {
            "n": len(sel),
            "lr": sel[0]["lr"],
            "ppl_at_full_steps": mean_std([v.get("ppl_at_full_steps") for v in vf]),
            "final_ppl": mean_std([a["final"][-1]["ppl"] for a in sel]),
            "multiplier": mean_std([v.get("multiplier") for v in vf]),
            "censored": sum(1 for v in vf if v.get("multiplier_censored")),
            "bound": vf[0].get("multiplier_bound"),
            "mem_rss": mem(model0, "bcd", opt, M),
            "mem_state": mem(model0, "bcd", opt, M, "state_mb"),
        }
    return out


def _final_at(arm: dict, step: int) -> float | None:
    """Whole-val ppl of the arm's evaluation at `step` (None if there was none)."""
    hits = [f["ppl"] for f in arm["final"] if f.get("step") == step]
    return hits[0] if hits else None


def _wall_end(arm: dict, step: int) -> float | None:
    """Training wall-clock at the end of the visit that ends at `step`."""
    hits = [v["end_wall_s"] for v in arm["visits"] if v.get("end_step") == step]
    return hits[0] if hits else None


def _target(ms, limit: float, ge: bool = False) -> dict:
    v = ms[0] if ms else None
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return {"value": None, "limit": limit, "met": False}
    return {"value": v, "limit": limit, "met": v >= limit if ge else v <= limit}


def _target_val(v, limit: float) -> dict:
    if v is None:
        return {"value": None, "limit": limit, "met": False}
    return {"value": v, "limit": limit, "met": v <= limit}
