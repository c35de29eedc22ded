"""Economics: does BCD with the cache beat full training and BCD that recomputes its prefix?

    python -m bench.economics --quick            # make bench: one seed, a small model, minutes
    python -m bench.economics                    # 3 seeds, the layers-heavy model (~1 h, 2 CPUs)
    python -m bench.economics --epochs 1 4 --M 3 6

Arms, from one token store and one init checkpoint per seed, side by side in one process:
  full           every parameter, its own step budget (full_steps, the same for every M)
  bcd            the rotation with the cache (train.epochs passes over each round's rows)
  bcd-recompute  the same rotation, prefix rerun on every step, same visits as bcd
Each arm's clock excludes the benchmark's own whole-val evaluations (after every visit, and
for full every steps_per_visit steps, through the visit hooks), and includes everything the
product does: cache builds and refreshes, visits, their evaluations and commits.

Per arm: whole-val ppl against wall-clock and against FLOPs, time to full's final whole-val
ppl, the cache share of bcd's time, the fixed part of each build, and the cost model's
predicted time (preinfer.costmodel FLOPs x the seconds per FLOP of this machine's full arm)
beside the measured one. Medians over seeds. The model is chosen so the layers outweigh the
LM head (H=256, 6 layers, V=2048: the head is ~10% of a full step's FLOPs); at the demo's
H=128, V=2048 the head costs more than a layer and BCD cannot save it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.harness import headline_table, load_average, results_path, write_results
from pipelines.bcd import load_state, run_bcd
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.adapters import forward_blocks
from preinfer.cache_identity import store_budget
from preinfer.checkpoint import Checkpoint
from preinfer.config import load_config
from preinfer.costmodel import Flops, run_flops
from preinfer.loss import evaluate_tokens
from preinfer.model_shape import model_shape
from preinfer.visit import VisitHooks
from storage.tokens import TokenStore

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Scale:
    """Sizes of one study."""

    model: list[str]
    documents: int
    seq_len: int = 64
    batch_size: int = 16
    vocab: int = 2048
    val_fraction: float = 0.02
    steps_per_visit: int = 30
    """The visit's step cap (train.max_steps)."""
    full_steps: int = 180
    """Full training's own step budget (the same for every M and passes per visit)."""
    bcd_factor: float = 3.0
    """bcd arms may run up to this many times full's steps to reach full's final ppl."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    lr: float = 2e-3


LAYERS_HEAVY = ["model.arch=gpt2", "model.hidden_size=256", "model.num_layers=6",
                "model.num_heads=4", "model.max_positions=128"]  # fmt: skip
# --arch llama: the same shape, untied (its LM head is the last block's, so the head-first
# order trains it first), GQA 2:1
ARCH = {
    "gpt2": ["model.arch=gpt2"],
    "llama": ["model.arch=llama", "model.tie_embeddings=false", "model.num_kv_heads=2"],
}
DEFAULT = Scale(model=LAYERS_HEAVY, documents=200)
QUICK = Scale(
    model=[
        "model.arch=gpt2",
        "model.hidden_size=128",
        "model.num_layers=6",
        "model.num_heads=4",
        "model.max_positions=64",
    ],  # fmt: skip
    documents=40,
    seq_len=32,
    batch_size=8,
    vocab=512,
    val_fraction=0.05,
    steps_per_visit=12,
    full_steps=36,
    bcd_factor=2.0,
    seeds=[0],
)


# The B-F studies (#15 item 4): what each changes in the bcd arm's config. `base` is the
# rotation as first measured (a fresh AdamW every visit, per-visit schedule, ascending order);
# every other variant changes one thing from it.
_BASE = ["train.keep_optimizer_state=false", "train.schedule=visit", "train.order=ascending"]
VARIANTS = {
    "base": _BASE,
    "adam-state": [*_BASE, "train.keep_optimizer_state=true"],  # AdamW kept across rounds
    "run-schedule": [*_BASE, "train.schedule=run"],  # one warmup + cosine over the rotation
    "descending": [*_BASE, "train.order=descending"],  # head-side block first
    # #27 item 1: the head (final norm + untied LM head) trains in every visit, AdamW kept
    "always-head": [*_BASE, "train.keep_optimizer_state=true", "train.always_train=[head]"],
    "random": [*_BASE, "train.keep_optimizer_state=true", "train.order=random"],  # #27 item 3
}


class _Stop(Exception):
    """Raised by the visit callback when an arm has done what the study needs."""


def base_overrides(sc: Scale, work: Path, M: int, epochs: float) -> list[str]:
    return [
        *sc.model,
        f"model.vocab_size={sc.vocab}",
        "data.source=builtin",
        f"data.max_documents={sc.documents}",
        f"data.vocab_size={sc.vocab}",
        f"data.seq_len={sc.seq_len}",
        f"data.val_fraction={sc.val_fraction}",
        f"data.out_dir={work / 'tokens'}",
        f"partition.num_blocks={M}",
        "cache.dtype=bf16",
        "cache.shard_mb=16",
        f"train.batch_size={sc.batch_size}",
        f"train.max_steps={sc.steps_per_visit}",
        f"train.epochs={epochs}",
        f"train.lr={sc.lr}",
        "train.warmup_steps=5",
        "train.eval_every=0",
        "train.eval_batches=4",
        "train.workers=0",
        "train.checkpoint_every=0",
        "run.device=cpu",
    ]


def prepare(sc: Scale, work: Path, M: int, seed: int, epochs: float) -> Path:
    """Token store (shared) and the seed's init checkpoint; returns the checkpoint dir."""
    init = work / f"init-M{M}-s{seed}"
    cfg = load_config(None, [*base_overrides(sc, work, M, epochs), f"run.dir={work / 'prep'}",
                             f"run.checkpoint={init}", f"model.init_seed={seed}"])  # fmt: skip
    if not TokenStore.exists(cfg.data.out_dir):
        run_tokenize(cfg, log=_quiet)
    if not (init / "checkpoint.json").exists():
        run_init(cfg, log=_quiet)
    return init


