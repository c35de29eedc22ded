"""Partitioning `layers[0..L-1]` into M contiguous blocks balanced by parameter count."""

from __future__ import annotations

from dataclasses import dataclass

from preinfer.confload import ConfigError


@dataclass(kw_only=True)
class PartitionConfig:
    num_blocks: int = 3
    """M, the number of blocks (1 <= M <= number of layers)."""

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ConfigError(f"partition.num_blocks must be >= 1, got {self.num_blocks}")
