"""Config of the activation cache (where it lives, how values are stored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from preinfer.confload import ConfigError

DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8_e4m3")
LOSSY_DTYPES = ("int8", "fp8_e4m3")


@dataclass(kw_only=True)
class CacheConfig:
    root: str | None = None
    """Directory (or fsspec URL) holding caches as <root>/<fingerprint>/; null = <run.dir>/cache."""
    dtype: Literal["fp32", "fp16", "bf16", "int8", "fp8_e4m3"] = "bf16"
    """Stored value type; int8 and fp8_e4m3 are lossy (per-token scale stored beside)."""
    codec: Literal["none", "zstd", "blosc-zstd"] = "blosc-zstd"
    """Compression of each sample chunk."""
    shuffle: Literal["none", "byte", "bit"] = "byte"
    """Blosc shuffle filter (blosc-zstd only)."""
    level: int = 3
    """Compression level (zstd / blosc-zstd)."""
    shard_mb: float = 256.0
    """Target uncompressed size of one shard (one writer task) in MiB."""
    keep: bool = False
    """Keep boundary K-1's cache after boundary K exists (else the rotation drops it)."""

    def __post_init__(self):
        if not 1 <= self.level <= 22:
            raise ConfigError(f"cache.level must be in 1..22, got {self.level}")
        if self.shard_mb <= 0:
            raise ConfigError(f"cache.shard_mb must be > 0, got {self.shard_mb}")
        if self.shuffle != "none" and self.codec != "blosc-zstd":
            raise ConfigError(
                f"cache.shuffle={self.shuffle!r} needs cache.codec='blosc-zstd' "
                f"(got {self.codec!r}); set cache.shuffle=none"
            )