def run_arm(sc: Scale, work: Path, mode: str, M: int, seed: int, epochs: float, *,
            target_ppl: float | None = None, max_visits: int | None = None,
            min_visits: int = 0, variant: str = "base") -> dict:  # fmt: skip
    """One arm from the seed's init checkpoint; returns its whole-val curve and timing.
    Stops at target_ppl once min_visits are done (a whole round: the cache/recompute ratio
    of a rotation that stopped after block 1 would say nothing about blocks 2..M-1), or after
    max_visits. variant: a key of VARIANTS, whose overrides the arm's config gets on top."""
    init = prepare(sc, work, M, seed, epochs)
    tag = "" if variant == "base" else f"-{variant}"
    run = work / f"{mode}{tag}-M{M}-E{epochs:g}-s{seed}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(init, run / "checkpoint")
    cfg = load_config(None, [*base_overrides(sc, work, M, epochs), f"run.dir={run}",
                             f"train.seed={seed}", *VARIANTS[variant]])  # fmt: skip
    store = TokenStore(cfg.data.out_dir)
    budget = store_budget(cfg, store)
    if mode == "full":  # run_bcd's full mode trains rounds x M x a visit's steps
        cfg.train.max_steps, cfg.train.epochs, cfg.train.rounds = sc.full_steps // M, None, 1
        budget = store_budget(cfg, store)
    else:  # up to bcd_factor x full's steps
        cfg.train.rounds = math.ceil(sc.bcd_factor * sc.full_steps / (M * budget.steps))
    curve: list[dict] = []
    excluded = [0.0]  # seconds of this benchmark's own evaluations
    t0 = time.perf_counter()
    steps_done = [0]

    def point(step_total: int, ppl: float, **extra) -> None:
        curve.append({"steps": step_total, "seconds": time.perf_counter() - t0 - excluded[0],
                      "ppl": ppl, **extra})  # fmt: skip

    def on_visit(r: int, k: int, summary: dict) -> None:
        steps_done[0] += int(summary["steps"])
        e0 = time.perf_counter()
        ppl = run_eval(cfg, log=_quiet)["ppl"]  # the whole val split, full model from tokens
        excluded[0] += time.perf_counter() - e0
        point(steps_done[0], ppl, round=r, block=k)
        reached = any(c["ppl"] <= target_ppl for c in curve) if target_ppl is not None else False
        if reached and len(curve) >= min_visits:
            raise _Stop
        if max_visits is not None and len(curve) >= max_visits:
            raise _Stop

    def on_eval(visit, step: int, _val: float, _seconds: float) -> None:
        if mode != "full":
            return
        e0 = time.perf_counter()
        ppl = whole_val_ppl(visit, store, sc.batch_size)
        excluded[0] += time.perf_counter() - e0
        point(step, ppl)

    hooks = VisitHooks(on_eval=on_eval)
    if mode == "full":  # a whole-val point every steps_per_visit steps
        cfg.train.eval_every = budget.steps
    with contextlib.suppress(_Stop):
        run_bcd(cfg, mode=mode, log=_quiet, hooks=hooks, on_visit=on_visit)
    seconds = time.perf_counter() - t0 - excluded[0]
    events = [e for e in load_state(cfg).get("events", []) if e.get("action")]
    cache_s = sum(e["seconds"] for e in events)
    builds = [e for e in events if e.get("executor")]
    if mode == "full":
        visits = [(0, curve[-1]["steps"])] if curve else []
    else:  # (block, steps) of each visit, from the curve's cumulative steps
        prev = [0] + [c["steps"] for c in curve]
        visits = [(p["block"], p["steps"] - q) for p, q in zip(curve, prev, strict=False)]
    return {
        "mode": mode, "variant": variant, "M": M, "seed": seed, "epochs": epochs, "seconds": seconds,
        "steps": curve[-1]["steps"] if curve else 0, "final_ppl": curve[-1]["ppl"] if curve else None,
        "curve": curve, "cache_seconds": cache_s, "cache_share": cache_s / seconds if seconds else 0,
        "builds": [{k: e.get(k) for k in ("action", "boundary", "round", "seconds", "fixed_s",
                                          "startup_s", "finalize_s", "rows", "executor")}
                   for e in builds],
        "fixed_share": (sum(e["fixed_s"] for e in builds) / sum(e["seconds"] for e in builds))
        if builds else None,
        "visits": visits, "budget": budget.why, "passes": budget.passes,
        "rows": budget.rows, "val_rows": budget.val_rows,
        "load_start": load_average(), "checkpoint": f"<work>/{run.name}/checkpoint",
        "tokens_per_step": sc.batch_size * sc.seq_len,
    }  # fmt: skip


