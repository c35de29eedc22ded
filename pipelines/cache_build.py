"""Stages `preinfer cache build` and `preinfer cache refresh` (in process, or Ray actors).

build K:   token rows --(blocks 0..K-1)--> hidden entering block K
refresh K: boundary K-1 cache --(block K-1 alone)--> hidden entering block K

The driver takes a boundary's caches as a visit's plan has them (preinfer.schedule.visit_plan: their
fingerprints and rows; the rotation hands its own, the stages plan block K's visit), opens
their writers (the shards still missing), then runs PrefixWorker (pipelines/prefix_worker.py)
over them: in this process for a local build (no actor start-up), or over a pool of Ray
actors given shard descriptors (a cluster job). Each actor is built from
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
from collections.abc import Iterator

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
from preinfer.checkpoint.store import Checkpoint
from preinfer.plan.guards import check_disk_for_boundary, check_vocab
from preinfer.run.config import Config
from preinfer.run.provenance import check_settings
from preinfer.runtime import hostmem
from preinfer.schedule.cache_identity import (
    BoundaryPlan,
    CachePlan,
    Sources,
    cache_meta,
    compute_choice,
)
from preinfer.schedule.rotation import store_budget
from preinfer.schedule.visit_plan import VisitPlan, plan_visit
from storage import fs
from storage.cache import CacheWriter
from storage.config import LOSSY_DTYPES
from storage.layout import is_complete
from storage.tokens import TokenStore


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
    src: Sources,
    work: list[tuple[CachePlan, list[int]]],
    block: int,
    first: int,
    sources: dict[str, str],
    log,
    source_rows: dict[str, np.ndarray] | None = None,
) -> dict:
    """Compute every shard of `work` (locally or over the actor pool); counts and timing."""
    items = [{"fingerprint": p.fingerprint, "shard": s} for p, shards in work for s in shards]
    if not items:
        return {"shards": 0, "rows": 0, "seconds": 0.0, "startup_s": 0.0, "executor": "none",
                **dict.fromkeys(PHASES, 0.0)}  # fmt: skip
    choice, seq_len = src.compute, src.store.seq_len
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
    """The shards over a pool of PrefixWorker actors; a record per shard, as calls return.
    worker_kw: plain data only (the payload, not the Config)."""

    def call(a: int, b: int) -> dict:
        return {k: np.asarray([it[k] for it in items[a:b]]) for k in ("fingerprint", "shard")}

    yield from shards_over_actors(cfg, PrefixWorker, worker_kw, len(items), call)


def shards_over_actors(cfg: Config, cls: type, kwargs: dict, n: int, call) -> Iterator[dict]:
    """n shards over a pool of `cls` actors (preinfer.actors, their resources, restarts and
    retries), shards_per_task shards per call: call(a, b) is the call of items [a, b), and each
    call returns arrays with one entry per shard (its "shard" among them). Yields one record
    per shard as calls return (any order). kwargs: plain data only (the worker payload)."""
    creds = credentials_env(cfg)
    ensure_ray(cfg.run.verbose, env=creds)
    pool = min(cfg.preinfer.actors, n)
    per = shards_per_task(cfg, n, pool)
    calls = [call(i, min(i + per, n)) for i in range(0, n, per)]
    env = {**actor_env(cfg), **runtime_env_vars(creds)}
    options = {
        "max_restarts": cfg.preinfer.max_restarts,
        "max_task_retries": cfg.preinfer.max_task_retries,
        "runtime_env": {"env_vars": env} if env else None,
        **actor_resources(cfg),
    }
    for out in map_over_actors(cls, kwargs, calls, actors=pool, method="run", options=options):
        for j in range(len(out["shard"])):
            yield {k: v[j] for k, v in out.items()}


def _finish(cfg: Config, plans: list[CachePlan]) -> float:
    """Finalize (manifest last) every cache a build wrote into; returns seconds."""
    t0 = time.perf_counter()
    for p in plans:
        CacheWriter.open(cfg.cache.root, p.fingerprint).finalize()
    return time.perf_counter() - t0


def open_sources(
    cfg: Config, ckpt: Checkpoint | None = None, store: TokenStore | None = None
) -> Sources:
    """The checkpoint and token store as they are now (ckpt, store: when the caller has them
    open), and how this config stores and computes caches: what a plan's caches are made from."""
    return Sources(
        ckpt=ckpt or Checkpoint.open(cfg.run.checkpoint),
        store=store or TokenStore(cfg.data.out_dir),
        cache=cfg.cache,
        compute=compute_choice(cfg.preinfer, cfg.cache, cfg.run.device),
    )


