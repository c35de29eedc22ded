"""Quality study: full-parameter training vs BCD from the cache vs BCD-recompute, same data.

    python -m bench.quality             # the default study (`make study`): <= 60 min on 2 CPUs
    python -m bench.quality --quick     # CI-scale: one seed, one tiny model, a few minutes
    python -m bench.quality --lr-sweep  # the learning-rate tuning the LR constants come from
    python -m bench.quality --from-json bench/results/quality-X.json  # re-render docs only

(from the repo root). The study's pieces: bench/quality_arms.py (constants, Scale, Arm,
configs), quality_train.py (training arms in this process, metrics parsing, the side studies),
quality_probe.py (memory probes), quality_analysis.py (pure analysis), quality_figures.py and
quality_markdown.py (docs/).

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
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.quality_analysis import analyse
from bench.quality_arms import DEFAULT, LR, QUICK, Scale, plan_arms
from bench.quality_figures import plot_curves, plot_sgd, plot_sweep
from bench.quality_markdown import write_markdown
from bench.quality_probe import probe_main, probe_specs, run_probes
from bench.quality_train import (
    diagnose_order,
    lr_sweep,
    prepare,
    run_arm,
    set_threads,
    torch_threads,
)

ROOT = Path(__file__).resolve().parents[1]

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
    set_threads(scale)
    log(f"quality study ({name}): {len(arms)} training arms, work dir {work}")
    prep = prepare(scale, arms, work, log=log)
    t0 = time.perf_counter()
    ensure_ray()
    ray_s = time.perf_counter() - t0
    recs = []
    for i, arm in enumerate(arms):
        log(
            f"[{i + 1}/{len(arms)}] {arm.id} ({arm.group}) "
            f"t={(time.perf_counter() - t_study) / 60:.1f} min"
        )
        try:
            recs.append(run_arm(scale, arm, work, log=log))
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
        "command": "python -m bench.quality" + (" --quick" if name == "quick" else ""),
        "scale_name": name,
        "scale": asdict(scale),
        "lr": LR,
        "started": started,
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg()[0],
            "torch_threads": torch_threads(),
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
        command=f"python -m bench.quality {flag}" + (" --quick" if quick else ""),
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