@torch.inference_mode()
def whole_val_ppl(visit, store: TokenStore, batch_size: int) -> float:
    """The whole val split through the visit's model (full mode: every block is loaded)."""
    was = visit.model.training
    visit.model.eval()
    M = visit.part.num_blocks
    res = evaluate_tokens(lambda ids: forward_blocks(visit.adapter, visit.part, ids, 0, M), store,
                          batch_size=batch_size)  # fmt: skip
    visit.model.train(was)
    return res["ppl"]


def predict(arms: list[dict], sc: Scale, work: Path, M: int, epochs: float) -> None:
    """Cost-model time of each arm: its FLOPs x the seconds per FLOP of the full arm."""
    cfg = load_config(None, [*base_overrides(sc, work, M, epochs), f"run.dir={work / 'prep'}"])
    ckpt = Checkpoint.open(prepare(sc, work, M, arms[1]["seed"], epochs))  # this M's partition
    fl = Flops(sh=model_shape(cfg.model), part=ckpt.partition, seq=sc.seq_len)
    for a in arms:
        a["flops"] = run_flops(fl, a["mode"], a["visits"], tokens_per_step=a["tokens_per_step"],
                               cached_rows=a["rows"], val_rows=a["val_rows"])  # fmt: skip
        for p in a["curve"]:  # FLOPs at each curve point: the visits up to it
            done = [
                v for v, c in zip(a["visits"], a["curve"], strict=False) if c["steps"] <= p["steps"]
            ]
            if a["mode"] == "full":
                done = [(0, p["steps"])]
            p["flops"] = run_flops(fl, a["mode"], done, tokens_per_step=a["tokens_per_step"],
                                   cached_rows=a["rows"], val_rows=a["val_rows"])["total"]  # fmt: skip
    full = next(a for a in arms if a["mode"] == "full")
    s_per_flop = full["seconds"] / full["flops"]["total"]
    for a in arms:
        a["predicted_seconds"] = a["flops"]["total"] * s_per_flop
        a["predicted_error"] = a["predicted_seconds"] / a["seconds"] - 1


