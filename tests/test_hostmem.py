"""pin_malloc: glibc's mmap threshold fixed, so freed large buffers leave the resident set."""

from __future__ import annotations

import sys

import pytest
import torch

from preinfer import hostmem
from preinfer.trainer import current_memory_mb

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


@linux
def test_freed_buffers_above_the_threshold_leave_the_resident_set():
    assert hostmem.pin_malloc(1 << 20) == 1 << 20
    assert hostmem.pinned() == 1 << 20
    cpu = torch.device("cpu")
    before = current_memory_mb(cpu)
    # 24 MiB blocks: below glibc's 32 MiB dynamic ceiling, so unpinned they could land in the heap
    blocks = [torch.ones(6 << 20) for _ in range(8)]  # 8 x 24 MiB, touched
    held = current_memory_mb(cpu) - before
    del blocks
    after = current_memory_mb(cpu) - before
    assert held > 150 and after < 20, (held, after)


def test_environment_sets_or_disables_the_threshold(monkeypatch):
    monkeypatch.setattr(hostmem, "_pinned", None)
    monkeypatch.setenv(hostmem.ENV, "0")
    assert hostmem.pin_malloc() is None and hostmem.pinned() is None
    monkeypatch.setenv(hostmem.ENV, "4MB")
    with pytest.raises(ValueError, match="byte count"):
        hostmem.pin_malloc()
    with pytest.raises(ValueError, match=">= 0 bytes"):
        hostmem.pin_malloc(-1)
