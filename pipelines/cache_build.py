"""Stages `preinfer cache build` and `preinfer cache refresh` (in process, or Ray actors).

build K:   token rows --(blocks 0..K-1)--> hidden entering block K
refresh K: boundary K-1 cache --(block K-1 alone)--> hidden entering block K

The driver plans the caches (preinfer.cache_identity: fingerprints, shards still missing),
then runs PrefixWorker (pipelines/prefix_worker.py) over them: in this process for a local build (no actor start-up), or
over a pool of Ray actors given shard descriptors (a cluster job). Each actor is built from
small plain data (the config without credentials, paths: not objects; its credentials come
in its environment), loads only the blocks it runs, computes whole shards in micro-batches
and writes them itself; only a small record comes back. The driver finalizes (manifest last).
Rerunning the same command resumes: shards with a valid done marker are skipped.

Lossy caches (int8, fp8_e4m3) are never refreshed: a refresh would quantize again what was
quantized once, and a cache's fingerprint names one content, the build's. Their boundaries
are built from tokens (`refresh_allowed`).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from tqdm import tqdm

from core import faults
from core.config import ConfigError
from pipelines.prefix_worker import PHASES, PrefixWorker
from pipelines.ray_env import (
    actor_resources,
    credentials_env,
    ensure_ray,
    map_over_actors,
    runtime_env_vars,
    worker_payload,
)
from preinfer import hostmem
from preinfer.cache_identity import CachePlan, Sources, compute_choice, plan_caches
from preinfer.config import Config
from preinfer.guards import check_disk_for_cache, check_vocab
from preinfer.provenance import check_settings
from preinfer.trainer import visit_position
from storage.cache import CacheWriter
from storage.config import LOSSY_DTYPES
from storage.layout import is_complete


def shards_per_task(cfg: Config, shards: int, actors: int) -> int:
    """Shards per worker call: preinfer.shards_per_task (a call pipelines its shards: the next
    input is read while one computes, the last is written while the next computes), fewer when
    there are under two calls per actor (so no actor idles while another works through a long
    call)."""
    return max(1, min(cfg.preinfer.shards_per_task, shards // (2 * actors)))


def actor_env(cfg: Config) -> dict[str, str]:
    """Environment of the worker processes: the allocator's (hostmem.worker_env: a few malloc
    arenas, so a worker's peak depends less on which thread freed what) and the test-fault
    switches when set. The storage credentials come on their own (ray_env.credentials_env)."""
    return {**hostmem.worker_env(cfg.preinfer.malloc_arenas), **faults.worker_env()}


def refresh_allowed(cfg: Config) -> bool:
    """Whether boundary K may be refreshed from boundary K-1: not for a lossy cache.dtype (a
    refresh would run block K-1 on dequantized values and quantize again, so its bytes would
    differ from a build's under the build's fingerprint, and the error would grow with K)."""
    return cfg.cache.dtype not in LOSSY_DTYPES


def executor(cfg: Config) -> str:
    """Where the prefix runs: 'local' (this process, the same worker code, no actor start-up)
    or 'ray' (an actor pool). auto: ray for a Ray cluster job (RAY_ADDRESS set: the build is
    spread over the cluster) or a node with several GPUs (one actor per GPU); else local, since
    one process already uses every core of one machine."""
    if cfg.preinfer.executor != "auto":
        return cfg.preinfer.executor
    if os.environ.get("RAY_ADDRESS"):
        return "ray"
    gpus = torch.cuda.device_count() if cfg.run.device != "cpu" else 0
    return "ray" if gpus > 1 else "local"


def _run_workers(
    cfg: Config,
    plans: list[CachePlan],
    block: int,
    first: int,
    sources: dict[str, str],
    seq_len: int,
    log,
    source_rows: dict[str, np.ndarray] | None = None,
) -> dict:
    """Compute every missing shard (locally or over the actor pool); counts and timing."""
    items = [{"fingerprint": p.fingerprint, "shard": s} for p in plans for s in p.missing]
    if not items:
        return {"shards": 0, "rows": 0, "seconds": 0.0, "startup_s": 0.0, "executor": "none",
                **dict.fromkeys(PHASES, 0.0)}  # fmt: skip
    choice = compute_choice(cfg)
    where = executor(cfg)
    log(f"  compute dtype {choice.compute} ({choice.reason}); executor {where}")
    worker_kw = {"block": block, "first": first, "sources": sources,
                 "compute": choice.compute, "round_to": choice.round_to,
                 "source_rows": source_rows or {}}  # fmt: skip
    t0, wall0 = time.perf_counter(), time.time()
    if where == "local":
        records = _local_records(cfg, items, {"cfg": cfg, **worker_kw})
    else:
        records = _ray_records(cfg, items, {"cfg": worker_payload(cfg), **worker_kw})
    rows = shards = 0
    phases = dict.fromkeys(PHASES, 0.0)
    first_start = float("inf")  # wall clock of the first shard any worker began
    # closed on an error too: the error's line (a full disk, say) starts a line of its own
    with tqdm(total=len(items), desc=f"preinfer block {block}", unit="shard", disable=None) as bar:
        for rec in records:
            shards += 1
            rows += int(rec["rows"])
            for k in PHASES:
                phases[k] += float(rec[k])
            first_start = min(first_start, float(rec["started"]))
            bar.update(1)
            bar.set_postfix(tok_s=f"{rows * seq_len / (time.perf_counter() - t0):,.0f}")
    # startup_s: call to the first shard begun (Ray start, planning, actor processes, imports,
    # weight loading); the rotation adds finalize to it as the build's fixed part
    return {"shards": shards, "rows": rows, "seconds": time.perf_counter() - t0,
            "startup_s": max(0.0, first_start - wall0) if shards else 0.0, "executor": where,
            **phases}  # fmt: skip


def _local_records(cfg: Config, items: list[dict], worker_kw: dict):
    """One PrefixWorker in this process over every shard, a few shards per call (a call
    pipelines read / compute / write; calls return a record per shard for progress)."""
    worker = PrefixWorker(**worker_kw, pin=False)  # the allocator is the driver's own
    try:
        per = max(1, cfg.preinfer.shards_per_task)
        for i in range(0, len(items), per):
            chunk = items[i : i + per]
            out = worker({k: np.asarray([it[k] for it in chunk]) for k in ("fingerprint", "shard")})
            for j in range(len(chunk)):
                yield {k: v[j] for k, v in out.items()}
    finally:
        worker.close()


def _ray_records(cfg: Config, items: list[dict], worker_kw: dict):
    """The shards over a pool of PrefixWorker actors, shards_per_task shards per call; a
    record per shard, as calls return. worker_kw: plain data only (the payload, not the Config)."""
    creds = credentials_env(cfg)
    ensure_ray(cfg.run.verbose, env=creds)
    pool = min(cfg.preinfer.actors, len(items))
    per = shards_per_task(cfg, len(items), pool)
    calls = [
        {k: np.asarray([it[k] for it in items[i : i + per]]) for k in ("fingerprint", "shard")}
        for i in range(0, len(items), per)
    ]
    env = {**actor_env(cfg), **runtime_env_vars(creds)}
    options = {
        "max_restarts": cfg.preinfer.max_restarts,
        "max_task_retries": cfg.preinfer.max_task_retries,
        "runtime_env": {"env_vars": env} if env else None,
        **actor_resources(cfg),
    }
    for out in map_over_actors(
        PrefixWorker, worker_kw, calls, actors=pool, method="run", options=options
    ):
        for j in range(len(out["shard"])):
            yield {k: v[j] for k, v in out.items()}


def _finish(cfg: Config, plans: list[CachePlan]) -> float:
    """Finalize (manifest last) every cache that was not complete; returns seconds."""
    t0 = time.perf_counter()
    for p in plans:
        if not p.complete:
            CacheWriter.open(cfg.cache.root, p.fingerprint).finalize()
    return time.perf_counter() - t0


def build_cache(
    cfg: Config,
    block: int,
    round_: int = 0,
    *,
    position: int | None = None,
    verify: bool = False,
    log=print,
    src: Sources | None = None,
) -> dict:
    """Hidden states entering `block` for train and val, from tokens through blocks 0..block-1.

    position: the visit (its place in the round) the cache is made for (None: block `block`'s
    own; cache_identity.boundary_visits). verify: also check a complete cache's shards and
    rewrite any that fail (repair). src: the checkpoint and token store, when the caller has
    them open.
    """
    t0 = time.perf_counter()
    src = src or Sources.open(cfg)
    _check_inputs(cfg, src, "cache build")
    _guard_disk(cfg, block, round_, position, src)
    plans = plan_caches(cfg, block, round_, position=position, verify=verify, src=src)
    todo = sum(len(p.missing) for p in plans)
    if all(p.complete for p in plans):
        log(f"cache build: boundary {block} is current ({_fps(plans)}); nothing to do")
        return {"action": "reused", **_result(plans)}
    stats = _run_workers(cfg, plans, block, 0, {}, src.store.seq_len, log)
    stats["finalize_s"] = _finish(cfg, plans)
    stats["plan_s"] = time.perf_counter() - t0 - stats["seconds"] - stats["finalize_s"]
    _log_done(log, "build", block, plans, stats, todo, src.store.seq_len)
    return {"action": "built", **_result(plans), **stats}


def refresh_cache(
    cfg: Config,
    block: int,
    round_: int = 0,
    *,
    position: int | None = None,
    log=print,
    src: Sources | None = None,
) -> dict:
    """Boundary `block` from the complete boundary block-1 cache, running block-1 alone; both
    as made for the visit at `position` (None: block `block`'s own). The source holds every
    row the target does (a boundary serves a subset of the visits the one below it serves)."""
    t0 = time.perf_counter()
    if block < 2:
        raise ConfigError(
            f"--block {block}: refresh needs a boundary-{block - 1} cache; "
            "boundary 1 is built from tokens with `cache build --block 1`"
        )
    if not refresh_allowed(cfg):
        raise ConfigError(
            f"cache.dtype={cfg.cache.dtype} is lossy: a refresh would quantize boundary "
            f"{block - 1}'s already quantized values again, so boundary {block} would not hold "
            f"what a build does (and errors would add up block by block); run "
            f"`preinfer cache build --block {block}` (the rotation builds lossy caches from tokens)"
        )
    src = src or Sources.open(cfg)
    _check_inputs(cfg, src, "cache refresh")
    if position is None:  # the source as this boundary's own visit finds it
        position = visit_position(cfg.train, src.ckpt.num_blocks, round_, block)
    prev = plan_caches(cfg, block - 1, round_, position=position, create=False, src=src)
    stale = [p for p in prev if not is_complete(cfg.cache.root, p.fingerprint)]
    if stale:
        raise ConfigError(
            f"no current boundary-{block - 1} cache for the checkpoint as it is now "
            f"(missing {', '.join(f'{p.split} {p.fingerprint}' for p in stale)}); "
            f"run `preinfer cache build --block {block - 1}` or `cache build --block {block}`"
        )
    _guard_disk(cfg, block, round_, position, src)
    plans = plan_caches(cfg, block, round_, position=position, src=src)
    if all(p.complete for p in plans):
        log(f"cache refresh: boundary {block} is current ({_fps(plans)}); nothing to do")
        return {"action": "reused", **_result(plans)}
    todo = sum(len(p.missing) for p in plans)
    sources = {p.fingerprint: q.fingerprint for p, q in zip(plans, prev, strict=True)}
    rows = {p.fingerprint: m for p, q in zip(plans, prev, strict=True)
            if (m := source_rows(p, q)) is not None}  # fmt: skip
    stats = _run_workers(cfg, plans, block, block - 1, sources, src.store.seq_len, log, rows)
    stats["finalize_s"] = _finish(cfg, plans)
    stats["plan_s"] = time.perf_counter() - t0 - stats["seconds"] - stats["finalize_s"]
    _log_done(log, "refresh", block, plans, stats, todo, src.store.seq_len)
    return {"action": "refreshed", **_result(plans), **stats}


def source_rows(target: CachePlan, source: CachePlan) -> np.ndarray | None:
    """(N_target,) int64: the row of `source` that holds each row's sample of `target`, or None
    where they hold the same rows in the same order (row i of one is row i of the other)."""
    a, b = target.indices, source.indices
    if len(a) == len(b) and np.array_equal(a, b):
        return None
    sorter = np.argsort(b, kind="stable")
    at = sorter[np.minimum(np.searchsorted(b, a, sorter=sorter), len(b) - 1)] if len(b) else a
    if len(b) == 0 or not np.array_equal(b[at], a):
        raise ConfigError(
            f"the boundary cache {source.fingerprint[:12]} lacks samples that "
            f"{target.fingerprint[:12]} holds, so it cannot be refreshed from it; build it "
            "from tokens (`preinfer cache build`)"
        )
    return at.astype(np.int64)


def _check_inputs(cfg: Config, src: Sources, stage: str) -> None:
    """Refuse, in the driver before anything is written, token ids that would index past the
    checkpoint's embedding, and a token store or checkpoint made with other settings than
    the config asks for."""
    check_vocab(src.ckpt, src.store)
    check_settings(cfg, stage, tokens=src.store.manifest, checkpoint=src.ckpt.index)


def _guard_disk(cfg: Config, block: int, round_: int, position: int | None, src: Sources) -> None:
    """Refuse before anything is written when what is left of the boundary's caches cannot
    fit the free disk. Committed shards are credited: a build resumed after a full disk needs
    room for the rest only (its manifest alone, once every shard is in)."""

    plans = plan_caches(cfg, block, round_, position=position, create=False, src=src)
    if not all(p.complete for p in plans):
        check_disk_for_cache(cfg, block, plans=plans)


def _fps(plans: list[CachePlan]) -> str:
    return ", ".join(f"{p.split} {p.fingerprint[:12]}" for p in plans)


def _result(plans: list[CachePlan]) -> dict:
    return {"fingerprints": {p.split: p.fingerprint for p in plans}}


def _log_done(log, what, block, plans, stats, todo, seq_len) -> None:
    tok_s = stats["rows"] * seq_len / max(stats["seconds"], 1e-9)
    log(
        f"cache {what}: boundary {block}: {stats['shards']}/{todo} shards, {stats['rows']} samples "
        f"in {stats['seconds']:.1f}s ({tok_s:,.0f} tok/s, {stats['executor']}; first shard after "
        f"{stats['startup_s']:.1f}s; worker seconds: "
        + ", ".join(f"{k[:-2]} {stats[k]:.1f}" for k in PHASES)
        + f") -> {_fps(plans)}"
    )
