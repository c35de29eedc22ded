"""Planner accuracy: measured peak memory of the real trainer and pre-inference worker on CPU
against preinfer.plan.memory's estimate, as a markdown table (docs/planner.md has the results).

    python -m bench.plan_accuracy [--configs demo gpt2-small] [--arms preinfer] [--json out.json]
    python -m bench.plan_accuracy --calibrate   # prints the CPU constants of preinfer.plan.memory
    python -m bench.plan_accuracy --rescore out.json   # today's estimates of measured rows

Each arm runs in --repeats fresh processes (its row is the median): PeakMemory's baseline is the
RSS after the imports; then the real code runs, `Visit.run()` for the trainer (2 optimizer
steps: the second backward holds the optimizer state), `PrefixWorker` over every shard for
pre-inference. Measured: the peak RSS growth, and per-phase peaks at the product's own hooks
(trainer load, backward, step, eval, commit; pre-inference other, load, input, compute, encode).
--calibrate measures on a minimal model and llama-small at two shard sizes, never on the
validated configs. Token stores are synthetic (sizes in SETS), checkpoints and caches real.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

import numpy as np
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from bench.arms import PeakMemory, in_child
from bench.harness import ROOT, headline_table, quiet, write_results
from pipelines.cache_build import actor_env, create_writers, plan_block, shards_per_task
from pipelines.init import run_init
from pipelines.prefix_worker import PrefixWorker
from pipelines.train import visit_spec
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.modeling import build_model
from preinfer.model.partition import partition_layers
from preinfer.model.shape import model_shape
from preinfer.plan import memory as plan
from preinfer.run.config import config_from_dict, load_config
from preinfer.run.visit import Visit, VisitHooks
from preinfer.runtime.device import resolve_device
from preinfer.schedule.cache_identity import compute_choice
from preinfer.schedule.rotation import visit_budget
from storage.cache import CacheWriter
from storage.layout import rows_per_shard
from storage.tokens import TokenStoreWriter

MiB = plan.MiB
COMMON = ["train.workers=0", "train.max_steps=2", "train.eval_every=0", "train.eval_batches=1",
          "train.checkpoint_every=0", "train.warmup_steps=0", "run.device=cpu",
          "run.precision=fp32"]  # fmt: skip
# config -> (YAML or None, overrides, train samples, val samples): the demo with its corpus's
# sizes; gpt2-small at batch 4 x 256 with 32 MiB shards, about a minute an arm on 2 CPUs
SETS = {
    "demo": ("configs/demo.yaml", [], 11773, 1142),
    "gpt2-small": ("configs/gpt2-small.yaml",
                   ["train.batch_size=4", "data.seq_len=256", "cache.shard_mb=32"], 96, 16),
    "calibrate": (None, ["model.arch=sequential", "model.vocab_size=300", "model.hidden_size=16",
                         "model.num_layers=2", "model.num_heads=1", "model.max_positions=16",
                         "data.seq_len=16", "partition.num_blocks=2",
                         "train.batch_size=2", "cache.shard_mb=1"], 64, 8),
    "llama-small": ("configs/llama-small.yaml", ["train.batch_size=8", "cache.shard_mb=64"], 256, 16),
    "llama-small-s8": ("configs/llama-small.yaml", ["train.batch_size=8", "cache.shard_mb=8"], 256, 16),
}  # fmt: skip
CALIBRATION = ("calibrate", "llama-small", "llama-small-s8")  # never the validated configs
ONE_SHARD = ["preinfer.shards_per_task=1"]  # --calibrate: compute and encode peaks apart


def child(spec: dict, _ask=None) -> dict:
    """One arm in this (fresh) process: its peak RSS growth over the baseline, bytes."""
    import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer step: ~75 MB)
    import transformers  # noqa: F401

    from storage import reader  # noqa: F401

    cfg = config_from_dict(json.loads(Path(spec["cfg"]).read_text()))
    build_model(cfg.model, device="meta")  # imports the HF model module (lazy in transformers)
    block, refresh = spec["block"], spec.get("refresh", False)
    if spec["arm"] == "trainer":
        vspec = visit_spec(plan_block(cfg, block, 0, mode=spec["mode"]))
    else:
        plans = plan_block(cfg, block, 0).caches
        prev = plan_block(cfg, block - 1, 0).caches if refresh else ()  # a refresh's sources
        sources = {p.fingerprint: q.fingerprint for p, q in zip(plans, prev, strict=refresh)}
        first = block - 1 if refresh else 0
        # every shard, not only the missing ones: a repeat rewrites the same bytes (allowed
        # until the cache is finished) so each run does the same work
        items = [(p.fingerprint, s) for p in plans
                 for s in range(CacheWriter.open(cfg.cache.root, p.fingerprint).num_shards)]  # fmt: skip
    mem = PeakMemory()  # the baseline: every import above in it
    t0 = time.perf_counter()
    if spec["arm"] == "trainer":

        def set_up(visit, default):  # VisitHooks.batches: blocks loaded, data opened
            mem.mark("load")
            return default

        register_optimizer_step_pre_hook(lambda *a: mem.mark("backward"))
        register_optimizer_step_post_hook(lambda *a: mem.mark("step"))
        hooks = VisitHooks(on_eval=lambda *a: mem.mark("eval"), batches=set_up)
        Visit(cfg, vspec, device=resolve_device("cpu"), hooks=hooks).run(log=quiet)
        mem.mark("commit")
    else:
        choice = compute_choice(cfg.preinfer, cfg.cache, cfg.run.device)
        mem.mark("other")
        worker = PrefixWorker(cfg.to_dict(), block, first, sources, choice.compute,
                              choice.round_to, on_phase=mem.mark)  # fmt: skip
        k = shards_per_task(cfg, len(items), min(cfg.preinfer.actors, len(items)))  # as Ray would
        for j in range(0, len(items), k):
            group = items[j : j + k]
            worker({"fingerprint": [fp for fp, _ in group], "shard": [s for _, s in group]})
            mem.mark("encode")
    return {"growth": (mem.stop() - mem.baseline) * MiB, "baseline": mem.baseline * MiB,
            "phases": {k: v * MiB for k, v in mem.phases.items()},
            "seconds": time.perf_counter() - t0}  # fmt: skip


def _run_child(cfg_path: Path, arm: dict, repeats: int = 1) -> dict:
    """The arm in `repeats` fresh processes: the median peak (a process's peak moves with which
    of glibc's malloc arenas holds a freed buffer) and per-phase medians, every run's peak in
    "samples". A pre-inference child gets the environment Ray gives the worker actors
    (pipelines.cache_build.actor_env: two malloc arenas)."""
    arm_cfg = config_from_dict(json.loads(cfg_path.read_text()))
    env = {**os.environ, **(actor_env(arm_cfg) if arm["arm"] == "preinfer" else {})}
    runs = [in_child("bench.plan_accuracy:child", {**arm, "cfg": str(cfg_path)}, env=env)
            for _ in range(repeats)]  # fmt: skip
    keys = sorted({k for r in runs for k in r["phases"]})
    return {"growth": median(r["growth"] for r in runs), "samples": [r["growth"] for r in runs],
            "phases": {k: median(r["phases"].get(k, 0) for r in runs) for k in keys},
            "seconds": median(r["seconds"] for r in runs)}  # fmt: skip


def _planned(name: str, run_dir, extra=()):
    """The config `name` of SETS, its model's shape and the planner's Setup for it (pipelined
    as the child's worker calls are)."""
    path, over, n_tr, n_val = SETS[name]
    cfg = load_config(path and ROOT / path, [*COMMON, *extra, *over, f"run.dir={run_dir}"])
    sh = model_shape(cfg.model)
    rps = rows_per_shard(cfg.data.seq_len, sh.hidden, cfg.cache.dtype, cfg.cache.shard_mb)
    shards = -(-n_tr // rps) + -(-n_val // rps)  # the child's calls, as the actor pool gets them
    pipelined = shards_per_task(cfg, shards, min(cfg.preinfer.actors, shards)) > 1
    rows = visit_budget(cfg.train, cfg.preinfer.sample_fraction, n_tr, n_val)
    return cfg, sh, plan.setup_for(sh, cfg.train, cfg.cache, cfg.preinfer, target="cpu",
                                   seq=cfg.data.seq_len, token_rows=cfg.data.shard_rows,
                                   run_precision=cfg.run.precision, budget=rows,
                                   pipelined=pipelined)  # fmt: skip


def _estimated(row: dict, sh, part, p) -> dict:
    """row with preinfer.plan.memory's estimate for its arm (labelled as measure() names them)."""
    label = row["arm"]
    k = 0 if label.endswith("full") else int(label.split()[-1])
    if label.startswith("pre-inference"):
        est = plan.preinfer_memory(sh, part, k, p, refresh="refresh" in label)
    else:
        est = plan.trainer_memory(sh, part, "full" if label.endswith("full") else "bcd", k, p)
    return {**row, "estimate": est["peak"], "phase": est["phase"],
            "components": est["components"], "basis": est["basis"]}  # fmt: skip


def rescore(rows: list[dict]) -> list[dict]:
    """The same measured rows with estimates from preinfer.plan.memory as it is now (after
    recalibrating its constants); shapes and partitions are arithmetic, nothing runs."""
    out = []
    for r in rows:
        cfg, sh, p = _planned(r["config"], "unused")
        part = partition_layers(list(sh.layers), sh.embed, sh.head, cfg.partition.num_blocks)
        out.append(_estimated(r, sh, part, p))
    return out


def measure(name: str, work: Path, arms: str = "all", repeats: int = 1,
            extra: list[str] = ()) -> list[dict]:  # fmt: skip
    """Set up one config under `work` (`extra` overrides), run its arms (all, preinfer or
    trainer: the trainer arms still build the caches they read) `repeats` times each; rows
    with the estimate and the median measurement."""
    cfg, sh, p = _planned(name, work / name, extra)
    n_tr, n_val = SETS[name][2:]
    w = TokenStoreWriter(cfg.data.out_dir, seq_len=cfg.data.seq_len, shard_rows=4096)
    g = np.random.default_rng(0)
    for split, n in (("train", n_tr), ("val", n_val)):  # synthetic token ids
        ids = g.integers(0, cfg.model.vocab_size, (n, cfg.data.seq_len + 1), dtype=np.int32)
        w.write_split(split, iter(ids))
    w.commit({"fingerprint": f"bench-{n_tr}-{n_val}", "vocab_size": cfg.model.vocab_size})
    run_init(cfg, log=quiet)
    part = Checkpoint.open(cfg.run.checkpoint).partition
    M, rows = part.num_blocks, []

    def arm(label, cfg_, **spec):
        pre = label.startswith("pre-inference")
        f = work / name / f"cfg-{len(rows)}.json"
        f.write_text(cfg_.to_json())
        if arms not in ("all", "preinfer" if pre else "trainer"):  # not measured
            if pre:  # still built: the trainer arms read its cache
                _run_child(f, spec)
            return
        got = _run_child(f, spec, repeats=repeats)
        row = _estimated({"config": name, "arm": label, "measured": got["growth"],
                          "samples": got["samples"], "phases": got["phases"],
                          "seconds": got["seconds"]}, sh, part, p)  # fmt: skip
        rows.append(row)
        lo, hi = min(got["samples"]) / MiB, max(got["samples"]) / MiB
        print(f"  {name:10s} {label:28s} measured {got['growth'] / MiB:8.1f} MiB "
              f"[{lo:.1f}..{hi:.1f}]  estimate {row['estimate'] / MiB:8.1f} MiB ({row['phase']})",
              file=sys.stderr, flush=True)  # fmt: skip

    for k in range(1, M):  # boundary caches, built from tokens (the trainer arms read them)
        plans = create_writers(cfg, k, 0)
        arm(f"pre-inference build -> {k}", cfg, arm="preinfer", block=k)
        for q in plans:  # finalize: every shard checked, manifest written
            CacheWriter.open(cfg.cache.root, q.fingerprint).finalize()
    if M > 2 and name != "calibrate" and arms != "trainer":  # the last boundary, refreshed
        alt = copy.deepcopy(cfg)  # into a second root
        alt.cache.root = str(work / name / "cache-refresh")
        for q in plan_block(cfg, M - 2, 0).caches:  # the finished source boundary
            src, dst = (Path(c.cache.root, q.fingerprint) for c in (cfg, alt))
            shutil.copytree(src, dst)
        create_writers(alt, M - 1, 0)
        arm(f"pre-inference refresh -> {M - 1}", alt, arm="preinfer", block=M - 1, refresh=True)
    for k in range(M - 1, -1, -1):  # descending: a commit of block k leaves boundaries <= k valid
        arm(f"trainer bcd block {k}", cfg, arm="trainer", mode="bcd", block=k)
    arm("trainer full", cfg, arm="trainer", mode="full", block=0)
    return rows


def _line(xs, ys) -> str:
    """The least-squares fit as a HOST_IO entry, "(intercept * MiB, slope)": through the origin
    when the xs are all equal or the fitted intercept is negative (no evidence of a fixed part)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    fit = np.polyfit(xs, ys, 1) if np.ptp(xs) > 0 else None
    slope, icpt = fit if fit is not None and fit[1] >= 0 else (ys.sum() / xs.sum(), 0.0)
    return f"({icpt / MiB:.0f} * MiB, {slope:.2f})"


def suggest(rows: list[dict]) -> str:
    """The constants of preinfer.plan.memory these measurements imply (pasted in by hand): RUNTIME
    from the minimal model (a refresh's from llama-small's); on llama-small at two shard sizes,
    CPU_ALLOC from the token-fed trainer arms, HOST_IO cache_read from the cache-fed ones, and
    CPU_INFER and HOST_IO cache_write from the builds' compute and encode phases."""
    b = lambda r: r["basis"]  # noqa: E731

    def path(r):
        if "pre-inference" in r["arm"]:
            return "preinfer-refresh" if "refresh" in r["arm"] else "preinfer"
        return "trainer-cache" if b(r).get("cache_buffer") else "trainer"

    def peak(r):  # the trainer's backward peak (the constants below are backward terms)
        return r["phases"].get("backward", r["measured"])  # pre-inference: no backward phase

    def held(r):  # a worker's weights, input and output shards and inputs
        return b(r)["weights"] + 2 * b(r)["shard"] + b(r)["inputs"]

    def fixed(r):  # the compute phase less its terms other than RUNTIME (one shard per call)
        return r["phases"]["compute"] - held(r) - plan.CPU_INFER * b(r)["work"]

    run = {}
    for r in [r for r in rows if r["config"] == "calibrate"]:  # the minimal model's rows
        if path(r) == "preinfer":  # the compute phase: the encode's own terms are fitted below
            run["preinfer"] = fixed(r)
        else:
            rest = r["estimate"] - r["components"]["runtime"]
            run[path(r)] = max(run.get(path(r), 0), peak(r) - rest)
    # the minimal model has two blocks (no refresh): a refresh's fixed part from llama-small
    fresh = [fixed(r) for r in rows if path(r) == "preinfer-refresh"]
    if fresh:
        run["preinfer-refresh"] = mean(fresh)
    # while loading: what the load phase holds beyond the weights (and the cast's copy), any arm
    run["load"] = max(r["phases"]["load"] - b(r)["load"] for r in rows if "load" in r["phases"])
    out = [
        f"RUNTIME cpu {k}: {v / MiB:.0f} MiB (now {plan.RUNTIME[('cpu', k)] / MiB:.0f})"
        for k, v in sorted(run.items())
    ]
    cal = [r for r in rows if r["config"] != "calibrate"]
    tok = [r for r in cal if path(r) == "trainer"]
    cache = [r for r in cal if path(r) == "trainer-cache"]
    if tok and cache and "trainer" in run and "trainer-cache" in run:  # --arms all
        reads = [plan.host_io("token_read", b(r)["token_shard"]) for r in tok]
        alloc = mean(
            (peak(r) - run["trainer"] - b(r)["static"] - io) / b(r)["act"]
            for r, io in zip(tok, reads, strict=True)
        )
        rest = [peak(r) - run["trainer-cache"] - b(r)["static"] - b(r)["grads"] for r in cache]
        read = _line(
            [b(r)["cache_buffer"] for r in cache],
            [x - alloc * b(r)["act"] for r, x in zip(cache, rest, strict=True)],
        )
        out.append(f"CPU_ALLOC: {alloc:.2f} (now {plan.CPU_ALLOC})")
        out.append(f"HOST_IO cache_read: {read} (now {plan.HOST_IO['cache_read']})")
    pre = [r for r in cal if "build" in r["arm"]]
    if pre and "preinfer" in run:  # not with --arms trainer
        # calibration children run one shard per call (preinfer.shards_per_task=1): no overlap
        infer = mean(
            (r["phases"]["compute"] - run["preinfer"] - held(r)) / b(r)["work"] for r in pre
        )
        # the encode holds the output shard, not the input's
        encode = [r["phases"]["encode"] - run["preinfer"] - held(r) + b(r)["shard"] for r in pre]
        write = _line([b(r)["shard"] for r in pre], encode)
        out.append(f"CPU_INFER: {infer:.2f} (now {plan.CPU_INFER})")
        out.append(f"HOST_IO cache_write: {write} (now {plan.HOST_IO['cache_write']})")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = [("config", "arm", "measured MiB (median)", "runs, min..max", "estimate MiB", "error",
            "error range over runs", "peak phase (estimate)")]  # fmt: skip
    for r in rows:
        runs = r.get("samples", [r["measured"]])  # rows from before --repeats have one run
        errs = sorted((r["estimate"] - m) / m for m in runs)
        out.append((r["config"], r["arm"], f"{r['measured'] / MiB:.1f}",
                    f"{len(runs)}, {min(runs) / MiB:.1f}..{max(runs) / MiB:.1f}",
                    f"{r['estimate'] / MiB:.1f}", f"{r['estimate'] / r['measured'] - 1:+.1%}",
                    f"{errs[0]:+.1%}..{errs[-1]:+.1%}", r["phase"]))  # fmt: skip
    return headline_table(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["demo", "gpt2-small"],
                    choices=sorted(set(SETS) - set(CALIBRATION)))  # fmt: skip
    ap.add_argument("--calibrate", action="store_true", help="measure the runtime constants")
    ap.add_argument("--arms", choices=["all", "preinfer", "trainer"], default="all",
                    help="which arms to measure (default all)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3,
                    help="fresh processes per arm; the row is their median peak (default 3)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--rescore", default=None, metavar="JSON",
                    help="re-estimate the measured rows of an earlier --json (no measuring)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="the minimal 2-block model, 1 run (tests)")
    args = ap.parse_args(argv)
    if args.rescore:
        rows = rescore(json.loads(Path(args.rescore).read_text()))
    else:
        names = ["calibrate"] if args.tiny else CALIBRATION if args.calibrate else args.configs
        repeats, extra = 1 if args.tiny else args.repeats, ONE_SHARD if args.calibrate else []
        rows = []
        with tempfile.TemporaryDirectory(prefix="plan-acc-") as tmp:
            for name in names:
                rows += measure(name, Path(tmp), args.arms, repeats, extra)
    if args.json:  # the measurements first: they take the time
        write_results(Path(args.json), rows)
    if args.calibrate:
        print(suggest(rows))
    print(table(rows))
    env = actor_env(load_config(None)) or "glibc defaults"
    print(f"\n(peak RSS growth over the post-import baseline, CPU, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; pre-inference children with {env})")  # fmt: skip
    errs = [(r["estimate"] - r["measured"]) / r["measured"] for r in rows]
    headline = {"arms": len(rows), "within 15%": sum(abs(e) <= 0.15 for e in errs),
                "worst error": max(errs, key=abs) if errs else None}  # fmt: skip
    return {"headline": headline, "rows": rows}


if __name__ == "__main__":
    main()
