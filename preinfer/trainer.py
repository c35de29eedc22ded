"""Block trainer config and loop: fit block K (later blocks frozen) from the cache or tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from preinfer.confload import ConfigError

# The paper's defaults per optimizer: (lr, momentum, weight decay).
PAPER_DEFAULTS = {"sgd": (0.1, 0.9, 1e-5), "adam": (1e-4, 0.0, 1e-5), "adamw": (1e-4, 0.0, 1e-5)}


@dataclass(kw_only=True)
class TrainConfig:
    mode: Literal["bcd", "full", "bcd-recompute"] = "bcd"
    """bcd: block K from the cache; full: all parameters from tokens; bcd-recompute: prefix rerun every step."""
    rounds: int = 1
    """Passes of the rotation over all M blocks (bcd modes)."""
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    """Optimizer of the active block."""
    lr: float | None = None
    """Peak learning rate; null = the paper's default for the optimizer (sgd 0.1, adam/adamw 1e-4)."""
    momentum: float | None = None
    """SGD momentum; null = 0.9."""
    weight_decay: float | None = None
    """Weight decay; null = 1e-5."""
    betas: list[float] | None = None
    """Adam betas; null = [0.9, 0.999]."""
    warmup_steps: int = 10
    """Linear warmup steps at the start of each block visit."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of the peak lr."""
    max_steps: int = 100
    """Steps per block visit (bcd) or in total (full)."""
    batch_size: int = 16
    """Global batch size in sequences (split evenly over workers)."""
    grad_clip: float = 1.0
    """Clip the active block's gradient norm to this (0 = off)."""
    eval_every: int = 25
    """Evaluate val loss every this many steps (0 = only at the end)."""
    eval_batches: int = 8
    """Val batches per evaluation (0 = the whole val split)."""
    patience: int = 0
    """Stop the block visit after this many evaluations without improvement (0 = never early-stop)."""
    min_delta: float = 0.0
    """Smallest val-loss decrease that counts as improvement."""
    workers: int = 1
    """Ray Train workers (DDP, gloo on CPU / NCCL on GPU); 0 = train in this process without Ray."""
    checkpoint_every: int = 50
    """Save a resumable mid-block state every this many steps (0 = off)."""
    seed: int = 0
    """Seed of data order and dropout."""

    def __post_init__(self):
        for name in ("rounds", "max_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "eval_batches", "patience", "workers",
                     "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0, got {self.grad_clip}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.betas is not None and (len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas)):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), got {self.betas}")
        if self.workers > 1 and self.batch_size % self.workers:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.workers ({self.workers})"
            )

    def resolved_optim(self) -> dict:
        """lr, momentum, weight decay and betas with the paper's defaults filled in."""
        lr, mom, wd = PAPER_DEFAULTS[self.optimizer]
        return {
            "lr": self.lr if self.lr is not None else lr,
            "momentum": self.momentum if self.momentum is not None else mom or 0.9,
            "weight_decay": self.weight_decay if self.weight_decay is not None else wd,
            "betas": tuple(self.betas) if self.betas is not None else (0.9, 0.999),
        }
