"""One arm of a study, trained in this process by the pipeline's own run_bcd (bench/study.py
and bench/economics.py share it).

    sc = QUICK; init = prepare(sc, work, "gpt2", M=3, seed=0)
    rec = run_arm(sc, work, Arm("bcd", []), layout="gpt2", M=3, seed=0, lr=2e-3,
                  stop=Stop(target_ppl=300.0, cap_steps=540))

An arm is a name, a mode (train.mode: full, bcd or bcd-recompute) and config overrides; every
arm of a (layout, M, seed) starts from the same init checkpoint and reads the same token store.
Config layers, later wins: the YAML (--config, optional) < the scale's model and data < the
layout < the study's --set < the arm's overrides < its lr < the harness's paths and seed.

Clock: everything the product does (cache builds and refreshes, visits, commits) minus every
evaluation (the visit's own, whose seconds VisitHooks.on_eval reports, and the benchmark's
whole-val ones). The whole val split is evaluated after every visit (bcd modes, run_eval from
the checkpoint) or every Scale.eval_every steps (full, the in-memory model), and gives the curve.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.harness import load_average
from bench.study_curves import plateau
from pipelines.bcd import load_state, run_bcd
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.adapters import forward_blocks
from preinfer.cache_identity import store_budget
from preinfer.config import load_config
from preinfer.loss import evaluate_tokens
from preinfer.visit import VisitHooks
from storage.tokens import TokenStore


@dataclass
class Scale:
    """Sizes of one study (model and data as config overrides)."""

    model: list[str]
    """model.* overrides shared by both layouts (the layout adds arch and tying)."""
    documents: int
    seq_len: int = 64
    batch_size: int = 16
    vocab: int = 2048
    val_fraction: float = 0.02
    steps_per_visit: int = 30
    """A BCD visit's step cap (train.max_steps); full is evaluated every this many steps too."""
    full_cap: int = 1800
    """Full's step cap and cosine horizon; it stops earlier once val ppl plateaus."""
    patience: int = 3
    """Full stops after this many whole-val evaluations without improvement."""
    min_rel_delta: float = 0.005
    """An evaluation improves on the best when it is lower by more than this fraction."""
    min_steps: int = 0
    """Full's patience cannot stop it before this many steps (early loss plateaus)."""
    bcd_factor: float = 3.0
    """BCD arms run until they reach full's best ppl or this many times full's steps to it."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    lrs: list[float] = field(default_factory=lambda: [1e-3, 2e-3, 4e-3])
    """Peak lrs swept for every arm (best against best)."""
    warmup_steps: int = 5
    val_batches: int = 16
    """Whole-val curve points read the split's first val_batches x batch_size rows (0 = all)."""


@dataclass
class Arm:
    """One arm: its name, mode (train.mode) and config overrides on top of the study's."""

    name: str
    overrides: list[str]
    mode: str = "bcd"


@dataclass
class Stop:
    """When an arm stops (whichever comes first; None = no such rule)."""

    target_ppl: float | None = None
    """bcd modes: the first visit whose whole-val ppl is at or below this."""
    cap_steps: int | None = None
    """bcd modes: once this many steps are done."""
    max_visits: int | None = None
    """bcd modes: after this many visits."""
    min_visits: int = 0
    """bcd modes: target_ppl stops only once this many visits are done (a whole round, say)."""
    patience: int | None = None
    """full: after this many evaluations without improvement (Scale.min_rel_delta)."""


LAYOUTS = {
    "gpt2": ["model.arch=gpt2"],  # tied: the LM head is wte, block 0's
    "llama": ["model.arch=llama", "model.tie_embeddings=false", "model.num_kv_heads=2"],
}
LAYERS_HEAVY = ["model.hidden_size=256", "model.num_layers=6", "model.num_heads=4",
                "model.max_positions=128"]  # fmt: skip
TINY_MODEL = ["model.hidden_size=32", "model.num_layers=6", "model.num_heads=2",
              "model.max_positions=16"]  # fmt: skip


class _Stop(Exception):
    """Raised by an arm's callbacks when a stop rule fires."""


