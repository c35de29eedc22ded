"""Economics: does BCD with the cache beat full training and BCD that recomputes its prefix?

    python -m bench.economics --quick            # make bench: one seed, a small model, minutes
    python -m bench.economics                    # 3 seeds, the layers-heavy model (~1 h, 2 CPUs)
    python -m bench.economics --epochs 1 4 --M 3 6

Arms from one token store and init checkpoint per seed (study's run_one, each in its own
process): full (full_cap steps, for every M), bcd (train.epochs passes over a round's rows) and
bcd-recompute (the same visits). Per arm: whole-val ppl against seconds (less every
evaluation) and FLOPs, time to full's final ppl, bcd's cache share and each build's fixed part,
preinfer.plan.costmodel's predicted time beside the measured; medians over all seeds. H=256, 6
layers, V=2048: the layers outweigh the LM head. Results: docs/economics.md; lr-swept studies of
one option against another are `bench.study --variant`.
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
from bench.arms import Stop, host
from bench.study import LAYERS_HEAVY, LAYOUTS, TINY, Arm, Scale, init_dir, run_one
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


def arm(sc: Scale, work: Path, layout: str, mode: str, M: int, seed: int, epochs: float,
        stop: Stop, inline: bool = False) -> dict:  # fmt: skip
    rec = run_one(sc, work, MODES[mode], layout=layout, M=M, seed=seed, lr=sc.lrs[0], stop=stop,
                  sets=(f"train.epochs={epochs}",), inline=inline)  # fmt: skip
    return {**rec, "epochs": epochs}


def predict(arms: list[dict], sc: Scale, work: Path, layout: str, M: int) -> None:
    """Cost-model time of each arm: its FLOPs x the seconds per FLOP of the full arm."""
    ckpt = Checkpoint.open(init_dir(work, layout, M, arms[1]["seed"]))  # this M's partition
    fl = Flops(sh=model_shape(ckpt.model_config), part=ckpt.partition, seq=sc.seq_len)

    def flops(a: dict, visits) -> dict:
        return run_flops(fl, a["mode"], visits, tokens_per_step=a["tokens_per_step"],
                         cached_rows=a["rows"], val_rows=a["val_rows"])  # fmt: skip

    for a in arms:
        a["flops"] = flops(a, a["visits"])
        for p in a["curve"]:  # FLOPs at each curve point: the visits up to it
            done = [v for v, c in zip(a["visits"], a["curve"], strict=False)
                    if c["steps"] <= p["steps"]]  # fmt: skip
            p["flops"] = flops(a, [(0, p["steps"])] if a["mode"] == "full" else done)["total"]
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


def study(sc: Scale, work: Path, layout: str, M: int, epochs: float, log=print,
          inline: bool = False) -> dict:  # fmt: skip
    per_seed = []
    for seed in sc.seeds:
        memo = work / f"full-{layout}-s{seed}-{sc.full_cap}.json"  # full: the same for any M, E
        if memo.exists():
            full = json.loads(memo.read_text())
        else:
            full = arm(sc, work, layout, "full", M, seed, epochs, Stop(), inline)
            write_json(memo, full)  # NaN stays a float (a cache, not a results file)
        log(f"  M={M} E={epochs:g} seed {seed}: full {full['steps']} steps {full['seconds']:.0f}s "
            f"ppl {full['final_ppl']:.1f}")  # fmt: skip
        cap = math.ceil(sc.bcd_factor * sc.full_cap)
        cache = arm(sc, work, layout, "bcd", M, seed, epochs,
                    Stop(target_ppl=full["final_ppl"], min_visits=M, cap_steps=cap), inline)  # fmt: skip
        recompute = arm(sc, work, layout, "bcd-recompute", M, seed, epochs,
                        Stop(max_visits=len(cache["curve"])), inline)  # fmt: skip
        arms = [full, cache, recompute]
        predict(arms, sc, work, layout, M)
        hit = h.first_reach(cache["curve"], full["final_ppl"])
        hit_r = h.first_reach(recompute["curve"], full["final_ppl"])
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
    keys = ("cache_to_full_time", "recompute_to_full_time", "bf_multiplier",
            "cache_over_recompute", "cache_share", "fixed_share", "break_even_passes")  # fmt: skip
    med = {k: h.spread([r[k] for r in per_seed])["median"] for k in keys}  # None: not reached
    med.update({f"prediction_error_{m}": h.spread([r["prediction_error"][m] for r in per_seed])
                ["median"] for m in MODES})  # fmt: skip
    med["reached"] = sum(r["reached"] for r in per_seed)
    return {"M": M, "epochs": epochs, "seeds": per_seed, "median": med}


def render(res: dict) -> str:
    def f(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    rows = [("M", "passes/visit", "bcd time to full's ppl / full", "B-F multiplier",
             "bcd / recompute (same visits)", "pre-inference share", "fixed / build",
             "break-even passes", "cost model error (bcd, recompute)", "seeds reaching")]  # fmt: skip
    for s in res["studies"]:
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
    ap.add_argument("--epochs", type=float, nargs="+", default=[1.0],
                    help="passes over each visit's rows (default 1)")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--work", default=None, help="keep runs here (default: a temp dir)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    ap.add_argument("--arch", choices=sorted(LAYOUTS), default="gpt2",
                    help="gpt2 (tied, default) or llama (untied, GQA)")  # fmt: skip
    ap.add_argument("--inline", action="store_true",
                    help="run the arms in this process (peak memory then not each arm's own)")  # fmt: skip
    a = ap.parse_args(argv)
    sc = replace(SMALLEST if a.tiny else QUICK if a.quick else DEFAULT)
    sc.seeds = a.seeds if a.seeds is not None else sc.seeds
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="economics-")
    work = Path(a.work or tmp.name)
    t0, load0 = time.perf_counter(), h.load_average()
    studies = [study(sc, work, a.arch, M, e, inline=a.inline) for M in a.M for e in a.epochs]
    res = {"scale": asdict(sc), "studies": studies, "load_start": load0,
           "load_end": h.load_average(), "seconds": time.perf_counter() - t0, "arch": a.arch,
           **host()}  # fmt: skip
    res["table"] = render(res)
    print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s)")
    name = "economics" + ("-quick" if a.quick else "-tiny" if a.tiny else "")
    out = h.publish(res, res["table"], a.out, name)
    if tmp is not None:
        tmp.cleanup()
    m = studies[0]["median"]
    return {"headline": {k: m[k] for k in ("cache_to_full_time", "cache_over_recompute",
                                           "cache_share")}, "results": str(out)}  # fmt: skip


if __name__ == "__main__":
    main()
