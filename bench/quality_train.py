"""Training the quality study's arms in this process (bench/quality.py is the entry point).

`prepare` tokenizes once and writes one init checkpoint per (model, seed, M); `run_arm` trains
one arm with the pipeline's own run_bcd, timing every in-training evaluation through the visit
hook `VisitHooks.on_eval` (`arm_hooks`) so it can be subtracted, and evaluates the whole val
split after each stop round; `parse_metrics` turns the run's metrics.jsonl into the eval curve,
per-visit timing and the contention-robust clock. Also the two side studies that train arms:
`diagnose_order` (the cache read in the reader's order vs a global order: `VisitHooks.batches`
= `global_order_batches`) and `lr_sweep`, and the trainer's torch thread setting.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from bench.quality_arms import LR, SWEEP_LRS, Arm, Scale, arm_cfg, make_cfg

# ---------------------------------------------------------------------------------------------
# Running one arm (in this process)


def arm_hooks(eval_durations: list[float], *, global_order: bool = False):
    """The visit hooks of one arm: every in-training evaluation's seconds are appended to
    `eval_durations` (the arm's clock leaves them out); global_order: cache-fed visits read
    their train cache through GlobalOrderCacheBatches (--diagnose-order)."""
    from preinfer.visit import VisitHooks

    def on_eval(visit, step: int, val_loss: float, seconds: float) -> None:
        eval_durations.append(seconds)

    return VisitHooks(on_eval=on_eval, batches=global_order_batches if global_order else None)


def _quiet(*_a, **_k) -> None:
    return None


def _copy_checkpoint(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


class GlobalOrderCacheBatches:
    """Diagnostic stand-in for preinfer.trainer.CacheBatches (--diagnose-order only): the
    whole cache split in memory, batches drawn in the same global random order TokenBatches
    uses. The pipeline's reader shuffles shard order plus rows within a one-shard buffer, and
    the token store packs documents in order, so its batches come from a few neighbouring
    documents; this class isolates what that costs."""

    def __init__(self, cache, *, batch_size: int, seed: int, shuffle: bool = True):
        import torch

        self.hidden, self.labels, _ = cache.read_rows(0, cache.num_samples, torch.float32)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.steps_per_epoch = cache.num_samples // batch_size

    def epoch(self, e: int):
        import numpy as np
        import torch

        n = len(self.labels)
        order = np.random.default_rng([self.seed, e]).permutation(n) if self.shuffle else None
        for s in range(self.steps_per_epoch):
            rows = np.arange(s * self.batch_size, (s + 1) * self.batch_size)
            idx = torch.from_numpy(np.sort(order[rows]) if order is not None else rows)
            yield self.hidden[idx], self.labels[idx]


def global_order_batches(visit, default):
    """VisitHooks.batches of --diagnose-order: a cache-fed visit trains on its train cache in
    a global order (same batch size, seed and shuffle as the reader it replaces); a token-fed
    visit keeps its default batches."""
    if not visit.from_cache:
        return default
    return GlobalOrderCacheBatches(
        visit.train_cache, batch_size=default.batch_size, seed=default.seed, shuffle=default.shuffle
    )


def diagnose_order(scale: Scale, work: Path, log=print) -> dict:
    """One BCD round of the last model, every seed: recompute vs the cache as the pipeline
    reads it vs the cache read in a global random order. Same init, same steps."""
    from pipelines.ray_env import ensure_ray

    set_threads(scale)
    ensure_ray()
    model, S, M = scale.models[-1], scale.steps_per_visit, scale.M
    arms = []
    for seed in scale.seeds:
        for mode, variant in (("bcd-recompute", ""), ("bcd", ""), ("bcd", "global-order")):
            arms.append(
                Arm(
                    model, mode, seed, M, "adamw", LR["adamw"], 1, S, group="order", variant=variant
                )
            )
    prepare(scale, arms, work, log=log)
    rows = []
    for a in arms:
        rec = run_arm(scale, a, work, log=log)
        rows.append(
            {
                "model": a.model,
                "seed": a.seed,
                "arm": {"bcd-recompute": "recompute (token batches)"}.get(
                    a.mode,
                    "cache, global order" if a.variant else "cache, pipeline's reader order",
                ),
                "steps": a.total_steps,
                "ppl": rec["final"][-1]["ppl"],
            }
        )
    return {"rows": rows}


def run_arm(scale: Scale, arm: Arm, work: Path, log=print) -> dict:
    from pipelines.bcd import run_bcd
    from pipelines.eval import run_eval

    run_dir = work / "arms" / arm.id
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    _copy_checkpoint(init_dir(work, arm.model, arm.seed, arm.M), run_dir / "checkpoint")
    load0 = os.getloadavg()
    eval_durs: list[float] = []  # every in-training evaluation's seconds, in order
    hooks = arm_hooks(eval_durs, global_order=arm.variant == "global-order")
    stops = sorted({r for r in arm.stop_rounds if r < arm.rounds} | {arm.rounds})
    if arm.mode == "full":
        stops = [arm.rounds]
    wall = 0.0  # training wall-clock of this arm, evaluations excluded
    finals = []
    outside = []  # (start, end) time.time() windows between run_bcd calls: not training
    t_start = last = time.time()
    for r in stops:
        cfg = arm_cfg(scale, arm, run_dir, work, rounds=r)
        t0 = time.perf_counter()
        now = time.time()
        outside.append((last, now))
        run_bcd(cfg, mode=arm.mode, log=_quiet, hooks=hooks)
        wall += time.perf_counter() - t0
        last = time.time()
        ev = run_eval(cfg, max_batches=0, log=_quiet)  # whole val split, not timed
        step = r * arm.M * arm.steps_per_visit if arm.mode != "full" else arm.total_steps
        finals.append({"round": r, "step": step, "loss": ev["loss"], "ppl": ev["ppl"]})
    if not arm.keep_caches:  # bounded disk: the arm's last caches are not needed any more
        shutil.rmtree(run_dir / "cache", ignore_errors=True)
    eval_s = sum(eval_durs)
    rec = {
        **asdict(arm),
        "id": arm.id,
        "total_steps": arm.total_steps,
        "wall_s": wall - eval_s,
        "wall_raw_s": wall,
        "eval_s": eval_s,
        "loadavg": [load0[0], os.getloadavg()[0]],
        "final": finals,
    }
    rec.update(parse_metrics(run_dir / "metrics.jsonl", t_start, list(eval_durs), outside))
    rec["tokens_per_step"] = scale.batch_size * scale.seq_len
    for p in rec["curve"]:
        p["tokens"] = p["step"] * rec["tokens_per_step"]
    last = rec["curve"][-1] if rec["curve"] else {}
    log(
        f"  {arm.id}: {arm.total_steps} steps, train {rec['wall_s']:.0f}s "
        f"(robust {rec['robust_s']:.0f}s, evals {eval_s:.0f}s, load {load0[0]:.1f}), "
        f"val ppl {last.get('ppl', float('nan')):.1f}, whole-val {finals[-1]['ppl']:.1f}"
    )
    return rec


def parse_metrics(
    path: Path,
    t_start: float,
    eval_durs: list[float],
    outside: list[tuple[float, float]] | None = None,
) -> dict:
    """Curve (val ppl per eval point, with global step and eval-free wall-clock), per-visit
    timing and cache events from a run's metrics.jsonl.

    A step record's time is stamped before that step's evaluation, so the eval-free clock at a
    record is its time minus the in-training evaluations that ran before it (`eval_durs`, in
    order) and minus the `outside` windows (time.time() spans between run_bcd calls: run_arm's
    whole-val evaluations and set-up; by default the whole-val `eval` events)."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in recs if r.get("event") == "step"]
    n_val = sum(1 for r in steps if "val_loss" in r)
    durs = eval_durs if len(eval_durs) == n_val else [0.0] * n_val
    caches = [r for r in recs if r.get("event") == "cache"]
    evals = [r for r in recs if r.get("event") == "eval"]
    if outside is None:  # whole-val eval windows (event 'eval' records are stamped at their end)
        windows = [(r["time"] - r.get("seconds", 0.0), r["time"]) for r in evals]
    else:
        windows = list(outside)

    def excl_before(t: float) -> float:
        return sum(min(b, t) - a for a, b in windows if a < t)

    curve, visits = [], []
    ev_i, ev_cum = 0, 0.0
    prev_adj, robust_prev = 0.0, 0.0
    cur = None
    for gstep, r in enumerate(steps, start=1):
        key = (r["round"], r["block"])
        adj = r["time"] - t_start - ev_cum - excl_before(r["time"])
        if cur is None or cur["key"] != key:
            if cur is not None:
                robust_prev = _close_visit(cur, visits, robust_prev)
            cur = {"key": key, "start": prev_adj, "times": [], "points": [], "gstep0": gstep - 1}
        cur["times"].append(adj)
        if "val_loss" in r:
            cur["points"].append(
                {
                    "step": gstep,
                    "local": len(cur["times"]),
                    "wall_s": adj,
                    "val_loss": r["val_loss"],
                    "ppl": math.exp(min(r["val_loss"], 50.0)),
                    "round": r["round"],
                    "block": r["block"],
                }
            )
            ev_cum += durs[ev_i]
            ev_i += 1
        prev_adj = adj
    if cur is not None:
        robust_prev = _close_visit(cur, visits, robust_prev)
    for v in visits:
        curve.extend(v.pop("points"))
    cache_s = sum(c.get("seconds", 0.0) for c in caches)
    return {
        "curve": curve,
        "visits": visits,
        "cache_s": cache_s,
        "cache_events": [
            {k: c.get(k) for k in ("action", "boundary", "round", "seconds", "bytes")}
            for c in caches
        ],
        "robust_s": robust_prev,
    }


def _close_visit(cur: dict, visits: list, robust_prev: float) -> float:
    """Per-visit timing; the robust clock replaces every step by the visit's median step."""
    t = cur["times"]
    deltas = [b - a for a, b in zip(t, t[1:], strict=False)]
    med = statistics.median(deltas) if deltas else max(t[0] - cur["start"], 0.0)
    overhead = max(t[0] - cur["start"] - med, 0.0)  # cache build, model load, first-step extras
    for p in cur["points"]:
        p["robust_s"] = robust_prev + overhead + med * p["local"]
    end = robust_prev + overhead + med * len(t)
    visits.append(
        {
            "round": cur["key"][0],
            "block": cur["key"][1],
            "steps": len(t),
            "median_step_s": med,
            "seconds": t[-1] - cur["start"],
            "overhead_s": overhead,
            "end_wall_s": t[-1],
            "end_robust_s": end,
            "end_step": cur["gstep0"] + len(t),
            "points": cur["points"],
        }
    )
    return end


# ---------------------------------------------------------------------------------------------
# Preparation: one token store, one init checkpoint per (model, seed, M)


def init_dir(work: Path, model: str, seed: int, M: int) -> Path:
    return work / "init" / f"{model}-s{seed}-M{M}" / "checkpoint"


def prepare(scale: Scale, arms: list[Arm], work: Path, log=print) -> dict:
    from pipelines.eval import run_eval
    from pipelines.init import run_init
    from pipelines.tokenize import run_tokenize

    t0 = time.perf_counter()
    cfg = make_cfg(scale, scale.models[0], work / "tok", work)
    store = run_tokenize(cfg, log=_quiet)
    info = {
        "train_samples": store.num_samples("train"),
        "val_samples": store.num_samples("val"),
        "tokenize_s": time.perf_counter() - t0,
        "initial": {},
    }
    for model, seed, M in sorted({(a.model, a.seed, a.M) for a in arms}):
        d = init_dir(work, model, seed, M)
        run_dir = d.parent
        if run_dir.exists():
            shutil.rmtree(run_dir)
        c = make_cfg(
            scale,
            model,
            run_dir,
            work,
            model__init_seed=seed,
            partition__num_blocks=M,
            run__checkpoint=d,
        )
        ckpt = run_init(c, log=_quiet)
        if model not in info.setdefault("params", {}):
            info["params"][model] = _count_params(ckpt)
        key = f"{model}-s{seed}"
        if key not in info["initial"]:
            ev = run_eval(c, max_batches=scale.eval_batches, log=_quiet)
            info["initial"][key] = {"loss": ev["loss"], "ppl": ev["ppl"]}
    log(
        f"prepared: {info['train_samples']} train / {info['val_samples']} val samples of "
        f"{scale.seq_len} tokens, params {info.get('params')}"
    )
    return info


def _count_params(ckpt) -> int:
    model, _ = ckpt.load(range(ckpt.num_blocks))
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# lr sweep


def lr_sweep(scale: Scale, work: Path, log=print) -> dict:
    """Short runs on the first model, seed 0, at 2/3 of the study's steps per visit: AdamW on
    full-parameter training (BCD reuses the winner: the baseline gets its best lr) and SGD on
    BCD from the cache (the only place SGD is used)."""
    from pipelines.ray_env import ensure_ray

    set_threads(scale)
    ensure_ray()
    model = scale.models[0]
    S, M, R = max(4, scale.steps_per_visit * 2 // 3), scale.M, scale.full_rounds
    arms = [Arm(model, "full", 0, M, "adamw", lr, R, S, group="lr") for lr in SWEEP_LRS["adamw"]]
    arms += [Arm(model, "bcd", 0, M, "sgd", lr, R, S, group="lr") for lr in SWEEP_LRS["sgd"]]
    prepare(scale, arms, work, log=log)
    rows = []
    for a in arms:
        rec = run_arm(scale, a, work, log=log)
        rows.append(
            {
                "optimizer": a.optimizer,
                "mode": a.mode,
                "lr": a.lr,
                "steps": a.total_steps,
                "ppl": rec["final"][-1]["ppl"],
                "wall_s": rec["wall_s"],
            }
        )
    return {"rows": rows}


def set_threads(scale: Scale) -> None:
    import torch

    if scale.torch_threads:
        torch.set_num_threads(scale.torch_threads)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