def break_even(cache: dict, recompute: dict) -> float | None:
    """Passes per visit above which the cache pays, measured: the pre-inference seconds over
    the seconds recompute spent rerunning prefixes (its time minus the cache arm's visits), at
    the passes this run made (more passes: the same pre-inference, more prefix reruns saved)."""
    extra = recompute["seconds"] - (cache["seconds"] - cache["cache_seconds"])
    if extra <= 0:
        return None  # recompute cost no more than the cache arm's visits: caching never pays
    return cache["epochs"] * cache["cache_seconds"] / extra


def time_to(curve: list[dict], ppl: float) -> dict | None:
    """The first curve point at or below `ppl` (seconds, steps, FLOPs), else None."""
    for p in curve:
        if p["ppl"] <= ppl:
            return p
    return None


def study(sc: Scale, work: Path, M: int, epochs: float, log=print) -> dict:
    per_seed = []
    for seed in sc.seeds:
        memo = work / f"full-s{seed}-{sc.full_steps}.json"  # full does not depend on M or E
        if memo.exists():
            full = json.loads(memo.read_text())
        else:
            full = run_arm(sc, work, "full", M, seed, epochs)
            memo.write_text(json.dumps(full))
        log(f"  M={M} E={epochs:g} seed {seed}: full {full['steps']} steps {full['seconds']:.0f}s "
            f"ppl {full['final_ppl']:.1f}")  # fmt: skip
        cache = run_arm(sc, work, "bcd", M, seed, epochs, target_ppl=full["final_ppl"],
                        min_visits=M)  # fmt: skip
        recompute = run_arm(sc, work, "bcd-recompute", M, seed, epochs,
                            max_visits=len(cache["curve"]))  # fmt: skip
        arms = [full, cache, recompute]
        predict(arms, sc, work, M, epochs)
        hit = time_to(cache["curve"], full["final_ppl"])
        hit_r = time_to(recompute["curve"], full["final_ppl"])
        row = {
            "seed": seed, "arms": arms,
            "cache_to_full_time": hit["seconds"] / full["seconds"] if hit else None,
            "recompute_to_full_time": hit_r["seconds"] / full["seconds"] if hit_r else None,
            "bf_multiplier": hit["steps"] / full["steps"] if hit else None,
            "cache_over_recompute": cache["seconds"] / recompute["seconds"],
            "cache_share": cache["cache_share"], "fixed_share": cache["fixed_share"],
            "break_even_passes": break_even(cache, recompute),
            "prediction_error": {a["mode"]: a["predicted_error"] for a in arms},
            "reached": hit is not None,
        }  # fmt: skip
        log(f"    bcd {cache['steps']} steps {cache['seconds']:.0f}s ppl {cache['final_ppl']:.1f} "
            f"(reached full's: {hit is not None}); recompute {recompute['seconds']:.0f}s; "
            f"cache/recompute {row['cache_over_recompute']:.2f}, cache share "
            f"{row['cache_share']:.0%}")  # fmt: skip
        per_seed.append(row)
    med = {}
    for key in ("cache_to_full_time", "recompute_to_full_time", "bf_multiplier",
                "cache_over_recompute", "cache_share", "fixed_share",
                "break_even_passes"):  # fmt: skip
        vals = [r[key] for r in per_seed if r[key] is not None]
        med[key] = statistics.median(vals) if vals else None
    for mode in ("full", "bcd", "bcd-recompute"):
        med[f"prediction_error_{mode}"] = statistics.median(
            r["prediction_error"][mode] for r in per_seed
        )
    med["reached"] = sum(r["reached"] for r in per_seed)
    return {"M": M, "epochs": epochs, "seeds": per_seed, "median": med}


