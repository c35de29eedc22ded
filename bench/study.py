"""The study to the plateau: BCD (with the cache, and recomputing its prefix) against full
training, each arm's lr swept, best against best (docs/quality.md says what and why).

    python -m bench.study                 # both layouts, M=3 and 6, 3 seeds, 3 lrs (many hours)
    python -m bench.study --quick         # make bench: LLaMA layout, M=3, one seed (minutes)
    python -m bench.study --small         # the quick model to its plateau, both layouts, 3 seeds
    python -m bench.study --tiny          # the slow test's end-to-end run (a minute)
    python -m bench.study --layouts llama --M 3 --variant head train.always_train=[head] \\
        --variant random train.order=random --set train.epochs=0.33

Per (layout, seed) every arm starts from one init checkpoint and token store, in a process of
its own (bench/arms.py; --inline: this one). full trains to its plateau; each BCD arm until it
reaches full's best val ppl (best lr, same seed) or bcd_factor x full's steps to it. B-F
multiplier (wall-clock ratio): BCD's steps (seconds, less evaluations) to it / full's to its
best; medians over all seeds (harness.spread).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path

import torch

from bench import harness as h
from bench.arms import Stop, host, prepare, run_arm


@dataclass
class Scale:
    """Sizes of one study (model and data as config overrides); economics' too."""

    model: list[str]  # model.* overrides of both layouts (the layout adds arch and tying)
    documents: int
    seq_len: int = 64
    batch_size: int = 16
    vocab: int = 2048
    val_fraction: float = 0.02
    steps_per_visit: int = 30  # a BCD visit's steps (train.max_steps); full's eval interval
    full_cap: int = 1800  # full's step cap and cosine horizon (patience may stop it sooner)
    patience: int = 3  # full stops after this many evaluations without improvement ...
    min_rel_delta: float = 0.005  # ... by more than this fraction of the best
    min_steps: int = 0  # ... but not before this many steps (early loss plateaus)
    bcd_factor: float = 3.0  # BCD arms run to full's best ppl or this x full's steps to it
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    lrs: list[float] = field(default_factory=lambda: [1e-3, 2e-3, 4e-3])  # every arm's sweep
    warmup_steps: int = 5
    val_batches: int = 16  # a curve point reads the first val_batches x batch val rows (0: all)


@dataclass
class Arm:
    """One arm: its name, mode (train.mode) and config overrides on top of the study's."""

    name: str
    overrides: list[str]
    mode: str = "bcd"


LAYOUTS = {
    "gpt2": ["model.arch=gpt2"],  # tied: the LM head is wte, block 0's
    "llama": ["model.arch=llama", "model.tie_embeddings=false", "model.num_kv_heads=2"],
}
LAYERS_HEAVY = ["model.hidden_size=256", "model.num_layers=6", "model.num_heads=4",
                "model.max_positions=128"]  # fmt: skip
DEFAULT = Scale(model=LAYERS_HEAVY, documents=100, full_cap=2400, patience=4, min_steps=300)
QUICK = Scale(
    model=["model.hidden_size=64", "model.num_layers=6", "model.num_heads=2",
           "model.max_positions=32"],  # fmt: skip
    documents=24, seq_len=32, batch_size=8, vocab=512, val_fraction=0.1, steps_per_visit=12,
    full_cap=144, patience=2, min_steps=72, seeds=[0], lrs=[3e-3, 1e-2, 3e-2], val_batches=4,
)  # fmt: skip
# the quick model to its plateau: its 24 documents overfit, so val ppl turns up and patience
# stops full well inside the cap; 3 seeds, the grid one step below the quick one's edge
SMALL = replace(
    QUICK, full_cap=1500, patience=3, min_steps=150, seeds=[0, 1, 2], lrs=[1e-3, 3e-3, 1e-2]
)
TINY = Scale(
    model=["model.hidden_size=32", "model.num_layers=6", "model.num_heads=2",
           "model.max_positions=16"],  # fmt: skip
    documents=8, seq_len=16, batch_size=4, vocab=320, val_fraction=0.2, steps_per_visit=3,
    full_cap=12, patience=2, seeds=[0], lrs=[1e-3, 1e-2, 3e-2], val_batches=2, warmup_steps=1,
)  # fmt: skip
PRESETS = {  # preset -> (scale, layouts, Ms)
    "default": (DEFAULT, ["gpt2", "llama"], [3, 6]),
    "quick": (QUICK, ["llama"], [3]),
    "small": (SMALL, ["llama", "gpt2"], [3]),
    "tiny": (TINY, ["gpt2"], [3]),
}
BASE_ARMS = {m: Arm(m, [], m) for m in ("bcd", "bcd-recompute")}
FULL = Arm("full", [], "full")
SHARED = ("model.", "data.", "partition.", "run.")  # every arm must share these: full is shared


