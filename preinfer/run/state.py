"""A run's state (`<run.dir>/state.json`) and the checkpoint it belongs to.

state.json records the rotation's finished visits, its caches, its token store and, since
this record, the checkpoint they were trained into:

    "checkpoint": {"path", "init_id": the init it descends from (checkpoint.json "init_id"),
                   "blocks": [each block's content hash after the last recorded commit]}

Every stage that reads a run (bcd, train, eval, report, export) holds the two together with
`check_run`: a checkpoint re-initialised or replaced under a run.dir whose state says "done"
would otherwise train nothing, or report visits the checkpoint does not hold. A visit that was
pending (started, maybe committed, not yet recorded) may have changed any of its blocks.

`reset_run` moves a run's records aside (into `<run.dir>/replaced/<time>/`, nothing deleted)
when `preinfer init` writes a new checkpoint under the run.dir.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from core.config import ConfigError
from preinfer.checkpoint.format import CheckpointError
from preinfer.checkpoint.store import Checkpoint
from preinfer.runtime.metrics import close_writers
from storage.atomic import write_bytes, write_json

STATE = "state.json"
# what a run writes about its training; moved aside together when its checkpoint is replaced
RUN_RECORDS = (STATE, "config.json", "metrics.jsonl", "train_state", "report", "tensorboard")


def state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STATE


def load_run_state(run_dir: str | Path) -> dict:
    """state.json, or an empty state when the run has not started."""
    p = state_path(run_dir)
    if not p.is_file():
        return {"visits": {}, "caches_in_use": [], "events": []}
    try:
        state = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{p} is not valid JSON ({e}); it was edited or damaged. Restore it, or train in a "
            "fresh run.dir"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("visits", {}), dict):
        raise ConfigError(f"{p} is not a preinfer run state; restore it or use a fresh run.dir")
    return state


def save_run_state(run_dir: str | Path, state: dict) -> None:
    p = state_path(run_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json(p, state)


def checkpoint_record(ckpt) -> dict:
    """What state.json keeps of the checkpoint its visits were committed to."""
    return {
        "path": str(ckpt.path),
        "init_id": ckpt.index.get("init_id"),
        "blocks": [b["hash"] for b in ckpt.index["blocks"]],
    }


def run_mismatch(state: dict, ckpt) -> str | None:
    """Why `ckpt` (a Checkpoint, or anything with its .index and .path) is not the checkpoint
    `state` trained, or None when it is (or when the state records none: a run not yet
    started, or one from before the record)."""
    rec = state.get("checkpoint")
    if not isinstance(rec, dict) or not isinstance(rec.get("blocks"), list):
        return None
    done = len(state.get("visits") or {})
    was_id, now_id = rec.get("init_id"), ckpt.index.get("init_id")
    if was_id and now_id and was_id != now_id:
        return (
            f"its state records {done} trained visit(s) of another checkpoint (init "
            f"{was_id[:12]}), but {ckpt.path} was initialised anew since (init {now_id[:12]})"
        )
    now = [b["hash"] for b in ckpt.index["blocks"]]
    if len(now) != len(rec["blocks"]):
        return (
            f"its state records visits of a {len(rec['blocks'])}-block checkpoint, but "
            f"{ckpt.path} has {len(now)} blocks"
        )
    if state.get("pending"):
        return None  # the visit in flight may have committed any of its blocks
    changed = [b for b, (x, y) in enumerate(zip(rec["blocks"], now, strict=True)) if x != y]
    if changed:
        return (
            f"block(s) {changed} of {ckpt.path} are not what its last recorded visit committed "
            "(the checkpoint was replaced or trained outside this run.dir)"
        )
    return None


def check_run(run_dir: str | Path, ckpt, stage: str) -> dict:
    """The run's state, refused (ConfigError) when it belongs to another checkpoint than
    `ckpt`. One line: what differs and what to do."""
    state = load_run_state(run_dir)
    why = run_mismatch(state, ckpt)
    for _ in range(5):  # a commit and its record in state.json are two writes: a reader beside
        if why is None:  # a running bcd that read one before and one after reads both again
            break
        try:
            index = Checkpoint.open(ckpt.path).index
        except CheckpointError:
            break
        again = load_run_state(run_dir)
        if (again, index) == (state, ckpt.index):
            break  # neither changed: the mismatch is real
        state, ckpt.index = again, index  # the reader goes on with the newer commit
        why = run_mismatch(state, ckpt)
    if why is not None:
        raise ConfigError(
            f"run.dir {run_dir} does not belong to its checkpoint: {why}. `preinfer {stage}` "
            "would go on as if those visits were in it. Train this checkpoint in a fresh "
            f"run.dir (run.dir=<new dir> run.checkpoint={ckpt.path}), or run `preinfer init "
            "--force`, which writes a new checkpoint and moves this run's records aside"
        )
    return state


def reset_run(run_dir: str | Path, log=print) -> Path | None:
    """Move the run's records (state, metrics, mid-visit states, report) into
    `<run.dir>/replaced/<time>/`: they describe a checkpoint that no longer exists there.
    Returns where they went (None: there were none)."""
    run = Path(run_dir)
    found = [run / n for n in RUN_RECORDS if (run / n).exists()]
    if not found:
        return None
    dest = run / "replaced" / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    close_writers(run)
    for p in found:
        p.rename(dest / p.name)
    log(f"init: the run's earlier records ({', '.join(p.name for p in found)}) described the "
        f"replaced checkpoint; moved to {dest}")  # fmt: skip
    return dest


# the records a rotation writes before its first visit: a refused command puts them back
_RECORDS = ("state.json", "config.json")


def checkpoint_hash(checkpoint: str | Path) -> str:
    """Content hash of the whole checkpoint as it is now."""
    ckpt = Checkpoint.open(checkpoint)
    return ckpt.prefix_hash(ckpt.num_blocks)


def snapshot_records(run_dir: str | Path, checkpoint: str | Path) -> dict:
    """The run's records as they are (state.json, config.json, the length of metrics.jsonl)
    and the checkpoint's hash, for restore_if_untrained."""
    run = Path(run_dir)
    snap = {n: (run / n).read_bytes() if (run / n).is_file() else None for n in _RECORDS}
    metrics = run / "metrics.jsonl"
    snap["metrics"] = metrics.stat().st_size if metrics.is_file() else None
    try:
        snap["checkpoint"] = checkpoint_hash(checkpoint)
    except (CheckpointError, OSError):
        snap["checkpoint"] = None
    return snap


def restore_if_untrained(run_dir: str | Path, checkpoint: str | Path, snap: dict) -> None:
    """A refusal after the run's records were written (a visit's own checks, say): when no
    visit committed meanwhile, put state.json, config.json and metrics.jsonl back as
    snapshot_records found them, so the refused command leaves the run.dir as it found it.
    Caches it built stay (they are addressed by content: the corrected rerun reuses them)."""
    run = Path(run_dir)
    try:
        if checkpoint_hash(checkpoint) != snap["checkpoint"]:
            return  # a visit committed: its record must stay
    except (CheckpointError, OSError):
        return
    for n in _RECORDS:
        if snap[n] is None:
            (run / n).unlink(missing_ok=True)
        else:
            write_bytes(run / n, snap[n])
    metrics = run / "metrics.jsonl"
    if snap["metrics"] is None:
        metrics.unlink(missing_ok=True)
    elif metrics.is_file():
        os.truncate(metrics, snap["metrics"])
