"""Test-fault hooks: the one place product code reads the switches tests set to kill or slow
a process at a chosen point. Outside tests they are unset and every hook does nothing.

    PREINFER_TEST_DIE_ONCE=<path>       the first shard task to find <path> absent creates it
                                        and exits (a pre-inference actor dying mid-build)
    PREINFER_TEST_SHARD_DELAY_S=<s>     each shard task sleeps <s> first (a node killed mid-build)
    PREINFER_TEST_KILL_AT=<r>:<b>:<n>   a visit of round r, block b exits before step n
"""

from __future__ import annotations

import os
import time
from pathlib import Path

DIE_ONCE = "PREINFER_TEST_DIE_ONCE"
SHARD_DELAY_S = "PREINFER_TEST_SHARD_DELAY_S"
KILL_AT = "PREINFER_TEST_KILL_AT"


def shard_task_started() -> None:
    """Called as a pre-inference shard task begins."""
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


def worker_env() -> dict[str, str]:
    """The switches set in this process, for worker processes started by Ray."""
    return {k: os.environ[k] for k in (DIE_ONCE, SHARD_DELAY_S) if k in os.environ}
