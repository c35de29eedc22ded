"""Peers: BCD with the cache against recompute, full fine-tuning, BAdam and LoRA (#27 item 6).

    python -m bench.peers --quick               # make bench: 1 lr per arm, 4 steps of batch 4
                                                # per visit, 1 seed (minutes)
    python -m bench.peers --work runs/peers     # the full form (hours): 3 lrs per arm on seed 0,
                                                # seeds 1, 2 at each arm's best, 30 steps of 8
    python -m bench.peers --quick --model tiny --inline  # a tiny random LLaMA, arms in-process
    python -m bench.peers --arms bcd full --bcd-set model.tie_embeddings=false \
        --bcd-set train.always_train=[head]     # the bcd arms untied, the head in every visit
    python -m bench.peers --work runs/peers --jobs 2 --resume   # two arms at a time; reuse
                                                # every run record the same settings made

Without the model (`make real-model`) or the `real` extra (badam, peft) it prints why and
returns {"skipped": ...}. Every arm fine-tunes from one init on the same batches of stdlib
docstring pairs (--data sitepkgs: held out), one warmup + cosine, fp32, each in its own process:
bcd (run_bcd, the product's defaults), bcd-recompute (the prefix rerun, at bcd's lr), full,
badam-layers (PyPI badam, a block per layer), badam-blocks (BAdam over preinfer's M blocks), lora
(peft, r 16, all-linear). After every visit: val loss against training seconds (evaluations
excluded); each arm's peak RSS. The full form sweeps each arm's lr on the first seed (best:
lowest final val loss), then runs the other seeds at it; TARGETS are medians over all seeds
(harness.spread). One torch thread per arm (--threads): on 2 busy CPUs two wait on each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transformers as tf

from bench import harness as h
from bench import peers_arms
from bench.arms import host, run_arm
from bench.peers_arms import ARMS, BCD_ARMS
from preinfer.model.evaluation import paired_ratio

BADAM = ("badam-layers", "badam-blocks")
TARGETS = [  # key, what, at most (None: no target)
    *[(f"bcd_time_to_{b}_loss", f"bcd wall-clock to {b}' final val loss / {b}'", 0.8) for b in BADAM],
    ("bcd_loss_at_full_time", "bcd val loss at full's wall-clock / full's final (stretch)", 1.0),
    ("bcd_best_over_full_best", "bcd's best val loss / full's best (#41, a multi-epoch run)", 1.01),
    ("bcd_loss_at_lora_time", "bcd val loss at LoRA's wall-clock / LoRA's final (#41)", 1.0),
    ("bcd_peak_over_lora", "bcd peak RSS / LoRA's (#41)", 1.0),
    *[(f"bcd_peak_over_{b}", f"bcd peak RSS / {b}'", 1.0) for b in BADAM],
    ("bcd_over_badam-blocks_seconds", "bcd seconds / badam-blocks' (the same steps)", None),
    ("bcd_minus_badam-blocks_loss", "bcd final val loss - badam-blocks'", None),
    ("bcd_over_recompute_seconds", "bcd seconds / bcd-recompute's (same visits)", None),
]  # fmt: skip


def point_at(curve: list[dict], seconds: float) -> dict:
    """The last point at or before `seconds` (an arm done sooner stopped there)."""
    return [p for p in curve if p["seconds"] <= seconds][-1]


def row_se(a: dict, b: dict) -> float | None:
    """The standard error of a's loss / b's, paired over the val rows both points read
    (issue #58), or None where a point holds no per-row losses (the start point; an older
    record)."""
    if "row_sums" not in a or "row_sums" not in b:
        return None
    return paired_ratio(a["row_sums"], b["row_sums"])["se"]


def targets(runs: dict[str, dict]) -> dict:
    """The issue's ratios for one seed's best-lr runs (arm -> run)."""
    bcd, out = runs["bcd"], {}
    for b in (b for b in BADAM if b in runs):
        hit = h.first_reach(bcd["curve"], runs[b]["final_loss"], "loss")
        out[f"bcd_time_to_{b}_loss"] = hit["seconds"] / runs[b]["seconds"] if hit else None
        out[f"bcd_peak_over_{b}"] = bcd["peak_rss_mb"] / runs[b]["peak_rss_mb"]
        # the same steps: where bcd ends level with b, the time to b's loss hangs on ~1e-3
        out[f"bcd_over_{b}_seconds"] = bcd["seconds"] / runs[b]["seconds"]
        out[f"bcd_minus_{b}_loss"] = bcd["final_loss"] - runs[b]["final_loss"]
    if "lora" in runs:  # #41: at LoRA's wall-clock, at LoRA's memory
        lora = runs["lora"]
        at = point_at(bcd["curve"], lora["seconds"])
        out["bcd_loss_at_lora_time"] = at["loss"] / lora["final_loss"]
        out["bcd_loss_at_lora_time_se"] = row_se(at, lora["curve"][-1])
        out["bcd_peak_over_lora"] = bcd["peak_rss_mb"] / lora["peak_rss_mb"]
    if "full" in runs:
        full = runs["full"]
        at = point_at(bcd["curve"], full["seconds"])
        out["bcd_loss_at_full_time"] = at["loss"] / full["final_loss"]
        out["bcd_loss_at_full_time_se"] = row_se(at, full["curve"][-1])
        # #41's multi-epoch target: each arm at its best evaluation (full overfits by the end)
        best = lambda run: min(p["loss"] for p in run["curve"])  # noqa: E731
        out["bcd_best_over_full_best"] = best(bcd) / best(full)
    if "bcd-recompute" in runs:
        out["bcd_over_recompute_seconds"] = bcd["seconds"] / runs["bcd-recompute"]["seconds"]
    return out


def render(res: dict) -> str:
    rows = [("arm", "lr", "val loss: start -> final (median [min, max])", "train s (median)",
             "peak RSS MiB (growth)", "trainable params", "steps", "load at start")]  # fmt: skip
    for arm, s in res["arms"].items():
        rows.append((arm, f"{s['lr']:g}", f"{s['start_loss']:.4f} -> {h.show(s['final_loss'], '{:.4f}')}",
                     h.show(s["seconds"], "{:.0f}"),
                     f"{s['peak_rss_mb']['median']:.0f} ({s['peak_growth_mb']['median']:.0f})",
                     s["trainable"], str(s["steps"]), str(s["load_start"])))  # fmt: skip
    t = [("target (issue #27)", "median [min, max]", "seeds", "target", "met",
          "mean +- s.e. rows; seeds")]  # fmt: skip
    errs = res.get("errors", {})
    for key, what, most in (x for x in TARGETS if x[0] in res["targets"]):
        s = res["targets"][key]
        ok = s["median"] is not None and most is not None and s["median"] <= most
        met = "" if most is None else "yes" if ok else "NO"
        f = "{:+.4f}" if key.startswith("bcd_minus") else "{:.3f}"
        e = errs.get(key)
        noise = (
            ""
            if e is None
            else (
                f"{e['mean']:.4f} +- {e['mean_rows_se']:.4f}; "
                + ("-" if e["mean_seeds_se"] is None else f"{e['mean_seeds_se']:.4f}")
            )
        )
        t.append((what, h.show(s, f), h.reached(s) if "time_to" in key else str(s["of"]),
                  "" if most is None else f"<= {most:g}", met, noise))  # fmt: skip
    sweep = [("arm", "lr", "seed", "final val loss", "train s", "peak RSS MiB", "load at start")]
    for r in res["runs"]:
        sweep.append((r["arm"], f"{r['lr']:g}", str(r["seed"]), f"{r['final_loss']:.4f}",
                      f"{r['seconds']:.0f}", f"{r['peak_rss_mb']:.0f}", str(r["load_start"])))  # fmt: skip
    return "\n\n".join(h.headline_table(x) for x in (rows, t, sweep))


def summarise(runs: list[dict], best: dict[str, float], seeds: list[int]) -> dict:
    """Per arm at its best lr: spreads over seeds; the targets per seed, then their spreads."""
    at_best = {a: [r for r in runs if r["arm"] == a and r["lr"] == best[a]] for a in best}
    arms = {}
    for a, rs in ((a, rs) for a, rs in at_best.items() if rs):
        t = [x / 1e6 for x in rs[0]["trainable_params"]]
        arms[a] = {
            "lr": best[a], "seeds": [r["seed"] for r in rs], "start_loss": rs[0]["curve"][0]["loss"],
            **{k: h.spread([r[k] for r in rs]) for k in ("final_loss", "seconds", "peak_rss_mb",
                                                          "peak_growth_mb")},
            "trainable": f"{min(t):.2f}M-{max(t):.2f}M" if min(t) != max(t) else f"{t[0]:.2f}M",
            **{k: rs[0][k] for k in ("steps", "load_start", "schedule")},
        }  # fmt: skip
    per_seed = []
    for s in seeds:
        by_arm = {a: r for a, rs in at_best.items() for r in rs if r["seed"] == s}
        if "bcd" in by_arm:
            per_seed.append({"seed": s, **targets(by_arm)})
    keys = sorted({k for t in per_seed for k in t if k != "seed" and not k.endswith("_se")})
    return {"arms": arms, "per_seed": per_seed, "errors": errors(per_seed),
            "targets": {k: h.spread([t.get(k) for t in per_seed]) for k in keys}}  # fmt: skip


def errors(per_seed: list[dict]) -> dict:
    """Each ratio's noise (issue #58): per seed, its standard error paired over the val rows
    (row_se); over the seeds, the mean ratio, the error of that mean from the rows (sqrt(sum
    se^2) / n) and from the seeds (their sd / sqrt(n), n >= 2). Only ratios whose every seed
    holds a row error."""
    out = {}
    for key in sorted({k[:-3] for t in per_seed for k in t if k.endswith("_se")}):
        ses = [t.get(f"{key}_se") for t in per_seed]
        vals = [t.get(key) for t in per_seed]
        if any(x is None for x in ses + vals):
            continue
        n = len(vals)
        out[key] = {"rows_se": ses, "mean": statistics.fmean(vals),
                    "mean_rows_se": math.sqrt(sum(s * s for s in ses)) / n,
                    "mean_seeds_se": statistics.stdev(vals) / math.sqrt(n) if n > 1 else None}  # fmt: skip
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 lr per arm, 4 steps per visit, 1 seed")
    ap.add_argument("--model", default=str(peers_arms.REAL_MODEL),
                    help="a LLaMA-layout HF model dir (default: the real model), or 'tiny'")  # fmt: skip
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--steps", dest="steps_per_visit", type=int, metavar="STEPS",
                    help="steps per block visit")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--blocks", dest="M", type=int, metavar="M",
                    help="M: blocks of the rotation, and of badam-blocks' block list (default 3)")  # fmt: skip
    ap.add_argument("--cache-dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="cache.dtype of the bcd arm (default bf16)")  # fmt: skip
    ap.add_argument("--data", default=None, choices=["stdlib", "sitepkgs"],
                    help="the stdlib's docstrings (default) or the held-out site-packages'")  # fmt: skip
    ap.add_argument("--eval-batches", type=int, default=None,
                    help="val batches of every evaluation (0 = the whole val split; default 4)")  # fmt: skip
    ap.add_argument("--bcd-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the bcd arms only (repeatable)")  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="the full form's 3 lrs per arm")
    ap.add_argument("--lrs", action="append", default=[], metavar="ARM=LR,LR,...",
                    help="an arm's lr grid (repeatable), e.g. badam-blocks=1e-4,3e-4,1e-3")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of each arm and the evaluations (0 = torch's default)")  # fmt: skip
    ap.add_argument("--inline", action="store_true",
                    help="run the arms in this process (peak RSS then not each arm's own)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=1, help="arms run at a time, each its own process")
    ap.add_argument("--resume", action="store_true",
                    help="reuse each record <work>/runs/*.json the same settings made")  # fmt: skip
    ap.add_argument("--work", default=None, help="keep data, tokens, init and runs here")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    a = ap.parse_args(argv)
    preset = (
        peers_arms.TINY if a.model == "tiny" else peers_arms.QUICK if a.quick else peers_arms.FULL
    )
    sc = dataclasses.replace(preset, bcd_set=list(a.bcd_set))
    sc.lrs = dict(peers_arms.FULL.lrs if a.sweep else sc.lrs)  # a copy: the preset's stays
    for name in ("seeds", "steps_per_visit", "rounds", "M", "cache_dtype", "data", "eval_batches"):
        if getattr(a, name) is not None:
            setattr(sc, name, getattr(a, name))
    for item in a.lrs:
        arm, _, grid = item.partition("=")
        if arm not in sc.lrs or not grid:
            ap.error(f"--lrs {item!r}: give ARM=LR,LR,... with ARM one of {sorted(sc.lrs)}")
        try:
            sc.lrs[arm] = [float(x) for x in grid.split(",")]
        except ValueError:
            ap.error(f"--lrs {item!r}: the lrs must be numbers, e.g. {arm}=1e-4,3e-4")
    if any("=" not in x for x in a.bcd_set):
        ap.error(f"--bcd-set {a.bcd_set}: give KEY=VALUE, e.g. train.always_train=[head]")
    if "bcd" not in a.arms:
        raise SystemExit("--arms must include bcd: every target is a ratio to it")
    if a.M is not None and a.M < 1:
        ap.error(f"--blocks must be >= 1 blocks, got {a.M}")
    if a.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {a.jobs}")
    if a.jobs > 1 and a.inline:
        ap.error("--jobs > 1 runs arms in processes of their own; drop --inline or --jobs")
    if a.resume and not a.work:
        ap.error("--resume reuses the records of an earlier run's --work dir: give --work")
    missing = peers_arms.missing_parts(a.model, a.arms)
    if missing:  # `make bench` on a machine without the real model or the `real` extra
        print(f"peers: skipped: {missing}")
        return {"skipped": missing}
    if a.threads:
        torch.set_num_threads(a.threads)  # this process's evaluations (the bcd arms' too)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="peers-")
    work = Path(a.work or tmp.name).resolve()
    t0, load0 = time.perf_counter(), h.load_average()
    print(f"peers: {a.model} ({'quick' if a.quick else 'full'}), arms {' '.join(a.arms)}, "
          f"seeds {sc.seeds}, load average {load0}")  # fmt: skip
    prep = peers_arms.prepare_peers(sc, work, a.model)
    (work / "logs").mkdir(exist_ok=True)
    runs: list[dict] = []

    def one(arm: str, lr: float, seed: int) -> None:
        """One run, or its record from an earlier run of the same spec (--resume)."""
        name, mine = f"{arm}-lr{lr:g}-s{seed}", arm in BCD_ARMS  # mine: with --bcd-set's
        spec = {"arm": arm, "lr": lr, "seed": seed, "M": sc.M, "model_dir": prep["model_dir"],
                "overrides": [*prep["common"], *(prep["bcd_set"] if mine else [])],
                "init": prep["bcd_init" if mine else "init"],
                "initial_loss": prep["bcd_initial_loss" if mine else "initial_loss"],
                "blocks": prep["blocks"], "eval_batches": sc.eval_batches, "threads": a.threads,
                "inline": a.inline, "run_dir": str(work / "runs" / name),
                "config": str(peers_arms.FINETUNE), "mode": arm if mine else None,
                "runner": None if mine else "bench.peers_arms:hf_arm",
                "per_row": True}  # fmt: skip
        spec["start"] = {"steps": 0, "seconds": 0.0, "loss": spec["initial_loss"]} if mine else None
        made_by = {k: v for k, v in spec.items() if k != "run_dir"}  # what makes a run's result
        record, say = work / "runs" / f"{name}.json", f"  {arm:>13} lr {lr:<7g} seed {seed}:"
        r = json.loads(record.read_text()) if a.resume and record.is_file() else None
        if r and r.get("made_by") == json.loads(json.dumps(made_by)):
            print(f"{say} reused {record.name} (--resume)", flush=True)
        else:
            if r:
                print(f"{say} {record.name} was made by other settings: rerun", flush=True)
            r = run_arm(spec, log_path=None if a.inline else work / "logs" / f"{name}.log")
            r["made_by"] = made_by
            h.write_results(record, r)  # as soon as it ends: a bench stopped midway keeps it
            print(f"{say} val loss {r['curve'][0]['loss']:.4f} -> {r['final_loss']:.4f} in "
                  f"{r['seconds']:.0f}s train, peak RSS {r['peak_rss_mb']:.0f} MiB, load "
                  f"{r['load_start']}", flush=True)  # fmt: skip
        runs.append(r)

    def batch(jobs: list[tuple[str, float, int]]) -> None:
        """Runs, a.jobs at a time, each arm its own process (the parent's threads answer their
        evaluations); one job: in this thread, where an --inline arm's torch state is."""
        if a.jobs == 1:
            for job in jobs:
                one(*job)
            return
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            list(pool.map(lambda job: one(*job), jobs))  # each run's error raised here

    def order(i: int) -> list[str]:  # arms interleaved, the order rotated per seed
        return h.interleave([x for x in ARMS if x in a.arms], i)

    # seed 0: every lr of every swept arm, lrs interleaved across arms; then bcd-recompute at
    # bcd's best lr (its role is the same visits without the cache, not its own tuning)
    sweep = [x for x in order(0) if x != "bcd-recompute"]
    batch([(arm, sc.lrs[arm][i], sc.seeds[0]) for i in range(max(len(sc.lrs[x]) for x in sweep))
           for arm in sweep if i < len(sc.lrs[arm])])  # fmt: skip
    best = {arm: h.select_lr({r["lr"]: [r] for r in runs if r["arm"] == arm}, "final_loss")["lr"]
            for arm in sweep}  # fmt: skip
    later = []
    if "bcd-recompute" in a.arms:
        best["bcd-recompute"] = best["bcd"]
        later.append(("bcd-recompute", best["bcd"], sc.seeds[0]))
    later += [(arm, best[arm], seed) for i, seed in enumerate(sc.seeds[1:], start=1)
              for arm in order(i)]  # fmt: skip
    batch(later)
    runs.sort(key=lambda r: (sc.seeds.index(r["seed"]), ARMS.index(r["arm"]), r["lr"]))
    summary = summarise(runs, best, sc.seeds)
    res = {"model": a.model, "quick": a.quick, "scale": dataclasses.asdict(sc), "arms_run": a.arms,
           "prep": prep, "runs": runs, "best_lr": best, **summary, "inline": a.inline,
           "load_start": load0, "load_end": h.load_average(), "seconds": time.perf_counter() - t0,
           **host(), "python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": tf.__version__}  # fmt: skip
    res["table"] = render(res)
    print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s; "
          f"{res['cpus']} CPUs; {'arms in one process' if a.inline else 'one process per arm'})")  # fmt: skip
    name = "peers" + ("-tiny" if a.model == "tiny" else "-quick" if a.quick else "")
    name += "-sweep" if a.sweep and a.quick else ""
    res = h.without_paths(res, {str(work): "<work>", str(h.ROOT): "<repo>"})
    out = h.publish(res, res["table"], a.out, name)
    if tmp is not None:
        tmp.cleanup()
    return {"headline": {k: v["median"] for k, v in summary["targets"].items()},
            "results": str(out)}  # fmt: skip


if __name__ == "__main__":
    main()
