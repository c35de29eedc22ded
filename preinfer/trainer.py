"""Block trainer config and loop: fit block K (later blocks frozen) from the cache or tokens."""

from __future__ import annotations

import dataclasses
import math
import resource
from dataclasses import dataclass
from typing import Literal

import torch

from core.config import ConfigError
from preinfer.device import autocast

# The paper's defaults per optimizer: (lr, momentum, weight decay).
PAPER_DEFAULTS = {"sgd": (0.1, 0.9, 1e-5), "adam": (1e-4, 0.0, 1e-5), "adamw": (1e-4, 0.0, 1e-5)}
# train.suffix_lr null: the suffix adapters' peak lr = this x the block's (LoRA's best lr in our
# bench was 10x bcd's)
SUFFIX_LR_MULTIPLE = 10.0


@dataclass(kw_only=True)
class TrainConfig:
    mode: Literal["bcd", "full", "bcd-recompute"] = "bcd"
    """bcd: block K from the cache; full: all parameters from tokens; bcd-recompute: prefix rerun every step."""
    rounds: int = 1
    """Passes of the rotation over all M blocks (bcd modes)."""
    order: Literal["ascending", "descending", "random"] = "ascending"
    """Blocks per round (bcd modes; full ignores it): 0..M-1; M-1..0 head first (an untied head is in block M-1; GPT-2's tied head matrix is wte, block 0's); random = a permutation per round seeded by (train.seed, round), as BAdam offers."""
    always_train: list[Literal["head"]] = dataclasses.field(default_factory=lambda: ["head"])
    """Parts that train in every bcd visit besides its block: head = the final norm and an untied LM head (block M-1's; a tied head matrix stays block 0's), their optimizer state kept with block M-1's. They follow every cached prefix: no cache is invalidated. Default [head]: the measured best in pretraining and fine-tuning (docs/quality.md, docs/economics.md); [] = the block alone."""
    freeze: list[Literal["embed"]] = dataclasses.field(default_factory=list)
    """Parts that never train: embed = the token embedding, and with it a tied LM head (the same matrix). Its gradient, optimizer state and the head's weight-gradient matmul are then not computed; the final norm still trains (train.always_train). [] = every part trains in its block's visits."""
    suffix_rank: int = 0
    """bcd modes: rank r of LoRA adapters (W x + alpha/r B A x; B starts at 0) on the layer linears of blocks K+1..M-1 (train.suffix_modules; never the embedding or the LM head), trained in the same backward as block K and merged into those blocks at the visit's commit, as BREAD does; they follow block K, so no cache is invalidated. 0 = off; full ignores it (preinfer/suffix.py)."""
    suffix_lr: float | None = None
    """Peak learning rate of the suffix adapters (the block's warmup + cosine shape); null = 10 x the block's peak lr (train.lr, or its optimizer's default)."""
    suffix_alpha: float | None = None
    """LoRA scale numerator: the adapters add alpha / suffix_rank x B A; null = 2 x suffix_rank (scale 2)."""
    suffix_modules: Literal["all", "attn", "mlp"] = "all"
    """Which linears of the suffix blocks' layers get adapters: all; attn = attention's (q/k/v/o; GPT-2 c_attn + c_proj); mlp = the MLP's."""
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
    """Linear warmup steps, once at the start of the rotation (train.schedule=visit: at the start of each block visit)."""
    schedule: Literal["visit", "run"] = "run"
    """LR warmup + cosine scope: run = one over the rotation (rounds x M visits x the visit's steps; 1.52x full's steps to its plateau ppl against 2.07x per visit, docs/quality.md); visit = within each block visit; full: its own steps either way."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of the peak lr."""
    max_steps: int = 100
    """Steps per block visit (bcd) or in total (full): the cap of the visit's budget."""
    epochs: float | None = 1.0
    """Passes over a visit's rows; rows = min(train x sample_fraction, max_steps x batch / epochs), and only those are cached. null = cache every sampled row, train max_steps."""
    cache_visits: float | None = None
    """Rows a round samples, in visits' worth (a visit reads max_steps x batch / epochs rows): null = the block count M (the measured best: each visit reads rows of its own, where the train split holds them); 1 = every visit of the round reads the same rows (the smallest cache). Visits read successive windows of the round's rows; a boundary caches the windows of the visits it serves (ascending: M-K at boundary K)."""
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
    """Ray Train workers (DDP, gloo on CPU / NCCL on GPU); 0, or 1 outside a Ray cluster job = train in this process."""
    cpus_per_worker: int | None = None
    """CPUs (and torch threads) per Ray Train CPU worker; null = this node's CPUs / workers."""
    checkpoint_every: int = 50
    """Save a resumable mid-block state every this many steps (0 = off)."""
    keep_optimizer_state: bool = True
    """Keep each block's optimizer state (AdamW moments, step) in the checkpoint for its next visit (lower ppl on 3/3 seeds); false = fresh every visit."""
    seed: int = 0
    """Seed of data order and dropout."""
    shuffle_buffer_mb: float = 64.0
    """Host MB of stored cache rows a rank shuffles together (bcd K > 0); a visit's rows that fit are drawn as from tokens."""
    loss_chunk: int = 256
    """Tokens per chunk of the fused LM head + cross-entropy (only (chunk, V) logits alive); 0 = plain."""

    def __post_init__(self):
        for name in ("rounds", "max_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "eval_every",
            "eval_batches",
            "patience",
            "workers",
            "checkpoint_every",
            "suffix_rank",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.cache_visits is not None and not self.cache_visits >= 1:
            raise ConfigError(
                f"train.cache_visits must be >= 1 visits' worth of rows per round (1 = every "
                f"visit reads the same rows), got {self.cache_visits}"
            )
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(
                f"train.epochs must be > 0 passes over the visit's rows, or null, got {self.epochs}"
            )
        if len(set(self.always_train)) != len(self.always_train):
            raise ConfigError(f"train.always_train lists a part twice: {self.always_train}")
        if len(set(self.freeze)) != len(self.freeze):
            raise ConfigError(f"train.freeze lists a part twice: {self.freeze}")
        if self.cpus_per_worker is not None and self.cpus_per_worker < 1:
            raise ConfigError(f"train.cpus_per_worker must be >= 1, got {self.cpus_per_worker}")
        for name in ("lr", "suffix_lr", "suffix_alpha"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"train.{name} must be > 0 or null, got {getattr(self, name)}")
        if self.loss_chunk < 0:
            raise ConfigError(
                f"train.loss_chunk must be >= 0 tokens (0 = unfused loss), got {self.loss_chunk}"
            )
        if self.shuffle_buffer_mb <= 0:
            raise ConfigError(f"train.shuffle_buffer_mb must be > 0, got {self.shuffle_buffer_mb}")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0, got {self.grad_clip}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.betas is not None and (
            len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas)
        ):
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