def plan_block(
    cfg: Config, block: int, round_: int = 0, *, mode: str = "bcd", src: Sources | None = None
) -> VisitPlan:
    """Block `block`'s visit of round `round_`, planned against the checkpoint and token store as
    they are now (src, when the caller has them open): what `cache build/refresh --block` and
    `train --block` act on."""
    src = src or open_sources(cfg)
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, src.store)
    M = src.ckpt.num_blocks
    return plan_visit(cfg.train, budget, M, round_, block, mode=mode, sources=src)


def damaged_shards(cfg: Config, bp: BoundaryPlan) -> dict[str, list[int]]:
    """Shards of `bp`'s complete caches that fail their checksum now, by fingerprint (xxh3:
    cheap next to training on them)."""
    root = cfg.cache.root
    bad = {p.fingerprint: CacheWriter.open(root, p.fingerprint).missing_shards()
           for p in bp.caches if p.complete}  # fmt: skip
    return {fp: shards for fp, shards in bad.items() if shards}


def open_writers(
    cfg: Config, src: Sources, plan: VisitPlan, bp: BoundaryPlan, bad: dict[str, list[int]]
) -> list[tuple[CachePlan, list[int]]]:
    """The caches of `bp` that need shards, each with the shards to compute: a damaged
    complete cache its `bad` ones (a repair rewrites exactly those, then the manifest); an
    incomplete one those without a valid done marker, its writer created first (its rows
    read from the token store, in cache row order)."""
    out, checkpoint = [], str(fs.path(cfg.run.checkpoint).resolve())  # a URL stays a URL
    for p in bp.caches:
        if p.complete:
            if p.fingerprint in bad:
                out.append((p, bad[p.fingerprint]))
            continue
        # (N, S+1) ids and (N, S) labels (IGNORE where masked) int32, in cache row order
        held = np.unique(p.indices)
        rows, labels = src.store.read_indices_with_labels(p.split, held)
        at = np.searchsorted(held, p.indices)
        meta = cache_meta(
            src, plan.budget, bp, p.split, config=cfg.to_dict(), checkpoint=checkpoint
        )
        writer = CacheWriter.create(
            cfg.cache.root,
            p.fingerprint,
            samples={
                "sample_id": p.indices.astype(np.int64),
                "input_ids": rows[at, :-1],
                "labels": labels[at],
            },
            seq_len=src.store.seq_len,
            hidden_size=src.ckpt.hidden_size,
            cache_cfg=cfg.cache,
            meta=meta,
        )
        out.append((p, writer.missing_shards()))
    return out


def create_writers(cfg: Config, block: int, round_: int = 0) -> tuple[CachePlan, ...]:
    """Boundary `block`'s caches as block `block`'s visit of round `round_` reads them, their
    writers created (the rows and the layout on disk, no shard computed): what a build
    computes into. Returns both caches' plans."""
    src = open_sources(cfg)
    plan = _plan_boundary(cfg, src, block, round_)
    open_writers(cfg, src, plan, plan.reads, {})
    return plan.caches


def build_boundary(
    cfg: Config,
    src: Sources,
    plan: VisitPlan,
    bp: BoundaryPlan,
    *,
    bad: dict[str, list[int]] | None = None,
    log=print,
) -> dict:
    """Hidden states entering boundary bp.boundary for train and val, from tokens through the
    blocks below it, as `plan` (the visit they are made for) planned them. bad: shards of
    complete caches that failed their checksum (damaged_shards), rewritten (a repair)."""
    t0 = time.perf_counter()
    _guard_disk(cfg, src, plan, bp)
    work = open_writers(cfg, src, plan, bp, bad or {})
    if bp.complete and not work:
        log(f"cache build: boundary {bp.boundary} is current ({_fps(bp)}); nothing to do")
        return {"action": "reused", **_result(bp)}
    todo = sum(len(s) for _, s in work)
    stats = _run_workers(cfg, src, work, bp.boundary, 0, {}, log)
    stats["finalize_s"] = _finish(cfg, [p for p, _ in work])
    stats["plan_s"] = time.perf_counter() - t0 - stats["seconds"] - stats["finalize_s"]
    _log_done(log, "build", bp, stats, todo, src.store.seq_len)
    return {"action": "built", **_result(bp), **stats}