def init_dir(work: Path, layout: str, M: int, seed: int) -> Path:
    return work / f"init-{layout}-M{M}-s{seed}"


def run_one(sc: Scale, work: Path, arm: Arm, *, layout: str, M: int, seed: int, lr: float,
            stop: Stop, sets: tuple[str, ...] = (), inline: bool = False,
            threads: int | None = None) -> dict:  # fmt: skip
    """One arm of (layout, M) from seed's init checkpoint (made once) and the shared token
    store, to its stop rule (bench/arms.py runs it): its record."""
    common = [  # what every arm of (layout, M) shares, the study's --set last but the paths
        *sc.model, *LAYOUTS[layout], f"model.vocab_size={sc.vocab}", "data.source=builtin",
        f"data.max_documents={sc.documents}", f"data.vocab_size={sc.vocab}",
        f"data.seq_len={sc.seq_len}", f"data.val_fraction={sc.val_fraction}",
        f"partition.num_blocks={M}", "cache.dtype=bf16", "cache.shard_mb=16",
        f"train.batch_size={sc.batch_size}", f"train.max_steps={sc.steps_per_visit}",
        f"train.warmup_steps={sc.warmup_steps}", "train.eval_every=0", "train.eval_batches=4",
        "train.workers=0", "train.checkpoint_every=0", "run.device=cpu", "run.tensorboard=false",
        *sets, f"data.out_dir={work / 'tokens'}", f"model.init_seed={seed}",
    ]  # fmt: skip
    init = init_dir(work, layout, M, seed)
    if not (init / "checkpoint.json").is_file():
        prepare(None, [*common, f"run.dir={work / 'prep'}"], init)
    name = f"{layout}-{arm.name}-M{M}-s{seed}-lr{lr:g}"
    over = [*common, *arm.overrides]
    if arm.mode == "full":  # run_bcd's full mode trains rounds x M x a visit's steps: the cap
        over += [f"train.max_steps={max(1, sc.full_cap // M)}", "train.epochs=null",
                 "train.rounds=1", f"train.eval_every={sc.steps_per_visit}"]  # fmt: skip
    spec = {"arm": arm.name, "mode": arm.mode, "lr": lr, "seed": seed, "overrides": over,
            "init": str(init), "run_dir": str(work / name), "stop": stop,
            "eval_batches": sc.val_batches, "threads": threads}  # fmt: skip
    (work / "logs").mkdir(parents=True, exist_ok=True)
    rec = run_arm(spec, log_path=None if inline else work / "logs" / f"{name}.log")
    rec.update(overrides=arm.overrides, layout=layout, M=M)
    print(f"    {layout} M={M} s{seed} {arm.name:>14s} lr {lr:<7g} {rec['steps']:>5d} steps "
          f"{rec['seconds']:7.1f}s ppl {rec['final_ppl'] or float('nan'):8.2f} peak "
          f"{rec['peak_rss_mb']:.0f} MiB (load {rec['load_start']})", flush=True)  # fmt: skip
    return rec


def parse_variant(spec: list[str]) -> Arm:
    """--variant NAME KEY=VALUE...: a BCD arm; train.mode=... in the overrides picks its mode."""
    name, *sets = spec
    if not sets:
        raise ValueError(f"--variant {name}: give at least one KEY=VALUE override after the name")
    if name in ("full", *BASE_ARMS):
        raise ValueError(f"--variant {name}: the name is a base arm's; choose another")
    mode = "bcd"
    for s in sets:
        if "=" not in s:
            raise ValueError(f"--variant {name}: {s!r} is not KEY=VALUE")
        if s.startswith(SHARED):
            raise ValueError(f"--variant {name}: {s!r} changes what every arm shares (model, "
                             f"data, partition, run); use --set for the whole study")  # fmt: skip
        if s.startswith("train.mode="):
            mode = s.split("=", 1)[1]
    if mode not in ("bcd", "bcd-recompute"):
        raise ValueError(f"--variant {name}: train.mode must be bcd or bcd-recompute, got {mode!r}")
    return Arm(name, list(sets), mode)


