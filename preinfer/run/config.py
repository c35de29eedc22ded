"""The root config: one section per stage, loaded from `configs/*.yaml` plus `--set` overrides.

    cfg = load_config("configs/demo.yaml", ["train.lr=0.01"])
    cfg.data.seq_len, cfg.cache.dtype, cfg.paths.checkpoint ...

Paths left null in YAML are resolved under `run.dir`, so the resolved config (what is saved
beside every output) names every path explicitly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.config import ConfigError, apply_override, from_dict, load_yaml, to_dict
from preinfer.data.config import DataConfig
from preinfer.data.tokenization import resolve_objective
from preinfer.model.modeling import ModelConfig
from preinfer.model.partition import PartitionConfig
from preinfer.schedule.cache_identity import PreinferConfig
from preinfer.train.config import TrainConfig
from storage import fs
from storage.config import CacheConfig, StorageConfig
from storage.shard_codec import set_codec_threads


@dataclass(kw_only=True)
class RunConfig:
    name: str = "run"
    """Name of the run (used in reports)."""
    dir: str = "runs/run"
    """Run directory: tokens, checkpoint, caches, metrics and reports live under it by default."""
    checkpoint: str | None = None
    """Checkpoint directory; null = <dir>/checkpoint."""
    seed: int = 0
    """Global seed (model init uses model.init_seed, data order train.seed)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where compute runs; auto = cuda when available."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision; auto = bf16 autocast on CUDA and AMX-BF16 CPUs, fp32 elsewhere."""
    verbose: bool = False
    """Show Ray's own log lines and its workers' output here (else they stay in Ray's session logs)."""
    tensorboard: bool = True
    """Mirror metrics.jsonl to TensorBoard under <run.dir>/tensorboard (when the package is installed)."""

    def __post_init__(self):
        if not self.dir:
            raise ConfigError("run.dir must not be empty")


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Run-wide settings (directory, seed, device)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture or local checkpoint."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and packing."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """How layers are cut into blocks."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """Activation cache storage."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Object-store options (endpoint, credentials) for s3:// paths of tokens/checkpoint/cache."""
    preinfer: PreinferConfig = field(default_factory=PreinferConfig)
    """Pre-inference Ray job."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Block trainer and rotation."""

    def __post_init__(self):
        # Absolute paths: Ray workers (actors, Train workers) do not share the driver's cwd.
        self.run.dir = _absolute(self.run.dir)
        base = self.run.dir.rstrip("/")
        if self.data.out_dir is None:
            self.data.out_dir = f"{base}/tokens"
        if self.run.checkpoint is None:
            self.run.checkpoint = f"{base}/checkpoint"
        if self.cache.root is None:
            self.cache.root = f"{base}/cache"
        self.data.out_dir = _absolute(self.data.out_dir)
        self.run.checkpoint = _absolute(self.run.checkpoint)
        self.cache.root = _absolute(self.cache.root)

        if self.train.cache_visits is None:  # each visit of a round reads rows of its own
            self.train.cache_visits = float(self.partition.num_blocks)
        resolve_objective(self.data, self.model.arch)  # data.objective null -> by model.arch
        fs.configure(self.storage)  # options of s3:// paths in this process (and Ray workers)
        set_codec_threads(self.cache.codec_threads)
        if self.model.checkpoint is None and self.data.seq_len > self.model.max_positions:
            raise ConfigError(
                f"data.seq_len ({self.data.seq_len}) is larger than model.max_positions "
                f"({self.model.max_positions}); lower data.seq_len or raise model.max_positions"
            )

    def to_dict(self) -> dict:
        """Plain data, credentials masked (core.config.to_dict)."""
        return to_dict(self)

    def to_json(self) -> str:
        """The config as printed and saved: credentials masked."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _absolute(path: str) -> str:
    """Local paths made absolute; URLs (s3://, gs://, ...) and pkg: specs left as they are."""
    if "://" in path or path.startswith("pkg:"):
        return path
    return os.path.abspath(os.path.expanduser(path))


def config_from_dict(data: dict) -> Config:
    return from_dict(Config, data)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or defaults when path is None) and apply `section.key=value` overrides."""
    data = load_yaml(path) if path is not None else {}
    for spec in overrides or []:
        apply_override(data, spec)
    return config_from_dict(data)
