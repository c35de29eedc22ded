"""Host memory: make a worker's resident set track what it holds (glibc malloc settings).

glibc serves a large allocation with its own mmap and returns it to the OS on free, but after
each such free it raises the mmap threshold to that block's size (up to 32 MiB): from then on
blocks below the new threshold come from the heap, where freed ones stay resident and fragment.
For a process that frees fp32 weights after casting them and streams shard-sized buffers, the
peak RSS then depends on the order allocations happened in (threads, timing): a gpt2-small
pre-inference worker peaked anywhere from 364 to 555 MB over identical runs on 2 CPUs. A fixed
threshold stops the adjustment: every block >= `threshold` is mmapped and returned on free.
Pinned at 4 MiB throughout, the same runs peaked at 326 MB every time, but a demo build ran at
0.61-0.66x of the bare forward instead of 0.98x (an mmap and page faults for every activation
of every micro-batch). So the worker pins 4 MiB while it loads and casts its weights and 32 MiB
(glibc's own ceiling, fixed) for compute: build 0.97x of the bare forward, gpt2-small build->1
peaks 375 / 392 MB in two runs (pipelines/preinfer.py PrefixWorker).

    pin_malloc()   # once, early in a worker process; a no-op where glibc is not the allocator

What is left of the spread comes from glibc's per-thread arenas (memory freed in one thread's
arena is not reused by another; torch's intra-op threads allocate too): gpt2-small build->2 at
one shard per call, where nothing overlaps, peaked at 460-621 MiB over 4 identical runs
(bench/plan_accuracy.py children, 2026-11-29). Fewer arenas tighten it: MALLOC_ARENA_MAX=1
gave 435-448 MiB (4 runs), =2 429-487 MiB (6 runs over two bench runs, 3 of them 452-475).
Fewer arenas also mean more lock contention: against glibc's default, a demo `cache build`
took 7% longer with one arena and 4% with two (3 interleaved runs each; with two, the runs
overlap the default's: 34.9-37.8 s vs 35.0-37.7 s). So workers get two (`worker_env()`). The
limit is read once per process, before its first thread allocates, so it cannot be set from
inside a running worker (mallopt(M_ARENA_MAX, 1) there left 475-587 MiB); it travels in the
worker process's environment, given to Ray as the actors' runtime_env. A user's own
MALLOC_ARENA_MAX wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
DEFAULT_THRESHOLD = 4 * 2**20
ENV = "PREINFER_MALLOC_MMAP_THRESHOLD"  # bytes; 0 = leave glibc's dynamic threshold alone
ARENA_ENV = "MALLOC_ARENA_MAX"  # glibc's own variable: malloc arenas per process
WORKER_ARENAS = 2

_pinned: int | None = None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def env_threshold() -> int:
    """$PREINFER_MALLOC_MMAP_THRESHOLD in bytes (0 = allocator settings off), else 4 MiB."""
    raw = os.environ.get(ENV, "")
    try:
        return int(raw) if raw else DEFAULT_THRESHOLD
    except ValueError:
        raise ValueError(f"{ENV} must be a byte count (0 = off), got {raw!r}") from None


def pin_malloc(threshold: int | None = None) -> int | None:
    """Fix glibc's mmap threshold at `threshold` bytes (default: $PREINFER_MALLOC_MMAP_THRESHOLD,
    else 4 MiB) and trim the heap; returns the threshold set, or None (not glibc, or 0 = off)."""
    global _pinned
    if threshold is None:
        threshold = env_threshold()
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


def pinned() -> int | None:
    """The threshold this process pinned, if any."""
    return _pinned


def worker_env() -> dict[str, str]:
    """Environment variables for a pre-inference worker process (set before it starts):
    WORKER_ARENAS malloc arenas, unless this process's own MALLOC_ARENA_MAX says otherwise, or
    none when PREINFER_MALLOC_MMAP_THRESHOLD=0 turned the allocator settings off."""
    if ARENA_ENV in os.environ:
        return {ARENA_ENV: os.environ[ARENA_ENV]}
    return {} if env_threshold() == 0 else {ARENA_ENV: str(WORKER_ARENAS)}
