"""Quality study: full-parameter training vs BCD from the cache vs BCD-recompute, same data.

    python bench/quality.py            # the default study (`make study`): <= 60 min on 2 CPUs
    python bench/quality.py --quick    # CI-scale: one seed, one tiny model, a few minutes
    python bench/quality.py --lr-sweep # the learning-rate tuning the LR constants come from
    python bench/quality.py --from-json bench/results/quality-X.json  # re-render docs only

Arms (per model and seed; all arms of a seed start from the same init checkpoint and read the
same token store):
  full           every parameter, AdamW, FULL_ROUNDS x M x S steps, one warmup + cosine
  bcd            BCD from the activation cache, M=3 blocks, S steps per visit (warmup + cosine
                 per visit), BCD_ROUNDS rounds: more steps than full, so the B-F multiplier (BCD
                 steps to full's final val ppl / full's steps) is measurable up to
                 BCD_ROUNDS / FULL_ROUNDS
  bcd-recompute  the same rotation, the frozen prefix rerun every step (no cache)
plus a block-count sweep M in {2,3,4,6} (BCD from the cache, 3S/M steps per visit, so every M
takes the same steps per round) and BCD with SGD instead of AdamW.

Measured: val ppl vs optimizer steps, tokens seen and training wall-clock (the time of every
evaluation is measured and subtracted; Ray is started once before the arms and reported apart;
cache builds are inside BCD's clock), the B-F multiplier, time to full's final ppl, and trainer
memory: every (arm kind, block) is re-run for a few steps from its arm's final checkpoint (and
kept caches) in a FRESH subprocess, and its peak RSS growth over the post-import, post-warm-up
baseline is taken (VmHWM after a reset of the high-water mark), next to the exact bytes of
parameters + gradients + optimizer state it holds.

All training arms run in this one process, one after another, their order rotated per seed.
The machine is shared: raw wall-clock is noisy; a contention-robust clock (each visit's median
step time x its steps, plus the measured non-step time) is reported beside it.

Outputs: bench/results/quality-<timestamp>.json (raw), docs/quality.md, docs/quality_*.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/quality.py` from anywhere
    sys.path.insert(0, str(ROOT))

# Learning rates, tuned once per optimizer with `--lr-sweep` (see docs/quality.md, "lr tuning"):
# AdamW on full-parameter training (the baseline gets its best lr; BCD reuses it), SGD
# (momentum 0.9) on BCD from the cache, the only place SGD is used.
LR = {"adamw": 2e-3, "sgd": 0.3}
SWEEP_LRS = {"adamw": (3e-4, 6e-4, 1e-3, 2e-3, 3e-3, 6e-3), "sgd": (0.1, 0.3, 1.0)}
TARGET_CLOSE = 1.05  # "within 5%" of full's final val ppl

GPT2 = ("configs/demo.yaml", [])
LLAMA = (
    "configs/llama-small.yaml",
    ["model.max_positions=256", "model.tie_embeddings=false"],
)


@dataclass
class Scale:
    """Sizes of one study (default or --quick)."""

    documents: int
    """Stdlib files in the corpus (builtin source)."""
    steps_per_visit: int
    """S: steps of one block visit at M=3; full trains FULL_ROUNDS * 3 * S steps."""
    full_rounds: int
    bcd_rounds: int
    recompute_rounds: int
    seeds: list[int]
    models: list[str]
    sweep_M: list[int]
    sweep_seeds: list[int]
    sgd_seeds: list[int]
    model_sets: dict[str, list[str]]
    """Model size overrides per model name."""
    val_fraction: float = 0.05
    sweep_rounds: int = 2
    """Rounds of the M-sweep arms (the sweep's multiplier is measurable up to this)."""
    torch_threads: int = 1
    """Intra-op threads of the trainer. 1: on a shared 2-CPU machine two OpenMP threads that
    wait for each other at every op barrier ran 3-4x SLOWER per step than one thread (measured
    under load 6-8); the cache-building Ray actor uses one thread too."""
    eval_every: int = 20
    eval_batches: int = 8
    warmup: int = 10
    batch_size: int = 16
    seq_len: int = 128
    vocab: int = 2048
    probe_steps: int = 3
    M: int = 3


_MODEL_SIZE = {
    "gpt2": ["model.hidden_size=128", "model.num_layers=6", "model.num_heads=4"],
    "llama": [
        "model.hidden_size=128",
        "model.num_layers=6",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=344",
    ],
}
_MODEL_TINY = {
    "gpt2": ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4"],
    "llama": [
        "model.hidden_size=64",
        "model.num_layers=4",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=172",
    ],
}

DEFAULT = Scale(
    seq_len=64,
    documents=60,
    steps_per_visit=60,
    full_rounds=1,
    bcd_rounds=3,
    recompute_rounds=1,
    seeds=[0, 1, 2],
    models=["gpt2", "llama"],
    sweep_M=[2, 3, 4, 6],
    sweep_seeds=[0],
    sgd_seeds=[0],
    model_sets=_MODEL_SIZE,
)
QUICK = Scale(
    documents=16,
    val_fraction=0.25,
    steps_per_visit=8,
    full_rounds=1,
    bcd_rounds=2,
    recompute_rounds=1,
    seeds=[0],
    models=["gpt2"],
    sweep_M=[2, 3],
    sweep_seeds=[0],
    sgd_seeds=[0],
    model_sets=_MODEL_TINY,
    eval_every=4,
    eval_batches=2,
    warmup=2,
    batch_size=8,
    seq_len=64,
    vocab=512,
    probe_steps=2,
)


@dataclass
class Arm:
    model: str
    mode: str  # full | bcd | bcd-recompute
    seed: int
    M: int
    optimizer: str
    lr: float
    rounds: int
    steps_per_visit: int
    group: str = "main"  # main | sgd | sweep
    stop_rounds: list[int] = field(default_factory=list)
    """Rounds after which the checkpoint is evaluated on the whole val split (excluded from time)."""
    keep_caches: bool = False
    """Keep every cache the arm builds (cache.keep): the memory probes of its blocks read the
    last round's caches, which are current for the arm's final checkpoint."""
    variant: str = ""
    """'global-order': (--diagnose-order only) the trainer reads the cache in a global random
    order instead of the reader's shard-buffered one."""

    @property
    def id(self) -> str:
        base = f"{self.model}-{self.mode}-{self.optimizer}-M{self.M}-s{self.seed}"
        if self.group == "lr":
            base += f"-lr{self.lr:g}"
        return f"{base}-{self.variant}" if self.variant else base

    @property
    def total_steps(self) -> int:
        return self.rounds * self.M * self.steps_per_visit


# ---------------------------------------------------------------------------------------------
# Configs


def overrides(scale: Scale, model: str, run_dir: Path, work: Path, **train) -> list[str]:
    """--set overrides of one run; the data section is identical for both models so they share
    one token store."""
    out = [
        f"run.dir={run_dir}",
        "run.device=cpu",
        "data.source=builtin",
        f"data.max_documents={scale.documents}",
        "data.tokenizer=bpe",
        f"data.vocab_size={scale.vocab}",
        f"data.seq_len={scale.seq_len}",
        f"data.val_fraction={scale.val_fraction}",
        "data.split_seed=0",
        f"data.out_dir={work / 'tokens'}",
        f"model.vocab_size={scale.vocab}",
        "model.dropout=0.0",
        "cache.dtype=bf16",
        "cache.codec=blosc-zstd",
        "cache.shuffle=byte",
        "cache.shard_mb=8",
        "cache.keep=false",
        "preinfer.actors=1",  # 2 CPUs: one actor builds as fast as two, with one process fewer
        "preinfer.micro_batch=32",
        "train.workers=0",
        "train.checkpoint_every=0",
        f"train.eval_every={scale.eval_every}",
        f"train.eval_batches={scale.eval_batches}",
        f"train.warmup_steps={scale.warmup}",
        f"train.batch_size={scale.batch_size}",
        "train.patience=0",
        "train.grad_clip=1.0",
    ]
    out += (GPT2 if model == "gpt2" else LLAMA)[1] + scale.model_sets[model]
    out += [f"{k.replace('__', '.')}={v}" for k, v in train.items()]
    return out


def make_cfg(scale: Scale, model: str, run_dir: Path, work: Path, **train):
    from preinfer.config import load_config

    base = (GPT2 if model == "gpt2" else LLAMA)[0]
    return load_config(ROOT / base, overrides(scale, model, run_dir, work, **train))


def arm_cfg(scale: Scale, arm: Arm, run_dir: Path, work: Path, rounds: int | None = None):
    return make_cfg(
        scale,
        arm.model,
        run_dir,
        work,
        model__init_seed=arm.seed,
        partition__num_blocks=arm.M,
        train__seed=arm.seed,
        train__optimizer=arm.optimizer,
        train__lr=arm.lr,
        train__rounds=rounds or arm.rounds,
        train__max_steps=arm.steps_per_visit,
        train__mode=arm.mode,
        cache__keep=arm.keep_caches,
    )


def plan_arms(scale: Scale) -> list[Arm]:
    S, M = scale.steps_per_visit, scale.M
    arms: list[Arm] = []
    for i, seed in enumerate(scale.seeds):
        for model in scale.models:
            trio = [
                Arm(model, "full", seed, M, "adamw", LR["adamw"], scale.full_rounds, S),
                Arm(
                    model,
                    "bcd",
                    seed,
                    M,
                    "adamw",
                    LR["adamw"],
                    scale.bcd_rounds,
                    S,
                    stop_rounds=sorted({scale.full_rounds, scale.sweep_rounds, scale.bcd_rounds}),
                ),
                Arm(
                    model, "bcd-recompute", seed, M, "adamw", LR["adamw"], scale.recompute_rounds, S
                ),
            ]
            # the order rotates with the seed, so slow drifts of a shared machine's load do not
            # always land on the same arm
            arms += trio[i % 3 :] + trio[: i % 3]
    model0 = scale.models[0]
    for seed in scale.sgd_seeds:
        arms.append(
            Arm(
                model0,
                "bcd",
                seed,
                M,
                "sgd",
                LR["sgd"],
                scale.bcd_rounds,
                S,
                group="sgd",
                stop_rounds=sorted({scale.full_rounds, scale.bcd_rounds}),
            )
        )
        if seed not in scale.seeds:  # its reference full arm
            arms.append(Arm(model0, "full", seed, M, "adamw", LR["adamw"], scale.full_rounds, S))
    for seed in scale.sweep_seeds:
        for m in scale.sweep_M:
            a = Arm(
                model0,
                "bcd",
                seed,
                m,
                "adamw",
                LR["adamw"],
                scale.sweep_rounds,
                max(1, M * S // m),
                group="sweep",
                stop_rounds=sorted({scale.full_rounds, scale.sweep_rounds}),
            )
            if not any(b.id == a.id for b in arms):
                arms.append(a)
        if seed not in scale.seeds and not any(
            b.id == f"{model0}-full-adamw-M{M}-s{seed}" for b in arms
        ):
            arms.append(Arm(model0, "full", seed, M, "adamw", LR["adamw"], scale.full_rounds, S))
    first = first_seeds(scale)
    for a in arms:
        a.keep_caches = a.mode == "bcd" and a.seed == first.get(a.group)
    return arms


def first_seeds(scale: Scale) -> dict[str, int]:
    """The seed whose arms the memory probes re-run, per group."""
    groups = (("main", scale.seeds), ("sgd", scale.sgd_seeds), ("sweep", scale.sweep_seeds))
    return {g: seeds[0] for g, seeds in groups if seeds}


# ---------------------------------------------------------------------------------------------
# Running one arm (in this process)


class EvalTimer:
    """Wraps Visit.evaluate so the study knows how long every in-training evaluation took."""

    def __init__(self):
        self.durations: list[float] = []
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        from preinfer.visit import Visit

        orig = Visit.evaluate
        timer = self

        def timed(visit_self):
            t0 = time.perf_counter()
            try:
                return orig(visit_self)
            finally:
                timer.durations.append(time.perf_counter() - t0)

        Visit.evaluate = timed
        self._installed = True


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

    def __init__(
        self, cache, *, batch_size, seed, rank=0, world=1, shuffle=True, dtype=None, buffer_mb=None
    ):
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


class _cache_order:
    """Context: swap the trainer's cache reader for GlobalOrderCacheBatches while active."""

    def __init__(self, active: bool):
        self.active, self.saved = active, None

    def __enter__(self):
        if self.active:
            import preinfer.visit as visit

            self.saved, visit.CacheBatches = visit.CacheBatches, GlobalOrderCacheBatches
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            import preinfer.visit as visit

            visit.CacheBatches = self.saved
        return False


def diagnose_order(scale: Scale, work: Path, log=print) -> dict:
    """One BCD round of the last model, every seed: recompute vs the cache as the pipeline
    reads it vs the cache read in a global random order. Same init, same steps."""
    from pipelines.ray_env import ensure_ray

    _set_threads(scale)
    ensure_ray()
    timer = EvalTimer()
    timer.install()
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
        rec = run_arm(scale, a, work, timer, log=log)
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


def run_arm(scale: Scale, arm: Arm, work: Path, timer: EvalTimer, log=print) -> dict:
    from pipelines.evaluate import run_eval
    from pipelines.rotate import run_bcd

    run_dir = work / "arms" / arm.id
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    _copy_checkpoint(init_dir(work, arm.model, arm.seed, arm.M), run_dir / "checkpoint")
    load0 = os.getloadavg()
    timer.durations.clear()
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
        with _cache_order(arm.variant == "global-order"):
            run_bcd(cfg, mode=arm.mode, log=_quiet)
        wall += time.perf_counter() - t0
        last = time.time()
        ev = run_eval(cfg, max_batches=0, log=_quiet)  # whole val split, not timed
        step = r * arm.M * arm.steps_per_visit if arm.mode != "full" else arm.total_steps
        finals.append({"round": r, "step": step, "loss": ev["loss"], "ppl": ev["ppl"]})
    if not arm.keep_caches:  # bounded disk: the arm's last caches are not needed any more
        shutil.rmtree(run_dir / "cache", ignore_errors=True)
    eval_s = sum(timer.durations)
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
    rec.update(parse_metrics(run_dir / "metrics.jsonl", t_start, list(timer.durations), outside))
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
    from pipelines.evaluate import run_eval
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
# Memory probes: each (arm kind, block) in a fresh subprocess


def probe_specs(scale: Scale, arms: list[Arm]) -> list[dict]:
    """One memory probe per distinct (model, mode, optimizer, M, block), re-run from the arm of
    its group's first seed (its final checkpoint; bcd blocks > 0 read that arm's kept caches).
    Block 0 is the same work in bcd and bcd-recompute (tokens in, all blocks loaded, backward
    through everything), so it is probed once, as mode bcd."""
    first = first_seeds(scale)
    specs, seen = [], set()
    for a in arms:
        if a.seed != first.get(a.group):
            continue
        for k in [0] if a.mode == "full" else range(a.M):
            if a.mode == "full":
                key = (a.model, "full", "adamw", 0, 0)
            elif k == 0:
                key = (a.model, "bcd", a.optimizer, a.M, 0)
            else:
                key = (a.model, a.mode, a.optimizer, a.M, k)
            if key in seen:
                continue
            seen.add(key)
            specs.append(
                {
                    "model": a.model,
                    "mode": key[1],
                    "optimizer": a.optimizer,
                    "lr": a.lr,
                    "M": a.M,
                    "seed": a.seed,
                    "block": k,
                    "steps_per_visit": a.steps_per_visit,
                    "arm": asdict(a),
                }
            )
    return specs


def run_probes(scale: Scale, specs: list[dict], work: Path, log=print) -> list:
    out = []
    for s in specs:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--probe",
            json.dumps({**s, "scale": asdict(scale), "work": str(work)}),
        ]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        res = None
        for line in reversed(p.stdout.splitlines()):
            if line.startswith("PROBE "):
                res = json.loads(line[6:])
                break
        if res is None:
            res = {"error": (p.stderr or p.stdout)[-2000:]}
        res.update(s)
        res["probe_s"] = time.perf_counter() - t0
        out.append(res)
        log(
            f"  probe {s['model']} {s['mode']} {s['optimizer']} M={s['M']} block {s['block']}: "
            + (
                f"RSS growth {res['rss_growth_mb']:.0f} MB, state {res['state_mb']:.1f} MB"
                if "error" not in res
                else "FAILED " + res["error"].strip().splitlines()[-1]
            )
        )
    return out


def _proc_status_mb(field_name: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def probe_main(spec: dict) -> dict:
    """Child process: a few training steps of one (mode, block); peak RSS growth + state bytes."""
    import resource

    import torch

    import pipelines.preinfer  # noqa: F401  (imports the trainer would pull in lazily)
    import storage.reader  # noqa: F401
    from pipelines.train import visit_spec
    from preinfer.trainer import build_optimizer, train_step
    from preinfer.visit import Visit

    scale = Scale(**spec["scale"])
    _set_threads(scale)
    work = Path(spec["work"])
    mode, k = spec["mode"], spec["block"]
    arm = Arm(**spec["arm"])
    arm.keep_caches = True  # never drop anything from here
    cfg = arm_cfg(scale, arm, work / "arms" / arm.id, work)
    torch.manual_seed(0)
    # Library warm-up, so the baseline holds what any trainer process holds before it loads a
    # model: the model classes (transformers imports them lazily: ~150 MB of RSS) and the
    # autograd machinery. What stays is the trainer's own: weights, gradients, optimizer
    # state, activations, batches and the reader's buffers.
    from preinfer.checkpoint import Checkpoint
    from preinfer.modeling import build_model

    ck = Checkpoint.open(cfg.run.checkpoint)
    build_model(ck.model_config, device="meta", hf_config=ck.hf_config)
    x = torch.nn.Parameter(torch.randn(8, 8))
    for warm in (torch.optim.AdamW([x]), torch.optim.SGD([x], lr=0.1, momentum=0.9)):
        (x @ x).sum().backward()  # the first optimizer step imports torch._dynamo lazily
        warm.step()
    del x, ck, warm
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark (VmHWM)
        hwm = "VmHWM"
    except OSError:
        hwm = ""
    base = _proc_status_mb("VmRSS")
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the arm's kept caches are its last round's (cache fingerprints carry the round's row order)
    spec_v = visit_spec(cfg, k, max(0, arm.rounds - 1) if mode == "bcd" else 0, mode)
    visit = Visit(cfg, spec_v, device=torch.device("cpu"))
    opt = build_optimizer(visit.params, cfg.train)
    it = iter(visit.batches.epoch(0))
    step_s = []
    for step in range(scale.probe_steps):
        t0 = time.perf_counter()
        train_step(
            visit.loss, visit.params, opt, next(it), cfg.train, step, device=torch.device("cpu")
        )
        step_s.append(time.perf_counter() - t0)
    peak = (
        _proc_status_mb(hwm)
        if hwm
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_maxrss + base
    )
    mb = 2**20
    loaded = {id(p): p for p in visit.model.parameters() if p.device.type != "meta"}
    param_b = sum(p.numel() * p.element_size() for p in loaded.values())
    train_b = sum(p.numel() * p.element_size() for p in visit.params)
    opt_b = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {
        "rss_base_mb": base,
        "rss_peak_mb": peak,
        "rss_growth_mb": peak - base,
        "hwm_reset": bool(hwm),
        "params_loaded_mb": param_b / mb,
        "params_trainable_mb": train_b / mb,
        "grads_mb": train_b / mb,
        "optimizer_state_mb": opt_b / mb,
        "state_mb": (param_b + train_b + opt_b) / mb,
        "step_s": statistics.median(step_s),
    }


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


def _fmt(m: float, s: float | None = None, n: int | None = None, digits: int = 1) -> str:
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "—"
    txt = f"{m:.{digits}f}"
    if s is not None and n and n > 1:
        txt += f" ± {s:.{digits}f}"
    return txt


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


# ---------------------------------------------------------------------------------------------
# Report: markdown + figures

ARM_STYLE = {
    "full": ("full AdamW", "C0"),
    "bcd": ("BCD cache M=3", "C1"),
    "bcd-recompute": ("BCD recompute M=3", "C2"),
}


def _mean_curve(sel: list[dict], xkey: str) -> tuple[list, list, list, list]:
    """Mean x, mean / min / max ppl over seeds, aligned by eval index."""
    n = min(len(a["curve"]) for a in sel)
    xs, ys, lo, hi = [], [], [], []
    for i in range(n):
        pts = [a["curve"][i] for a in sel]
        xs.append(statistics.fmean(p[xkey] for p in pts))
        v = [p["ppl"] for p in pts]
        ys.append(statistics.fmean(v))
        lo.append(min(v))
        hi.append(max(v))
    return xs, ys, lo, hi


def _plain_log_axis(ax) -> None:
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.yaxis.get_minor_formatter().set_scientific(False)
    ax.yaxis.get_major_formatter().set_scientific(False)
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=()))


def plot_curves(results: dict, docs: Path, xkey: str, fname: str, xlabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = results["scale"]
    models = scale["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6, 3.5), dpi=100, squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        init = [
            v["ppl"] for k, v in results["prep"]["initial"].items() if k.startswith(model + "-")
        ]
        for mode, (label, color) in ARM_STYLE.items():
            sel = [
                a
                for a in results["arms"]
                if a["model"] == model
                and a["mode"] == mode
                and a["group"] == "main"
                and a["optimizer"] == "adamw"
                and a["M"] == scale["M"]
                and a["curve"]
            ]
            if not sel:
                continue
            xs, ys, lo, hi = _mean_curve(sel, xkey)
            if init:
                xs, ys = [0.0, *xs], [statistics.fmean(init), *ys]
                lo, hi = [min(init), *lo], [max(init), *hi]
            if xkey == "tokens":
                xs = [x / 1e6 for x in xs]
            ax.plot(xs, ys, color=color, label=label, lw=1.2)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
            if mode == "full":
                ax.axhline(ys[-1], color=color, ls=":", lw=0.8)
        ax.set_yscale("log")
        _plain_log_axis(ax)
        ax.set_title(f"{model} ({len(scale['seeds'])} seeds)", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, which="both", lw=0.4)
        lows = [
            p["ppl"]
            for a in results["arms"]
            if a["model"] == model and a["group"] == "main"
            for p in a["curve"]
        ]
        if lows:
            ax.set_ylim(min(lows) * 0.9, min(max(lows), min(lows) * 6))
    axes[0][0].set_ylabel("val perplexity", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = docs / fname
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(results: dict, summary: dict, docs: Path) -> Path | None:
    """Left: trainer memory per M as a fraction of full training's (RSS growth and exact state,
    max over all blocks and over blocks >= 1). Right: BCD steps to full's final ppl / full's
    steps per M (hollow triangles at the budget: not reached within it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["sweep"]
    if not rows:
        return None
    model0 = results["scale"]["models"][0]
    full = summary["models"].get(model0, {}).get("arms", {}).get("full", {})
    f_rss = full.get("mem_rss", {}).get("max")
    f_st = full.get("mem_state", {}).get("max")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(6, 3.5), dpi=100)
    Ms = [r["M"] for r in rows]

    def frac(vals, ref):
        return [v / ref if (v is not None and ref) else float("nan") for v in vals]

    series = (
        ("RSS growth, max block", [r["mem_rss"]["max"] for r in rows], f_rss, "C1", "o-"),
        (
            "RSS growth, blocks ≥ 1",
            [r["mem_rss"].get("later_max") for r in rows],
            f_rss,
            "C3",
            "o--",
        ),
        ("params+grads+opt, max block", [r["mem_state"]["max"] for r in rows], f_st, "C7", "s-"),
        (
            "params+grads+opt, blocks ≥ 1",
            [r["mem_state"].get("later_max") for r in rows],
            f_st,
            "C2",
            "s--",
        ),
    )
    for label, vals, ref, color, style in series:
        a1.plot(Ms, frac(vals, ref), style, color=color, label=label, ms=4, lw=1)
    a1.axhline(1.0, color="C0", lw=0.8, ls=":")
    a1.axhline(0.5, color="grey", lw=0.6, ls=":")
    a1.set_ylim(0, 1.3)
    a1.set_xticks(Ms)
    a1.set_xlabel("blocks M", fontsize=8)
    a1.set_ylabel("trainer memory / full AdamW", fontsize=8)
    a1.legend(fontsize=6, loc="lower left")
    a1.tick_params(labelsize=7)
    bound = max((r["bound"] or 0) for r in rows)
    for key, color, marker, label in (
        ("multiplier", "C1", "o", "to full's final ppl"),
        ("multiplier_close", "C2", "s", "to 1.05 x full's final"),
    ):
        ys = [r[key][0] if r[key][2] else float("nan") for r in rows]
        a2.plot(Ms, ys, marker + "-", color=color, label=label, ms=4, lw=1)
        cens = [m for m, y in zip(Ms, ys, strict=True) if math.isnan(y)]
        if cens:
            a2.plot(cens, [bound] * len(cens), "^", mfc="none", color=color, ms=7)
    a2.axhline(1.39, color="grey", ls=":", lw=0.8)
    a2.axhline(2.89, color="grey", ls=":", lw=0.8)
    a2.text(Ms[0], 1.42, "paper avg 1.39", fontsize=6, color="grey")
    a2.text(Ms[0], 2.92, "paper worst 2.89", fontsize=6, color="grey")
    a2.set_xticks(Ms)
    a2.set_xlabel("blocks M", fontsize=8)
    a2.set_ylabel("BCD steps / full steps (^ = not reached)", fontsize=8)
    a2.set_ylim(0.8, max(3.2, bound + 0.3))
    a2.legend(fontsize=6, loc="lower right")
    a2.tick_params(labelsize=7)
    fig.suptitle(f"{model0}: block count M, memory vs extra steps", fontsize=9)
    fig.tight_layout()
    path = docs / "quality_m_sweep.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sgd(results: dict, docs: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = results["scale"]
    model0 = scale["models"][0]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    any_ = False
    for opt, mode, color, label in (
        ("adamw", "full", "C0", "full AdamW"),
        ("adamw", "bcd", "C1", "BCD cache, AdamW"),
        ("sgd", "bcd", "C4", "BCD cache, SGD"),
    ):
        sel = [
            a
            for a in results["arms"]
            if a["model"] == model0
            and a["mode"] == mode
            and a["optimizer"] == opt
            and a["M"] == scale["M"]
            and a["seed"] in scale["sgd_seeds"]
            and a["curve"]
        ]
        if not sel:
            continue
        any_ = True
        xs, ys, lo, hi = _mean_curve(sel, "step")
        ax.plot(xs, ys, color=color, label=f"{label} (lr {sel[0]['lr']:g})", lw=1.2)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
    if not any_:
        plt.close(fig)
        return None
    ax.set_yscale("log")
    _plain_log_axis(ax)
    ax.set_xlabel("optimizer steps", fontsize=8)
    ax.set_ylabel("val perplexity", fontsize=8)
    ax.set_title(f"{model0}: SGD vs AdamW inside BCD", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both", lw=0.4)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    path = docs / "quality_sgd_adam.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _mult_txt(ms, censored: int, bound) -> str:
    m, s, n = ms
    if n == 0:
        return f"> {bound:.2f} (not reached)" if bound else "—"
    txt = _fmt(m, s, n, 2)
    if censored:
        txt += f" ({censored} seed(s) not reached by {bound:.2f})"
    return txt


def _mem_txt(mem: dict) -> str:
    vals = mem.get("per_block") or []
    if not vals:
        return "—"
    return " / ".join("—" if v is None else f"{v:.0f}" for v in vals)


def _load_range(results: dict) -> str:
    loads = [x for a in results["arms"] for x in a.get("loadavg", [])]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"


def findings(results: dict, summary: dict) -> list[str]:
    """Bullets with the measured numbers (worse and better alike)."""
    sc = results["scale"]
    M, S = sc["M"], sc["steps_per_visit"]
    full_steps = sc["full_rounds"] * M * S
    out = []

    def f(ms, d=2):
        return _fmt(*ms, digits=d) if isinstance(ms, list | tuple) else _fmt(ms, digits=d)

    for model, ms in summary["models"].items():
        a = ms["arms"]
        full, bcd = a.get("full"), a.get("bcd")
        if not full or not bcd:
            continue
        cens = bcd["multiplier_censored"]
        mult = f(bcd["multiplier"])
        if cens:
            mult += f" ({cens} of {bcd['n']} seeds did not reach it within {bcd['multiplier_bound']:.1f}x)"
        worst = bcd["multiplier_worst"]
        share = bcd["cache_s"][0] / bcd["wall_s"][0] if bcd["wall_s"][0] else float("nan")
        out.append(
            f"- **{model}**: at full's budget ({full_steps} steps) BCD-cache's whole-val ppl is "
            f"{f(bcd['ppl_at_full_steps_whole'], 1)} vs full's {f(full['final_ppl'], 1)} "
            f"({f(bcd['ppl_ratio_at_full_steps'])}x, curve subset): **worse**. With "
            f"{bcd['steps']} steps it ends at {f(bcd['final_ppl'], 1)}. B-F multiplier "
            f"(steps to full's final ppl) {mult}, worst "
            + ("not reached" if math.isinf(worst) else f"{worst:.2f}")
            + f" (paper: 1.39 average, 2.89 worst); to 1.05x of it {f(bcd['multiplier_close'])}."
        )
        out.append(
            f"  Wall-clock to 1.05x full's final ppl: {f(bcd['time_ratio_close'])}x full's "
            f"(robust clock {f(bcd['robust_ratio_close'])}x); cache builds are "
            f"{share:.0%} of BCD's training time ({f(bcd['cache_s'], 0)} s of "
            f"{f(bcd['wall_s'], 0)} s). Same steps, recompute over cache time: "
            f"{f(ms['recompute_over_cache_time'])}x (whole arm, builds included); per step of "
            "blocks 1.., recompute/cache: "
            + " / ".join(f"{v:.2f}" for v in ms.get("later_block_step_speedup") or [] if v)
            + "."
        )
        gap = ms.get("cache_over_recompute_ppl")
        if gap and gap[2]:
            out.append(
                f"  Same init, same steps, cache vs recompute whole-val ppl: {f(gap)}x "
                "(they differ only in where block K's input comes from and in batch order; see "
                "'Cache batch order')."
            )
        mem = bcd.get("mem_ratio_max")
        out.append(
            f"  Trainer memory (RSS growth) vs full: BCD peak {f(mem)}x (max over blocks, "
            f"block 0 needs the whole backward), blocks >= 1 {f(bcd.get('mem_ratio_later'))}x; "
            f"exact params+grads+optimizer state: {f(bcd.get('state_ratio_max'))}x peak, "
            f"{f(bcd.get('state_ratio_later'))}x blocks >= 1. At this size activations, the "
            "reader's shard buffer and the runtime dominate the RSS, not the state."
        )
    if summary["sweep"]:
        parts = []
        for r in summary["sweep"]:
            m = r["multiplier"]
            mt = f"{m[0]:.2f}" if m[2] else f">{r['bound']:.1f}"
            st = r["mem_state"]
            parts.append(
                f"M={r['M']}: multiplier {mt}, state max {_fmt(st['max'])} MB"
                + (f" (blocks >= 1: {st['later_max']:.1f})" if st.get("later_max") else "")
            )
        out.append(
            f"- Block count ({sc['models'][0]}, seeds {sc['sweep_seeds']}, equal steps per "
            "round): " + "; ".join(parts) + "."
        )
    if {"adamw", "sgd"} <= set(summary["sgd"]):
        a, g = summary["sgd"]["adamw"], summary["sgd"]["sgd"]
        out.append(
            f"- SGD inside BCD (lr {g['lr']:g}, momentum 0.9) vs AdamW: whole-val ppl "
            f"{f(g['final_ppl'], 1)} vs {f(a['final_ppl'], 1)} after the same steps; B-F multiplier "
            + (f"{g['multiplier'][0]:.2f}" if g["multiplier"][2] else f">{g['bound']:.1f}")
            + " vs "
            + (f"{a['multiplier'][0]:.2f}" if a["multiplier"][2] else f">{a['bound']:.1f}")
            + f"; params+grads+optimizer state per block {_mem_txt(g['mem_state'])} vs "
            f"{_mem_txt(a['mem_state'])} MB."
        )
    order = results.get("order")
    if order:
        by = {}
        for r in order["rows"]:
            by.setdefault(r["arm"], []).append(r["ppl"])
        means = {k: statistics.fmean(v) for k, v in by.items()}
        out.append(
            f"- Cache batch order ({order['rows'][0]['model']}, one round, mean whole-val ppl over seeds): "
            + "; ".join(f"{k}: {v:.1f}" for k, v in means.items())
            + f". Diagnostic run of {order.get('started', '?')}, before train caches were "
            "written in a shuffled row order: read in a global order the cache matched "
            "recompute, so the gap was the reader's shard-local batches, not bf16 and not BCD. "
            "Since the fix the main comparison's 'cache vs recompute' ratio measures the same."
        )
    return out


def write_markdown(results: dict, summary: dict, docs: Path, figures: list[Path]) -> Path:
    sc = results["scale"]
    prep = results["prep"]
    M, S = sc["M"], sc["steps_per_visit"]
    full_steps = sc["full_rounds"] * M * S
    L = []
    L.append("# Quality study: BCD (with the activation cache) vs full-parameter training\n")
    L.append(
        f"Produced by `{results['command']}` on {results['host']['cpus']} CPUs "
        f"({results['started']}; study wall time {results['study_s'] / 60:.1f} min; "
        f"load average {results['host']['loadavg_start']:.1f} at start, "
        f"{results['host']['loadavg_end']:.1f} at end, {_load_range(results)} at the arms' "
        f"starts and ends; trainer torch threads: {results['host'].get('torch_threads')} — "
        "the machine is shared, so raw "
        "wall-clock is noisy; the 'robust' clock replaces each step by its visit's median step "
        f"time). Raw numbers: `{results['json_path']}`.\n"
    )
    L.append("## Setup\n")
    L.append(
        f"- Corpus: the built-in one (Python stdlib sources), first {sc['documents']} files, "
        f"byte-level BPE {sc['vocab']}, S={sc['seq_len']}: {prep['train_samples']} train / "
        f"{prep['val_samples']} val samples (split by document)."
    )
    models = []
    for m in sc["models"]:
        size = ", ".join(o.removeprefix("model.") for o in sc["model_sets"][m])
        n = prep.get("params", {}).get(m)
        models.append(f"`{m}` ({size}; {n:,} params)" if n else f"`{m}` ({size})")
    L.append("- Models (random init from the seed): " + "; ".join(models) + ".")
    L.append(
        f"- Batch {sc['batch_size']} x {sc['seq_len']} tokens; every arm of a seed starts from "
        "the same init checkpoint and token store; data order seed = train.seed = the seed."
    )
    L.append(
        f"- full: all parameters, AdamW lr {LR['adamw']:g}, {full_steps} steps, warmup "
        f"{sc['warmup']} + cosine to 0.1x. BCD: M={M} blocks, {S} steps per block visit "
        f"(warmup {sc['warmup']} + cosine per visit, same family), ascending rotation; "
        f"{sc['full_rounds']} round = full's step budget; the cache arm runs {sc['bcd_rounds']} "
        f"rounds ({sc['bcd_rounds'] * M * S} steps) so the B-F multiplier is measurable up to "
        f"{sc['bcd_rounds'] / sc['full_rounds']:.1f}; bcd-recompute runs "
        f"{sc['recompute_rounds']} round(s). Seeds {sc['seeds']}."
    )
    L.append(
        f"- Val ppl on the curves: the first {sc['eval_batches']} val batches every "
        f"{sc['eval_every']} steps (BCD blocks > 0 evaluate from the bf16 val cache); 'whole "
        "val' = `run_eval` over the whole val split. Target = full's final curve ppl (same "
        "seed). B-F multiplier = BCD steps at the first eval point at or below the target / "
        "full's steps (resolution: one eval interval)."
    )
    L.append(
        "- Wall-clock = training time of the arm with every evaluation's measured time "
        "subtracted; BCD's includes its cache builds (Ray Data actors; Ray itself was started "
        f"once before the arms, {results['ray_start_s']:.1f} s, not charged to any arm)."
    )
    L.append(
        "- Memory: each (arm, block) re-run for "
        f"{sc['probe_steps']} steps in a fresh subprocess; 'RSS growth' = peak RSS (VmHWM, "
        "reset after imports) minus the post-import RSS: weights loaded, gradients, optimizer "
        "state, activations, batches. 'State' = exact bytes of loaded parameters + gradients + "
        "optimizer state. BCD peak = max over the rotation's blocks.\n"
    )

    L.append("## Findings (numbers from this run)\n")
    L += findings(results, summary)
    L.append("")
    L.append("## Main comparison\n")
    L.append(
        "| model | arm | steps | val ppl at full's budget (whole val) | final whole-val ppl | "
        "B-F multiplier | steps to 1.05x target | train wall-clock (s) | robust (s) | "
        "cache builds (s) | time to 1.05x target / full | trainer RSS growth per block (MB) | "
        "peak vs full | state per block (MB) |"
    )
    L.append("|" + "---|" * 14)
    for model, ms in summary["models"].items():
        for mode, row in ms["arms"].items():
            mult = (
                "1 (reference)"
                if mode == "full"
                else _mult_txt(
                    row["multiplier"], row["multiplier_censored"], row["multiplier_bound"]
                )
            )
            close = (
                "—"
                if mode == "full"
                else _mult_txt(row["multiplier_close"], 0, row["multiplier_bound"])
            )
            tr = "1.00" if mode == "full" else _fmt(*row["time_ratio_close"], digits=2)
            ratio = "1.00" if mode == "full" else _fmt(row.get("mem_ratio_max"), digits=2)
            L.append(
                f"| {model} | {ARM_STYLE[mode][0]} | {row['steps']} | "
                f"{_fmt(*row['ppl_at_full_steps_whole'])} | {_fmt(*row['final_ppl'])} | {mult} | "
                f"{close} | {_fmt(*row['wall_s'], digits=0)} | {_fmt(*row['robust_s'], digits=0)} | "
                f"{_fmt(*row['cache_s'], digits=0)} | {tr} | {_mem_txt(row['mem_rss'])} | {ratio} | "
                f"{_mem_txt(row['mem_state'])} |"
            )
    L.append("")
    L.append("Cache vs recompute (same steps, same rotation):\n")
    L.append(
        "| model | recompute time / cache time (whole arm, incl. cache builds) | robust | "
        "later-block step speed-up (recompute step / cache step), blocks 1.. |"
    )
    L.append("|---|---|---|---|")
    for model, ms in summary["models"].items():
        sp = ms.get("later_block_step_speedup") or []
        L.append(
            f"| {model} | {_fmt(*ms['recompute_over_cache_time'], digits=2)} | "
            f"{_fmt(*ms['recompute_over_cache_robust'], digits=2)} | "
            + " / ".join(f"{v:.2f}" if v else "—" for v in sp)
            + " |"
        )
    L.append("")
    L.append("## Targets (measured; a miss is reported, not hidden)\n")
    L.append("| model | target | limit | measured | met |")
    L.append("|---|---|---|---|---|")
    names = {
        "ppl_within_5pct": "BCD-cache val ppl at full's step budget / full's final",
        "ppl_within_5pct_any": "BCD-cache steps to 1.05x full's final ppl / full's steps (≤ the extended budget)",
        "time_to_close_le_full": "BCD-cache wall-clock to 1.05x full's final ppl / full's wall-clock",
        "faster_than_recompute_1p5x": "recompute time / cache time, same steps (≥)",
        "peak_mem_le_half_full": "BCD trainer peak RSS growth (max over blocks) / full",
        "later_block_mem_le_half_full": "BCD trainer RSS growth, blocks ≥ 1 / full",
    }
    for model, tg in summary["targets"].items():
        for key, t in tg.items():
            v = "—" if t["value"] is None else f"{t['value']:.2f}"
            met = "yes" if t["met"] else "**no**"
            L.append(f"| {model} | {names[key]} | {t['limit']} | {v} | {met} |")
    L.append("")
    if summary["sweep"]:
        L.append(f"## Block-count sweep ({sc['models'][0]}, seeds {sc['sweep_seeds']})\n")
        L.append(f"Same steps per round ({M * S}) for every M: {M * S}/M steps per visit.\n")
        L.append(
            "| M | steps/visit | val ppl at full's budget (curve) | whole-val ppl at the sweep's budget | "
            "B-F multiplier | to 1.05x | train wall-clock (s) | cache builds (s) | "
            "RSS growth per block (MB) | state per block (MB) |"
        )
        L.append("|" + "---|" * 10)
        for r in summary["sweep"]:
            L.append(
                f"| {r['M']} | {r['steps_per_visit']} | {_fmt(*r['ppl_at_full_steps'])} | "
                f"{_fmt(*r['final_ppl'])} | {_mult_txt(r['multiplier'], r['censored'], r['bound'])} | "
                f"{_mult_txt(r['multiplier_close'], 0, r['bound'])} | {_fmt(*r['wall_s'], digits=0)} | "
                f"{_fmt(*r['cache_s'], digits=0)} | {_mem_txt(r['mem_rss'])} | {_mem_txt(r['mem_state'])} |"
            )
        L.append("")
    if summary["sgd"]:
        L.append(
            f"## SGD vs AdamW inside BCD ({sc['models'][0]}, M={M}, seeds {sc['sgd_seeds']})\n"
        )
        L.append(
            "| optimizer | lr | val ppl at full's budget (curve) | final ppl (whole val) | B-F multiplier | "
            "RSS growth per block (MB) | state per block (MB) |"
        )
        L.append("|---|---|---|---|---|---|---|")
        for opt, r in summary["sgd"].items():
            L.append(
                f"| {opt} | {r['lr']:g} | {_fmt(*r['ppl_at_full_steps'])} | {_fmt(*r['final_ppl'])} | "
                f"{_mult_txt(r['multiplier'], r['censored'], r['bound'])} | {_mem_txt(r['mem_rss'])} | "
                f"{_mem_txt(r['mem_state'])} |"
            )
        L.append("")
    order = results.get("order")
    if order:
        L.append("## Cache batch order (diagnostic, before the row-order fix)\n")
        L.append(
            "Since commit fd8893a pre-inference writes train caches in a seeded random row "
            "order and the reader shuffles a buffer of several shards, so cache-fed batches "
            "mix the corpus like token batches (the main comparison's 'cache vs recompute' "
            "ratio above shows the effect). The table below is the diagnostic that found the "
            "defect, run on the code before that fix.\n"
        )
        L.append(
            f"From `{order.get('command')}` ({order.get('started', '')}): one BCD round "
            f"(M={M}, {M * S} steps, AdamW) from the same init per seed; whole-val ppl. The "
            "pipeline's cache reader (`storage.reader.CacheDataset` via "
            "`preinfer.trainer.CacheBatches`) permutes shards and shuffles rows inside a "
            "one-shard buffer, and the token store packs documents in order, so each batch "
            "comes from a few neighbouring documents; recompute reads token batches in a "
            "global random order. 'cache, global order' = the same bf16 cache read in "
            "TokenBatches' global order (a diagnostic stand-in for the reader, in this script "
            "only).\n"
        )
        seeds = sorted({r["seed"] for r in order["rows"]})
        kinds = list(dict.fromkeys(r["arm"] for r in order["rows"]))
        L.append("| model | arm | " + " | ".join(f"seed {x}" for x in seeds) + " | mean |")
        L.append("|---|---|" + "---|" * (len(seeds) + 1))
        for kind in kinds:
            rs = [r for r in order["rows"] if r["arm"] == kind]
            vals = {r["seed"]: r["ppl"] for r in rs}
            L.append(
                f"| {rs[0]['model']} | {kind} | "
                + " | ".join(f"{vals[x]:.1f}" if x in vals else "—" for x in seeds)
                + f" | {statistics.fmean(vals.values()):.1f} |"
            )
        L.append("")
    sweep = results.get("lr_sweep")
    L.append("## lr tuning\n")
    if sweep:
        L.append(
            f"From `{sweep.get('command', 'python bench/quality.py --lr-sweep')}` "
            f"({sweep.get('started', '')}): val ppl at the end of each short run.\n"
        )
        L.append("| optimizer | arm | lr | steps | val ppl |")
        L.append("|---|---|---|---|---|")
        for r in sweep["rows"]:
            L.append(
                f"| {r['optimizer']} | {r['mode']} | {r['lr']:g} | {r['steps']} | {r['ppl']:.1f} |"
            )
        L.append("")
    L.append(
        f"Used: AdamW lr {LR['adamw']:g} (best for full; BCD reuses it), SGD lr {LR['sgd']:g} "
        "(momentum 0.9, best for BCD), weight decay 1e-5, grad clip 1.0.\n"
    )
    L.append("## Figures\n")
    for f in figures:
        L.append(f"![{f.stem}]({f.name})\n")
    path = docs / "quality.md"
    path.write_text("\n".join(L))
    return path


# ---------------------------------------------------------------------------------------------
# lr sweep


def lr_sweep(scale: Scale, work: Path, log=print) -> dict:
    """Short runs on the first model, seed 0, at 2/3 of the study's steps per visit: AdamW on
    full-parameter training (BCD reuses the winner: the baseline gets its best lr) and SGD on
    BCD from the cache (the only place SGD is used)."""
    from pipelines.ray_env import ensure_ray

    _set_threads(scale)
    ensure_ray()
    timer = EvalTimer()
    timer.install()
    model = scale.models[0]
    S, M, R = max(4, scale.steps_per_visit * 2 // 3), scale.M, scale.full_rounds
    arms = [Arm(model, "full", 0, M, "adamw", lr, R, S, group="lr") for lr in SWEEP_LRS["adamw"]]
    arms += [Arm(model, "bcd", 0, M, "sgd", lr, R, S, group="lr") for lr in SWEEP_LRS["sgd"]]
    prepare(scale, arms, work, log=log)
    rows = []
    for a in arms:
        rec = run_arm(scale, a, work, timer, log=log)
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


# ---------------------------------------------------------------------------------------------
# Entry point


def _latest(pattern: str, directory: Path) -> Path | None:
    files = sorted(directory.glob(pattern))
    return files[-1] if files else None


def run_study(scale: Scale, name: str, work: Path, docs: Path, results_dir: Path, log=print):
    from pipelines.ray_env import ensure_ray

    t_study = time.perf_counter()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    load_start = os.getloadavg()[0]
    work.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    arms = plan_arms(scale)
    _set_threads(scale)
    log(f"quality study ({name}): {len(arms)} training arms, work dir {work}")
    prep = prepare(scale, arms, work, log=log)
    t0 = time.perf_counter()
    ensure_ray()
    ray_s = time.perf_counter() - t0
    timer = EvalTimer()
    timer.install()
    recs = []
    for i, arm in enumerate(arms):
        log(
            f"[{i + 1}/{len(arms)}] {arm.id} ({arm.group}) "
            f"t={(time.perf_counter() - t_study) / 60:.1f} min"
        )
        try:
            recs.append(run_arm(scale, arm, work, timer, log=log))
        except Exception as e:  # a failed arm is recorded, the study goes on
            log(f"  {arm.id} FAILED: {type(e).__name__}: {e}")
            recs.append({**asdict(arm), "id": arm.id, "error": f"{type(e).__name__}: {e}"})
    log(f"memory probes t={(time.perf_counter() - t_study) / 60:.1f} min")
    good = [r for r in recs if "error" not in r]
    specs = probe_specs(scale, [a for a in arms if any(r["id"] == a.id for r in good)])
    probes = run_probes(scale, specs, work, log=log)
    for a in arms:  # the kept caches were only for the probes
        if a.keep_caches:
            shutil.rmtree(work / "arms" / a.id / "cache", ignore_errors=True)
    results = {
        "command": "python bench/quality.py" + (" --quick" if name == "quick" else ""),
        "scale_name": name,
        "scale": asdict(scale),
        "lr": LR,
        "started": started,
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg()[0],
            "torch_threads": _torch_threads(),
        },
        "prep": prep,
        "ray_start_s": ray_s,
        "arms": good,
        "failed_arms": [r for r in recs if "error" in r],
        "probes": probes,
    }
    attach_side_studies(results, results_dir)
    json_path = results_dir / f"quality-{stamp}.json"
    results["json_path"] = _rel(json_path)
    results["study_s"] = time.perf_counter() - t_study
    render(results, docs)
    results["study_s"] = time.perf_counter() - t_study
    json_path.write_text(json.dumps(results, indent=1, default=_json_default))
    log(
        f"done in {results['study_s'] / 60:.1f} min: {_rel(json_path)}, {results['outputs']['markdown']}"
    )
    return results


def attach_side_studies(results: dict, results_dir: Path) -> None:
    """The newest --lr-sweep and --diagnose-order results beside the study's, if any."""
    for key, pattern in (("lr_sweep", "quality-lrsweep-*.json"), ("order", "quality-order-*.json")):
        f = _latest(pattern, results_dir)
        if f is not None:
            results[key] = json.loads(f.read_text())


def render(results: dict, docs: Path) -> dict:
    """Summary, figures and markdown from the raw results (also: --from-json)."""
    docs.mkdir(parents=True, exist_ok=True)
    summary = analyse(results)
    results["summary"] = summary
    figs = [
        plot_curves(results, docs, "tokens", "quality_ppl_tokens.png", "tokens seen (M)"),
        plot_curves(results, docs, "wall_s", "quality_ppl_wall.png", "training wall-clock (s)"),
    ]
    for f in (plot_sweep(results, summary, docs), plot_sgd(results, docs)):
        if f is not None:
            figs.append(f)
    md = write_markdown(results, summary, docs, figs)
    results["outputs"] = {"markdown": _rel(md), "figures": [_rel(f) for f in figs]}
    return summary


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(type(o).__name__)


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def _set_threads(scale: Scale) -> None:
    import torch

    if scale.torch_threads:
        torch.set_num_threads(scale.torch_threads)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI-scale: one seed, tiny model")
    ap.add_argument("--lr-sweep", action="store_true", help="tune lr per optimizer (short runs)")
    ap.add_argument(
        "--diagnose-order",
        action="store_true",
        help="cache-fed BCD with the reader's batch order vs a global order vs recompute",
    )
    ap.add_argument("--work", default=None, help="scratch dir (default runs/quality[-quick])")
    ap.add_argument(
        "--docs", default=None, help="markdown + figures (default docs/ or <work>/docs)"
    )
    ap.add_argument(
        "--results", default=None, help="raw JSON dir (default bench/results or <work>/results)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", help="override the main seeds (partial runs)")
    ap.add_argument("--models", nargs="+", choices=["gpt2", "llama"], help="override the models")
    ap.add_argument("--sweep-M", type=int, nargs="*", help="override the M sweep ([] = none)")
    ap.add_argument("--sgd-seeds", type=int, nargs="*", help="override the SGD seeds ([] = none)")
    ap.add_argument(
        "--from-json", default=None, help="re-render docs from a saved quality-*.json (no runs)"
    )
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        res = probe_main(json.loads(args.probe))
        print("PROBE " + json.dumps(res), flush=True)
        return res
    name = "quick" if args.quick else "default"
    scale = copy.deepcopy(QUICK if args.quick else DEFAULT)
    for name_, val in (
        ("seeds", args.seeds),
        ("models", args.models),
        ("sweep_M", args.sweep_M),
        ("sgd_seeds", args.sgd_seeds),
    ):
        if val is not None:
            setattr(scale, name_, list(val))
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        attach_side_studies(res, Path(args.from_json).parent)
        render(res, Path(args.docs or ROOT / "docs"))
        Path(args.from_json).write_text(json.dumps(res, indent=1, default=_json_default))
        return _brief(res)
    work = Path(args.work or ROOT / ("runs/quality-quick" if args.quick else "runs/quality"))
    docs = Path(args.docs or (work / "docs" if args.quick else ROOT / "docs"))
    results_dir = Path(
        args.results or (work / "results" if args.quick else ROOT / "bench" / "results")
    )
    if args.diagnose_order:
        return _side_study(
            "--diagnose-order", "order", diagnose_order, scale, work / "order", results_dir,
            args.quick, lambda r: f"{r['model']} seed {r['seed']} {r['arm']:32s} ppl {r['ppl']:.1f}",
        )  # fmt: skip
    if args.lr_sweep:
        return _side_study(
            "--lr-sweep", "lrsweep", lr_sweep, scale, work / "lr-sweep", results_dir, args.quick,
            lambda r: f"{r['optimizer']:6s} {r['mode']:14s} lr {r['lr']:<8g} ppl {r['ppl']:.1f}",
        )  # fmt: skip
    return _brief(run_study(scale, name, work, docs, results_dir))


def _side_study(flag, tag, fn, scale, work, results_dir, quick, row_line) -> dict:
    """Run one side study (`fn(scale, work)`), stamp it with its command, write
    bench/results/quality-<tag>-<time>.json and print one line per row."""
    t0 = time.perf_counter()
    res = fn(replace(scale), work, log=print)
    res.update(
        command=f"python bench/quality.py {flag}" + (" --quick" if quick else ""),
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
        seconds=time.perf_counter() - t0,
    )
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"quality-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        print(row_line(r))
    print(f"wrote {path}")
    return res


def _brief(res: dict) -> dict:
    """What main() returns (`make bench` tabulates its 'headline'): the key numbers."""
    s = res["summary"]
    head: dict = {"study_min": res["study_s"] / 60}
    for m, v in s["models"].items():
        arms = v["arms"]
        bcd = arms.get("bcd", {})
        head[f"{m}.full_ppl"] = arms.get("full", {}).get("final_ppl", (None,))[0]
        head[f"{m}.bcd_ppl_same_steps"] = bcd.get("ppl_at_full_steps_whole", (None,))[0]
        head[f"{m}.bf_multiplier"] = bcd.get("multiplier", (None,))[0]
        head[f"{m}.time_to_1.05x_vs_full"] = bcd.get("time_ratio_close", (None,))[0]
        head[f"{m}.recompute_over_cache"] = v.get("recompute_over_cache_time", (None,))[0]
        head[f"{m}.bcd_peak_mem_vs_full"] = bcd.get("mem_ratio_max")
    return {
        "headline": head,
        "json": res["json_path"],
        "targets": s["targets"],
        "models": {
            m: {
                mode: {
                    "final_ppl": row["final_ppl"][0],
                    "multiplier": row.get("multiplier", (1.0,))[0],
                    "mem_ratio_max": row.get("mem_ratio_max"),
                }
                for mode, row in v["arms"].items()
            }
            for m, v in s["models"].items()
        },
    }


if __name__ == "__main__":
    main()
