"""One optimizer step of the active parameters: the optimizer, the lr schedule, the gradient
allreduce and the step itself."""

from __future__ import annotations

import math

import torch

from preinfer.runtime.device import autocast
from preinfer.train.config import TrainConfig


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
        peak = cfg.suffix_peak_lr()
        groups.append({"params": suffix, "lr": peak, "lr_scale": peak / o["lr"]})
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            groups, lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"]
        )
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    # the fused kernel: one pass over each tensor, no temporaries; on CPU 4-5x faster than the
    # default per-tensor loop (docs/log/2026-12-02.md), which holds 2-3 copies of the largest tensor
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
