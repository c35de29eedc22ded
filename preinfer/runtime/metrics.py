"""Run metrics: <run.dir>/metrics.jsonl, one JSON record per line (event = step | visit | cache
| eval), mirrored to TensorBoard (`tensorboard --logdir <run.dir>/tensorboard`) when the
`tensorboard` package is installed and run.tensorboard is on.

TensorBoard tags, by event: step -> train/loss, train/tokens_per_s, train/peak_mem_mb and
val/loss (when the step evaluated), at the run's step count; visit -> visit/<name> per block
and round; cache -> cache/seconds, cache/fixed_s per boundary; eval -> eval/loss, eval/ppl.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
from pathlib import Path

METRICS = "metrics.jsonl"

_writers: dict[str, object] = {}  # run dir -> SummaryWriter (one per process and run)
_steps: dict[str, int] = {}  # run dir -> step records written by this process


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def append_metrics(run_dir: str | Path, record: dict, *, tensorboard: bool = False) -> None:
    """One record to <run_dir>/metrics.jsonl (the source of truth), and its numbers to
    TensorBoard under <run_dir>/tensorboard when `tensorboard` (run.tensorboard). A last line
    left torn by a kill is ended first, so this record gets a line of its own."""
    path = Path(run_dir) / METRICS
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "a+b") as f:
            torn = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
            f.write((("\n" if torn else "") + json.dumps(record) + "\n").encode())
    except OSError as e:
        raise _named(e, path) from e
    if tensorboard:
        _tensorboard(run_dir, record)


def _named(e: OSError, path: Path) -> OSError:
    """`e` naming `path` when it names no file (a full disk on write or flush)."""
    return e if e.filename is not None else OSError(e.errno, e.strerror, str(path))


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every record of <run_dir>/metrics.jsonl in order ([] when it does not exist). A line that
    is not a JSON object (a write torn by a kill) is skipped."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def last_visit_summary(run_dir: str | Path) -> dict:
    """The newest "visit" record of the run's metrics.jsonl ({} if none)."""
    visits = [r for r in read_metrics(run_dir) if r.get("event") == "visit"]
    return visits[-1] if visits else {}


def close_writers(run_dir) -> None:
    """Close this process's TensorBoard writer of `run_dir` (its files are about to move)."""
    key = str(Path(run_dir))
    w = _writers.pop(key, None)
    _steps.pop(key, None)
    if w is not None:
        w.close()


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises a write error (a full disk) out of its run(), which
    Python prints as "Exception in thread ..." with a traceback; the writer's next flush raises
    the same error in its caller (`_tensorboard`, which flushes every record), so the thread's
    own report is left out. Installed once, on this process's first TensorBoard writer."""
    prev = threading.excepthook
    if getattr(prev, "_preinfer_quiet", False):
        return

    def hook(args) -> None:
        if not type(args.thread).__module__.startswith("tensorboard."):
            prev(args)

    hook._preinfer_quiet = True
    threading.excepthook = hook


def _tensorboard(run_dir: str | Path, record: dict) -> None:
    if not tensorboard_available():
        return
    key, logdir = str(Path(run_dir)), Path(run_dir) / "tensorboard"
    try:
        _write_tensorboard(key, logdir, record)
    except OSError as e:  # a full disk: the writer is broken; a later record makes a new one
        w = _writers.pop(key, None)
        mine = sorted(logdir.glob(f"events.out.tfevents.*.{os.getpid()}.*"),
                      key=lambda p: p.stat().st_mtime)  # fmt: skip
        if mine and mine[-1].stat().st_size == 0:
            mine[-1].unlink()  # the event file this process could not begin
        if w is not None:
            with contextlib.suppress(Exception):  # a broken writer's close raises it again
                w.close()
        raise _named(e, mine[-1] if mine else logdir) from e


def _write_tensorboard(key: str, logdir: Path, record: dict) -> None:
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    if key not in _writers:
        _quiet_writer_threads()
        _writers[key] = SummaryWriter(log_dir=str(logdir))
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
