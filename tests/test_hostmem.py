"""pin_malloc: glibc's mmap threshold fixed, so freed large buffers leave the resident set."""

from __future__ import annotations

import sys

import pytest

from preinfer import hostmem

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


CHILD = """
import torch
from preinfer import hostmem
from preinfer.trainer import current_memory_mb
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


def test_environment_sets_or_disables_the_threshold(monkeypatch):
    monkeypatch.setattr(hostmem, "_pinned", None)
    monkeypatch.setenv(hostmem.ENV, "0")
    assert hostmem.pin_malloc() is None and hostmem.pinned() is None  # off: nothing changed
    monkeypatch.setenv(hostmem.ENV, "4MB")
    with pytest.raises(ValueError, match="byte count"):
        hostmem.pin_malloc()
    with pytest.raises(ValueError, match=">= 0 bytes"):
        hostmem.pin_malloc(-1)