def _quiet(*_a, **_k) -> None:
    return None


def study_overrides(sc: Scale, work: Path, layout: str, M: int, sets: list[str]) -> list[str]:
    """The overrides every arm of (layout, M) shares, the study's --set last."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {sorted(LAYOUTS)}")
    return [
        *sc.model,
        *LAYOUTS[layout],
        f"model.vocab_size={sc.vocab}",
        "data.source=builtin",
        f"data.max_documents={sc.documents}",
        f"data.vocab_size={sc.vocab}",
        f"data.seq_len={sc.seq_len}",
        f"data.val_fraction={sc.val_fraction}",
        f"partition.num_blocks={M}",
        "cache.dtype=bf16",
        "cache.shard_mb=16",
        f"train.batch_size={sc.batch_size}",
        f"train.max_steps={sc.steps_per_visit}",
        f"train.warmup_steps={sc.warmup_steps}",
        "train.eval_every=0",
        "train.eval_batches=4",
        "train.workers=0",
        "train.checkpoint_every=0",
        "run.device=cpu",
        "run.tensorboard=false",
        *sets,
    ]


def _paths(work: Path) -> list[str]:
    return [f"data.out_dir={work / 'tokens'}"]


def prepare(sc: Scale, work: Path, layout: str, M: int, seed: int, *, config: str | None = None,
            sets: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """The token store (shared by every arm) and the (layout, M, seed) init checkpoint."""
    init = work / f"init-{layout}-M{M}-s{seed}"
    cfg = load_config(config, [*study_overrides(sc, work, layout, M, list(sets)), *_paths(work),
                               f"run.dir={work / 'prep'}", f"run.checkpoint={init}",
                               f"model.init_seed={seed}"])  # fmt: skip
    if not TokenStore.exists(cfg.data.out_dir):
        run_tokenize(cfg, log=_quiet)
    if not (init / "checkpoint.json").exists():
        run_init(cfg, log=_quiet)
    return init


def run_arm(sc: Scale, work: Path, arm: Arm, *, layout: str, M: int, seed: int, lr: float,
            stop: Stop, config: str | None = None, sets: tuple[str, ...] = (),
            log=_quiet) -> dict:  # fmt: skip
    """Train one arm from the (layout, M, seed) init checkpoint until a stop rule fires;
    returns its whole-val curve, timing, cache events and visit budget."""
    init = prepare(sc, work, layout, M, seed, config=config, sets=sets)
    run = work / f"{layout}-{arm.name}-M{M}-s{seed}-lr{lr:g}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(init, run / "checkpoint")
    cfg = load_config(config, [*study_overrides(sc, work, layout, M, list(sets)), *arm.overrides,
                               f"train.lr={lr}", *_paths(work), f"run.dir={run}",
                               f"run.checkpoint={run / 'checkpoint'}",
                               f"train.seed={seed}", f"model.init_seed={seed}"])  # fmt: skip
    store = TokenStore(cfg.data.out_dir)
    full = arm.mode == "full"
    if full:  # run_bcd's full mode trains rounds x M x a visit's steps: the cap is the horizon
        cfg.train.max_steps, cfg.train.epochs, cfg.train.rounds = max(1, sc.full_cap // M), None, 1
        cfg.train.eval_every = sc.steps_per_visit
    budget = store_budget(cfg, store)
    if not full:
        cap = stop.cap_steps or (stop.max_visits or M) * budget.steps
        cfg.train.rounds = max(1, math.ceil(cap / (M * budget.steps)))
    curve: list[dict] = []
    excluded = [0.0]  # seconds of evaluations, the visit's own and this benchmark's
    steps_done = [0]
    t0 = time.perf_counter()

    def point(steps: int, ppl: float, **extra) -> None:
        if curve and curve[-1]["steps"] == steps:
            return  # full's last step can be both an eval_every step and the end
        curve.append({"steps": steps, "seconds": time.perf_counter() - t0 - excluded[0],
                      "ppl": ppl, **extra})  # fmt: skip

    def on_visit(r: int, k: int, summary: dict) -> None:
        if full:
            return
        steps_done[0] += int(summary["steps"])
        e0 = time.perf_counter()
        ppl = run_eval(cfg, max_batches=sc.val_batches, log=_quiet)["ppl"]  # model from tokens
        excluded[0] += time.perf_counter() - e0
        point(steps_done[0], ppl, round=r, block=k)
        reached = stop.target_ppl is not None and ppl <= stop.target_ppl
        if reached and len(curve) >= stop.min_visits:
            raise _Stop
        if stop.cap_steps is not None and steps_done[0] >= stop.cap_steps:
            raise _Stop
        if stop.max_visits is not None and len(curve) >= stop.max_visits:
            raise _Stop

    def on_eval(visit, step: int, _val: float, seconds: float) -> None:
        excluded[0] += seconds
        if not full:
            return
        e0 = time.perf_counter()
        ppl = whole_val_ppl(visit, store, cfg.train.batch_size, sc.val_batches)
        excluded[0] += time.perf_counter() - e0
        point(step, ppl)
        if (
            stop.patience
            and plateau(curve, stop.patience, sc.min_rel_delta, sc.min_steps)["plateaued"]
        ):
            raise _Stop

    load0 = load_average()
    with contextlib.suppress(_Stop):
        run_bcd(cfg, mode=arm.mode, log=_quiet, hooks=VisitHooks(on_eval=on_eval),
                on_visit=on_visit)  # fmt: skip
    seconds = time.perf_counter() - t0 - excluded[0]
    events = [e for e in load_state(cfg).get("events", []) if e.get("action")]
    builds = [e for e in events if e.get("executor")]
    cache_s = sum(e["seconds"] for e in events)
    if full:
        visits = [(0, curve[-1]["steps"])] if curve else []
    else:  # (block, steps) of each visit, from the curve's cumulative steps
        prev = [0] + [c["steps"] for c in curve]
        visits = [(p["block"], p["steps"] - q) for p, q in zip(curve, prev, strict=False)]
    rec = {
        "arm": arm.name, "mode": arm.mode, "overrides": arm.overrides, "layout": layout, "M": M,
        "seed": seed, "lr": lr, "seconds": seconds, "curve": curve,
        "steps": curve[-1]["steps"] if curve else 0,
        "final_ppl": curve[-1]["ppl"] if curve else None,
        "cache_seconds": cache_s, "cache_share": cache_s / seconds if seconds else 0.0,
        "builds": [{k: e.get(k) for k in ("action", "boundary", "round", "seconds", "fixed_s",
                                          "rows", "executor")} for e in builds],
        "fixed_share": (sum(e["fixed_s"] for e in builds) / sum(e["seconds"] for e in builds))
        if builds else None,
        "visits": visits, "budget": budget.why, "passes": budget.passes, "rows": budget.rows,
        "val_rows": budget.val_rows, "tokens_per_step": cfg.train.batch_size * cfg.data.seq_len,
        "load_start": load0, "load_end": load_average(),
    }  # fmt: skip
    log(f"    {layout} M={M} s{seed} {arm.name:>14s} lr {lr:<7g} {rec['steps']:>5d} steps "
        f"{seconds:7.1f}s ppl {rec['final_ppl'] or math.nan:8.2f} (load {load0[0] if load0 else '?'})")  # fmt: skip
    shutil.rmtree(run, ignore_errors=True)  # checkpoints and caches: not needed after the curve
    return rec


@torch.inference_mode()
def whole_val_ppl(visit, store: TokenStore, batch_size: int, max_batches: int = 0) -> float:
    """The val split (its first max_batches batches; 0 = all) through the visit's model (full
    mode: every block is loaded), the rows run_eval reads."""
    was = visit.model.training
    visit.model.eval()
    M = visit.part.num_blocks
    res = evaluate_tokens(lambda ids: forward_blocks(visit.adapter, visit.part, ids, 0, M), store,
                          batch_size=batch_size, max_batches=max_batches)  # fmt: skip
    visit.model.train(was)
    return res["ppl"]
