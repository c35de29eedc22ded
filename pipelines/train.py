"""Stage `preinfer train --block K`: one block visit, on Ray Train workers or in this process.

train.workers >= 2 (or 1 in a Ray cluster job): a Ray Train `TorchTrainer` with that many
workers (DDP over gloo on CPU, NCCL on GPU); every rank reads its own part of each global batch
and the ranks average gradients, so every rank takes the same steps. A rank runs `run_rank`,
which needs only a torch.distributed process group (tests/test_ddp.py runs 2 without Ray).
train.workers = 0, or 1 on this machine: the same loop in this process, without Ray Train's
start-up.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from core.config import ConfigError
from pipelines.cache_build import open_sources, plan_block
from pipelines.ray_env import (
    credentials_env,
    ensure_ray,
    gpus_available,
    runtime_env_vars,
    worker_config,
    worker_payload,
)
from preinfer.checkpoint.store import Checkpoint
from preinfer.plan.guards import check_vocab
from preinfer.run.config import Config
from preinfer.run.preflight import check_memory
from preinfer.run.provenance import check_settings
from preinfer.run.state import check_run, checkpoint_record, load_run_state, save_run_state
from preinfer.run.visit import Visit, VisitHooks, VisitSpec, state_path
from preinfer.run.visit_state import load_state
from preinfer.runtime.device import resolve_device
from preinfer.runtime.metrics import last_visit_summary
from preinfer.schedule.visit_plan import VisitPlan
from storage.tokens import TokenStore


def visit_spec(plan: VisitPlan) -> VisitSpec:
    """The visit `plan` plans, with (bcd, K > 0) the fingerprints of the caches it reads."""
    fps = plan.fingerprints or {}
    return VisitSpec(block=plan.block, round=plan.round, mode=plan.mode,
                     cache_train=fps.get("train"), cache_val=fps.get("val"))  # fmt: skip


def _require_caches(plan: VisitPlan) -> None:
    """Refuse a bcd visit whose boundary caches are not built for the checkpoint as it is now."""
    if plan.reads is not None and not plan.reads.complete:
        block = plan.block
        raise ConfigError(
            f"block {block} trains from the boundary-{block} cache, which is not built for the "
            f"checkpoint as it is now; run `preinfer cache build --block {block}` (or "
            f"`cache refresh --block {block}`), or train with --mode bcd-recompute"
        )


def cpus_per_worker(cfg: Config) -> float:
    """CPUs a Ray Train worker asks for and runs torch threads on: train.cpus_per_worker, or
    this node's CPUs shared evenly over the workers."""
    if cfg.train.cpus_per_worker is not None:
        return cfg.train.cpus_per_worker
    return max(1, (os.cpu_count() or 1) // max(1, cfg.train.workers))


def worker_loop_config(cfg: Config, spec: VisitSpec) -> dict:
    """What every rank of a data-parallel visit runs from (`run_rank`'s input; Ray Train's
    train_loop_config): the config as plain data with the storage credentials masked (Ray
    Train keeps the loop config where it can be read back), the visit, the torch threads."""
    return {"cfg": worker_payload(cfg), "spec": asdict(spec), "threads": cpus_per_worker(cfg)}


def worker_args(cfg: Config, spec: VisitSpec) -> tuple[dict, dict]:
    """(train_loop_config, worker runtime_env) of the Ray Train workers, Ray started: the
    credentials reach the workers in their environment, not in the loop config."""
    env = runtime_env_vars(credentials_env(cfg))
    return worker_loop_config(cfg, spec), ({"env_vars": env} if env else {})


def run_rank(
    config: dict,
    *,
    rank: int,
    world: int,
    local_rank: int = 0,
    log=print,
    hooks: VisitHooks | None = None,
) -> dict:
    """One rank of a data-parallel visit (`worker_loop_config`'s data), its process group up
    when world > 1 (Ray Train's workers, or any torch.distributed launcher): this rank reads
    its part of each global batch, gradients and losses are averaged over the group, rank 0
    commits, and no rank returns before that commit is made. Returns the visit's summary (its
    losses the same on every rank)."""
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"rank {rank} of {world}: no torch.distributed process group; initialise one "
            "(torch.distributed.init_process_group) before run_rank"
        )
    cfg = worker_config(config["cfg"])
    spec = VisitSpec(**config["spec"])
    device = resolve_device(cfg.run.device)
    if device.type == "cpu":  # Ray gives a CPU worker one OMP thread; use the share it holds
        torch.set_num_threads(max(1, int(config["threads"])))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
    summary = Visit(cfg, spec, device=device, rank=rank, world=world, hooks=hooks).run(log=log)
    if world > 1:  # rank 0's commit is made before any rank returns (and reads the checkpoint)
        dist.barrier()
    return summary


