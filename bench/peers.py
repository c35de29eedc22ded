"""Peers: BCD with the cache against recompute, full fine-tuning, BAdam and LoRA (#27 item 6).

    python -m bench.peers --quick                       # make bench: 1 lr per arm, 4 steps of
        # batch 4 per block visit, 1 seed: 7.3 min on 2 CPUs at load average 9.7 -> 4.7
        # (bench/results/peers-quick-20261201-163112.json)
    nice -n 19 .venv/bin/python -m bench.peers --work runs/peers   # the full form, by hand: 3 lrs
        # per arm on seed 0, then seeds 1 and 2 at each arm's best lr, 30 steps of batch 8 per
        # block visit (28 arm runs; from the quick run's step times, several hours on 2 CPUs;
        # --work keeps the data, token store and init checkpoint for a rerun)
    python -m bench.peers --quick --model tiny --inline # a tiny random LLaMA, arms in this process
        # (tests/test_peers_bench.py; --inline: peak RSS is then not each arm's own)
    python -m bench.peers --quick --sweep               # the quick steps, 3 lrs per arm swept
    python -m bench.peers --seeds 0 --lrs full=3e-5,1e-4,3e-4   # the full form's sweep only,
        # with full's grid moved up one step
    python -m bench.peers --arms bcd --lrs bcd=3e-4 --cache-dtype fp32   # bcd with caches that
        # hold the prefix's fp32 hidden states (the cache's rounding, against bcd-recompute)
    python -m bench.peers --arms bcd badam-blocks full --bcd-set model.tie_embeddings=false \
        --bcd-set train.always_train=[head]   # bcd with the tied head untied for training and
        # trained in every visit (its own init checkpoint); the other arms as they are
    python -m bench.peers --work runs/peers --jobs 2 --resume   # two arms at a time (each arm
        # then shares the machine with another: the load is recorded per run); --resume reuses
        # every run whose record <work>/runs/*.json the same settings made (a stopped bench
        # goes on where it stopped)

Without the real model or the `real` extra (badam, peft) the default run prints why and
returns {"skipped": ...} (`make bench` runs every bench module's --quick form).

A real pretrained model (default models/smollm2-135m-instruct: SmolLM2-135M-Instruct, LLaMA
layout, tied embeddings; `make real-model` makes it) fine-tuned on offline instruction data:
prompt/response pairs built from the Python standard library's docstrings (prompt: the chat
turn "What does `module.name` do?", response: the first paragraph of its docstring; 1,200
pairs in a fixed hash order, deterministic for a Python version; the jsonl's sha256 is
recorded). One token store (configs/finetune.yaml, data.format=prompt_response: the loss
counts response tokens only) and one init checkpoint serve every arm. Arms:

  bcd            preinfer's rotation with the cache: pipelines.bcd.run_bcd (M blocks ascending,
                 train.max_steps steps per visit, 1 pass over each visit's rows, AdamW, one
                 warmup + cosine over the rotation, AdamW state kept across rounds: the
                 product's defaults; train.cache_visits M: each visit its own rows, as every
                 arm reads them)
  bcd-recompute  the same rotation, the frozen prefix rerun every step (run_bcd mode
                 bcd-recompute), at bcd's lr: the cache's own saving, same visits
  full           plain transformers: AutoModelForCausalLM from the model dir, AdamW on every
                 parameter, one warmup + cosine over the run
  badam-layers   PyPI badam's BlockOptimizer over that HF model with its default block list
                 (one block per layer; embedding and final norm never trained), ascending, one
                 warmup + cosine over the run (BAdam's recipe); it switches block every
                 (M x steps per visit) / L steps, so a round visits every layer once
  badam-blocks   the same with preinfer's M blocks as its block list (the checkpoint's
                 partition: embedding + first layers, ..., last layers + final norm), ascending,
                 steps per visit steps per block: the rotation's blocks and steps
  lora           PyPI peft on that HF model: r 16, alpha 32, every linear layer of the
                 transformer ("all-linear"), AdamW, one warmup + cosine over the run

Every arm reads the same batches: the HF arms read, for visit (round r, block k), the batches
bcd-recompute (and bcd's block 0) reads (preinfer.batches.TokenBatches over the round's sampled
rows, preinfer.cache_identity.sample_indices / row_order, seeded per visit); bcd's later
blocks read the same rows from the cache. Same steps in every arm (rounds x M x steps per
visit), batch, weight decay 1e-5, gradient clipping 1.0, fp32 (BAdam expects bf16 weights and
keeps fp32 copies of the active block; on an AVX2 CPU bf16 matmuls are ~50x slower, so the
model is fp32 and BAdam's copy duplicates the active block). The HF arms compute the LM head on
response positions only, as preinfer's loss does, so no arm pays the head where no label counts.

Measured: val loss (response tokens only, the first eval_batches x batch val rows, the same in
every arm: preinfer.loss.evaluate_tokens; for the bcd arms through `preinfer eval` of the run's
checkpoint, made in the parent process while the arm waits) after every visit's worth of steps,
against training seconds: everything the arm does (model load, cache builds, visits, commits,
the HF arms' final save_pretrained) less evaluations (the bench's, and the visit's own val
evaluation). Each arm runs in its own subprocess (`--child`): its peak RSS is the kernel's
high-water mark (VmHWM) polled every 10 ms after the imports, paused around the bench's
evaluations (the product resets it at every visit, preinfer.trainer.reset_peak_memory, so it is
polled, not read once). Arms interleave (the order rotates with the seed); the full form sweeps
each arm's lr on the first seed, then runs the other seeds at each arm's best lr (lowest final
val loss). Targets (issue #27): bcd's wall-clock to BAdam's final val loss / BAdam's (<= 0.8);
bcd's val loss at full's wall-clock / full's (stretch <= 1.0); bcd's peak RSS / BAdam's
(<= 1.0). Curve points are visit ends, so "time to reach" is the first visit end at or below.
One torch thread per arm by default (--threads): with other work on the 2 CPUs, two threads
spend their time waiting on each other (a 256x576x1536 matmul at load ~9: 24 GFLOP/s on one
thread, 8 on two).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import transformers as tf

from bench.harness import headline_table, load_average, results_path, without_paths, write_results
from bench.peers_arms import ARMS, child_main, run_arm, spawn_arm
from bench.peers_data import FULL, QUICK, REAL_MODEL, ROOT, TINY, eval_run, missing_parts, prepare

# ---------------------------------------------------------------------------------------------
# The study


def first_at_or_below(curve: list[dict], loss: float) -> dict | None:
    for p in curve:
        if p["loss"] <= loss:
            return p
    return None


def loss_at(curve: list[dict], seconds: float) -> float:
    """The loss of the last curve point at or before `seconds` (an arm that finished sooner
    stopped there: conservative for it)."""
    return [p for p in curve if p["seconds"] <= seconds][-1]["loss"]


def targets(runs: dict[str, dict]) -> dict:
    """The issue's ratios for one seed's best-lr runs (arm -> run)."""
    bcd, out = runs["bcd"], {}
    for b in ("badam-layers", "badam-blocks"):
        if b not in runs:
            continue
        hit = first_at_or_below(bcd["curve"], runs[b]["final_loss"])
        out[f"bcd_time_to_{b}_loss"] = hit["seconds"] / runs[b]["seconds"] if hit else None
        out[f"bcd_peak_over_{b}"] = bcd["peak_rss_mb"] / runs[b]["peak_rss_mb"]
        # the same steps: where bcd ends level with b, the time to b's loss hangs on ~1e-3
        out[f"bcd_over_{b}_seconds"] = bcd["seconds"] / runs[b]["seconds"]
        out[f"bcd_minus_{b}_loss"] = bcd["final_loss"] - runs[b]["final_loss"]
    if "lora" in runs:  # #41: at LoRA's wall-clock, at LoRA's memory
        lora = runs["lora"]
        out["bcd_loss_at_lora_time"] = loss_at(bcd["curve"], lora["seconds"]) / lora["final_loss"]
        out["bcd_peak_over_lora"] = bcd["peak_rss_mb"] / lora["peak_rss_mb"]
    if "full" in runs:
        full = runs["full"]
        out["bcd_loss_at_full_time"] = loss_at(bcd["curve"], full["seconds"]) / full["final_loss"]
    if "bcd-recompute" in runs:
        out["bcd_over_recompute_seconds"] = bcd["seconds"] / runs["bcd-recompute"]["seconds"]
    return out


def spread(vals: list[float | None]) -> dict:
    """Median and [min, max] over ALL seeds, a seed that never reached (None) counted as not
    reached (above every reached value): the median is None when half or more did not reach."""
    v = sorted(x for x in vals if x is not None)
    n, of = len(v), len(vals)
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0, "of": of}
    ranked = v + [math.inf] * (of - n)
    med = statistics.median(ranked)
    return {"median": None if math.isinf(med) else med, "min": v[0],
            "max": v[-1] if n == of else None, "n": n, "of": of}  # fmt: skip


TARGETS = [  # key, what, target, met when
    ("bcd_time_to_badam-layers_loss", "bcd wall-clock to badam-layers' final val loss / "
     "badam-layers'", "<= 0.8", lambda v: v <= 0.8),
    ("bcd_time_to_badam-blocks_loss", "bcd wall-clock to badam-blocks' final val loss / "
     "badam-blocks'", "<= 0.8", lambda v: v <= 0.8),
    ("bcd_loss_at_full_time", "bcd val loss at full's wall-clock / full's final (stretch)",
     "<= 1.0", lambda v: v <= 1.0),
    ("bcd_loss_at_lora_time", "bcd val loss at LoRA's wall-clock / LoRA's final (#41)",
     "<= 1.0", lambda v: v <= 1.0),
    ("bcd_peak_over_lora", "bcd peak RSS / LoRA's (#41)", "<= 1.0", lambda v: v <= 1.0),
    ("bcd_peak_over_badam-layers", "bcd peak RSS / badam-layers'", "<= 1.0", lambda v: v <= 1.0),
    ("bcd_peak_over_badam-blocks", "bcd peak RSS / badam-blocks'", "<= 1.0", lambda v: v <= 1.0),
    ("bcd_over_badam-blocks_seconds", "bcd seconds / badam-blocks' (the same steps)", "", None),
    ("bcd_minus_badam-blocks_loss", "bcd final val loss - badam-blocks'", "", None),
    ("bcd_over_recompute_seconds", "bcd seconds / bcd-recompute's (same visits)", "", None),
]  # fmt: skip


def _fmt(v, f="{:.3f}") -> str:
    return "n/a" if v is None else f.format(v)


def render(res: dict) -> str:
    rows = [("arm", "lr", "val loss: start -> final (median [min, max])", "train s (median)",
             "peak RSS MiB (growth)", "trainable params", "steps", "load at start")]  # fmt: skip
    for arm, s in res["arms"].items():
        fl, sec = s["final_loss"], s["seconds"]
        rows.append((arm, f"{s['lr']:g}",
                     f"{s['start_loss']:.4f} -> {fl['median']:.4f} [{fl['min']:.4f}, {fl['max']:.4f}]",
                     f"{sec['median']:.0f} [{sec['min']:.0f}, {sec['max']:.0f}]",
                     f"{s['peak_rss_mb']['median']:.0f} ({s['peak_growth_mb']['median']:.0f})",
                     s["trainable"], str(s["steps"]), str(s["load_start"])))  # fmt: skip
    t = [("target (issue #27)", "median", "[min, max]", "seeds", "target", "met")]
    for key, what, goal, ok in TARGETS:
        s = res["targets"].get(key)
        if s is None:
            continue
        m = s["median"]
        met = "" if ok is None else ("n/a" if m is None else ("yes" if ok(m) else "NO"))
        f = "{:+.4f}" if key.endswith("_loss") and key.startswith("bcd_minus") else "{:.3f}"
        t.append((what, _fmt(m, f), f"[{_fmt(s['min'], f)}, {_fmt(s['max'], f)}]",
                  f"{s['n']}/{s['of']}", goal, met))  # fmt: skip
    sweep = [("arm", "lr", "seed", "final val loss", "train s", "peak RSS MiB", "load at start")]
    for r in res["runs"]:
        sweep.append((r["arm"], f"{r['lr']:g}", str(r["seed"]), f"{r['final_loss']:.4f}",
                      f"{r['seconds']:.0f}", f"{r['peak_rss_mb']:.0f}", str(r["load_start"])))  # fmt: skip
    return "\n\n".join(headline_table(x) for x in (rows, t, sweep))


def _trainable(run: dict) -> str:
    t = run["trainable_params"]
    return f"{min(t) / 1e6:.2f}M-{max(t) / 1e6:.2f}M" if min(t) != max(t) else f"{t[0] / 1e6:.2f}M"


def summarise(runs: list[dict], best: dict[str, float], seeds: list[int]) -> dict:
    """Per arm at its best lr: medians and spread over seeds; the targets per seed, then their
    medians."""
    at_best = {a: [r for r in runs if r["arm"] == a and r["lr"] == best[a]] for a in best}
    arms = {}
    for a, rs in at_best.items():
        if not rs:
            continue
        arms[a] = {
            "lr": best[a], "seeds": [r["seed"] for r in rs],
            "start_loss": rs[0]["curve"][0]["loss"],
            "final_loss": spread([r["final_loss"] for r in rs]),
            "seconds": spread([r["seconds"] for r in rs]),
            "peak_rss_mb": spread([r["peak_rss_mb"] for r in rs]),
            "peak_growth_mb": spread([r["peak_growth_mb"] for r in rs]),
            "trainable": _trainable(rs[0]), "steps": rs[0]["steps"],
            "load_start": rs[0]["load_start"], "schedule": rs[0]["schedule"],
        }  # fmt: skip
    per_seed = []
    for s in seeds:
        by_arm = {a: next((r for r in rs if r["seed"] == s), None) for a, rs in at_best.items()}
        by_arm = {a: r for a, r in by_arm.items() if r is not None}
        if "bcd" in by_arm:
            per_seed.append({"seed": s, **targets(by_arm)})
    keys = sorted({k for t in per_seed for k in t if k != "seed"})
    return {"arms": arms, "per_seed": per_seed,
            "targets": {k: spread([t.get(k) for t in per_seed]) for k in keys}}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 lr per arm, 6 steps per visit, 1 seed")
    ap.add_argument("--model", default=str(REAL_MODEL),
                    help="a LLaMA-layout HF model dir (default: the real model), or 'tiny'")  # fmt: skip
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per block visit")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=None,
                    help="M: blocks of the rotation, and of badam-blocks' block list (default 3)")  # fmt: skip
    ap.add_argument(
        "--cache-dtype",
        default=None,
        choices=["bf16", "fp16", "fp32"],
        help="cache.dtype of the bcd arm (default bf16)",
    )
    ap.add_argument("--data", default=None, choices=["stdlib", "sitepkgs"],
                    help="instruction set: stdlib docstrings (default) or the held-out "
                         "site-packages docstrings")  # fmt: skip
    ap.add_argument("--eval-batches", type=int, default=None,
                    help="val batches of every evaluation (0 = the whole val split; default 4)")  # fmt: skip
    ap.add_argument("--bcd-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the bcd arms only (repeatable), e.g. "
                         "model.tie_embeddings=false, train.always_train=[head]")  # fmt: skip
    ap.add_argument("--sweep", action="store_true",
                    help="the full form's 3 lrs per arm at this scale (e.g. with --quick)")  # fmt: skip
    ap.add_argument("--lrs", action="append", default=[], metavar="ARM=LR,LR,...",
                    help="an arm's lr grid (repeatable), e.g. badam-blocks=1e-4,3e-4,1e-3")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of each arm and of the evaluations (default 1: on a busy "
                         "machine two threads wait on each other; 0 = torch's default)")  # fmt: skip
    ap.add_argument("--inline", action="store_true",
                    help="run the arms in this process (fast; peak RSS is then not each arm's own)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=1,
                    help="arms run this many at a time, each its own process (default 1)")  # fmt: skip
    ap.add_argument("--resume", action="store_true",
                    help="with --work: reuse each run whose record <work>/runs/*.json was made "
                         "by the same settings; run the rest")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep every run's checkpoint / weights")
    ap.add_argument("--work", default=None, help="keep data, tokens, init and runs here")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        child_main(a.child)
        return {}
    sc = dataclasses.replace(TINY if a.model == "tiny" else QUICK if a.quick else FULL)
    for name, v in (("seeds", a.seeds), ("steps_per_visit", a.steps), ("rounds", a.rounds),
                    ("M", a.blocks), ("cache_dtype", a.cache_dtype), ("data", a.data),
                    ("eval_batches", a.eval_batches)):  # fmt: skip
        if v is not None:
            setattr(sc, name, v)
    for item in a.bcd_set:
        if "=" not in item:
            ap.error(f"--bcd-set {item!r}: give KEY=VALUE, e.g. train.always_train=[head]")
    sc.bcd_set = list(a.bcd_set)
    sc.lrs = dict(FULL.lrs if a.sweep else sc.lrs)  # a copy: the preset's own dict stays
    for item in a.lrs:
        arm, _, grid = item.partition("=")
        if arm not in sc.lrs or not grid:
            ap.error(f"--lrs {item!r}: give ARM=LR,LR,... with ARM one of {sorted(sc.lrs)}")
        try:
            sc.lrs[arm] = [float(x) for x in grid.split(",")]
        except ValueError:
            ap.error(f"--lrs {item!r}: the lrs must be numbers, e.g. {arm}=1e-4,3e-4")
    if "bcd" not in a.arms:
        raise SystemExit("--arms must include bcd: every target is a ratio to it")
    if a.blocks is not None and a.blocks < 1:
        ap.error(f"--blocks must be >= 1 blocks, got {a.blocks}")
    if a.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {a.jobs}")
    if a.jobs > 1 and a.inline:
        ap.error("--jobs > 1 runs arms in processes of their own; drop --inline or --jobs")
    if a.resume and not a.work:
        ap.error("--resume reuses the records of an earlier run's --work dir: give --work")
    missing = missing_parts(a.model, a.arms)
    if missing:  # `make bench` on a machine without the real model or the `real` extra
        print(f"peers: skipped: {missing}")
        return {"skipped": missing}
    if a.threads:
        torch.set_num_threads(a.threads)  # this process's evaluations (the bcd arms' too)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="peers-")
    work = Path(a.work or tmp.name).resolve()
    t0, load0 = time.perf_counter(), load_average()
    print(f"peers: {a.model} ({'quick' if a.quick else 'full'}), arms {' '.join(a.arms)}, "
          f"seeds {sc.seeds}, load average {load0}")  # fmt: skip
    prep = prepare(sc, work, a.model)
    (work / "logs").mkdir(exist_ok=True)
    runs: list[dict] = []

    def one(arm: str, lr: float, seed: int) -> dict:
        name = f"{arm}-lr{lr:g}-s{seed}"
        mine = arm.startswith("bcd")  # bcd, bcd-recompute: with --bcd-set's overrides
        spec = {"arm": arm, "lr": lr, "seed": seed, "M": sc.M, "model_dir": prep["model_dir"],
                "overrides": [*prep["common"], *(prep["bcd_set"] if mine else [])],
                "init": prep["bcd_init" if mine else "init"],
                "initial_loss": prep["bcd_initial_loss" if mine else "initial_loss"],
                "blocks": prep["blocks"],
                "eval_batches": sc.eval_batches, "threads": a.threads, "keep": a.keep,
                "inline": a.inline, "run_dir": str(work / "runs" / name)}  # fmt: skip
        # what makes a run's result: a record made by another spec is not reused
        made_by = {k: v for k, v in spec.items() if k not in ("keep", "run_dir")}
        record = work / "runs" / f"{name}.json"
        if a.resume and record.is_file():
            r = json.loads(record.read_text())
            if r.get("made_by") == json.loads(json.dumps(made_by)):
                runs.append(r)
                print(f"  {arm:>13} lr {lr:<7g} seed {seed}: reused {record.name} (--resume)",
                      flush=True)  # fmt: skip
                return r
            print(f"  {arm:>13} lr {lr:<7g} seed {seed}: {record.name} was made by other "
                  "settings: rerun", flush=True)  # fmt: skip
        if a.inline:
            r = run_arm(spec, lambda ov: eval_run(ov, sc.eval_batches))
        else:
            r = spawn_arm(spec, work / "logs" / f"{name}.log")
        r["made_by"] = made_by
        runs.append(r)
        # each run's record as soon as it ends: a bench stopped midway keeps what ran
        write_results(record, r)
        print(f"  {arm:>13} lr {lr:<7g} seed {seed}: val loss {r['curve'][0]['loss']:.4f} -> "
              f"{r['final_loss']:.4f} in {r['seconds']:.0f}s train, peak RSS "
              f"{r['peak_rss_mb']:.0f} MiB, load {r['load_start']}", flush=True)  # fmt: skip
        return r

    def batch(jobs: list[tuple[str, float, int]]) -> None:
        """Runs, a.jobs at a time (each arm's own process; the parent answers their
        evaluations in its threads). Every run's record lands in `runs`."""
        if a.jobs == 1:
            for j in jobs:
                one(*j)
            return
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            for f in [pool.submit(one, *j) for j in jobs]:
                f.result()

    def order(i: int) -> list[str]:  # arms interleaved, the order rotated per seed
        arms = [x for x in ARMS if x in a.arms]
        return arms[i % len(arms):] + arms[: i % len(arms)]  # fmt: skip

    # seed 0: every lr of every swept arm, lrs interleaved across arms; then bcd-recompute at
    # bcd's best lr (its role is the same visits without the cache, not its own tuning)
    sweep = [x for x in order(0) if x != "bcd-recompute"]
    batch([(arm, sc.lrs[arm][i], sc.seeds[0]) for i in range(max(len(sc.lrs[x]) for x in sweep))
           for arm in sweep if i < len(sc.lrs[arm])])  # fmt: skip
    best = {}
    for arm in sweep:
        mine = [r for r in runs if r["arm"] == arm]
        best[arm] = min(mine, key=lambda r: (r["final_loss"], r["lr"]))["lr"]
    later = []
    if "bcd-recompute" in a.arms:
        best["bcd-recompute"] = best["bcd"]
        later.append(("bcd-recompute", best["bcd"], sc.seeds[0]))
    later += [(arm, best[arm], seed) for i, seed in enumerate(sc.seeds[1:], start=1)
              for arm in order(i)]  # fmt: skip
    batch(later)
    runs.sort(key=lambda r: (sc.seeds.index(r["seed"]), ARMS.index(r["arm"]), r["lr"]))
    summary = summarise(runs, best, sc.seeds)
    res = {"model": a.model, "quick": a.quick, "scale": asdict(sc), "arms_run": a.arms,
           "prep": prep, "runs": runs, "best_lr": best, **summary, "inline": a.inline,
           "load_start": load0, "load_end": load_average(), "seconds": time.perf_counter() - t0,
           "cpus": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": tf.__version__}  # fmt: skip
    res["table"] = render(res)
    print(res["table"])
    print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s; "
          f"{os.cpu_count()} CPUs; {'arms in one process' if a.inline else 'one process per arm'})")  # fmt: skip
    name = "peers" + ("-tiny" if a.model == "tiny" else "-quick" if a.quick else "")
    name += "-sweep" if a.sweep and a.quick else ""
    out = Path(a.out) if a.out else results_path(name)
    write_results(out, without_paths(res, {str(work): "<work>", str(ROOT): "<repo>"}))
    print(f"results: {out}")
    if tmp is not None:
        tmp.cleanup()
    return {"headline": {k: v["median"] for k, v in summary["targets"].items()},
            "results": str(out)}  # fmt: skip


if __name__ == "__main__":
    main()
