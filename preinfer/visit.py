"""One block visit: load what the mode needs, train to local convergence, commit the block.

Modes (same data, same schedule, so the three are comparable):
  bcd            block K trains; blocks K+1..M-1 frozen; input = the boundary-K cache (K > 0)
                 or tokens (K = 0). Blocks 0..K-1 are never loaded.
  bcd-recompute  as bcd, but blocks 0..K-1 are loaded and rerun (no grad) on every step.
  full           every parameter trains, from tokens.
Library code: no Ray. `pipelines/train.py` runs it on Ray Train workers (rank, world).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import torch

from core import faults
from core.config import ConfigError
from preinfer.cache_identity import row_order, sample_indices, store_budget
from preinfer.checkpoint import Checkpoint
from preinfer.config import Config
from preinfer.device import autocast
from preinfer.loss import mode_loss
from preinfer.metrics import append_metrics
from preinfer.partition import trainable_parameters
from preinfer.trainer import (
    CacheBatches,
    TokenBatches,
    build_optimizer,
    current_memory_mb,
    endless,
    peak_memory_mb,
    reset_peak_memory,
    train_step,
)
from storage.reader import open_cache
from storage.tokens import TokenStore

STATE_VERSION = 1


class TrainingDiverged(ConfigError):
    """A visit's loss or trainable weights became NaN/inf: nothing was committed."""


@dataclass(kw_only=True)
class VisitSpec:
    """What one visit trains and where it reads and writes (paths travel, not objects)."""

    block: int
    round: int = 0
    mode: str = "bcd"
    cache_train: str | None = None
    """Fingerprint of the boundary-K train cache (bcd, K > 0)."""
    cache_val: str | None = None
    """Fingerprint of the boundary-K val cache (bcd, K > 0)."""
    shuffle: bool = True


def state_path(cfg: Config, spec: VisitSpec) -> Path:
    return Path(cfg.run.dir) / "train_state" / f"r{spec.round}-b{spec.block}-{spec.mode}.pt"


def _save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".partial-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_state(path: Path, start_hash: str) -> dict | None:
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)  # no pickle on the load path
    if state.get("version") != STATE_VERSION or state.get("start_hash") != start_hash:
        return None  # from another checkpoint state: stale, start the visit over
    return state


@dataclass
class VisitHooks:
    """Explicit extension points of a visit (benchmarks and studies use these, never patches).

    on_eval(visit, step, val_loss, seconds): after every evaluation (seconds: its duration).
    batches(visit, default): the training batch source; gets the default (CacheBatches or
    TokenBatches) and returns what to train on (anything with .epoch(e) and .steps_per_epoch).
    """

    on_eval: Callable[[Visit, int, float, float], None] | None = None
    batches: Callable[[Visit, object], object] | None = None