def run_arms(sc: Scale, work: Path, layout: str, M: int, arms: list[Arm], opts: dict,
             full: dict | None = None) -> dict:  # fmt: skip
    """Every arm at every (seed, lr), interleaved per seed, as {arm: {lr: [record per seed]}}.
    Without `full`: full to its plateau; with it ({seed: full's record at its best lr}): each
    BCD arm until it reaches that seed's best ppl, or bcd_factor x full's steps to it."""
    runs = {a.name: {lr: [] for lr in sc.lrs} for a in arms}
    jobs = [(a, lr) for lr in sc.lrs for a in arms]  # arms alternate within each lr
    for i, seed in enumerate(sc.seeds):
        if full is None:
            stop = Stop(patience=sc.patience, min_rel_delta=sc.min_rel_delta, min_steps=sc.min_steps)  # fmt: skip
        else:
            best = full[seed]["best"]
            stop = Stop(target_ppl=best["ppl"], cap_steps=math.ceil(sc.bcd_factor * best["steps"]))
        for arm, lr in h.interleave(jobs, i):
            rec = run_one(sc, work, arm, layout=layout, M=M, seed=seed, lr=lr, stop=stop, **opts)
            if full is None:
                p = h.plateau(rec["curve"], sc.patience, sc.min_rel_delta, sc.min_steps)
                rec.update(best=p["best"], plateaued=p["plateaued"], best_ppl=p["best"]["ppl"],
                           steps_to_best=p["best"]["steps"])  # fmt: skip
            else:
                hit = h.first_reach(rec["curve"], best["ppl"])
                rec.update(h.multiplier(hit, best), reach_steps=hit["steps"] if hit else None,
                           target_ppl=best["ppl"], cap_steps=stop.cap_steps,
                           best_ppl=min(p["ppl"] for p in rec["curve"]) if rec["curve"] else None)  # fmt: skip
            runs[arm.name][lr].append(rec)  # seeds run in order: each list is in seed order
    return runs


def analyse(full_runs: dict, bcd_runs: dict) -> dict:
    """Best lr per arm and, at it, the per-seed figures with their spreads (harness.spread)."""
    fsel = h.select_lr(full_runs, "best_ppl", tie="steps_to_best")
    best_full = full_runs[fsel["lr"]]
    out = {"full": {"select": fsel, "plateaued": sum(r["plateaued"] for r in best_full),
                    "seeds": len(best_full), "seconds_to_best":
                    h.spread([r["best"]["seconds"] for r in best_full]),
                    **{k: h.spread([r[k] for r in best_full]) for k in ("best_ppl", "steps_to_best")}}}  # fmt: skip
    for name, by_lr in bcd_runs.items():
        sel = h.select_lr(by_lr, "bf_multiplier", tie="best_ppl")
        recs = by_lr[sel["lr"]]
        out[name] = {"select": sel, "reached": sum(r["reached"] for r in recs), "seeds": len(recs),
                     **{k: h.spread([r[k] for r in recs]) for k in ("reach_steps", "bf_multiplier",
                        "time_ratio", "best_ppl", "cache_share")}}  # fmt: skip
    return out


def render(studies: list[dict]) -> str:
    rows = [("layout", "M", "arm", "best lr (sweep)", "best val ppl", "steps to full's best ppl",
             "B-F multiplier", "wall-clock / full's", "reached")]  # fmt: skip
    for s in studies:
        for name, r in s["analysis"].items():
            sel = r["select"]
            lr = f"{sel['lr']:g}{' (edge)' if sel['edge'] else ''} ({', '.join(f'{x:g}' for x in sel['by_lr'])})"
            head = (s["layout"], str(s["M"]), name, lr, h.show(r["best_ppl"], "{:.1f}"))
            if name == "full":
                rows.append((*head, h.show(r["steps_to_best"], "{:.0f}"), "1", "1",
                             f"plateau {r['plateaued']}/{r['seeds']}"))  # fmt: skip
            else:
                rows.append((*head, h.show(r["reach_steps"], "{:.0f}"), h.show(r["bf_multiplier"]),
                             h.show(r["time_ratio"]), h.reached(r["bf_multiplier"])))  # fmt: skip
    return h.headline_table(rows)