def refresh_boundary(
    cfg: Config, src: Sources, plan: VisitPlan, bp: BoundaryPlan, *, log=print
) -> dict:
    """Boundary bp.boundary from the complete boundary below it (bp.source, as made for the
    same visit), running that one block alone. The source holds every row the target does (a
    boundary serves a subset of the visits the one below it serves)."""
    t0 = time.perf_counter()
    block, prev = bp.boundary, bp.source
    _refuse_refresh(cfg, block)
    stale = [p for p in prev.caches if not is_complete(cfg.cache.root, p.fingerprint)]
    if stale:
        raise ConfigError(
            f"no current boundary-{block - 1} cache for the checkpoint as it is now "
            f"(missing {', '.join(f'{p.split} {p.fingerprint}' for p in stale)}); "
            f"run `preinfer cache build --block {block - 1}` or `cache build --block {block}`"
        )
    _guard_disk(cfg, src, plan, bp)
    work = open_writers(cfg, src, plan, bp, {})
    if bp.complete:
        log(f"cache refresh: boundary {block} is current ({_fps(bp)}); nothing to do")
        return {"action": "reused", **_result(bp)}
    todo = sum(len(s) for _, s in work)
    pairs = list(zip(bp.caches, prev.caches, strict=True))
    sources = {p.fingerprint: q.fingerprint for p, q in pairs}
    rows = {p.fingerprint: m for p, q in pairs if (m := source_rows(p, q)) is not None}
    stats = _run_workers(cfg, src, work, block, block - 1, sources, log, rows)
    stats["finalize_s"] = _finish(cfg, [p for p, _ in work])
    stats["plan_s"] = time.perf_counter() - t0 - stats["seconds"] - stats["finalize_s"]
    _log_done(log, "refresh", bp, stats, todo, src.store.seq_len)
    return {"action": "refreshed", **_result(bp), **stats}


def build_cache(
    cfg: Config, block: int, round_: int = 0, *, verify: bool = False, log=print
) -> dict:
    """`preinfer cache build --block K`: boundary K's caches as block K's visit of round
    `round_` reads them, from tokens through blocks 0..K-1. verify: also check a complete
    cache's shards and rewrite any that fail (repair)."""
    src = open_sources(cfg)
    _check_inputs(cfg, src, "cache build")
    plan = _plan_boundary(cfg, src, block, round_)
    bad = damaged_shards(cfg, plan.reads) if verify else {}
    return build_boundary(cfg, src, plan, plan.reads, bad=bad, log=log)


def refresh_cache(cfg: Config, block: int, round_: int = 0, *, log=print) -> dict:
    """`preinfer cache refresh --block K`: boundary K from the complete boundary K-1 cache, both
    as made for block K's visit of round `round_`, running block K-1 alone."""
    _refuse_refresh(cfg, block)
    src = open_sources(cfg)
    _check_inputs(cfg, src, "cache refresh")
    plan = _plan_boundary(cfg, src, block, round_)
    return refresh_boundary(cfg, src, plan, plan.reads, log=log)


def _plan_boundary(cfg: Config, src: Sources, block: int, round_: int) -> VisitPlan:
    """Block `block`'s visit of round `round_`, whose boundary caches a cache stage makes (a
    cache exists for boundaries 1..M-1 only)."""
    M = src.ckpt.num_blocks
    if not 1 <= block < M:
        raise ConfigError(
            f"--block {block}: a cache exists only for boundaries 1..{M - 1} "
            f"(block 0 trains from tokens; the checkpoint has {M} blocks)"
        )
    plan = plan_block(cfg, block, round_, src=src)
    if plan.adapts_prefix:
        raise ConfigError(
            f"--block {block}: block {block}'s visit of round {round_} is its round's last, and "
            "under train.prefix_adapters=last it runs its prefix from tokens with adapters: it "
            "reads no cache, so none is made for it. Train it (`preinfer train --block "
            f"{block}`), or set train.prefix_adapters=none to cache boundary {block}"
        )
    return plan


def _refuse_refresh(cfg: Config, block: int) -> None:
    """A refresh needs a boundary below (block >= 2) and a lossless cache.dtype."""
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


def _guard_disk(cfg: Config, src: Sources, plan: VisitPlan, bp: BoundaryPlan) -> None:
    """Refuse before anything is written when what is left of the boundary's caches cannot
    fit the free disk. Committed shards are credited: a build resumed after a full disk needs
    room for the rest only (its manifest alone, once every shard is in)."""
    if not bp.complete:
        check_disk_for_boundary(cfg.cache, plan.budget, bp.boundary, hidden=src.ckpt.hidden_size,
                                seq=src.store.seq_len, plans=bp.caches)  # fmt: skip


def _fps(bp: BoundaryPlan) -> str:
    return ", ".join(f"{p.split} {p.fingerprint[:12]}" for p in bp.caches)


def _result(bp: BoundaryPlan) -> dict:
    return {"fingerprints": bp.fingerprints}


def _log_done(log, what, bp: BoundaryPlan, stats, todo, seq_len) -> None:
    tok_s = stats["rows"] * seq_len / max(stats["seconds"], 1e-9)
    log(
        f"cache {what}: boundary {bp.boundary}: {stats['shards']}/{todo} shards, {stats['rows']} "
        f"samples in {stats['seconds']:.1f}s ({tok_s:,.0f} tok/s, {stats['executor']}; first "
        f"shard after {stats['startup_s']:.1f}s; worker seconds: "
        + ", ".join(f"{k[:-2]} {stats[k]:.1f}" for k in PHASES)
        + f") -> {_fps(bp)}"
    )
