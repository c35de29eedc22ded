"""Memory now and at its peak: the CUDA allocator's on a GPU, else the process's RSS (Linux)."""

from __future__ import annotations

import resource

import torch


def _status_mb(key: str) -> float | None:
    """A memory line of /proc/self/status (Linux) in MiB, or None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA allocator stats, or the process's RSS high-water mark (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def current_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    rss = _status_mb("VmRSS")
    return rss if rss is not None else peak_memory_mb(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory: torch.cuda.max_memory_allocated on GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = _status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