def finish(res: dict, t0: float, load0, tmp, out: str | None, name: str) -> Path:
    """res with the run's load, seconds and host, printed and written (harness.publish); the
    temp work dir (None: --work's) removed. Economics' too."""
    res.update(load_start=load0, load_end=h.load_average(), seconds=time.perf_counter() - t0)
    res.update(host())
    print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s)")
    if tmp is not None:
        tmp.cleanup()
    return h.publish(res, res["table"], out, name)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="LLaMA layout, M=3, 1 seed (make bench)")
    size.add_argument(
        "--small", action="store_true", help="the quick model to its plateau, 3 seeds"
    )
    size.add_argument("--tiny", action="store_true", help="a tiny model, seconds per arm (tests)")
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS))
    ap.add_argument("--M", type=int, nargs="+", help="block counts")
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--lrs", type=float, nargs="+", help="the lr grid of every arm")
    ap.add_argument("--arms", nargs="*", choices=sorted(BASE_ARMS), help="BCD arms (default: both)")
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                    help="a named BCD arm with config overrides (repeatable)")  # fmt: skip
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every arm (repeatable)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--inline", action="store_true", help="run the arms in this process")
    ap.add_argument("--work", help="scratch dir (default: a temp dir)")
    ap.add_argument("--out", help="results JSON (default bench/results/...)")
    ap.add_argument("--val-batches", type=int, help="val batches per curve point (0: all)")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    preset = "quick" if a.quick else "small" if a.small else "tiny" if a.tiny else "default"
    base, layouts, Ms = PRESETS[preset]
    vb = base.val_batches if a.val_batches is None else a.val_batches
    if vb < 0:
        ap.error(f"--val-batches must be >= 0 (0 = the whole val split), got {vb}")
    sc = replace(base, seeds=a.seeds or base.seeds, lrs=a.lrs or base.lrs, val_batches=vb)
    layouts, Ms = a.layouts or layouts, a.M or Ms
    try:
        arms = [BASE_ARMS[n] for n in (a.arms if a.arms is not None else BASE_ARMS)]
        arms += [parse_variant(v) for v in a.variant]
    except ValueError as e:
        ap.error(str(e))
    if len({x.name for x in arms}) != len(arms):
        ap.error("two BCD arms share a name")
    torch.set_num_threads(a.threads)  # >= 1 (torch says so)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="study-")
    work = Path(a.work or tmp.name)
    opts = {"sets": tuple(a.sets), "inline": a.inline, "threads": a.threads}
    t0, load0 = time.perf_counter(), h.load_average()
    print(f"study ({preset}): layouts {layouts}, M {Ms}, seeds {sc.seeds}, lrs {sc.lrs}, "
          f"arms full + {[x.name for x in arms]} (load {load0})", flush=True)  # fmt: skip
    studies = []
    for layout in layouts:
        full_runs = run_arms(sc, work, layout, min(Ms), [FULL], opts)["full"]
        fsel = h.select_lr(full_runs, "best_ppl", tie="steps_to_best")
        best_full = {r["seed"]: r for r in full_runs[fsel["lr"]]}
        for M in Ms:
            bcd_runs = run_arms(sc, work, layout, M, arms, opts, full=best_full)
            studies.append({"layout": layout, "M": M, "analysis": analyse(full_runs, bcd_runs),
                            "full_runs": full_runs, "bcd_runs": bcd_runs})  # fmt: skip
    # the command as run, --work's and --out's values (machine paths) as <work>, <out>
    shown = [f"<{p[2:]}>" if p in ("--work", "--out") else x for p, x in pairwise(["", *argv])]
    res = {
        "command": " ".join(["python -m bench.study", *shown]),
        "preset": preset, "scale": asdict(sc), "layouts": {k: LAYOUTS[k] for k in layouts},
        "M": Ms, "arms": [asdict(x) for x in arms], "sets": a.sets, "studies": studies,
        "table": render(studies),
    }  # fmt: skip
    name = "study" + ("" if preset == "default" else f"-{preset}")
    out = finish(res, t0, load0, tmp, a.out, name)
    head = {f"{s['layout']}.M{s['M']}.{name}.{k}": r[k]["median"] for s in studies
            for name, r in s["analysis"].items() if name != "full"
            for k in ("bf_multiplier", "time_ratio")}  # fmt: skip
    return {"headline": head, "results": h.rel(out), "seconds": res["seconds"]}


if __name__ == "__main__":
    main()
