"""The study to the plateau: BCD (with the cache, and recomputing its prefix) against full
training, each arm's lr swept, best against best.

    python -m bench.study                 # both layouts, M=3 and 6, 3 seeds, 3 lrs (many hours)
    python -m bench.study --quick         # make bench: LLaMA layout, M=3, one seed (minutes)
    python -m bench.study --small         # the quick model to its plateau, both layouts, M=3,
                                          # 3 seeds, 3 lrs
    python -m bench.study --tiny          # the slow test's end-to-end run (a minute)
    python -m bench.study --layouts llama --M 3 --variant head train.always_train=[head] \\
        --variant random train.order=random --set train.epochs=0.33

(from the repo root). Per layout (gpt2: tied head, wte in block 0; llama: untied head in the
last block, GQA 2:1) and seed, every arm starts from the same init checkpoint and token store
(bench/study_arms.py runs one arm; bench/study_curves.py holds the arithmetic):

  full           every parameter, from tokens, until its val ppl stops improving: `patience`
                 whole-val evaluations (every steps_per_visit steps) without a gain of more
                 than min_rel_delta, or full_cap steps (its cosine horizon). Run once per
                 (layout, seed, lr) and shared by every M (same init weights, same batches).
  bcd            the rotation from the cache; bcd-recompute the same, prefix rerun every step;
  --variant NAME KEY=VALUE...   a bcd arm with these config overrides (train.mode=... picks
                 its mode); --set KEY=VALUE applies to every arm.
                 Each BCD arm trains until its whole-val ppl (after every visit) reaches full's
                 best (full at its best lr, same seed), or bcd_factor x full's steps to it.

Measured at the plateau: B-F multiplier = BCD steps to full's best ppl / full's steps to its
best; wall-clock ratio = BCD seconds to it / full's seconds to its best (clocks: everything the
product does minus every evaluation). Every arm's lr is swept over Scale.lrs: full's best lr
has the lowest median best ppl over seeds; a BCD arm's the lowest median B-F multiplier (not
reached = infinite; ties: lowest median ppl). A best lr at the grid's edge is flagged: widen the
sweep. Medians and [min, max] over seeds; arms interleaved (the lr x arm order rotated per seed;
full's runs come first, since every BCD arm needs its target);
the load average at every arm's start and end. Output: a printed table and
bench/results/study[-quick|-tiny]-<time>.json (no machine paths).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.harness import headline_table, load_average, results_path, write_results
from bench.study_arms import LAYERS_HEAVY, LAYOUTS, TINY_MODEL, Arm, Scale, Stop, run_arm
from bench.study_curves import (
    cap_steps,
    first_reach,
    interleave,
    multiplier,
    plateau,
    select_lr,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]

DEFAULT = Scale(model=LAYERS_HEAVY, documents=100, full_cap=2400, patience=4, min_steps=300)
QUICK = Scale(
    model=["model.hidden_size=64", "model.num_layers=6", "model.num_heads=2",
           "model.max_positions=32"],  # fmt: skip
    documents=24, seq_len=32, batch_size=8, vocab=512, val_fraction=0.1, steps_per_visit=12,
    full_cap=144, patience=2, min_steps=72, seeds=[0], lrs=[3e-3, 1e-2, 3e-2], val_batches=4,
)  # fmt: skip
# the quick model to its plateau: its 24 documents overfit, so val ppl turns up and patience
# stops full well inside the cap; 3 seeds, the grid one step below the quick one's edge
SMALL = dataclasses.replace(
    QUICK, full_cap=1500, patience=3, min_steps=150, seeds=[0, 1, 2], lrs=[1e-3, 3e-3, 1e-2]
)
TINY = Scale(
    model=TINY_MODEL, documents=8, seq_len=16, batch_size=4, vocab=320, val_fraction=0.2,
    steps_per_visit=3, full_cap=12, patience=2, seeds=[0], lrs=[1e-3, 1e-2, 3e-2],
    val_batches=2, warmup_steps=1,
)  # fmt: skip
# preset -> (scale, layouts, Ms)
PRESETS = {
    "default": (DEFAULT, ["gpt2", "llama"], [3, 6]),
    "quick": (QUICK, ["llama"], [3]),
    "small": (SMALL, ["llama", "gpt2"], [3]),
    "tiny": (TINY, ["gpt2"], [3]),
}
BASE_ARMS = {
    "bcd": Arm("bcd", [], "bcd"),
    "bcd-recompute": Arm("bcd-recompute", [], "bcd-recompute"),
}
SHARED = ("model.", "data.", "partition.", "run.")  # every arm must share these: full is shared


def parse_variant(spec: list[str]) -> Arm:
    """--variant NAME KEY=VALUE...: a BCD arm; train.mode=... in the overrides picks its mode."""
    name, *sets = spec
    if not sets:
        raise ValueError(f"--variant {name}: give at least one KEY=VALUE override after the name")
    if name in ("full", *BASE_ARMS):
        raise ValueError(f"--variant {name}: the name is a base arm's; choose another")
    mode = "bcd"
    for s in sets:
        if "=" not in s:
            raise ValueError(f"--variant {name}: {s!r} is not KEY=VALUE")
        if s.startswith(SHARED):
            raise ValueError(f"--variant {name}: {s!r} changes what every arm shares (model, "
                             f"data, partition, run); use --set for the whole study")  # fmt: skip
        if s.startswith("train.mode="):
            mode = s.split("=", 1)[1]
    if mode not in ("bcd", "bcd-recompute"):
        raise ValueError(f"--variant {name}: train.mode must be bcd or bcd-recompute, got {mode!r}")
    return Arm(name, list(sets), mode)


def run_full(sc: Scale, work: Path, layout: str, M: int, opts: dict, log) -> dict:
    """Full at every (seed, lr), to its plateau. Returns {lr: [record per seed]}."""
    runs: dict[float, list[dict]] = {lr: [] for lr in sc.lrs}
    for i, seed in enumerate(sc.seeds):
        for lr in interleave(list(sc.lrs), i):
            rec = run_arm(sc, work, Arm("full", [], "full"), layout=layout, M=M, seed=seed, lr=lr,
                          stop=Stop(patience=sc.patience), log=log, **opts)  # fmt: skip
            p = plateau(rec["curve"], sc.patience, sc.min_rel_delta, sc.min_steps)
            rec.update(best=p["best"], plateaued=p["plateaued"], best_ppl=p["best"]["ppl"],
                       steps_to_best=p["best"]["steps"])  # fmt: skip
            runs[lr].append(rec)
    for lr in runs:  # seed order, whatever order they ran in
        runs[lr].sort(key=lambda r: sc.seeds.index(r["seed"]))
    return runs


def run_bcd_arms(sc: Scale, work: Path, layout: str, M: int, arms: list[Arm], full: dict,
                 opts: dict, log) -> dict:  # fmt: skip
    """Every BCD arm at every (seed, lr) against full's best of that seed.
    full: {seed: full's record at its best lr}. Returns {arm: {lr: [record per seed]}}."""
    runs = {a.name: {lr: [] for lr in sc.lrs} for a in arms}
    jobs = [(a, lr) for lr in sc.lrs for a in arms]  # arms alternate within each lr
    for i, seed in enumerate(sc.seeds):
        best = full[seed]["best"]
        stop = Stop(target_ppl=best["ppl"], cap_steps=cap_steps(best, sc.bcd_factor))
        for arm, lr in interleave(jobs, i):
            rec = run_arm(sc, work, arm, layout=layout, M=M, seed=seed, lr=lr, stop=stop, log=log,
                          **opts)  # fmt: skip
            hit = first_reach(rec["curve"], best["ppl"])
            rec.update(multiplier(hit, best), reach_steps=hit["steps"] if hit else None)
            rec.update(target_ppl=best["ppl"], cap_steps=stop.cap_steps,
                       best_ppl=min(p["ppl"] for p in rec["curve"]) if rec["curve"] else None)  # fmt: skip
            runs[arm.name][lr].append(rec)
    for by_lr in runs.values():
        for recs in by_lr.values():
            recs.sort(key=lambda r: sc.seeds.index(r["seed"]))
    return runs


def analyse(full_runs: dict, bcd_runs: dict) -> dict:
    """Best lr per arm and, at it, the per-seed figures with their medians and spread."""
    fsel = select_lr(full_runs, "best_ppl", tie="steps_to_best")
    best_full = full_runs[fsel["lr"]]
    out = {
        "full": {
            "select": fsel,
            "best_ppl": summarize([r["best_ppl"] for r in best_full]),
            "steps_to_best": summarize([r["steps_to_best"] for r in best_full]),
            "seconds_to_best": summarize([r["best"]["seconds"] for r in best_full]),
            "plateaued": sum(r["plateaued"] for r in best_full),
            "seeds": len(best_full),
        }
    }
    for name, by_lr in bcd_runs.items():
        sel = select_lr(by_lr, "bf_multiplier", tie="best_ppl")
        recs = by_lr[sel["lr"]]
        out[name] = {
            "select": sel,
            "reach_steps": summarize([r["reach_steps"] for r in recs]),
            "bf_multiplier": summarize([r["bf_multiplier"] for r in recs]),
            "time_ratio": summarize([r["time_ratio"] for r in recs]),
            "best_ppl": summarize([r["best_ppl"] for r in recs]),
            "cache_share": summarize([r["cache_share"] for r in recs]),
            "reached": sum(r["reached"] for r in recs),
            "seeds": len(recs),
        }
    return out


def _f(s: dict, fmt: str = "{:.2f}") -> str:
    """A summary as 'median [min, max]', or n/a."""
    if s["median"] is None:
        return "n/a"
    if s["n"] == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


def render(studies: list[dict]) -> str:
    rows = [("layout", "M", "arm", "best lr (sweep)", "best val ppl", "steps to full's best ppl",
             "B-F multiplier", "wall-clock / full's", "reached")]  # fmt: skip
    for s in studies:
        a = s["analysis"]
        for name, r in a.items():
            sel = r["select"]
            lr = f"{sel['lr']:g}{' (edge)' if sel['edge'] else ''} ({', '.join(f'{x:g}' for x in sel['by_lr'])})"
            if name == "full":
                rows.append((s["layout"], str(s["M"]), "full", lr, _f(r["best_ppl"], "{:.1f}"),
                             _f(r["steps_to_best"], "{:.0f}"), "1", "1",
                             f"plateau {r['plateaued']}/{r['seeds']}"))  # fmt: skip
            else:
                rows.append((s["layout"], str(s["M"]), name, lr, _f(r["best_ppl"], "{:.1f}"),
                             _f(r["reach_steps"], "{:.0f}"),
                             _f(r["bf_multiplier"]), _f(r["time_ratio"]),
                             f"{r['reached']}/{r['seeds']}"))  # fmt: skip
    return headline_table(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="LLaMA layout, M=3, one seed (make bench)"
    )
    size.add_argument(
        "--small",
        action="store_true",
        help="the quick model to its plateau: both layouts, M=3, 3 seeds, 3 lrs (about an hour)",
    )
    size.add_argument("--tiny", action="store_true", help="a tiny model, seconds per arm (tests)")
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=None)
    ap.add_argument("--M", type=int, nargs="+", default=None, help="block counts")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--lrs", type=float, nargs="+", default=None, help="the lr grid of every arm")
    ap.add_argument("--arms", nargs="*", choices=sorted(BASE_ARMS), default=None,
                    help="base BCD arms (default both; full always runs)")  # fmt: skip
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                    help="a named BCD arm with config overrides (repeatable)")  # fmt: skip
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every arm (repeatable)")  # fmt: skip
    ap.add_argument("--config", default=None, help="a YAML under every arm's overrides")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a busy machine more threads spin and wait)")  # fmt: skip
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    preset = "quick" if a.quick else "small" if a.small else "tiny" if a.tiny else "default"
    base, layouts, Ms = PRESETS[preset]
    sc = copy.deepcopy(base)
    if a.seeds:
        sc.seeds = a.seeds
    if a.lrs:
        sc.lrs = a.lrs
    layouts, Ms = a.layouts or layouts, a.M or Ms
    try:
        arms = [BASE_ARMS[n] for n in (a.arms if a.arms is not None else BASE_ARMS)]
        arms += [parse_variant(v) for v in a.variant]
    except ValueError as e:
        ap.error(str(e))
    if len({x.name for x in arms}) != len(arms):
        ap.error("two BCD arms share a name")
    if a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    torch.set_num_threads(a.threads)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="study-")
    work = Path(a.work or tmp.name)
    opts = {"config": a.config, "sets": tuple(a.sets)}
    t0, load0 = time.perf_counter(), load_average()
    print(f"study ({preset}): layouts {layouts}, M {Ms}, seeds {sc.seeds}, lrs {sc.lrs}, "
          f"arms full + {[x.name for x in arms]} (load {load0})", flush=True)  # fmt: skip
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    studies = []
    for layout in layouts:
        full_runs = run_full(sc, work, layout, min(Ms), opts, log)
        fsel = select_lr(full_runs, "best_ppl", tie="steps_to_best")
        best_full = {r["seed"]: r for r in full_runs[fsel["lr"]]}
        for M in Ms:
            bcd_runs = run_bcd_arms(sc, work, layout, M, arms, best_full, opts, log)
            studies.append({"layout": layout, "M": M, "analysis": analyse(full_runs, bcd_runs),
                            "full_runs": full_runs, "bcd_runs": bcd_runs})  # fmt: skip
    table = render(studies)
    res = {
        "command": command(argv),
        "preset": preset, "scale": asdict(sc), "layouts": {k: LAYOUTS[k] for k in layouts},
        "M": Ms, "arms": [asdict(x) for x in arms], "sets": a.sets,
        "config": a.config, "studies": studies, "table": table,
        "load_start": load0, "load_end": load_average(), "seconds": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }  # fmt: skip
    print(table)
    print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s)")
    out = (
        Path(a.out)
        if a.out
        else results_path("study" + ("" if preset == "default" else f"-{preset}"))
    )
    write_results(out, res)
    print(f"wrote {_rel(out)}")
    if tmp is not None:
        tmp.cleanup()
    head = {}
    for s in studies:
        for name, r in s["analysis"].items():
            if name != "full":
                key = f"{s['layout']}.M{s['M']}.{name}"
                head[f"{key}.bf_multiplier"] = r["bf_multiplier"]["median"]
                head[f"{key}.time_ratio"] = r["time_ratio"]["median"]
    return {"headline": head, "results": _rel(out), "seconds": res["seconds"]}


def command(argv: list[str] | None) -> str:
    """The command line as recorded: --work and --out values (this machine's paths) left out."""
    args, skip = [], False
    for x in argv or []:
        if skip:
            skip = False
        elif x in ("--work", "--out"):
            skip = True
            args.append(f"{x} <{x[2:]}>")
        else:
            args.append(x)
    return " ".join(["python -m bench.study", *args])


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


if __name__ == "__main__":
    main()