# ---------------------------------------------------------------------------------------------
# Optimisation


def build_optimizer(
    params: list[torch.nn.Parameter],
    cfg: TrainConfig,
    suffix: list[torch.nn.Parameter] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of `params` (group 0, at train.lr); suffix: the suffix adapters
    (train.suffix_rank), a second group at train.suffix_lr. Each group's "lr_scale" is its peak
    lr over the block's: train_step sets lr = the schedule's lr x lr_scale, one shape for both."""
    o = cfg.resolved_optim()
    groups = [{"params": params, "lr_scale": 1.0}]
    if suffix:
        peak = cfg.suffix_lr if cfg.suffix_lr is not None else SUFFIX_LR_MULTIPLE * o["lr"]
        groups.append({"params": suffix, "lr": peak, "lr_scale": peak / o["lr"]})
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            groups, lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"]
        )
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    # the fused kernel: one pass over each tensor, no temporaries; on CPU 4-5x faster than the
    # default per-tensor loop (docs/economics.md), which holds 2-3 copies of the largest tensor
    every = [p for g in groups for p in g["params"]]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in every)
    return cls(
        groups, lr=o["lr"], betas=o["betas"], weight_decay=o["weight_decay"], fused=fused or None
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * peak, over cfg.max_steps steps (one
    block visit, or with train.schedule=run the rotation: Visit.lr passes the global step)."""
    peak = cfg.resolved_optim()["lr"]
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * peak
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))


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


def allreduce_grads(params: list[torch.nn.Parameter], world: int) -> None:
    """Average gradients over ranks (what DDP does), one flat buffer per call."""
    if world <= 1:
        return
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def train_step(
    loss_fn,
    params,
    optimizer,
    batch,
    cfg: TrainConfig,
    step: int,
    *,
    device,
    precision: str = "auto",
    world: int = 1,
    lr: float | None = None,
) -> float:
    """One optimizer step of the active parameters; returns this rank's loss.

    loss_fn(x, labels) -> mean loss: x the batch's ids (B, S) or hidden (B, S, H), on `device`.
    lr: this step's learning rate; None = lr_at(step, cfg)."""
    x, labels = batch
    for group in optimizer.param_groups:  # lr_scale: the group's peak over the block's
        group["lr"] = (lr_at(step, cfg) if lr is None else lr) * group.get("lr_scale", 1.0)
    optimizer.zero_grad(set_to_none=True)
    with autocast(device, precision):
        loss = loss_fn(x.to(device), labels.to(device))
    loss.backward()
    allreduce_grads(params, world)
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    return loss.item()
