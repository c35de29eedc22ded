"""Test-fault hooks: the one place product code reads the switches tests set to kill or slow
a process at a chosen point. Outside tests they are unset and every hook does nothing.

    PREINFER_TEST_DIE_ONCE=<path>       the first shard task to find <path> absent creates it
                                        and exits (a pre-inference actor dying mid-build)
    PREINFER_TEST_SHARD_DELAY_S=<s>     each shard task sleeps <s> first (a node killed mid-build)
    PREINFER_TEST_KILL_AT=<r>:<b>:<n>   a visit of round r, block b exits before step n
    PREINFER_TEST_KILL_POINT=<name>[@<n>]
                                        the process exits (137) the n-th time (default 1) it
                                        passes the named point of a multi-file write, one of
                                        KILL_POINTS
    PREINFER_TEST_KILL_ONCE=<name>:<path>
                                        the first process (of all) to pass point <name> with
                                        <path> absent creates it and exits (137): a Ray actor
                                        killed there, which Ray restarts (and which must not
                                        die again)
    PREINFER_TEST_SHARD_LOG=<path>      each shard task appends "<pid> <fingerprint> <shard>
                                        <time>" to <path> as it begins (who ran what, retries)
    PREINFER_TEST_READ_GATE=<path>@<n>  a cache reader (CacheDataset) waits before its n-th
                                        batch until <path> exists (a reader held mid-visit)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

DIE_ONCE = "PREINFER_TEST_DIE_ONCE"
SHARD_DELAY_S = "PREINFER_TEST_SHARD_DELAY_S"
KILL_AT = "PREINFER_TEST_KILL_AT"
KILL_POINT = "PREINFER_TEST_KILL_POINT"
KILL_ONCE = "PREINFER_TEST_KILL_ONCE"
SHARD_LOG = "PREINFER_TEST_SHARD_LOG"
READ_GATE = "PREINFER_TEST_READ_GATE"

KILL_POINTS = {
    "checkpoint.file_tmp": "a new checkpoint file's temp is written, not yet renamed into place",
    "checkpoint.file": "a new block or optimizer file is in place; checkpoint.json not replaced",
    "checkpoint.index_tmp": "checkpoint.json's temp is written, not yet renamed into place",
    "checkpoint.index": "checkpoint.json is replaced (the commit); old files not yet deleted",
    "checkpoint.unlink": "an old checkpoint file is deleted",
    "visit.state_tmp": "a visit's mid-block state temp is saved, not yet renamed into place",
    "visit.state": "a visit's mid-block state is renamed into place",
    "visit.committed": "a visit committed its blocks; its mid-block state is not yet removed",
    "visit.done": "a visit finished; its caller (bcd: state.json) not yet told",
    "cache.shard_tmp": "a cache shard's files are written aside (temps), none renamed into place",
    "cache.shard_file": "one file of a cache shard is in place; the rest and its marker not yet",
}
_passes: dict[str, int] = {}  # kill point -> times this process passed it
_batches = 0  # batches this process's cache readers yielded (READ_GATE)


def shard_task_started(fingerprint: str = "", shard: int = -1) -> None:
    """Called as a pre-inference shard task begins."""
    log = os.environ.get(SHARD_LOG)
    if log:  # one short O_APPEND write: whole lines, whichever process writes
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {fingerprint} {shard} {time.time():.3f}\n")
    time.sleep(float(os.environ.get(SHARD_DELAY_S) or 0))
    marker = os.environ.get(DIE_ONCE)
    if marker and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        os._exit(1)  # Ray restarts the actor and retries the task


def kill_step(round_: int, block: int) -> int:
    """The step before which a visit of (round_, block) exits; -1: none."""
    spec = os.environ.get(KILL_AT, "")
    if spec:
        r, b, step = (int(v) for v in spec.split(":"))
        if (r, b) == (round_, block):
            return step
    return -1


def kill_point(name: str) -> None:
    """Called at a named point of a multi-file write (KILL_POINTS)."""
    once = os.environ.get(KILL_ONCE, "")
    if once:
        want, _, marker = once.partition(":")
        if want not in KILL_POINTS or not marker:
            raise ValueError(
                f"{KILL_ONCE}={once!r}: want <point>:<path>, point one of {list(KILL_POINTS)}"
            )
        if want == name:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one process wins
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os._exit(137)  # test-only: a process killed at this point
    spec = os.environ.get(KILL_POINT, "")
    if not spec:
        return
    want, _, nth = spec.partition("@")
    if want not in KILL_POINTS:
        raise ValueError(
            f"{KILL_POINT}={spec!r}: no kill point {want!r}; one of {list(KILL_POINTS)}"
        )
    if want == name:
        _passes[name] = _passes.get(name, 0) + 1
        if _passes[name] == int(nth or 1):
            os._exit(137)  # test-only: a process killed at this point


def read_gate() -> None:
    """Called before a cache reader yields a batch (READ_GATE)."""
    global _batches
    spec = os.environ.get(READ_GATE, "")
    if not spec:
        return
    path, _, nth = spec.rpartition("@")
    _batches += 1
    if _batches == int(nth):
        while not os.path.exists(path):
            time.sleep(0.05)


def worker_env() -> dict[str, str]:
    """The switches set in this process, for worker processes started by Ray."""
    keys = (DIE_ONCE, SHARD_DELAY_S, KILL_ONCE, SHARD_LOG)
    return {k: os.environ[k] for k in keys if k in os.environ}
