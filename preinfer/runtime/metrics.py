"""Run metrics: <run.dir>/metrics.jsonl, one JSON record per line (event = step | visit | cache
| eval), mirrored to TensorBoard (`tensorboard --logdir <run.dir>/tensorboard`) when the
`tensorboard` package is installed and run.tensorboard is on.

TensorBoard tags, by event: step -> train/loss, train/tokens_per_s, train/peak_mem_mb and
val/loss (when the step evaluated), at the run's step count; visit -> visit/<name> per block
and round; cache -> cache/seconds, cache/fixed_s per boundary; eval -> eval/loss, eval/ppl.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_writers: dict[str, object] = {}  # run dir -> SummaryWriter (one per process and run)
_steps: dict[str, int] = {}  # run dir -> step records written by this process


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def append_metrics(cfg, record: dict) -> None:
    """One record to <run.dir>/metrics.jsonl (the source of truth), and its numbers to
    TensorBoard under <run.dir>/tensorboard when run.tensorboard is on."""
    path = Path(cfg.run.dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if cfg.run.tensorboard:
        _tensorboard(cfg, record)


def last_visit_summary(cfg) -> dict:
    """The newest "visit" record of the run's metrics.jsonl ({} if none)."""
    last: dict = {}
    path = Path(cfg.run.dir) / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "visit":
                last = rec
    return last


def close_writers(run_dir) -> None:
    """Close this process's TensorBoard writer of `run_dir` (its files are about to move)."""
    key = str(Path(run_dir))
    w = _writers.pop(key, None)
    _steps.pop(key, None)
    if w is not None:
        w.close()


def _tensorboard(cfg, record: dict) -> None:
    if not tensorboard_available():
        return
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    key = str(Path(cfg.run.dir))
    if key not in _writers:
        _writers[key] = SummaryWriter(log_dir=str(Path(cfg.run.dir) / "tensorboard"))
    w = _writers[key]
    t = record.get("time")
    ev = record.get("event")
    if ev == "step":
        _steps[key] = _steps.get(key, 0) + 1
        n = _steps[key]
        for name in ("loss", "tokens_per_s", "peak_mem_mb"):
            if isinstance(record.get(name), int | float):
                w.add_scalar(f"train/{name}", record[name], n, walltime=t)
        if isinstance(record.get("val_loss"), int | float):
            w.add_scalar("val/loss", record["val_loss"], n, walltime=t)
    elif ev == "visit":
        tag = f"r{record.get('round')}-b{record.get('block')}"
        for name in ("loss", "val_loss", "seconds", "tokens_per_s", "peak_mem_mb"):
            if isinstance(record.get(name), int | float):
                w.add_scalar(f"visit/{name}/{tag}", record[name], _steps.get(key, 0), walltime=t)
    elif ev == "cache":
        tag = f"boundary{record.get('boundary')}"
        for name in ("seconds", "fixed_s"):
            if isinstance(record.get(name), int | float):
                w.add_scalar(f"cache/{name}/{tag}", record[name], record.get("round") or 0,
                             walltime=t)  # fmt: skip
    elif ev == "eval":
        for name in ("loss", "ppl"):
            if isinstance(record.get(name), int | float):
                w.add_scalar(f"eval/{name}", record[name], _steps.get(key, 0), walltime=t)
    w.flush()
