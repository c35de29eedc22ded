"""pin_malloc: glibc's mmap threshold fixed, so freed large buffers leave the resident set."""

from __future__ import annotations

import sys

import pytest

from preinfer.runtime import hostmem

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


CHILD = """
import torch
from preinfer.runtime import hostmem
from preinfer.runtime.memstats import current_memory_mb
assert hostmem.pin_malloc(1 << 20) == 1 << 20 and hostmem.pinned() == 1 << 20
cpu = torch.device("cpu")
before = current_memory_mb(cpu)
# 24 MiB blocks: below glibc's 32 MiB dynamic ceiling, so unpinned they could land in the heap
blocks = [torch.ones(6 << 20) for _ in range(8)]  # 8 x 24 MiB, touched
held = current_memory_mb(cpu) - before
del blocks
after = current_memory_mb(cpu) - before
print(held, after)
"""


@linux
def test_freed_buffers_above_the_threshold_leave_the_resident_set():
    """In a fresh process: a pinned threshold stays for the process's life (this one's tests
    would all run with it)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=root, check=True
    )
    held, after = map(float, out.stdout.split())
    assert held > 150 and after < 20, (held, after)


def test_zero_threshold_leaves_the_allocator_alone(monkeypatch):
    from core.config import ConfigError
    from preinfer.run.config import load_config

    monkeypatch.setattr(hostmem, "_pinned", None)
    assert hostmem.pin_malloc(0) is None and hostmem.pinned() is None  # off: nothing changed
    with pytest.raises(ValueError, match=">= 0 bytes"):
        hostmem.pin_malloc(-1)
    with pytest.raises(ConfigError, match="malloc_mmap_threshold_mb"):
        load_config(None, ["preinfer.malloc_mmap_threshold_mb=-1"])


def test_workers_get_two_malloc_arenas_unless_told_otherwise(monkeypatch):
    """The env Ray gives the pre-inference actors (pipelines.cache_build.actor_env)."""
    from core import faults
    from pipelines.cache_build import actor_env
    from preinfer.run.config import load_config

    cfg = load_config(None)
    monkeypatch.delenv(hostmem.ARENA_ENV, raising=False)
    monkeypatch.delenv(faults.DIE_ONCE, raising=False)
    assert actor_env(cfg) == {"MALLOC_ARENA_MAX": "2"}
    monkeypatch.setenv(faults.DIE_ONCE, "/tmp/x")
    assert actor_env(cfg) == {"MALLOC_ARENA_MAX": "2", faults.DIE_ONCE: "/tmp/x"}
    monkeypatch.delenv(faults.DIE_ONCE)
    assert actor_env(load_config(None, ["preinfer.malloc_arenas=0"])) == {}  # glibc's default
    monkeypatch.setenv(hostmem.ARENA_ENV, "4")  # the user's own choice wins
    assert hostmem.worker_env(2) == {"MALLOC_ARENA_MAX": "4"}


ARENAS = """
import threading
import torch
from preinfer.runtime import hostmem
from preinfer.runtime.memstats import current_memory_mb
hostmem.pin_malloc(32 << 20)  # as a worker computes: MiB-sized blocks come from the heap
cpu = torch.device("cpu")
keep = []
made, done = threading.Event(), threading.Event()
def holes():  # 64 x 1 MiB, every 4th kept: 48 MiB of holes between live blocks
    keep.append([torch.ones(1 << 18) for _ in range(64)][::4])
    made.set()
    done.wait()  # alive: an exited thread's arena would be handed to the next thread
def fill():  # 40 MiB in 256 KiB blocks: fits those holes, if this thread may use them
    made.wait()
    keep.append([torch.ones(1 << 16) for _ in range(160)])
    done.set()
before = current_memory_mb(cpu)
ts = [threading.Thread(target=f) for f in (holes, fill)]  # an arena each unless capped
for t in ts:
    t.start()
for t in ts:
    t.join()
print(current_memory_mb(cpu) - before)
"""


@linux
def test_shared_arena_reuses_what_another_thread_freed():
    """Why workers run with few arenas: in a fresh process one thread leaves holes in the heap
    and a second thread allocates what would fit them; sharing an arena it fills them (~64 MiB
    resident), with an arena per thread it grows by its whole 40 MiB (~104)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def grown(arenas: str | None) -> float:
        env = {k: v for k, v in os.environ.items() if k != hostmem.ARENA_ENV}
        env.update({hostmem.ARENA_ENV: arenas} if arenas else {})
        out = subprocess.run([sys.executable, "-c", ARENAS], capture_output=True, text=True,
                             cwd=root, env=env, check=True)  # fmt: skip
        return float(out.stdout)

    one, many = grown("1"), grown(None)
    assert one < 0.8 * many and one < 80, (one, many)
