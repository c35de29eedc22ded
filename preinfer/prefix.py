"""Pre-inference config (the Ray job that runs the frozen prefix over the corpus)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from preinfer.confload import ConfigError


@dataclass(kw_only=True)
class PreinferConfig:
    actors: int = 2
    """Size of the Ray actor pool running the prefix."""
    cpus_per_actor: float = 0.5
    """CPUs each actor asks Ray for when no GPU is present (fractional keeps the read stage alive)."""
    gpus_per_actor: float = 1.0
    """GPUs each actor asks for when GPUs exist."""
    micro_batch: int = 16
    """Samples per forward call inside an actor."""
    sample_fraction: float = 1.0
    """Fraction of train samples cached per round (deterministic per seed and round; part of the fingerprint)."""
    compute_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Dtype the prefix computes in; auto = the cache dtype where the device runs it natively
    (CUDA, AVX512-BF16/AMX CPUs), else fp32 rounded to the cache dtype at each block boundary."""
    max_restarts: int = 2
    """How often a dead actor is restarted."""
    max_task_retries: int = -1
    """How often a failed shard task is retried; -1: while its actor lives or is restarted (so
    within max_restarts). A lost node fails its in-flight tasks fast and repeatedly ("actor
    unavailable") until Ray declares it dead: a small bound is spent in that second."""

    def __post_init__(self):
        for name in ("actors", "micro_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"preinfer.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.sample_fraction <= 1.0:
            raise ConfigError(
                f"preinfer.sample_fraction must be in (0, 1], got {self.sample_fraction}"
            )
        if self.cpus_per_actor <= 0:
            raise ConfigError(f"preinfer.cpus_per_actor must be > 0, got {self.cpus_per_actor}")
        if self.max_restarts < 0:
            raise ConfigError(f"preinfer.max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_task_retries < -1:
            raise ConfigError(
                f"preinfer.max_task_retries must be >= 0, or -1 (unbounded), got "
                f"{self.max_task_retries}"
            )
