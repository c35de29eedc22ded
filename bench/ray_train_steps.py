"""Visit steps/s under Ray Train against the same visit in this process, on one machine.

    python -m bench.ray_train_steps [--config configs/demo.yaml] [--repeats 3] [--steps 30]

Both arms train the same visit (block 0 from tokens, then the last block from its cache) from
the same checkpoint, alternating; the Ray Train arm (one worker, every CPU) joins a Ray instance
this process starts, as a cluster job does (RAY_ADDRESS). The figure is the visit's tokens/s
(Ray Train's start-up reported apart) beside the steady step time from metrics.jsonl.
Target (#15): Ray Train / in process >= 0.9; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.arms import prepare
from bench.harness import headline_table, load_average, publish, quiet
from pipelines.cache_build import build_cache
from pipelines.train import run_train
from preinfer.runtime.metrics import read_metrics


def _visit(cfg, block: int, ray_address: str | None) -> tuple[float, float, float]:
    """(tokens/s, median step seconds past the first two by metrics.jsonl's clock, wall-clock
    seconds of the whole run_train call)."""
    seen = len(read_metrics(cfg.run.dir))
    if ray_address:
        os.environ["RAY_ADDRESS"] = ray_address
    try:
        t0 = time.perf_counter()
        summary = run_train(cfg, block, 0, log=quiet, memory_check=False)
        wall = time.perf_counter() - t0
    finally:
        os.environ.pop("RAY_ADDRESS", None)
    t = [r["time"] for r in read_metrics(cfg.run.dir)[seen:] if r.get("event") == "step"]
    gaps = [b - a for a, b in zip(t[2:-1], t[3:], strict=True)]
    return summary["tokens_per_s"], statistics.median(gaps or [float("nan")]), wall


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="steps per visit")
    ap.add_argument("--quick", action="store_true", help="2 repeats of 10-step visits")
    ap.add_argument("--tiny", action="store_true", help="1 repeat of 4-step visits (tests)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    a = ap.parse_args(argv)
    if a.quick or a.tiny:
        a.repeats, a.steps = (1, 4) if a.tiny else (2, 10)
    import ray

    load0 = load_average()
    with tempfile.TemporaryDirectory(prefix="ray-train-steps-", ignore_cleanup_errors=True) as tmp:
        over = [f"run.dir={tmp}", f"train.max_steps={a.steps}", "train.eval_every=0",
                "train.eval_batches=1", "train.checkpoint_every=0", "train.workers=1",
                "train.epochs=null", "data.max_documents=120", "run.device=cpu"]  # fmt: skip
        cfg, _ = prepare(a.config, over, Path(tmp) / "checkpoint")
        last = cfg.partition.num_blocks - 1
        build_cache(cfg, last, 0, log=quiet)  # the last block's input
        pristine = Path(tmp) / "checkpoint-0"
        shutil.copytree(cfg.run.checkpoint, pristine)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)  # fmt: skip
        address = ray.get_runtime_context().gcs_address
        rows: dict[int, dict[str, list]] = {0: {}, last: {}}
        for _, b, addr in itertools.product(range(a.repeats), (0, last), (None, address)):
            arm = "ray" if addr else "in"
            keys = ("ray train" if addr else "in process", f"step {arm}", f"wall {arm}")
            for k, v in zip(keys, _visit(cfg, b, addr), strict=True):
                rows[b].setdefault(k, []).append(v)
            # each visit from the same weights: block 0's commit would make the cache stale
            shutil.rmtree(cfg.run.checkpoint)
            shutil.copytree(pristine, cfg.run.checkpoint)
        ray.shutdown()
    res = {"config": a.config, "steps": a.steps, "repeats": a.repeats, "cpus": os.cpu_count(),
           "load_start": load0, "load_end": load_average(), "blocks": {}}  # fmt: skip
    table = [("block (input)", "in process tok/s", "Ray Train tok/s", "Ray Train / in process",
              "steady step time, in process / Ray Train",
              "start-up + eval + commit extra s (Ray)")]  # fmt: skip
    for b, r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        ratio, steady = med["ray train"] / med["in process"], med["step in"] / med["step ray"]
        res["blocks"][str(b)] = {**r, "ratio": ratio, "steady_ratio": steady}
        table.append((f"{b} ({'tokens' if b == 0 else 'cache'})", f"{med['in process']:.0f}",
                      f"{med['ray train']:.0f}", f"{ratio:.2f}", f"{steady:.2f}",
                      f"{med['wall ray'] - med['wall in']:.1f}"))  # fmt: skip
    res["table"] = headline_table(table)
    text = f"{res['table']}\n(medians of {a.repeats}; load average {load0} at start, {res['load_end']} at end)"
    out = publish(res, text, a.out, "ray_train_steps")
    ratios = [v["ratio"] for v in res["blocks"].values()]
    return {"headline": {"ray_train_over_in_process": min(ratios)}, "results": str(out)}


if __name__ == "__main__":
    main()
