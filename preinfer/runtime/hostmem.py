"""Host memory: make a worker's resident set track what it holds (glibc malloc settings).

A fixed mmap threshold stops glibc raising it after each large free (then freed weights and
shard buffers stay resident and fragment); a few arenas stop one thread's freed memory being
out of another's reach. Measurements and the trade-off chosen: docs/host_memory.md.

    pin_malloc(4 << 20)   # early in a worker process; None where glibc is not the allocator
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
ARENA_ENV = "MALLOC_ARENA_MAX"  # glibc's own variable: malloc arenas per process

_pinned: int | None = None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def pin_malloc(threshold: int) -> int | None:
    """Fix glibc's mmap threshold at `threshold` bytes and trim the heap; returns the threshold
    set, or None (not glibc, or 0 = off)."""
    global _pinned
    if threshold < 0:
        raise ValueError(f"mmap threshold must be >= 0 bytes (0 = off), got {threshold}")
    libc = _libc()
    if threshold == 0 or libc is None:
        return None
    if libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) != 1:
        return None
    libc.malloc_trim(0)  # give back what the heap already holds free
    _pinned = int(threshold)
    return _pinned


def trim() -> bool:
    """Give the heap's free memory back to the system (glibc's malloc_trim); False where glibc
    is not the allocator. Between two visits in one process the last visit's freed model,
    optimizer state and activations (GBs) otherwise stay resident, and the next visit's
    allocations land around them: its peak RSS rose by ~15% (docs/host_memory.md)."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


def pinned() -> int | None:
    """The threshold this process pinned, if any."""
    return _pinned


def worker_env(arenas: int) -> dict[str, str]:
    """Environment variables for a worker process (set before it starts): `arenas` malloc
    arenas (0: glibc's default), unless this process's own MALLOC_ARENA_MAX says otherwise."""
    if ARENA_ENV in os.environ:
        return {ARENA_ENV: os.environ[ARENA_ENV]}
    return {ARENA_ENV: str(arenas)} if arenas else {}


def available() -> int:
    """Bytes this process may still allocate: the host's available memory, less where its
    cgroup (a container's memory limit) or its address-space limit (ulimit -v) caps it lower."""
    import resource
    from pathlib import Path

    import psutil

    free = psutil.virtual_memory().available
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        free = min(free, soft - psutil.Process().memory_info().vms)
    try:  # /proc/self/cgroup lines: "0::<path>" (v2), "<n>:memory:<path>" (v1)
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, ctl, rel = line.split(":", 2)
        if ctl == "":  # cgroup v2; memory.max is "max" when unlimited
            files = ("/sys/fs/cgroup", "memory.max", "memory.current")
        elif "memory" in ctl.split(","):
            files = ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        base = Path(files[0]) / rel.lstrip("/")
        try:
            cap = (base / files[1]).read_text().strip()
            if cap != "max":
                free = min(free, int(cap) - int((base / files[2]).read_text()))
        except (OSError, ValueError):
            continue
    return max(0, int(free))
