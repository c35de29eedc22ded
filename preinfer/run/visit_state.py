"""What a visit keeps between runs, and the token store it is tied to.

A visit's mid-block state (train_state/r{round}-b{block}-{mode}.pt, preinfer.run.visit.state_path),
saved by rank 0 every train.checkpoint_every steps (temp file + os.replace) and resumed by a
rerun of the same visit:

    {"version": STATE_VERSION, "start_hash": prefix hash of the checkpoint the visit started
     from, "tokens": token_record of the store it trains on, "step", "best", "bad", "loss",
     "threads": torch's intra-op threads (a resume takes them: a CPU step's sums depend on
     them), "params": [one tensor per trainable parameter], "optim": the optimizer's state_dict}

A state of another checkpoint (start_hash) or of an older preinfer (version 1 kept no token
record: whether its tokens are today's is unknowable) is stale: the visit starts over. A state
trained on another token store is refused: its weights and moments follow ids that the
re-tokenize gave another meaning, and the file is left as it is.

The checkpoint's own record (checkpoint.json "tokens", written by each commit) is provenance:
training on another store is fine-tuning, which `tokens_warning` names but never refuses.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from core import faults
from core.config import ConfigError
from preinfer.checkpoint.store import Checkpoint
from preinfer.plan.guards import token_changes
from storage import atomic

STATE_VERSION = 2  # 2: "tokens" (the token store's record); 1: none


def save_state(path: Path, state: dict) -> None:
    """Save the visit's state at `path` atomically (temp `<stem>.partial-<pid>`, fsync,
    rename); a full disk is an OSError naming `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(f) -> None:
        try:
            torch.save({"version": STATE_VERSION, **state}, f)
        except RuntimeError as e:  # torch wraps the file's OSError (a full disk: ENOSPC)
            if not isinstance(e.__context__, OSError):
                raise
            raise OSError(e.__context__.errno, e.__context__.strerror, str(path)) from e

    atomic.write_file(
        path,
        save,
        tmp_name=_tmp,
        before_replace=lambda: faults.kill_point("visit.state_tmp"),
    )
    faults.kill_point("visit.state")


def _tmp(path: Path) -> Path:
    return path.with_suffix(f".partial-{os.getpid()}")


def drop_state(path: Path) -> None:
    """The visit's mid-block state and the temps (`_tmp`) of saves a kill interrupted."""
    for p in [path, *path.parent.glob(f"{path.stem}.partial-*")]:
        p.unlink(missing_ok=True)


def load_state(path: Path, start_hash: str, store, log=None) -> dict | None:
    """The state to resume from, or None (none, or stale: start the visit over). Raises
    ConfigError when it was trained on a token store other than `store`."""
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)  # no pickle on the load path
    if state.get("start_hash") != start_hash:
        return None  # from another checkpoint state: stale, start the visit over
    if state.get("version") != STATE_VERSION:
        if log is not None:
            log(f"  {path} is from an older preinfer (state version {state.get('version')!r}, "
                "no token record): starting the visit over")  # fmt: skip
        return None
    rec = state["tokens"] if isinstance(state.get("tokens"), dict) else {}
    if rec.get("fingerprint") != store.fingerprint:
        raise ConfigError(
            f"the token store changed under this visit: {path} holds its training up to step "
            f"{state.get('step')} on tokens {str(rec.get('fingerprint'))[:12]} ({rec.get('path')}), "
            f"but {store.path} now holds {store.fingerprint[:12]} ({token_changes(rec, store)}); "
            "resuming would train on ids that now mean something else. Re-tokenize back "
            "(`preinfer tokenize --force` with the data settings the visit started with) and "
            f"rerun, or delete {path} to start the visit over on the new tokens"
        )
    return state


def tokens_warning(ckpt: Checkpoint, store) -> str | None:
    """A warning line when the checkpoint's last commit was trained on a token store other than
    `store` (fine-tuning on new data, or a re-tokenize by mistake); None when the same or when
    the checkpoint records none (fresh from init, or committed before the record)."""
    rec = ckpt.trained_tokens
    if rec is None or rec.get("fingerprint") == store.fingerprint:
        return None
    return (
        f"  warning: {ckpt.path}'s last commit (blocks {rec.get('blocks')}) was trained on tokens "
        f"{str(rec.get('fingerprint'))[:12]}; this visit trains on {store.fingerprint[:12]} "
        f"({store.path}: {token_changes(rec, store)}). Fine when fine-tuning on new data; "
        "otherwise re-tokenize back (`preinfer tokenize --force` with the data settings the "
        "checkpoint was trained on)"
    )
