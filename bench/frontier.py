"""The memory frontier (#55): the largest LLaMA-layout model each method trains under a memory
budget on this machine, measured, with `preinfer plan`'s predictions beside the measurements.

    python -m bench.frontier                         # 135M .. 2.25B shapes, 20 GiB, M=4 (~30 min)
    python -m bench.frontier --budget-gib 12 --sizes smollm2-135m smollm2-360m
    python -m bench.frontier --quick                 # tiny shapes, a budget that full misses

Shapes (SHAPES): public models' layouts, random init. Methods, each arm a process of its own:
full (preinfer's full mode), lora (peft r16 all-linear over the same HF model), badam (PyPI
badam's BlockOptimizer over preinfer's M blocks: block 0, a middle block and the last, in one
process), bcd (the visits of block 0 from tokens and of a middle and the last block from their
boundary caches, each cache built first by `preinfer cache build`'s code) and bcd-recompute
(the same visits, the frozen prefix rerun; block 0 is bcd's own visit). Every arm runs a few
steps at run.precision=auto (the precision this CPU trains best in) at a tiny batch x S.

The budget: each arm is forked from a server that holds the imports; a watchdog kills an arm
whose RSS passes the budget (psutil, every 20 ms) and records it as "does not fit" with the
peak it reached. RLIMIT_DATA (twice the budget past the child's start) only stops a runaway
allocation: the data segment counts the checkpoint's private file maps and oneDNN's
reservations, so it runs ~1 GiB and more ahead of the RSS (RLIMIT_AS: further still). An arm killed because the MACHINE ran short
(other processes) is "inconclusive", never "does not fit". A method that did not fit at one
size is not run at the larger ones. --quick's budget is 90% of the peak that full training of
the larger tiny shape reached in a first, unbudgeted run: full must then be refused, bcd fit.

The planner: each preinfer arm beside `preinfer plan --card cpu`'s stage peak (build_plan, at
the precision the trainer resolves) and a FLOP-model step time (preinfer.plan.costmodel) whose
one constant, the CPU's effective FLOP/s, is fitted on the smallest size and judged on the
others. A visit's held parameters (materialised, not meta) are checked against the planner's
loaded blocks: a visit from the cache must load blocks k..M-1 only.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from importlib.util import find_spec
from pathlib import Path

import torch

from bench import harness as h
from bench.frontier_arms import (
    FULL,
    METHODS,
    NEEDS,
    QUICK,
    SHAPES,
    GiB,
    MiB,
    Scale,
    overrides,
    run_child,
)  # fmt: skip
from preinfer.model.partition import partition_layers
from preinfer.model.shape import model_shape
from preinfer.plan import memory as pm
from preinfer.plan.costmodel import Flops
from preinfer.run.config import load_config
from preinfer.run.plan_report import PlanOptions, build_plan
from preinfer.runtime.device import training_precision

# ---------------------------------------------------------------------------------------------
# The planner


def planned(sc: Scale, size: str, work: Path, precision: str, budget: int) -> dict:
    """`preinfer plan --card cpu --gpu-mem <budget>`'s stage peaks at the trainer's precision
    (and at run.precision=auto as the planner reads it), the smallest M that fits the budget
    and the FLOPs per token of each visit (costmodel.Flops: the planner's step-time model)."""
    cfg = load_config(None, overrides(sc, size, work))
    prec = {"bf16": "amp-bf16", "fp32": "fp32"}[precision]
    o = PlanOptions(card="cpu", gpu_mem=budget / GiB, precision=prec, flops_only=True)
    plan = build_plan(cfg, o)
    auto = build_plan(cfg, replace(o, precision=None))  # run.precision=auto as setup_for reads it
    sh = model_shape(cfg.model)
    part = partition_layers(list(sh.layers), sh.embed, sh.head, sc.M)

    def peaks_of(pl: dict) -> tuple[dict, dict]:  # the plan's stages + bcd-recompute's visits
        p = pm.Setup(**{k: pl["setup"][k] for k in pm.Setup.__dataclass_fields__})
        rec = [pm.trainer_memory(sh, part, "bcd-recompute", k, p) for k in range(1, sc.M)]
        stages = [*pl["stages"], *rec]
        return {s["stage"]: s["peak"] for s in stages}, {
            s["stage"]: s.get("loaded_params") for s in stages
        }

    peaks, loaded = peaks_of(plan)
    phase = {s["stage"]: s["phase"] for s in plan["stages"]}
    fl = Flops(sh=sh, part=part, seq=sc.seq)
    flops = {"full": fl.full(), **{f"bcd block {k}": fl.bcd(k) for k in range(sc.M)},
             **{f"bcd-recompute block {k}": fl.bcd(k) + fl.prefix(k) for k in range(sc.M)}}  # fmt: skip
    return {"params": sh.params, "blocks": [list(b) for b in part.blocks], "precision": prec,
            "peaks": peaks, "phase": phase, "loaded_params": loaded, "flops_per_token": flops,
            "auto_precision": auto["setup"]["precision"],
            "auto_peaks": peaks_of(auto)[0],
            "full_fits": plan["full_fits"], "bcd_fits": plan["bcd_fits"],
            "smallest_m": plan["smallest_m"]}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# One size: its arms in order, then the summary


def arms_of(sc: Scale, methods: list[str]) -> list[tuple[str, dict]]:
    """(name, spec part) of a size's arms, in an order where every cache read is current: the
    builds (from the init checkpoint), then the visits from the last block down (a commit of
    block k leaves boundaries <= k current). bcd's visits keep the product's default
    train.keep_optimizer_state (first visits: a fresh state, saved at commit); the arms that
    visit a block again (bcd-recompute, full) start fresh too, keep_optimizer_state=false."""
    mid, last = sc.M // 2, sc.M - 1
    fresh = ["train.keep_optimizer_state=false"]
    out = []
    if "bcd" in methods:
        out += [(f"bcd build {k}", {"kind": "build", "block": k, "method": "bcd"})
                for k in sorted({mid, last} - {0})]  # fmt: skip
        out += [(f"bcd block {k}", {"kind": "visit", "mode": "bcd", "block": k, "method": "bcd"})
                for k in sorted({last, mid}, reverse=True)]  # fmt: skip
    if "bcd-recompute" in methods:
        out += [(f"bcd-recompute block {k}", {"kind": "visit", "mode": "bcd-recompute", "block": k,
                 "method": "bcd-recompute", "set": fresh}) for k in sorted({last, mid} - {0}, reverse=True)]  # fmt: skip
    if {"bcd", "bcd-recompute"} & set(methods):  # block 0 from tokens: the same visit in both
        out.append(("bcd block 0", {"kind": "visit", "mode": "bcd", "block": 0, "method": "bcd"}))
    if "full" in methods:
        out.append(
            ("full", {"kind": "visit", "mode": "full", "block": 0, "method": "full", "set": fresh})
        )
    out += [(m, {"kind": "hf", "method": m}) for m in ("lora", "badam") if m in methods]
    return out


def _s_per_step(times: list[float]) -> float:
    """The median step after the first (kernels, pools and the optimizer state made there)."""
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def method_rows(arms: dict[str, dict], methods: list[str], skipped: dict[str, str]) -> dict:
    """Per method: fits (every arm it needs fitted), its peak (the largest arm's), s/step (the
    mean over its visit kinds: a rotation's average with M=3), tokens/s; why it did not fit."""
    out = {}
    for m in (m for m in METHODS if m in methods):
        if m in skipped:
            out[m] = {"fits": None, "why": skipped[m]}
            continue
        mine = {
            n: r
            for n, r in arms.items()
            if r["method"] == m or (m == "bcd-recompute" and n == "bcd block 0")
        }
        if not mine:
            continue
        bad = [(n, r) for n, r in mine.items() if r["fits"] is not True]
        fits = None if any(r["fits"] is None for _, r in bad) else not bad
        steps = []
        for r in mine.values():
            steps += [_s_per_step(t) for t in r.get("phase_step_s", {}).values()]
            steps += [_s_per_step(r["step_s"])] if r.get("step_s") else []
        tok = next((r["tokens_per_step"] for r in mine.values() if r.get("tokens_per_step")), None)
        s = statistics.mean(steps) if steps and not bad else None
        out[m] = {"fits": fits, "peak_rss_mb": max(r["peak_rss_mb"] for r in mine.values()),
                  "s_per_step": s, "tokens_per_s": tok / s if s and tok else None,
                  "why": "; ".join(f"{n}: {r['why']}" for n, r in bad) or None,
                  "arms": sorted(mine)}  # fmt: skip
    return out


def run_size(sc: Scale, size: str, methods: list[str], work: Path, budget: int, precision: str,
             say, over_time, prep: dict | None = None) -> dict:  # fmt: skip
    """Prepare one size afresh (token store, init checkpoint; `prep`: quick_budget's), plan it,
    run its arms."""
    base = {"overrides": overrides(sc, size, work), "threads": sc.threads, "M": sc.M}
    if prep is None:
        shutil.rmtree(work, ignore_errors=True)
        (work / "logs").mkdir(parents=True)
        prep = run_child({**base, "kind": "prep"}, 4 * budget, work / "logs" / "prep.log", 3600)
    if prep["why"]:
        raise SystemExit(f"frontier: {size}: preparing failed: {prep['why']}")
    plan = planned(sc, size, work, precision, budget)
    say(f"  {size}: {plan['params'] / 1e6:.0f}M params, blocks {plan['blocks']}; init "
        f"{prep['init_s']:.0f}s; planner (cpu, {plan['precision']}): full fits "
        f"{plan['full_fits']}, bcd M={sc.M} fits {plan['bcd_fits']}, smallest M "
        f"{(plan['smallest_m'] or {}).get('M')}")  # fmt: skip
    arms = {}
    for name, part in arms_of(sc, methods):
        if over_time():
            arms[name] = {
                **part,
                "fits": None,
                "why": "not run: the bench's time cap",
                "peak_rss_mb": 0,
            }
            continue
        spec = {**base, **part, "overrides": [*base["overrides"], *part.get("set", [])]}
        log = work / "logs" / f"{name.replace(' ', '-')}.log"
        rec = {**part, **run_child(spec, budget, log, sc.arm_timeout_s)}
        arms[name] = rec
        t = rec.get("step_s") or [x for v in rec.get("phase_step_s", {}).values() for x in v]
        say(f"    {name:24s} {'fits' if rec['fits'] else 'DOES NOT FIT' if rec['fits'] is False else '??'}"
            f"  peak {rec['peak_rss_mb'] / 1024:6.2f} GiB"
            + (f" (growth {rec['growth_mb'] / 1024:.2f})" if "growth_mb" in rec else "")
            + (f", steps {' '.join(f'{x:.2f}' for x in t)} s" if t else "")
            + (f", build {rec['build_s']:.1f}s, {rec['cache_bytes'] / MiB:.1f} MiB" if "build_s" in rec else "")
            + (f"  [{rec['why']}]" if rec["why"] else "") + f"  ({rec['wall_s']:.0f}s wall)")  # fmt: skip
    return {"prep": prep, "plan": plan, "arms": arms}


# ---------------------------------------------------------------------------------------------
# The planner against the measurements; the check that memory falls with k


def _stage(name: str) -> str:
    return f"pre-inference build -> boundary {name.split()[-1]}" if " build " in name else name


def planner_rows(res: dict, calibrate: str) -> tuple[list[dict], float | None]:
    """Every preinfer arm that ran to its end beside the planner's peak and step time. The step
    time's one constant (effective FLOP/s of this CPU) is the median over `calibrate`'s visits."""

    def rate_of(r, plan):
        return plan["flops_per_token"][r["name"]] * r["tokens_per_step"] / _s_per_step(r["step_s"])

    cal = res["sizes"].get(calibrate)
    rates = [rate_of({**r, "name": n}, cal["plan"]) for n, r in (cal or {"arms": {}})["arms"].items()
             if r["fits"] and r.get("step_s") and n in cal["plan"]["flops_per_token"]]  # fmt: skip
    rate = statistics.median(rates) if rates else None
    rows = []
    for size, s in res["sizes"].items():
        for name, r in s["arms"].items():
            est = s["plan"]["peaks"].get(_stage(name))
            if r["method"] in ("lora", "badam") or est is None or not r["fits"]:
                continue
            row = {"size": size, "arm": name, "params": s["plan"]["params"],
                   "measured_mb": r["peak_rss_mb"], "growth_mb": r["growth_mb"],
                   "baseline_mb": r["baseline_mb"], "estimate_mb": est / MiB,
                   "error_vs_peak": est / MiB / r["peak_rss_mb"] - 1,
                   "error_vs_growth": est / MiB / r["growth_mb"] - 1,
                   "estimate_at_auto_mb": s["plan"]["auto_peaks"].get(_stage(name), 0) / MiB,
                   "out_of_sample": size != calibrate,
                   "phase": max(r["phases_mb"], key=r["phases_mb"].get) if r.get("phases_mb") else None,
                   "planned_phase": s["plan"]["phase"].get(_stage(name))}  # fmt: skip
            if r.get("step_s") and rate and name in s["plan"]["flops_per_token"]:
                pred = s["plan"]["flops_per_token"][name] * r["tokens_per_step"] / rate
                row.update(step_s=_s_per_step(r["step_s"]), step_pred_s=pred,
                           step_error=pred / _s_per_step(r["step_s"]) - 1)  # fmt: skip
            rows.append(row)
    return rows, rate


def falls_with_k(sc: Scale, res: dict) -> list[dict]:
    """Per size, bcd's visits k = 0, mid, last: measured growth against the planner's, and the
    parameters a visit held against the planner's loaded blocks (k..M-1 from the cache)."""
    out = []
    for size, s in res["sizes"].items():
        ks = sorted({0, sc.M // 2, sc.M - 1})
        for mode in ("bcd", "bcd-recompute"):
            got = [(k, s["arms"].get(f"{mode if k else 'bcd'} block {k}")) for k in ks]
            got = [(k, r) for k, r in got if r and r["fits"]]
            if len(got) < 2:
                continue
            rows = [{"k": k, "growth_mb": r["growth_mb"],
                     "estimate_mb": s["plan"]["peaks"][f"{mode if k else 'bcd'} block {k}"] / MiB,
                     "held_params": r["held"]["model"]["params"]
                     + ((r["held"].get("prefix") or {}).get("params") or 0),
                     "held_bytes": r["held"]["model"]["bytes"],
                     "planned_params": s["plan"]["loaded_params"][f"{mode if k else 'bcd'} block {k}"]}
                    for k, r in got]  # fmt: skip
            g, e = [x["growth_mb"] for x in rows], [x["estimate_mb"] for x in rows]
            out.append({"size": size, "mode": mode, "rows": rows,
                        # falls: each k holds no more than the one before (2% for RSS noise)
                        "measured_falls": all(a * 1.02 >= b for a, b in itertools.pairwise(g)),
                        "planned_falls": all(a >= b for a, b in itertools.pairwise(e)),
                        "held_as_planned": all(x["held_params"] == x["planned_params"] for x in rows)})  # fmt: skip
    return out


def render(res: dict) -> str:
    sizes = list(res["sizes"])
    head = ("method", *[f"{s} ({res['sizes'][s]['plan']['params'] / 1e6:.0f}M)" for s in sizes])
    rows = [head]
    for m in METHODS:
        cells = []
        for s in sizes:
            r = res["sizes"][s]["methods"].get(m)
            if r is None:
                cells.append("-")
            elif r["fits"]:
                cells.append(
                    f"fits ({r['peak_rss_mb'] / 1024:.2f} GiB, {r['s_per_step']:.2f} s/step)"
                )
            elif r["fits"] is False:
                cells.append(f"does not fit (reached {r['peak_rss_mb'] / 1024:.2f} GiB)"
                             if r.get("peak_rss_mb") else f"does not fit ({r['why']})")  # fmt: skip
            else:
                cells.append(r["why"] if len(r["why"]) < 60 else r["why"][:57] + "...")
        rows.append((m, *cells))
    out = [f"budget {res['budget_gib']:.2f} GiB RSS per arm; precision {res['precision']}; "
           f"batch {res['scale']['batch']} x S {res['scale']['seq']}, {res['scale']['steps']} steps "
           f"per visit kind, M={res['scale']['M']}", h.headline_table(rows)]  # fmt: skip
    cache = [("size", "boundary", "build s", "cache MiB", "rows")]
    for s in sizes:
        for n, r in res["sizes"][s]["arms"].items():
            if r.get("build_s") is not None:
                cache.append(
                    (
                        s,
                        n.split()[-1],
                        f"{r['build_s']:.1f}",
                        f"{r['cache_bytes'] / MiB:.1f}",
                        str(r["rows"]),
                    )
                )
    out.append(h.headline_table(cache))
    pl = [("size", "arm", "measured GiB (growth)", "planner GiB", "error vs peak", "vs growth",
           "planner at auto", "step s", "predicted s", "step error")]  # fmt: skip
    for r in res["planner"]:
        pl.append((r["size"] + ("" if r["out_of_sample"] else " (fit)"), r["arm"],
                   f"{r['measured_mb'] / 1024:.2f} ({r['growth_mb'] / 1024:.2f})",
                   f"{r['estimate_mb'] / 1024:.2f}", f"{r['error_vs_peak']:+.1%}",
                   f"{r['error_vs_growth']:+.1%}", f"{r['estimate_at_auto_mb'] / 1024:.2f}",
                   *((f"{r['step_s']:.2f}", f"{r['step_pred_s']:.2f}", f"{r['step_error']:+.0%}")
                     if "step_s" in r else ("-", "-", "-"))))  # fmt: skip
    out.append(h.headline_table(pl))
    fk = [
        (
            "size",
            "mode",
            "k: growth GiB / planner GiB / held M params (planned)",
            "falls",
            "as planned",
        )
    ]
    for f in res["falls_with_k"]:
        fk.append((f["size"], f["mode"], "; ".join(
            f"{x['k']}: {x['growth_mb'] / 1024:.2f} / {x['estimate_mb'] / 1024:.2f} / "
            f"{x['held_params'] / 1e6:.1f} ({x['planned_params'] / 1e6:.1f})" for x in f["rows"]),
            "yes" if f["measured_falls"] else "NO", "yes" if f["held_as_planned"] else "NO"))  # fmt: skip
    out.append(h.headline_table(fk))
    return "\n\n".join(out)


def frontier_line(frontier: dict) -> str:
    """'largest that fits: full 1100M, lora ...; bcd / full 2.05x; bcd s/step / LoRA's 1.18'."""
    fit = ", ".join(f"{m} {f['params'] / 1e6:.0f}M" if f["params"] else f"{m} none"
                    for m, f in frontier.items())  # fmt: skip
    line = f"largest that fits: {fit}"
    if frontier["bcd"].get("vs_full") is not None:
        line += f"; bcd / full: {frontier['bcd']['vs_full']:.2f}x the parameters"
    if frontier["bcd"].get("step_vs_lora") is not None:
        line += (f"; bcd s/step / LoRA's at {frontier['bcd']['largest']}: "
                 f"{frontier['bcd']['step_vs_lora']:.2f}")  # fmt: skip
    return line


def quick_budget(sc: Scale, work: Path) -> tuple[int, dict]:
    """--quick's budget: 90% of the peak RSS full training of the largest size reached, run
    once without a budget (the budget full just misses; bcd must fit in it to pass); and the
    size's prep record (its token store and checkpoint stay for its arms)."""
    size = sc.sizes[-1]
    base = {"overrides": [*overrides(sc, size, work), "train.keep_optimizer_state=false"],
            "threads": sc.threads, "M": sc.M}  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    recs = []
    for part in ({"kind": "prep"}, {"kind": "visit", "mode": "full", "block": 0}):
        recs.append(run_child({**base, **part}, 64 * GiB, work / "logs" / "budget.log", 600))
        if recs[-1]["why"]:
            raise SystemExit(
                f"frontier: --quick's budget: {size} {part['kind']}: {recs[-1]['why']}"
            )
    return int(0.9 * recs[-1]["peak_rss_mb"] * MiB), recs[0]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, a budget full misses")
    ap.add_argument(
        "--budget-gib", type=float, default=None, help="RSS budget per arm (default 20)"
    )
    ap.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=None)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    for flag in ("steps", "seq", "batch", "threads"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default=None,
                    help="run.precision of every arm (default auto)")  # fmt: skip
    ap.add_argument("--blocks", dest="M", type=int, default=None, help="M (default 4; --quick 3)")
    ap.add_argument("--time-cap-min", type=float, default=None,
                    help="start no arm after this many minutes (default 40; --quick none)")  # fmt: skip
    ap.add_argument("--work", default=None, help="keep token stores, checkpoints, logs here")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    a = ap.parse_args(argv)
    sc = replace(QUICK if a.quick else FULL)
    for k in ("sizes", "steps", "seq", "batch", "threads", "M", "budget_gib", "precision"):
        if getattr(a, k) is not None:
            setattr(sc, k, getattr(a, k))
    if a.time_cap_min is not None:
        sc.time_cap_s = a.time_cap_min * 60
    if sc.M < 2 or sc.steps < 1:
        ap.error(f"--blocks must be >= 2 (got {sc.M}) and --steps >= 1 (got {sc.steps})")
    skipped = {m: f"skipped: {NEEDS[m]} not installed (pip install -e '.[real]')"
               for m in a.methods if m in NEEDS and not find_spec(NEEDS[m])}  # fmt: skip
    methods = [m for m in a.methods if m not in skipped]
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="frontier-")
    work = Path(a.work or tmp.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.perf_counter(), h.load_average()
    precision, why = training_precision(torch.device("cpu"), sc.precision)
    budget, prepared = int((sc.budget_gib or 0) * GiB), None
    if not budget:
        budget, prepared = quick_budget(sc, work / sc.sizes[-1])
    sc.budget_gib = budget / GiB

    def say(line: str) -> None:
        print(line, flush=True)

    def over_time() -> bool:
        return sc.time_cap_s is not None and time.perf_counter() - t0 > sc.time_cap_s

    say(f"frontier: sizes {' '.join(sc.sizes)}; methods {' '.join(methods)}; budget "
        f"{sc.budget_gib:.2f} GiB RSS per arm; {precision} ({why}); load {load0}")  # fmt: skip
    res = {"quick": a.quick, "scale": asdict(sc), "budget_gib": sc.budget_gib,
           "precision": precision, "precision_why": why, "skipped": skipped, "sizes": {}}  # fmt: skip
    failed: dict[str, str] = {}
    for size in sc.sizes:
        todo = [m for m in methods if m not in failed]
        gone = {m: f"not run: did not fit at {failed[m]}" for m in methods if m in failed}
        pre = prepared if size == sc.sizes[-1] else None
        s = run_size(sc, size, todo, work / size, budget, precision, say, over_time, pre)
        s["methods"] = method_rows(s["arms"], a.methods, {**skipped, **gone})
        for m, r in s["methods"].items():
            if r["fits"] is False and m not in failed:
                failed[m] = size
        res["sizes"][size] = s
        if not a.work:
            for d in ("run", "cache", "tokens"):  # GBs at the larger sizes
                shutil.rmtree(work / size / d, ignore_errors=True)
    res["planner"], res["flops_per_s"] = planner_rows(res, sc.sizes[0])
    res["falls_with_k"] = falls_with_k(sc, res)
    frontier = {}
    for m in METHODS:
        fit = [s for s in sc.sizes if res["sizes"][s]["methods"].get(m, {}).get("fits")]
        frontier[m] = {"largest": fit[-1] if fit else None,
                       "params": res["sizes"][fit[-1]]["plan"]["params"] if fit else None}  # fmt: skip
    # the targets' figures (issue #55): bcd's largest size over full's; bcd's s/step over LoRA's
    # at bcd's largest size (both arms run there)
    full_params = frontier["full"]["params"]
    for f in frontier.values():
        f["vs_full"] = round(f["params"] / full_params, 3) if f["params"] and full_params else None
    big = frontier["bcd"]["largest"]
    if big:
        rows = res["sizes"][big]["methods"]
        b, lo = rows["bcd"]["s_per_step"], rows.get("lora", {}).get("s_per_step")
        frontier["bcd"]["step_vs_lora"] = round(b / lo, 3) if b and lo else None
    res["frontier"] = frontier
    res.update(load_start=load0, load_end=h.load_average(), seconds=time.perf_counter() - t0,
               cpus=os.cpu_count(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
               torch=torch.__version__, python=sys.version.split()[0])  # fmt: skip
    res["table"] = render(res) + "\n\n" + frontier_line(frontier)
    res = h.without_paths(res, {str(work): "<work>", str(h.ROOT): "<repo>"})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = (
        Path(a.out) if a.out else h.RESULTS / f"frontier-{stamp}{'-quick' if a.quick else ''}.json"
    )
    h.publish(res, res["table"] + f"\n\n(load {load0} -> {res['load_end']}; "
              f"{res['seconds']:.0f}s; {os.cpu_count()} CPUs)", str(out), "frontier")  # fmt: skip
    if tmp is not None:
        tmp.cleanup()
    return {"results": str(out), "frontier": frontier, "res": res}


if __name__ == "__main__":
    main()
