"""One block visit: load what the mode needs, train to local convergence, commit the block.

Modes (same data, same schedule, so the three are comparable):
  bcd            block K trains; blocks K+1..M-1 frozen; input = the boundary-K cache (K > 0)
                 or tokens (K = 0). Blocks 0..K-1 are never loaded.
  bcd-recompute  as bcd, but blocks 0..K-1 are loaded and rerun (no grad) on every step, in
                 the dtype and with the rounding a cache build uses (preinfer.model.prefix).
  full           every parameter trains, from tokens.
train.suffix_rank (bcd modes): LoRA adapters on blocks K+1..M-1 train alongside block K and are
merged into them at the commit (preinfer/train/suffix.py); with train.prefix_adapters=last the
round's last visit adapts blocks 0..K-1 too, running them from tokens.
Library code: no Ray. `pipelines/train.py` runs it on Ray Train workers (rank, world).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from core import faults
from core.config import ConfigError
from preinfer.checkpoint.optim_state import SEP, load_optimizer_tensors, optimizer_tensors
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.evaluation import blocks_row_losses, val_estimate
from preinfer.model.loss import mode_loss, split_sample
from preinfer.model.partition import trainable_named_parameters
from preinfer.model.prefix import forward_prefix
from preinfer.plan.costmodel import visit_steps
from preinfer.plan.guards import token_record
from preinfer.run.config import Config
from preinfer.run.visit_state import drop_state, load_state, save_state, tokens_warning
from preinfer.runtime.device import autocast, compute_dtype, pin_threads, torch_dtype
from preinfer.runtime.memstats import current_memory_mb, peak_memory_mb, reset_peak_memory
from preinfer.runtime.metrics import append_metrics
from preinfer.schedule.rotation import sample_indices, store_budget, visit_steps_at
from preinfer.schedule.visit_plan import VisitPlan, plan_visit
from preinfer.train.batches import CacheBatches, CacheWindow, TokenBatches, endless
from preinfer.train.step import build_optimizer, lr_at, train_step
from preinfer.train.suffix import SuffixAdapters, resume_mismatch, suffix_spec
from storage.reader import open_cache
from storage.tokens import TokenStore


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


def finish_committed(cfg: Config, round_: int, block: int, mode: str) -> None:
    """Tidy up after a visit killed once its commit was made (bcd records it as finished):
    the checkpoint's old files and temps, the visit's mid-block state."""
    Checkpoint.open(cfg.run.checkpoint).tidy()
    drop_state(state_path(cfg, VisitSpec(block=block, round=round_, mode=mode)))


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
        plan: VisitPlan | None = None,
        device: torch.device,
        rank: int = 0,
        world: int = 1,
        hooks: VisitHooks | None = None,
    ):
        self.cfg, self.spec, self.device, self.rank, self.world = cfg, spec, device, rank, world
        self.hooks = hooks or VisitHooks()
        if device.type == "cpu":
            pin_threads()
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
        self.store = TokenStore(cfg.data.out_dir)
        # the visit's plan (preinfer.schedule.visit_plan): its place in its round (train.order), its
        # window of the round's rows, its steps, the boundary it reads; made by the caller, else
        # (a visit run by hand, a worker rank) here
        if plan is None:
            budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, self.store)
            plan = plan_visit(cfg.train, budget, self.M, spec.round, K, mode=spec.mode)
        if (plan.block, plan.round, plan.mode) != (K, spec.round, spec.mode):
            raise ValueError(f"the plan of {plan.mode} round {plan.round} block {plan.block} "
                             f"is not this visit's ({spec.mode} round {spec.round} block {K})")  # fmt: skip
        self.plan = plan
        self.from_cache = plan.boundary is not None
        # train.prefix_adapters=last, the round's last visit: blocks 0..K-1 run from tokens
        # with adapters (the whole model, as full's forward), no cache read
        self.whole = spec.mode == "full" or plan.adapts_prefix
        first = 0 if self.whole else K
        self.model, self.adapter = self.ckpt.load(range(first, self.M), device=device)
        self.prefix = None  # bcd-recompute: the frozen blocks 0..K-1, computed as a cache is
        if spec.mode == "bcd-recompute" and K > 0 and not self.whole:
            choice = compute_dtype(cfg.preinfer.compute_dtype, cfg.cache.dtype, cfg.run.device)
            model, adapter = self.ckpt.load(range(K), device=device)
            self.prefix = (model.to(torch_dtype(choice.compute)).eval(), adapter, choice)
        self.part = self.ckpt.partition
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.blocks = list(range(self.M)) if spec.mode == "full" else [K]
        # block -> (name, param) it trains; the optimizer's state is kept per block
        seen, self.params, self.named = set(), [], {}
        # train.freeze: the embedding (a tied head's matrix with it) stays as it is
        frozen = set(self.adapter.part_names()["embed"]) if "embed" in cfg.train.freeze else set()
        for b in self.blocks:
            for n, p in trainable_named_parameters(self.model, self.adapter, self.part, b):
                if id(p) not in seen and n not in frozen:
                    seen.add(id(p))
                    self.params.append(p)
                    self.named.setdefault(b, []).append((n, p))
        # train.always_train: the head's own tensors (final norm, an untied LM head; block M-1's)
        # train in this visit too, their optimizer state kept with block M-1's
        self.always: list[tuple[str, torch.nn.Parameter]] = []
        if "head" in cfg.train.always_train and spec.mode != "full" and K < self.M - 1:
            head = set(self.adapter.part_names()["head"])
            last = trainable_named_parameters(self.model, self.adapter, self.part, self.M - 1)
            self.always = [(n, p) for n, p in last if n in head and id(p) not in seen]
            self.params += [p for _, p in self.always]
            self.named[self.M - 1] = self.always
        # train.suffix_rank: adapters on blocks K+1..M-1 (None: off, full, or K = M-1), their
        # A, B the last of the visit's params (own param group; no state kept: merged at commit)
        # (+ train.prefix_adapters=last, the round's last visit: on blocks 0..K-1 too)
        self.suffix = None
        if spec.mode != "full" and cfg.train.suffix_rank:
            self.suffix = SuffixAdapters.attach(
                self.adapter, self.part, K, rank=cfg.train.suffix_rank,
                alpha=cfg.train.suffix_alpha, modules=cfg.train.suffix_modules,
                seed=(cfg.train.seed, spec.round), device=device, prefix=plan.adapts_prefix,
            )  # fmt: skip
        self.n_block = len(self.params)  # the block's (+ always-trained) params come first
        self.params += self.suffix.parameters() if self.suffix else []
        for p in self.params:
            p.requires_grad_(True)
        self.model.train(cfg.model.dropout > 0)
        # bcd modes: the round's rows (rotation.visit_budget) and the visit's steps (train.
        # visit_steps: costmodel.visit_steps); full: every train row, max_steps (the rotation
        # sets it to the whole rotation's steps)
        steps, offset, total = cfg.train.max_steps, 0, cfg.train.max_steps
        if spec.mode != "full":
            # a visit by hand may name a round past train.rounds: its schedule position lies
            # past the rotation's steps (lr at the floor), the total stays the rotation's
            rounds = max(cfg.train.rounds, spec.round + 1)
            every = visit_steps(cfg, self.part, plan.budget, rounds=rounds)
            steps, offset, _ = visit_steps_at(every, spec.round, plan.position)
            total = sum(n for r in every[: cfg.train.rounds] for n in r)
        self.tc = dataclasses.replace(cfg.train, max_steps=steps)  # the schedule spans the visit
        # train.schedule=run (bcd modes): this visit's steps are positions [offset, offset +
        # steps) of one schedule over all the rotation's visits' steps
        self.sched, self.lr_offset, self.rewarm = self.tc, 0, 0
        if cfg.train.schedule == "run" and spec.mode != "full":
            self.lr_offset = offset
            self.sched = dataclasses.replace(self.tc, max_steps=total)
            # train.rewarm_steps: every visit after the rotation's first ramps its lr again
            self.rewarm = cfg.train.rewarm_steps if self.lr_offset else 0
        self._data()

    def step_seed(self, step: int) -> int:
        """The RNG seed of this visit's step `step` on this rank (dropout masks)."""
        seed = 0
        for v in (self.cfg.train.seed, self.spec.round, self.K, step, self.rank):
            seed = (seed * 1_000_003 + v) % 2**63
        return seed

    def lr(self, step: int) -> float:
        """The learning rate of this visit's step `step` (0-based)."""
        ramp = min(1.0, (step + 1) / self.rewarm) if self.rewarm else 1.0
        return lr_at(self.lr_offset + step, self.sched) * ramp

    # x: (B, S) ids or (B, S, H) hidden entering block K; labels (B, S)  ->  mean loss
    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """What the trained blocks take: x as given (ids, or a cache's hidden), or, for
        bcd-recompute, the hidden a cache of boundary K holds, as a reader decodes it (fp32),
        recomputed from ids outside the training step's autocast, as the build runs."""
        if self.prefix is None:
            return x
        _, adapter, choice = self.prefix
        with torch.autocast(x.device.type, enabled=False):
            x = forward_prefix(
                adapter,
                self.part,
                x,
                0,
                self.K,
                dtype=torch_dtype(choice.compute),
                round_to=choice.round_to and torch_dtype(choice.round_to),
            )
        return x.float()

    def _start(self) -> int:
        """The first block the loss runs (loss.mode_loss's rule): 0 from tokens, else K."""
        return 0 if self.spec.mode == "full" or self.whole else self.K

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mode_loss(self.adapter, self.part, self._input(x), labels, mode=self.spec.mode,
                         block=self.K, chunk=self.cfg.train.loss_chunk, whole=self.whole)  # fmt: skip

    def _data(self) -> None:
        cfg, spec, plan = self.cfg, self.spec, self.plan
        kw = dict(
            batch_size=cfg.train.batch_size,
            seed=plan.data_seed,
            rank=self.rank,
            world=self.world,
            shuffle=spec.shuffle,
        )
        if self.from_cache:
            root, lease_s = cfg.cache.root, cfg.cache.lease_s  # leased while open: gc spares them
            self.train_cache = open_cache(
                root, spec.cache_train, expected_fingerprint=spec.cache_train, lease_s=lease_s
            )
            self.val_cache = open_cache(
                root, spec.cache_val, expected_fingerprint=spec.cache_val, lease_s=lease_s
            )
            got, want = (
                self.val_cache.read_labels(0, self.val_cache.num_samples)[1],
                self.val_rows(),
            )
            if not np.array_equal(got.numpy(), want):
                raise ConfigError(
                    f"val cache {spec.cache_val[:12]} holds {len(got)} val rows, not the "
                    f"{len(want)} this config evaluates on (rotation.val_indices: train."
                    "eval_batches x batch rows spread by train.seed); rebuild it (`preinfer cache "
                    "build`) with the config the visit runs"
                )
            # the boundary holds the windows of the visits it serves; this visit reads its own
            train = self.train_cache
            if train.num_samples != plan.cache_rows:
                raise ConfigError(
                    f"cache {spec.cache_train[:12]} holds {train.num_samples} train rows, but "
                    f"block {self.K}'s boundary in round {spec.round} holds {plan.cache_rows} "
                    "under this config; rebuild it (`preinfer cache build`) with the config the "
                    "visit runs"
                )
            start, n = plan.cache_window
            if start or n < train.num_samples:  # this visit's window of the boundary's rows
                train = CacheWindow(train, start, n)
            self.batches = CacheBatches(train, buffer_mb=cfg.train.shuffle_buffer_mb, **kw)
        else:
            # full: every train row; else this visit's window of the round's rows, as a cache
            # reads it
            self.batches = TokenBatches(self.store, "train", indices=plan.train_rows(), **kw)
        if self.hooks.batches is not None:
            self.batches = self.hooks.batches(self, self.batches)

    def _evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        est = self.evaluate()
        if self.hooks.on_eval is not None:
            self.hooks.on_eval(self, step, est["loss"], time.perf_counter() - t0)
        return est

    def val_rows(self) -> np.ndarray:
        """Ascending token-store val rows every evaluation of the run reads (rotation.
        sample_indices: train.eval_batches x batch rows spread over the split by train.seed,
        or all of it); a visit from the cache reads them from its val cache, which holds
        exactly these rows in this order."""
        return sample_indices(self.plan.budget, "val", self.spec.round)

    def _val_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels) of the val rows (val_rows), batch_size rows at a time, in order:
        the hidden (b, S, H) fp32 entering block K from the val cache, else token ids."""
        B = self.cfg.train.batch_size
        if self.from_cache:
            n = self.val_cache.num_samples
            for a in range(0, n, B):
                hidden, labels, _ = self.val_cache.read_rows(a, min(n, a + B))
                yield hidden, labels
            return
        rows = self.val_rows()
        for a in range(0, len(rows), B):
            part = rows[a : a + B]
            if self.store.has_labels:
                yield split_sample(*self.store.read_indices_with_labels("val", part))
            else:
                yield split_sample(self.store.read_indices("val", part))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """evaluation.val_estimate of the val loss over val_rows (all ranks compute the same):
        {loss, ppl, tokens, rows, of_rows, se, ppl_se}."""
        was = self.model.training
        self.model.eval()
        sums, counts = [], []
        for x, labels in self._val_batches():
            with autocast(self.device, self.cfg.run.precision):
                s, c = blocks_row_losses(self.adapter, self.part, self._input(x.to(self.device)),
                                         labels.to(self.device), self._start(),
                                         self.cfg.train.loss_chunk)  # fmt: skip
            sums += s
            counts += c
        self.model.train(was)
        return val_estimate(sums, counts, self.store.num_samples("val"))

    def _mean(self, value: float) -> float:
        if self.world <= 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # nccl: on the GPU
        dist.all_reduce(t)
        return t.item() / self.world

    def run(self, log=print) -> dict:
        cfg, tc, spec = self.cfg, self.tc, self.spec
        start_hash = self.ckpt.prefix_hash(self.M)
        spath = state_path(cfg, spec)
        opt = self.optimizer()
        step, best, bad, est = 0, float("inf"), 0, None
        loss = float("nan")
        state = load_state(spath, start_hash, self.store, log if self.rank == 0 else None)
        if self.rank == 0 and (warning := tokens_warning(self.ckpt, self.store)):
            log(warning)  # fine-tuning on other data: said, never refused
        if state is not None:
            if why := resume_mismatch(state, self.suffix):
                raise ConfigError(f"{spath} holds this visit's training up to step "
                                  f"{state.get('step')} {why}")  # fmt: skip
            with torch.no_grad():
                for p, t in zip(self.params, state["params"], strict=True):
                    p.copy_(t)
            opt.load_state_dict(state["optim"])
            step, best, bad = state["step"], state["best"], state["bad"]
            loss = state.get("loss", loss)  # the summary's, when resumed at the last step
            if self.rank == 0:
                log(f"  resumed {spec.mode} block {self.K} round {spec.round} at step {step}")
            threads = state.get("threads")
            if self.device.type == "cpu" and threads and threads != torch.get_num_threads():
                # a CPU step's sums split over the threads: the visit's own count keeps the
                # resumed steps bit-identical to those it would have taken (docs/failures.md)
                if self.rank == 0:
                    log(f"  torch threads {torch.get_num_threads()} -> {threads}, the visit's own")
                pin_threads(threads)
        kill_at = faults.kill_step(spec.round, self.K)
        data = endless(self.batches, step)
        t0, tokens, stopped = time.perf_counter(), 0, "max_steps"
        while step < tc.max_steps:
            if step == kill_at:
                os._exit(137)  # test-only: a trainer killed mid-block
            batch = next(data)
            if self.model.training:  # dropout draws from torch's global RNG: seeded per step,
                # so a resumed visit draws what an uninterrupted one would (no RNG state saved)
                torch.manual_seed(self.step_seed(step))
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
                    lr=self.lr(step),
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
                "lr": opt.param_groups[0]["lr"],  # the step's, as the optimizer used it
                "tokens": tokens,  # trained in this visit so far (all ranks)
                "tokens_per_s": tokens / (time.perf_counter() - t0),
                "peak_mem_mb": peak_memory_mb(self.device),
                "time": time.time(),
            }
            evaluate = (tc.eval_every and step % tc.eval_every == 0) or step == tc.max_steps
            if evaluate:
                est = self._evaluate(step)
                val = rec["val_loss"] = est["loss"]
                if val < best - tc.min_delta:
                    best, bad = val, 0
                else:
                    bad += 1
            if self.rank == 0:
                append_metrics(cfg.run.dir, rec, tensorboard=cfg.run.tensorboard)
            if tc.patience and bad >= tc.patience:
                stopped = "early_stop"
                break
            if self.rank == 0 and tc.checkpoint_every and step % tc.checkpoint_every == 0:
                save_state(
                    spath,
                    {
                        "start_hash": start_hash,
                        "tokens": token_record(self.store),
                        "step": step,
                        "best": best,
                        "bad": bad,
                        "loss": loss,
                        "threads": torch.get_num_threads(),
                        "suffix": suffix_spec(self.suffix),
                        "params": [p.detach().clone() for p in self.params],
                        "optim": opt.state_dict(),
                    },
                )
        if est is None:
            est = self._evaluate(step)
        val = est["loss"]
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
            # which val rows the figure is over, and its standard error (issue #58)
            "val_sample": {"rows": est["rows"], "of": est["of_rows"], "se": est["se"]},
            "seconds": elapsed,
            "tokens": tokens,
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            "peak_mem_mb": peak_memory_mb(self.device),
            "peak_mem_growth_mb": peak_memory_mb(self.device) - self.mem_base,
            "trainable_params": sum(p.numel() for p in self.params),
            "suffix_params": self.suffix.num_params() if self.suffix else 0,
            "spec": asdict(spec),
        }
        if spec.mode != "full":  # which of the round's cached rows (cache row order) it read
            summary["rows"] = {"start": self.plan.window[0], "rows": self.plan.window[1],
                               "of": self.plan.budget.rows}  # fmt: skip
        bad_params = self._non_finite_params()
        if bad_params:
            self._diverged(spath, step, f"{bad_params} trainable tensor(s) hold NaN/inf values")
        if self.rank == 0:
            # summary first: a kill after the commit leaves bcd's pending branch this visit's
            # summary to record (a rerun of an uncommitted visit appends a newer one)
            append_metrics(cfg.run.dir, summary, tensorboard=cfg.run.tensorboard)
            self.commit(opt)
            faults.kill_point("visit.committed")
            drop_state(spath)
            faults.kill_point("visit.done")
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

    def optimizer(self) -> torch.optim.Optimizer:
        """The visit's optimizer: fresh, or (train.keep_optimizer_state) holding the state each
        block's last visit left in the checkpoint (fresh for a block that has none yet). With
        always-trained parts, block M-1's saved state may hold more (its layers) or fewer (only
        the head, before its own first visit) tensors than this visit trains: what both have."""
        opt = build_optimizer(self.params[: self.n_block], self.tc, self.params[self.n_block :])
        if self.tc.keep_optimizer_state:
            for b, named in self.named.items():
                # block M-1's state beside another block's visit: only the head's is read
                head_only = b == self.M - 1 and bool(self.always)
                saved = self.ckpt.optimizer_state(b, {n for n, _ in named} if head_only else None)
                if saved is None or not saved[1]:  # none (or kept empty by a suffix commit)
                    continue
                by, tensors = saved
                if b == 0:  # train.freeze toggled since the save: the embedding's state follows
                    embed, names = set(self.adapter.part_names()["embed"]), {n for n, _ in named}
                    have = {k.rpartition(SEP)[0] for k in tensors}
                    tensors = {k: t for k, t in tensors.items()
                               if k.rpartition(SEP)[0] in names or k.rpartition(SEP)[0] not in embed}  # fmt: skip
                    named = [(n, p) for n, p in named if n in have or n not in embed]
                if b == self.M - 1 and self.cfg.train.always_train and self.spec.mode != "full":
                    names = {n for n, _ in named}
                    tensors = {k: t for k, t in tensors.items() if k.rpartition(SEP)[0] in names}
                    have = {k.rpartition(SEP)[0] for k in tensors}
                    named = [(n, p) for n, p in named if n in have]
                load_optimizer_tensors(opt, named, tensors, saved_by=by,
                                       optimizer=self.tc.optimizer, what=f"block {b}")  # fmt: skip
        return opt

    def commit(self, opt: torch.optim.Optimizer) -> None:
        """The trained blocks (one, or all M in full mode; + blocks K+1..M-1 with their suffix
        adapters merged; + block M-1 when its head trained alongside), with
        train.keep_optimizer_state their optimizer states, in ONE commit. A block committed by
        another's visit keeps its own last visit's state (+ the head's, trained here)."""
        also = set(self.suffix.blocks if self.suffix else [])
        also |= {self.M - 1} if self.always else set()
        if self.suffix is not None:
            self.suffix.merge()  # W += alpha/r B @ A in W's dtype; the hooks come off
        blocks = self.blocks + sorted(also)
        states = {b: self.ckpt.block_state(self.model, self.adapter, b) for b in blocks}
        optim, keep, alongside = None, set(), None
        if self.tc.keep_optimizer_state:
            optim = {b: optimizer_tensors(opt, self.named.get(b, [])) for b in self.blocks}
            # the other blocks' own states stay in their files, unread (reading them would
            # hold all of blocks K+1..M-1's moments at the commit); the head's goes beside
            keep = also
            alongside = {self.M - 1: optimizer_tensors(opt, self.always)} if self.always else None
        self.ckpt.commit_blocks(states, optim=optim, keep_optim=keep, alongside=alongside,
                                optimizer=self.tc.optimizer,
                                tokens=token_record(self.store))  # fmt: skip