def variants_study(sc: Scale, work: Path, M: int, epochs: float, variants: list[str],
                   log=print) -> dict:  # fmt: skip
    """The bcd arm under each variant for full's own step budget (no early stop): whole-val ppl
    at full's steps against full's, and the steps to first reach full's final ppl."""
    per_seed = []
    for seed in sc.seeds:
        memo = work / f"full-s{seed}-{sc.full_steps}.json"
        if memo.exists():
            full = json.loads(memo.read_text())
        else:
            full = run_arm(sc, work, "full", M, seed, epochs)
            memo.write_text(json.dumps(full))
        row = {"seed": seed, "full_ppl": full["final_ppl"], "full_seconds": full["seconds"]}
        for v in variants:
            init = prepare(sc, work, M, seed, epochs)
            cfg = load_config(None, [*base_overrides(sc, work, M, epochs), f"run.dir={work / 'prep'}",
                                     f"run.checkpoint={init}"])  # fmt: skip
            steps = store_budget(cfg, TokenStore(cfg.data.out_dir)).steps
            arm = run_arm(sc, work, "bcd", M, seed, epochs, variant=v,
                          max_visits=math.ceil(sc.full_steps / steps))  # fmt: skip
            hit = time_to(arm["curve"], full["final_ppl"])
            row[v] = {"ppl": arm["final_ppl"], "steps": arm["steps"], "seconds": arm["seconds"],
                      "ppl_over_full": arm["final_ppl"] / full["final_ppl"],
                      "bf_multiplier": hit["steps"] / full["steps"] if hit else None,
                      "curve": arm["curve"]}  # fmt: skip
            log(f"  M={M} E={epochs:g} seed {seed} {v}: {arm['steps']} steps ppl "
                f"{arm['final_ppl']:.1f} (full {full['final_ppl']:.1f}), reaches full's at "
                f"{hit['steps'] if hit else 'never'}")  # fmt: skip
        per_seed.append(row)
    med = {}
    for v in variants:
        med[v] = {}
        for key in ("ppl_over_full", "bf_multiplier", "seconds"):
            vals = [r[v][key] for r in per_seed if r[v][key] is not None]
            med[v][key] = statistics.median(vals) if vals else None
        med[v]["reached"] = sum(r[v]["bf_multiplier"] is not None for r in per_seed)
    return {"M": M, "epochs": epochs, "variants": variants, "seeds": per_seed, "median": med}


def render_variants(s: dict) -> str:
    rows = [("variant (M, passes/visit)", "whole-val ppl at full's steps / full's",
             "B-F multiplier (steps to full's ppl / full's)", "seconds", "seeds reaching")]  # fmt: skip
    for v in s["variants"]:
        m = s["median"][v]
        bf = "n/a" if m["bf_multiplier"] is None else f"{m['bf_multiplier']:.2f}"
        rows.append((f"{v} (M={s['M']}, {s['epochs']:g})", f"{m['ppl_over_full']:.3f}", bf,
                     f"{m['seconds']:.0f}", f"{m['reached']}/{len(s['seeds'])}"))  # fmt: skip
    return headline_table(rows)