class Visit:
    def __init__(
        self,
        cfg: Config,
        spec: VisitSpec,
        *,
        device: torch.device,
        rank: int = 0,
        world: int = 1,
        hooks: VisitHooks | None = None,
    ):
        self.cfg, self.spec, self.device, self.rank, self.world = cfg, spec, device, rank, world
        self.hooks = hooks or VisitHooks()
        # memory of this visit = peak over what the process held before loading anything
        reset_peak_memory(device)
        self.mem_base = current_memory_mb(device)
        self.ckpt = Checkpoint.open(cfg.run.checkpoint)
        self.M = self.ckpt.num_blocks
        K = spec.block
        if not 0 <= K < self.M:
            raise ValueError(
                f"--block {K} is out of range: the checkpoint has blocks 0..{self.M - 1}"
            )
        self.K = K
        self.from_cache = spec.mode == "bcd" and K > 0
        first = K if spec.mode == "bcd" else 0
        self.model, self.adapter = self.ckpt.load(range(first, self.M), device=device)
        self.part = self.ckpt.partition
        for p in self.model.parameters():
            p.requires_grad_(False)
        blocks = range(self.M) if spec.mode == "full" else [K]
        seen, self.params = set(), []
        for b in blocks:
            for p in trainable_parameters(self.model, self.adapter, self.part, b):
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        for p in self.params:
            p.requires_grad_(True)
        self.model.train(cfg.model.dropout > 0)
        self.store = TokenStore(cfg.data.out_dir)
        # bcd modes: the round's rows and the visit's steps (cache_identity.visit_budget); full:
        # every train row, max_steps (the rotation sets it to the whole rotation's steps)
        self.budget = store_budget(cfg, self.store)
        steps = cfg.train.max_steps if spec.mode == "full" else self.budget.steps
        self.tc = dataclasses.replace(cfg.train, max_steps=steps)  # the schedule spans the visit
        self._data()

    # x: (B, S) ids or (B, S, H) hidden entering block K; labels (B, S)  ->  mean loss
    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mode_loss(self.adapter, self.part, x, labels, mode=self.spec.mode, block=self.K,
                         chunk=self.cfg.train.loss_chunk)  # fmt: skip

    def _data(self) -> None:
        cfg, spec = self.cfg, self.spec
        seed = (cfg.train.seed * 1000 + spec.round) * 1000 + spec.block  # data order per visit
        kw = dict(
            batch_size=cfg.train.batch_size,
            seed=seed,
            rank=self.rank,
            world=self.world,
            shuffle=spec.shuffle,
        )
        if self.from_cache:
            root = cfg.cache.root
            self.train_cache = open_cache(
                root, spec.cache_train, expected_fingerprint=spec.cache_train
            )
            self.val_cache = open_cache(root, spec.cache_val, expected_fingerprint=spec.cache_val)
            self.batches = CacheBatches(
                self.train_cache, buffer_mb=cfg.train.shuffle_buffer_mb, **kw
            )
        else:
            rows = None  # full: every train row
            if spec.mode != "full":  # the rows a cache of this round holds, in its row order
                rows = sample_indices(cfg, self.budget, "train", spec.round)
                rows = rows[row_order(cfg, "train", spec.round, len(rows))]
            self.batches = TokenBatches(self.store, "train", indices=rows, **kw)
        if self.hooks.batches is not None:
            self.batches = self.hooks.batches(self, self.batches)

    def _evaluate(self, step: int) -> float:
        t0 = time.perf_counter()
        val = self.evaluate()
        if self.hooks.on_eval is not None:
            self.hooks.on_eval(self, step, val, time.perf_counter() - t0)
        return val

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean val loss over the first eval_batches batches (all ranks compute the same)."""
        was = self.model.training
        self.model.eval()
        B, nb = self.cfg.train.batch_size, self.cfg.train.eval_batches
        if self.from_cache:
            data = CacheBatches(
                self.val_cache, batch_size=min(B, self.val_cache.num_samples), seed=0, shuffle=False
            )
        else:
            data = TokenBatches(
                self.store,
                "val",
                batch_size=min(B, self.store.num_samples("val")),
                seed=0,
                shuffle=False,
            )
        total, count = 0.0, 0
        for i, (x, labels) in enumerate(data.epoch(0)):
            if nb and i >= nb:
                break
            with autocast(self.device, self.cfg.run.precision):
                loss = self.loss(x.to(self.device), labels.to(self.device))
            total += loss.item() * labels.numel()
            count += labels.numel()
        self.model.train(was)
        return total / max(count, 1)

    def _mean(self, value: float) -> float:
        if self.world <= 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / self.world

    def run(self, log=print) -> dict:
        cfg, tc, spec = self.cfg, self.tc, self.spec
        start_hash = self.ckpt.prefix_hash(self.M)
        spath = state_path(cfg, spec)
        opt = build_optimizer(self.params, tc)
        step, best, bad, val = 0, float("inf"), 0, None
        state = _load_state(spath, start_hash)
        if state is not None:
            with torch.no_grad():
                for p, t in zip(self.params, state["params"], strict=True):
                    p.copy_(t)
            opt.load_state_dict(state["optim"])
            step, best, bad = state["step"], state["best"], state["bad"]
            if self.rank == 0:
                log(f"  resumed {spec.mode} block {self.K} round {spec.round} at step {step}")
        kill_at = faults.kill_step(spec.round, self.K)
        data = endless(self.batches, step)
        t0, tokens, stopped = time.perf_counter(), 0, "max_steps"
        loss = float("nan")
        while step < tc.max_steps:
            if step == kill_at:
                os._exit(137)  # test-only: a trainer killed mid-block
            batch = next(data)
            loss = self._mean(
                train_step(
                    self.loss,
                    self.params,
                    opt,
                    batch,
                    tc,
                    step,
                    device=self.device,
                    precision=cfg.run.precision,
                    world=self.world,
                )
            )
            tokens += batch[1].numel() * self.world
            step += 1
            if not math.isfinite(loss):  # a float already: no extra device sync
                self._diverged(spath, step, f"the training loss is {loss}")
            rec = {
                "event": "step",
                "mode": spec.mode,
                "round": spec.round,
                "block": self.K,
                "step": step,
                "loss": loss,
                "tokens": tokens,  # trained in this visit so far (all ranks)
                "tokens_per_s": tokens / (time.perf_counter() - t0),
                "peak_mem_mb": peak_memory_mb(self.device),
                "time": time.time(),
            }
            evaluate = (tc.eval_every and step % tc.eval_every == 0) or step == tc.max_steps
            if evaluate:
                val = self._evaluate(step)
                rec["val_loss"] = val
                if val < best - tc.min_delta:
                    best, bad = val, 0
                else:
                    bad += 1
            if self.rank == 0:
                append_metrics(cfg, rec)
            if tc.patience and bad >= tc.patience:
                stopped = "early_stop"
                break
            if self.rank == 0 and tc.checkpoint_every and step % tc.checkpoint_every == 0:
                _save_state(
                    spath,
                    {
                        "version": STATE_VERSION,
                        "start_hash": start_hash,
                        "step": step,
                        "best": best,
                        "bad": bad,
                        "params": [p.detach().clone() for p in self.params],
                        "optim": opt.state_dict(),
                    },
                )
        if val is None:
            val = self._evaluate(step)
        elapsed = time.perf_counter() - t0
        summary = {
            "event": "visit",
            "mode": spec.mode,
            "round": spec.round,
            "block": self.K,
            "steps": step,
            "stopped": stopped,
            "loss": loss,
            "val_loss": val,
            "seconds": elapsed,
            "tokens": tokens,
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            "peak_mem_mb": peak_memory_mb(self.device),
            "peak_mem_growth_mb": peak_memory_mb(self.device) - self.mem_base,
            "trainable_params": sum(p.numel() for p in self.params),
            "spec": asdict(spec),
        }
        bad_params = self._non_finite_params()
        if bad_params:
            self._diverged(spath, step, f"{bad_params} trainable tensor(s) hold NaN/inf values")
        if self.rank == 0:
            self.commit()
            append_metrics(cfg, summary)
            spath.unlink(missing_ok=True)
        return summary

    def _non_finite_params(self) -> int:
        """How many trainable tensors hold a NaN or inf (one device sync for all of them)."""
        if not self.params:
            return 0
        with torch.no_grad():
            ok = torch.stack([torch.isfinite(p).all() for p in self.params])
        return int((~ok).sum().item())

    def _diverged(self, spath: Path, step: int, what: str) -> NoReturn:
        """Stop a visit whose training went non-finite; nothing is committed, and the visit's
        mid-block state is dropped (it is on the diverging path) so a rerun starts it over."""
        spec = self.spec
        if self.rank == 0:
            spath.unlink(missing_ok=True)
        raise TrainingDiverged(
            f"training diverged in round {spec.round}, block {self.K}, step {step} "
            f"({spec.mode}): {what}; nothing was committed (the checkpoint is as it was before "
            f"this visit). Lower train.lr (now {self.tc.resolved_optim()['lr']:g} with "
            f"{self.tc.optimizer}; keep train.grad_clip > 0, now {self.tc.grad_clip:g}) and rerun "
            "the same command"
        )

    def commit(self) -> None:
        blocks = range(self.M) if self.spec.mode == "full" else [self.K]
        for b in blocks:
            self.ckpt.commit_block(b, self.ckpt.block_state(self.model, self.adapter, b))
