"""Economics: does BCD with the cache beat full training and BCD that recomputes its prefix?

    python -m bench.economics --quick            # make bench: one seed, a small model, minutes
    python -m bench.economics                    # 3 seeds, the layers-heavy model (~1 h, 2 CPUs)
    python -m bench.economics --epochs 1 4 --M 3 6

Per seed, from one token store and init checkpoint (study's run_one): full (full_cap steps),
bcd (train.epochs passes over a visit's rows, to full's final ppl) and bcd-recompute (the same
visits). Per arm: val ppl against seconds and FLOPs, the cache's share, the cost model's
predicted time beside the measured; medians over all seeds. The layers-heavy model (H=256, 6
layers, V=2048): the layers outweigh the LM head. Results: docs/economics.md.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench import harness as h
from bench.arms import Stop
from bench.study import LAYERS_HEAVY, LAYOUTS, TINY, Arm, Scale, finish, init_dir, run_one
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.shape import model_shape
from preinfer.plan.costmodel import Flops, run_flops
from storage.atomic import write_json

# full_cap: full's own step budget (no patience: it runs them all); lrs[0]: every arm's lr;
# val_batches=0: the whole val split
DEFAULT = Scale(model=LAYERS_HEAVY, documents=200, full_cap=180, lrs=[2e-3], val_batches=0)
QUICK = Scale(
    model=["model.hidden_size=128", "model.num_layers=6", "model.num_heads=4",
           "model.max_positions=64"],  # fmt: skip
    documents=40, seq_len=32, batch_size=8, vocab=512, val_fraction=0.05, steps_per_visit=12,
    full_cap=36, bcd_factor=2.0, seeds=[0], lrs=[2e-3], val_batches=0,
)  # fmt: skip
SMALLEST = replace(TINY, full_cap=9, bcd_factor=2.0, lrs=[1e-2], val_batches=4)  # --tiny (tests)
MODES = {m: Arm(m, [], m) for m in ("full", "bcd", "bcd-recompute")}


def predict(arms: list[dict], sc: Scale, work: Path, layout: str, M: int) -> None:
    """Cost-model time of each arm: its FLOPs x the seconds per FLOP of the full arm."""
    ckpt = Checkpoint.open(init_dir(work, layout, M, arms[1]["seed"]))  # this M's partition
    fl = Flops(sh=model_shape(ckpt.model_config), part=ckpt.partition, seq=sc.seq_len)

    def flops(a: dict, visits) -> dict:
        return run_flops(fl, a["mode"], visits, tokens_per_step=a["tokens_per_step"],
                         cached_rows=a["rows"], val_rows=a["val_rows"])  # fmt: skip

    for a in arms:
        a["flops"] = flops(a, a["visits"])
        for i, p in enumerate(a["curve"]):  # FLOPs at each curve point: the visits up to it
            done = [(0, p["steps"])] if a["mode"] == "full" else a["visits"][: i + 1]
            p["flops"] = flops(a, done)["total"]
    full = next(a for a in arms if a["mode"] == "full")
    s_per_flop = full["seconds"] / full["flops"]["total"]
    for a in arms:
        a["predicted_seconds"] = a["flops"]["total"] * s_per_flop
        a["predicted_error"] = a["predicted_seconds"] / a["seconds"] - 1


def study(sc: Scale, work: Path, layout: str, M: int, epochs: float, threads: int | None) -> dict:
    def arm(mode: str, seed: int, stop: Stop) -> dict:
        rec = run_one(sc, work, MODES[mode], layout=layout, M=M, seed=seed, lr=sc.lrs[0],
                      stop=stop, sets=(f"train.epochs={epochs}",), threads=threads)  # fmt: skip
        return {**rec, "epochs": epochs}

    per_seed = []
    for seed in sc.seeds:
        memo = work / f"full-{layout}-s{seed}-{sc.full_cap}.json"  # full: the same for any M, E
        if memo.exists():
            full = json.loads(memo.read_text())
        else:
            full = arm("full", seed, Stop())
            write_json(memo, full)  # NaN stays a float (a cache, not a results file)
        cap = math.ceil(sc.bcd_factor * sc.full_cap)
        cache = arm("bcd", seed, Stop(target_ppl=full["final_ppl"], min_visits=M, cap_steps=cap))
        recompute = arm("bcd-recompute", seed, Stop(max_visits=len(cache["curve"])))  # same visits
        arms = [full, cache, recompute]
        predict(arms, sc, work, layout, M)
        hit = h.first_reach(cache["curve"], full["final_ppl"])
        hit_r = h.first_reach(recompute["curve"], full["final_ppl"])
        # break-even passes per visit: the pre-inference seconds over those recompute spent
        # rerunning prefixes (its time less the cache arm's visits) x this run's passes
        extra = recompute["seconds"] - (cache["seconds"] - cache["cache_seconds"])
        figures = {  # their medians over seeds: None where not reached (or caching never pays)
            "cache_to_full_time": hit["seconds"] / full["seconds"] if hit else None,
            "recompute_to_full_time": hit_r["seconds"] / full["seconds"] if hit_r else None,
            "bf_multiplier": hit["steps"] / full["steps"] if hit else None,
            "cache_over_recompute": cache["seconds"] / recompute["seconds"],
            "cache_share": cache["cache_share"], "fixed_share": cache["fixed_share"],
            "break_even_passes": epochs * cache["cache_seconds"] / extra if extra > 0 else None,
        }  # fmt: skip
        print(f"  M={M} E={epochs:g} seed {seed}: bcd reached full's ppl: {hit is not None}; "
              f"cache/recompute {figures['cache_over_recompute']:.2f}, cache share "
              f"{figures['cache_share']:.0%}", flush=True)  # fmt: skip
        errors = {a["mode"]: a["predicted_error"] for a in arms}
        per_seed.append({"seed": seed, "arms": arms, **figures, "prediction_error": errors,
                         "reached": hit is not None})  # fmt: skip
    med = {k: h.spread([r[k] for r in per_seed])["median"] for k in figures}
    med.update({f"prediction_error_{m}": h.spread([r["prediction_error"][m] for r in per_seed])
                ["median"] for m in MODES})  # fmt: skip
    med["reached"] = sum(r["reached"] for r in per_seed)
    return {"M": M, "epochs": epochs, "seeds": per_seed, "median": med}


def render(studies: list[dict]) -> str:
    def f(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    rows = [("M", "passes/visit", "bcd time to full's ppl / full", "B-F multiplier",
             "bcd / recompute (same visits)", "pre-inference share", "fixed / build",
             "break-even passes", "cost model error (bcd, recompute)", "seeds reaching")]  # fmt: skip
    for s in studies:
        m = s["median"]
        rows.append((str(s["M"]), f"{s['epochs']:g}", f(m["cache_to_full_time"]),
                     f(m["bf_multiplier"]), f(m["cache_over_recompute"]),
                     f(m["cache_share"], "{:.0%}"), f(m["fixed_share"], "{:.0%}"),
                     f(m["break_even_passes"]),
                     f"{m['prediction_error_bcd']:+.0%}, {m['prediction_error_bcd-recompute']:+.0%}",
                     f"{m['reached']} of {len(s['seeds'])} reached"))  # fmt: skip
    return h.headline_table(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one seed, a small model (make bench)")
    size.add_argument("--tiny", action="store_true", help="a tiny model, seconds per arm (tests)")
    ap.add_argument("--M", type=int, nargs="+", default=[3], help="blocks (default 3)")
    ap.add_argument("--epochs", type=float, nargs="+", default=[1.0], help="passes per visit")
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--threads", type=int, help="torch threads, here and in each arm")
    ap.add_argument("--work", help="keep runs here (default: a temp dir)")
    ap.add_argument("--out", help="results JSON (default bench/results/...)")
    ap.add_argument("--arch", choices=sorted(LAYOUTS), default="gpt2", help="layout (gpt2: tied)")
    a = ap.parse_args(argv)
    sc = replace(SMALLEST if a.tiny else QUICK if a.quick else DEFAULT)
    sc.seeds = a.seeds or sc.seeds
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="economics-")
    work = Path(a.work or tmp.name)
    t0, load0 = time.perf_counter(), h.load_average()
    studies = [study(sc, work, a.arch, M, e, a.threads) for M in a.M for e in a.epochs]
    res = {"scale": asdict(sc), "studies": studies, "arch": a.arch, "table": render(studies)}
    name = "economics" + ("-quick" if a.quick else "-tiny" if a.tiny else "")
    out = finish(res, t0, load0, tmp, a.out, name)
    m = studies[0]["median"]
    keys = ("cache_to_full_time", "cache_over_recompute", "cache_share")
    return {"headline": {k: m[k] for k in keys}, "results": str(out)}


if __name__ == "__main__":
    main()