def render(res: dict) -> str:
    rows = [("M", "passes/visit", "bcd time to full's ppl / full", "B-F multiplier",
             "bcd / recompute (same visits)", "pre-inference share", "fixed / build",
             "break-even passes", "cost model error (bcd, recompute)", "seeds reaching")]  # fmt: skip
    for s in res["studies"]:
        m = s["median"]

        def f(v, fmt="{:.2f}"):
            return "n/a" if v is None else fmt.format(v)

        rows.append((str(s["M"]), f"{s['epochs']:g}", f(m["cache_to_full_time"]),
                     f(m["bf_multiplier"]), f(m["cache_over_recompute"]),
                     f(m["cache_share"], "{:.0%}"), f(m["fixed_share"], "{:.0%}"),
                     f(m["break_even_passes"]),
                     f"{m['prediction_error_bcd']:+.0%}, {m['prediction_error_bcd-recompute']:+.0%}",
                     f"{m['reached']}/{len(s['seeds'])}"))  # fmt: skip
    return headline_table(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed, a small model (make bench)")
    ap.add_argument("--M", type=int, nargs="+", default=[3], help="blocks (default 3)")
    ap.add_argument("--epochs", type=float, nargs="+", default=[1.0],
                    help="passes over each visit's rows (default 1)")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--work", default=None, help="keep runs here (default: a temp dir)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    ap.add_argument("--arch", choices=sorted(ARCH), default="gpt2",
                    help="gpt2 (tied, default) or llama (untied, GQA)")  # fmt: skip
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=None,
                    help="the B-F studies instead: the bcd arm under each, for full's steps")  # fmt: skip
    a = ap.parse_args(argv)
    sc = QUICK if a.quick else DEFAULT
    if a.seeds is not None:
        sc.seeds = a.seeds
    sc.model = [o for o in sc.model if not o.startswith("model.arch=")] + ARCH[a.arch]
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="economics-")
    work = Path(a.work or tmp.name)
    t0 = time.perf_counter()
    load0 = load_average()
    if a.variants:
        studies = [variants_study(sc, work, M, e, a.variants) for M in a.M for e in a.epochs]
        res = {"scale": asdict(sc), "variant_studies": studies, "load_start": load0,
               "load_end": load_average(), "seconds": time.perf_counter() - t0,
               "overrides": {v: VARIANTS[v] for v in a.variants}, "arch": a.arch,
               "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
        res["table"] = "\n\n".join(render_variants(s) for s in studies)
        print(res["table"])
        print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s)")
        out = (
            Path(a.out)
            if a.out
            else results_path("economics-variants" + ("" if a.arch == "gpt2" else f"-{a.arch}"))
        )
        write_results(out, res)
        if tmp is not None:
            tmp.cleanup()
        return {
            "headline": {v: studies[0]["median"][v]["ppl_over_full"] for v in a.variants},
            "results": str(out),
        }
    studies = [study(sc, work, M, e) for M in a.M for e in a.epochs]
    res = {"scale": asdict(sc), "studies": studies, "load_start": load0,
           "load_end": load_average(), "seconds": time.perf_counter() - t0,
           "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "arch": a.arch,
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
    res["table"] = render(res)
    print(res["table"])
    print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s)")
    out = Path(a.out) if a.out else results_path("economics" + ("-quick" if a.quick else ""))
    write_results(out, res)
    if tmp is not None:
        tmp.cleanup()
    m = studies[0]["median"]
    return {"headline": {"cache_to_full_time": m["cache_to_full_time"],
                         "cache_over_recompute": m["cache_over_recompute"],
                         "cache_share": m["cache_share"]}, "results": str(out)}  # fmt: skip


def _quiet(*_a, **_k) -> None:
    return None


if __name__ == "__main__":
    main()
