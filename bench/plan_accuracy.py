"""Planner accuracy: measured peak memory of the real trainer and pre-inference worker on CPU
against preinfer.plan.memory's estimate, as a markdown table (docs/planner.md has the results).

    python -m bench.plan_accuracy [--configs demo gpt2-small] [--json out.json]
    python -m bench.plan_accuracy --calibrate   # prints the CPU constants of preinfer.plan.memory

Each arm runs in --repeats fresh processes (bench/arms.py's in_child; its row is the median):
the imports first, then PeakMemory takes the RSS as the baseline and polls the high-water
mark while the real code runs: `Visit.run()` for the trainer (2 optimizer steps, so the
second backward holds the optimizer state; the eval, the commit), `PrefixWorker` over every shard for pre-inference. Measured: the peak RSS growth
over the baseline, and per-phase peaks (PeakMemory.mark at the product's own hooks, nothing
patched): trainer load (VisitHooks.batches), backward (torch's optimizer step pre-hook), step
(its post-hook), eval (VisitHooks.on_eval), commit; pre-inference other, load, input, compute
(PrefixWorker's on_phase), encode (apart from compute only with one shard per call).
The estimate is plan.trainer_memory / plan.preinfer_memory for the same config, target="cpu";
--calibrate measures its constants on a minimal model and configs/llama-small.yaml at two shard
sizes, never on the validated configs. Token stores are synthetic (sizes in SETS), checkpoints
and caches real.
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
        first = block - 1 if refresh else 0
        sources = {}
        if refresh:
            prev = plan_block(cfg, block - 1, 0).caches
            sources = {p.fingerprint: q.fingerprint for p, q in zip(plans, prev, strict=True)}
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
    peak, MiB = mem.stop(), 2**20
    return {"growth": (peak - mem.baseline) * MiB, "baseline": mem.baseline * MiB,
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


def _tokens(cfg, n_train: int, n_val: int) -> None:
    w = TokenStoreWriter(cfg.data.out_dir, seq_len=cfg.data.seq_len, shard_rows=4096)
    g = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        rows = g.integers(0, cfg.model.vocab_size, (n, cfg.data.seq_len + 1), dtype=np.int32)
        w.write_split(split, iter(rows))
    w.commit({"fingerprint": f"bench-{n_train}-{n_val}", "vocab_size": cfg.model.vocab_size})


def _setup(cfg, sh, n_tr: int, n_val: int):
    """The planner's Setup for an arm's config, pipelined as the child's worker calls are."""
    rps = rows_per_shard(cfg.data.seq_len, sh.hidden, cfg.cache.dtype, cfg.cache.shard_mb)
    shards = -(-n_tr // rps) + -(-n_val // rps)  # the child's calls, as the actor pool gets them
    pipelined = shards_per_task(cfg, shards, min(cfg.preinfer.actors, shards)) > 1
    rows = visit_budget(cfg.train, cfg.preinfer.sample_fraction, n_tr, n_val)
    return plan.setup_for(sh, cfg.train, cfg.cache, cfg.preinfer, target="cpu",
                          seq=cfg.data.seq_len, token_rows=cfg.data.shard_rows,
                          run_precision=cfg.run.precision, budget=rows,
                          pipelined=pipelined)  # fmt: skip


def _estimate(sh, part, p, label: str) -> dict:
    """preinfer.plan.memory's estimate for the arm named `label` (as measure() names them)."""
    k = 0 if label.endswith("full") else int(label.split()[-1])
    if label.startswith("pre-inference"):
        return plan.preinfer_memory(sh, part, k, p, refresh="refresh" in label)
    return plan.trainer_memory(sh, part, "full" if label.endswith("full") else "bcd", k, p)


def _estimated(row: dict, est: dict) -> dict:
    return {**row, "estimate": est["peak"], "phase": est["phase"],
            "components": est["components"], "basis": est["basis"]}  # fmt: skip


def rescore(rows: list[dict]) -> list[dict]:
    """The same measured rows with estimates from preinfer.plan.memory as it is now (after
    recalibrating its constants); shapes and partitions are arithmetic, nothing runs."""
    out = []
    for r in rows:
        path, over, n_tr, n_val = SETS[r["config"]]
        cfg = load_config(ROOT / path if path else None, [*COMMON, *over, "run.dir=unused"])
        sh = model_shape(cfg.model)
        part = partition_layers(list(sh.layers), sh.embed, sh.head, cfg.partition.num_blocks)
        out.append(_estimated(r, _estimate(sh, part, _setup(cfg, sh, n_tr, n_val), r["arm"])))
    return out


def measure(name: str, work: Path, arms: str = "all", repeats: int = 1,
            extra: list[str] = ()) -> list[dict]:  # fmt: skip
    """Set up one config under `work` (`extra` overrides), run its arms (all, preinfer or
    trainer: the trainer arms still build the caches they read) `repeats` times each; rows
    with the estimate and the median measurement."""
    path, over, n_tr, n_val = SETS[name]
    cfg = load_config(ROOT / path if path else None,
                      [*COMMON, *extra, *over, f"run.dir={work / name}"])  # fmt: skip
    _tokens(cfg, n_tr, n_val)
    run_init(cfg, log=quiet)
    part = Checkpoint.open(cfg.run.checkpoint).partition
    sh = model_shape(cfg.model)
    p = _setup(cfg, sh, n_tr, n_val)
    M, rows = part.num_blocks, []

    def arm(label, cfg_, **spec):
        pre = label.startswith("pre-inference")
        f = work / name / f"cfg-{len(rows)}.json"
        f.write_text(cfg_.to_json())
        if arms not in ("all", "preinfer" if pre else "trainer"):  # not measured
            if pre:  # still built: the trainer arms read its cache
                _run_child(f, spec)
            return
        est = _estimate(sh, part, p, label)
        got = _run_child(f, spec, repeats=repeats)
        rows.append(_estimated({"config": name, "arm": label, "measured": got["growth"],
                                "samples": got["samples"], "phases": got["phases"],
                                "seconds": got["seconds"]}, est))  # fmt: skip
        lo, hi = min(got["samples"]) / 2**20, max(got["samples"]) / 2**20
        print(f"  {name:10s} {label:28s} measured {got['growth'] / 2**20:8.1f} MiB "
              f"[{lo:.1f}..{hi:.1f}]  estimate {est['peak'] / 2**20:8.1f} MiB ({est['phase']})",
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
            shutil.copytree(
                Path(cfg.cache.root) / q.fingerprint, Path(alt.cache.root) / q.fingerprint
            )
        create_writers(alt, M - 1, 0)
        arm(f"pre-inference refresh -> {M - 1}", alt, arm="preinfer", block=M - 1, refresh=True)
    for k in range(M - 1, -1, -1):  # descending: a commit of block k leaves boundaries <= k valid
        arm(f"trainer bcd block {k}", cfg, arm="trainer", mode="bcd", block=k)
    arm("trainer full", cfg, arm="trainer", mode="full", block=0)
    return rows


def _line(xs, ys) -> tuple[float, float]:
    """Least-squares (intercept, slope); through the origin when the xs are all equal or the
    fitted intercept is negative (no evidence of a fixed part)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if np.ptp(xs) > 0:
        slope, icpt = np.polyfit(xs, ys, 1)
        if icpt >= 0:
            return float(icpt), float(slope)
    return 0.0, float(ys.sum() / xs.sum())


def suggest(rows: list[dict]) -> str:
    """The constants of preinfer.plan.memory these measurements imply (pasted in by hand): RUNTIME
    from the minimal model (a refresh's from llama-small's); on llama-small at two shard sizes,
    CPU_ALLOC from the token-fed trainer arms, HOST_IO cache_read from the cache-fed ones, and
    CPU_INFER and HOST_IO cache_write from the builds' compute and encode phases."""
    from preinfer.plan.memory import CPU_ALLOC, CPU_INFER, HOST_IO, RUNTIME, MiB, host_io

    def path(r):
        if "pre-inference" in r["arm"]:
            return "preinfer-refresh" if "refresh" in r["arm"] else "preinfer"
        return "trainer-cache" if r["basis"].get("cache_buffer") else "trainer"

    def peak(r):  # the trainer's backward peak (the constants below are backward terms)
        return (
            r["phases"].get("backward", r["measured"]) if "trainer" in r["arm"] else r["measured"]
        )

    def compute_rest(r):  # the compute phase's terms other than RUNTIME (one shard per call)
        b_ = r["basis"]
        return b_["weights"] + CPU_INFER * b_["work"] + 2 * b_["shard"] + b_["inputs"]

    out, run = [], {}
    for r in rows:
        if r["config"] != "calibrate":
            continue
        if path(r) == "preinfer":  # the compute phase: the encode's own terms are fitted below
            run["preinfer"] = r["phases"]["compute"] - compute_rest(r)
        else:
            rest = r["estimate"] - r["components"]["runtime"]
            run[path(r)] = max(run.get(path(r), 0), peak(r) - rest)
    # the minimal model has two blocks (no refresh): a refresh's fixed part from llama-small
    fresh = [r for r in rows if path(r) == "preinfer-refresh"]
    if fresh:
        run["preinfer-refresh"] = mean(r["phases"]["compute"] - compute_rest(r) for r in fresh)
    # while loading: what the load phase holds beyond the weights (and the cast's copy), any arm
    run["load"] = max(
        r["phases"]["load"] - r["basis"]["load"] for r in rows if "load" in r["phases"]
    )
    out += [f"RUNTIME cpu {k}: {v / MiB:.0f} MiB (now {RUNTIME[('cpu', k)] / MiB:.0f})"
            for k, v in sorted(run.items())]  # fmt: skip
    cal = [r for r in rows if r["config"] != "calibrate"]
    b = lambda r: r["basis"]  # noqa: E731
    tok = [r for r in cal if path(r) == "trainer"]
    cache = [r for r in cal if path(r) == "trainer-cache"]
    if tok and cache and "trainer" in run and "trainer-cache" in run:  # --arms all
        alloc = mean((peak(r) - run["trainer"] - b(r)["static"]
                      - host_io("token_read", b(r)["token_shard"])) / b(r)["act"] for r in tok)  # fmt: skip
        out.append(f"CPU_ALLOC: {alloc:.2f} (now {CPU_ALLOC})")
        read = _line([b(r)["cache_buffer"] for r in cache],
                     [peak(r) - run["trainer-cache"] - b(r)["static"] - alloc * b(r)["act"]
                      - b(r)["grads"] for r in cache])  # fmt: skip
        out.append(
            f"HOST_IO cache_read: ({read[0] / MiB:.0f} * MiB, {read[1]:.2f}) (now {HOST_IO['cache_read']})"
        )
    pre = [r for r in cal if "build" in r["arm"]]
    if not pre or "preinfer" not in run:  # --arms trainer
        return "\n".join(out)
    # calibration children run one shard per call (preinfer.shards_per_task=1): no overlap
    infer = mean((r["phases"]["compute"] - run["preinfer"] - b(r)["weights"] - 2 * b(r)["shard"]
                  - b(r)["inputs"]) / b(r)["work"] for r in pre)  # fmt: skip
    out.append(f"CPU_INFER: {infer:.2f} (now {CPU_INFER})")
    write = _line([b(r)["shard"] for r in pre],
                  [r["phases"]["encode"] - run["preinfer"] - b(r)["weights"] - b(r)["shard"]
                   - b(r)["inputs"] for r in pre])  # fmt: skip
    out.append(
        f"HOST_IO cache_write: ({write[0] / MiB:.0f} * MiB, {write[1]:.2f}) (now {HOST_IO['cache_write']})"
    )
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = [("config", "arm", "measured MiB (median)", "runs, min..max", "estimate MiB", "error",
            "error range over runs", "peak phase (estimate)")]  # fmt: skip
    for r in rows:
        runs = r.get("samples", [r["measured"]])  # rows from before --repeats have one run
        errs = sorted((r["estimate"] - m) / m for m in runs)
        out.append((r["config"], r["arm"], f"{r['measured'] / 2**20:.1f}",
                    f"{len(runs)}, {min(runs) / 2**20:.1f}..{max(runs) / 2**20:.1f}",
                    f"{r['estimate'] / 2**20:.1f}", f"{r['estimate'] / r['measured'] - 1:+.1%}",
                    f"{errs[0]:+.1%}..{errs[-1]:+.1%}", r["phase"]))  # fmt: skip
    return headline_table(out)


def main(argv=None) -> dict | None:
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
    return {"headline": _headline(rows), "rows": rows}


def _headline(rows: list[dict]) -> dict:
    errs = [(r["estimate"] - r["measured"]) / r["measured"] for r in rows]
    return {"arms": len(rows), "within 15%": sum(abs(e) <= 0.15 for e in errs),
            "worst error": max(errs, key=abs) if errs else None}  # fmt: skip


if __name__ == "__main__":
    main()