def _worker_loop(config: dict) -> None:
    """Ray Train per-worker entry: run this rank of the visit, report the summary."""
    import ray.train

    ctx = ray.train.get_context()
    summary = run_rank(
        config,
        rank=ctx.get_world_rank(),
        world=ctx.get_world_size(),
        local_rank=ctx.get_local_rank(),
    )
    ray.train.report({k: v for k, v in summary.items() if isinstance(v, int | float)})


def run_train(
    cfg: Config,
    block: int,
    round_: int = 0,
    *,
    mode: str | None = None,
    log=print,
    memory_check: bool = True,
    plan: VisitPlan | None = None,
    hooks: VisitHooks | None = None,
) -> dict:
    """Train one block visit (`preinfer train --block K`). memory_check: warn first when the
    planner's trainer-peak estimate exceeds the device, and say the training precision (bcd
    does both once for the rotation);
    plan: the visit's plan, when the caller made it (the rotation: its caches just made
    current); else planned here, and a bcd visit's caches must be built already;
    hooks: a visit's extension points (in this process only: not sent to Ray Train workers)."""
    mode = mode or cfg.train.mode
    # pre-flight in the driver: bad input fails here with one clear line, not inside a worker
    store = TokenStore(cfg.data.out_dir)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    if not 0 <= block < ckpt.num_blocks:
        raise ConfigError(
            f"--block {block} is out of range: the checkpoint has blocks 0..{ckpt.num_blocks - 1}"
        )
    check_vocab(ckpt, store)  # ids past the embedding: refused here
    # what the config asks is what runs: the store's data and the checkpoint's model settings
    check_settings(cfg, "train", tokens=store.manifest, checkpoint=ckpt.index)
    # a damaged block file is named before anything else is said of the visit (a missing cache,
    # say: building one would not mend it)
    ckpt.check_files(range(block if mode == "bcd" else 0, ckpt.num_blocks))
    if plan is None:
        plan = plan_block(cfg, block, round_, mode=mode, src=open_sources(cfg, ckpt, store))
        _require_caches(plan)
    if plan.adapts_prefix:  # train.prefix_adapters=last: this visit loads blocks 0..K-1 too
        ckpt.check_files(range(block))
    spec = visit_spec(plan)
    if memory_check:
        check_memory(cfg, ckpt, plan.budget, store.seq_len, mode=mode,
                     block=None if mode == "full" else block, log=log)  # fmt: skip
    workers = cfg.train.workers
    if workers == 0 or (workers == 1 and not os.environ.get("RAY_ADDRESS")):
        # one worker on this machine: the same loop in this process, no Ray Train start-up
        device = resolve_device(cfg.run.device)
        return Visit(cfg, spec, plan=plan, device=device, hooks=hooks).run(log=log)
    if hooks is not None:
        raise ConfigError(
            "visit hooks run in this process only; train with train.workers=0 or 1 to use them"
        )
    # a mid-block state trained on other tokens: refused here, before any worker starts
    load_state(state_path(cfg, spec), ckpt.prefix_hash(ckpt.num_blocks), store)

    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    ensure_ray(cfg.run.verbose, log=log, env=credentials_env(cfg))
    use_gpu = cfg.run.device != "cpu" and gpus_available()
    loop_config, runtime_env = worker_args(cfg, spec)
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers,
            use_gpu=use_gpu,
            resources_per_worker=None if use_gpu else {"CPU": cpus_per_worker(cfg)},
        ),
        run_config=ray.train.RunConfig(
            name=f"r{round_}-b{block}-{mode}",
            storage_path=str((Path(cfg.run.dir) / "ray_train").resolve()),
            worker_runtime_env=runtime_env,
        ),
    )
    trainer.fit()
    # rank 0 appended the visit's summary to metrics.jsonl; Ray Train's own metrics are flat
    return last_visit_summary(cfg.run.dir)


def run_train_by_hand(cfg: Config, block: int, round_: int, *, mode: str | None = None) -> dict:
    """`preinfer train --block K`: one visit outside the rotation. A run.dir whose state.json
    records a rotation must hold the checkpoint it names; the visit's commit is then recorded
    there as the checkpoint the run goes on from (a later bcd, eval or export accepts it)."""
    state = load_run_state(cfg.run.dir)
    if state.get("checkpoint"):  # else no rotation to hold it to: run_train's own checks
        state = check_run(cfg.run.dir, Checkpoint.open(cfg.run.checkpoint), "train")
    res = run_train(cfg, block, round_, mode=mode)
    if state.get("checkpoint"):
        state["checkpoint"] = checkpoint_record(Checkpoint.open(cfg.run.checkpoint))
        save_run_state(cfg.run.dir, state)
    return res
