"""Stages `preinfer cache build` and `preinfer cache refresh` (in process, or Ray Data).

build K:   token rows --(blocks 0..K-1)--> hidden entering block K
refresh K: boundary K-1 cache --(block K-1 alone)--> hidden entering block K

The driver plans the caches (preinfer.cache_identity: fingerprints, shards still missing),
then runs PrefixWorker over them: in this process for a local build (no actor start-up), or
as a Ray Data pipeline mapping shard descriptors over an actor pool (a cluster job). Each actor loads only the blocks it runs (paths
travel, not objects), computes one whole shard per task in micro-batches and writes it itself;
only a small marker comes back. The driver finalizes (manifest last). Rerunning the same
command resumes: shards with a valid done marker are skipped.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from tqdm import tqdm

from core import faults
from core.config import ConfigError
from pipelines.ray_env import actor_resources, ensure_ray
from preinfer import hostmem
from preinfer.adapters import forward_blocks
from preinfer.cache_identity import CachePlan, Sources, compute_choice, plan_caches
from preinfer.checkpoint import Checkpoint
from preinfer.config import Config, config_from_dict
from preinfer.device import resolve_device, torch_dtype
from preinfer.guards import check_disk_for_cache
from storage.cache import CacheWriter
from storage.layout import is_complete
from storage.reader import open_cache
from storage.values import decode

PHASES = ("read_s", "compute_s", "write_s")  # a shard's seconds: source rows, blocks, write_shard


class PrefixWorker:
    """Ray actor: runs blocks [first, block) of the checkpoint and writes whole cache shards.

    first = 0 (build, input = token ids) or block-1 (refresh, input = the boundary-(block-1)
    cache). Constructed once per actor from plain data (config dict, paths, and the compute
    dtype the driver resolved, so every actor computes alike). on_phase (in-process callers
    only, e.g. a memory benchmark; never sent to Ray): called with "load" once the weights are
    loaded, then per shard "input" when its input is in hand and "compute" after its forward.
    """

    def __init__(
        self,
        cfg_dict: dict,
        block: int,
        first: int,
        sources: dict[str, str],
        compute: str,
        round_to: str | None,
        pin: bool = True,
        on_phase: Callable[[str], None] | None = None,
    ):
        self.cfg = config_from_dict(cfg_dict)
        pin = pin and self.cfg.preinfer.malloc_mmap_threshold_mb > 0
        if pin:  # a worker process of its own (not the driver): its allocator is ours to set
            # the fp32 weights loaded and cast below go back to the OS when freed
            hostmem.pin_malloc(int(self.cfg.preinfer.malloc_mmap_threshold_mb * 2**20))
        self.block, self.first, self.sources = block, first, sources
        self.device = resolve_device(self.cfg.run.device)
        self.dtype = torch_dtype(compute)
        self.round_to = torch_dtype(round_to) if round_to else None
        ckpt = Checkpoint.open(self.cfg.run.checkpoint)
        self.model, self.adapter = ckpt.load(range(first, block), device=self.device)
        self.model.to(self.dtype).eval()
        # compute: glibc's largest (32 MiB) threshold, fixed, so per-micro-batch activations
        # come from the heap (mmap + page faults for each of them halved build throughput)
        if pin and hostmem.pinned() is not None:
            hostmem.pin_malloc(COMPUTE_MMAP_THRESHOLD)
        self.part = ckpt.partition
        self._forward = forward_blocks
        self._open_writer = CacheWriter.open
        self._writers: dict[str, CacheWriter] = {}  # by fingerprint of the cache being written
        self._sources: dict = {}  # fingerprint -> open boundary-(block-1) cache (refresh)
        # [0] reads the next shard's input, [1] encodes + writes the last computed shard
        self._lock = threading.Lock()
        self._helpers = [ThreadPoolExecutor(1, thread_name_prefix=n) for n in ("input", "write")]
        self.on_phase = on_phase
        if on_phase is not None:
            on_phase("load")

    def close(self) -> None:
        for h in self._helpers:
            h.shutdown(wait=True)

    @torch.inference_mode()
    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        """(n, S) ids or (n, S, H) hidden -> (n, S, H) hidden entering `block`, in micro-batches,
        one block at a time: with round_to set, each block's output (B, S, H) is rounded to the
        stored dtype, so the hidden entering every block is what a cache of it would hold."""
        mb = self.cfg.preinfer.micro_batch
        outs = []
        for i in range(0, len(x), mb):
            xi = x[i : i + mb].to(self.device)
            if xi.is_floating_point():
                xi = xi.to(self.dtype)
            for b in range(self.first, self.block):
                xi = self._forward(self.adapter, self.part, xi, b, b + 1)
                if self.round_to is not None:
                    xi = (
                        xi.to(self.round_to)
                        if b == self.block - 1
                        else xi.to(self.round_to).to(self.dtype)
                    )
            outs.append(xi.cpu())
        return torch.cat(outs)

    def __call__(self, batch: dict) -> dict:
        """Compute and write the batch's shards; every one is written and committed (marker
        on disk) before this returns. Pipelined on two helper threads: the next shard's input
        is read (and decompressed) while this one computes, and a computed shard is encoded
        and written while the next computes (one in flight: memory stays ~3 shards)."""
        items = [(fp, int(s)) for fp, s in zip(batch["fingerprint"], batch["shard"], strict=True)]
        out = {k: [] for k in ("fingerprint", "shard", "rows", "seconds", "started", *PHASES)}
        writing: Future | None = None
        try:
            nxt = self._helpers[0].submit(self._input, *items[0])
            for j, (fp, shard) in enumerate(items):
                faults.shard_task_started()
                out["started"].append(time.time())  # wall clock: the driver finds start-up
                t0 = time.perf_counter()
                x, rows, read_s = nxt.result()
                if j + 1 < len(items):
                    nxt = self._helpers[0].submit(self._input, *items[j + 1])
                if self.on_phase is not None:
                    self.on_phase("input")
                t1 = time.perf_counter()
                hidden = self._compute(x)
                t2 = time.perf_counter()
                if self.on_phase is not None:
                    self.on_phase("compute")
                if writing is not None:
                    out["write_s"].append(writing.result())  # the previous shard is committed
                writing = self._helpers[1].submit(self._write, fp, shard, hidden)
                out["fingerprint"].append(fp)
                out["shard"].append(shard)
                out["rows"].append(rows)
                out["seconds"].append(t2 - t0)  # + its write, below
                out["read_s"].append(read_s)
                out["compute_s"].append(t2 - t1)
            out["write_s"].append(writing.result())
            writing = None
        finally:
            if writing is not None:
                writing.exception()  # an error elsewhere: let the write finish (or fail) first
        out["seconds"] = [s + w for s, w in zip(out["seconds"], out["write_s"], strict=True)]
        return {k: np.asarray(v) for k, v in out.items()}

    def _writer(self, fp: str):
        with self._lock:  # the helper threads ask too
            if fp not in self._writers:
                self._writers[fp] = self._open_writer(self.cfg.cache.root, fp)
            return self._writers[fp]

    def _input(self, fp: str, shard: int) -> tuple[torch.Tensor, int, float]:
        """(input rows of shard `shard` of cache `fp`, their count, seconds): token ids (n, S)
        long for a build, boundary-(block-1) hidden (n, S, H) for a refresh."""
        t0 = time.perf_counter()
        start, stop = self._writer(fp).shard_range(shard)
        if self.first == 0:
            ids = self._writer(fp).read_input_ids(start, stop)
            x = torch.from_numpy(np.array(ids)).long()  # (n, S)
        else:
            x = self._read_source(fp, start, stop)  # (n, S, H) in the cache dtype
        return x, stop - start, time.perf_counter() - t0

    def _write(self, fp: str, shard: int, hidden: torch.Tensor) -> float:
        t0 = time.perf_counter()
        self._writer(fp).write_shard(shard, hidden)
        return time.perf_counter() - t0

    def _read_source(self, fp: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the boundary-(block-1) cache as (n, S, H) in the cache dtype:
        its stored values only (no labels), a view of them when they are stored in that dtype
        (bf16 bits, fp16, fp32: no decode to fp32 and back)."""
        src = self._source(fp)
        stored, scale = src.read_stored(start, stop)
        return decode(stored, scale, src.dtype, self.dtype)

    def _source(self, fp: str):
        src_fp = self.sources[fp]
        if src_fp not in self._sources:
            self._sources[src_fp] = open_cache(
                self.cfg.cache.root, src_fp, expected_fingerprint=src_fp
            )
        return self._sources[src_fp]


COMPUTE_MMAP_THRESHOLD = 32 * 2**20


def shards_per_task(cfg: Config, shards: int, actors: int) -> int:
    """Shards per worker call: preinfer.shards_per_task (a call pipelines its shards: the next
    input is read while one computes, the last is written while the next computes), fewer when
    there are under two calls per actor (so no actor idles while another works through a long
    call)."""
    return max(1, min(cfg.preinfer.shards_per_task, shards // (2 * actors)))


def actor_env(cfg: Config) -> dict[str, str]:
    """Environment of the worker processes: the allocator's (hostmem.worker_env: a few malloc
    arenas, so a worker's peak depends less on which thread freed what) and the test-fault
    switches when set."""
    return {**hostmem.worker_env(cfg.preinfer.malloc_arenas), **faults.worker_env()}


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
) -> dict:
    """Compute every missing shard (locally or over the actor pool); counts and timing."""
    items = [{"fingerprint": p.fingerprint, "shard": s} for p in plans for s in p.missing]
    if not items:
        return {"shards": 0, "rows": 0, "seconds": 0.0, "startup_s": 0.0, "executor": "none",
                **dict.fromkeys(PHASES, 0.0)}  # fmt: skip
    choice = compute_choice(cfg)
    where = executor(cfg)
    log(f"  compute dtype {choice.compute} ({choice.reason}); executor {where}")
    worker_kw = {"cfg_dict": cfg.to_dict(), "block": block, "first": first, "sources": sources,
                 "compute": choice.compute, "round_to": choice.round_to}  # fmt: skip
    t0, wall0 = time.perf_counter(), time.time()
    if where == "local":
        records = _local_records(cfg, items, worker_kw)
    else:
        records = _ray_records(cfg, items, worker_kw)
    rows = shards = 0
    phases = dict.fromkeys(PHASES, 0.0)
    first_start = float("inf")  # wall clock of the first shard any worker began
    bar = tqdm(total=len(items), desc=f"preinfer block {block}", unit="shard", disable=None)
    for rec in records:
        shards += 1
        rows += int(rec["rows"])
        for k in PHASES:
            phases[k] += float(rec[k])
        first_start = min(first_start, float(rec["started"]))
        bar.update(1)
        bar.set_postfix(tok_s=f"{rows * seq_len / (time.perf_counter() - t0):,.0f}")
    bar.close()
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
    import ray

    ensure_ray(cfg.run.verbose)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    pool = min(cfg.preinfer.actors, len(items))
    env = actor_env(cfg)
    with warnings.catch_warnings():
        # restart/retry bounds are only accepted as (deprecated) free-form remote args
        warnings.simplefilter("ignore")
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            PrefixWorker,
            fn_constructor_kwargs=worker_kw,
            batch_size=shards_per_task(cfg, len(items), pool),
            compute=ray.data.ActorPoolStrategy(size=pool),
            runtime_env={"env_vars": env} if env else None,
            max_restarts=cfg.preinfer.max_restarts,
            max_task_retries=cfg.preinfer.max_task_retries,
            **actor_resources(cfg),
        )
    yield from ds.iter_rows()


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
    verify: bool = False,
    log=print,
    src: Sources | None = None,
) -> dict:
    """Hidden states entering `block` for train and val, from tokens through blocks 0..block-1.

    verify: also check a complete cache's shards and rewrite any that fail (repair). src: the
    checkpoint and token store, when the caller has them open.
    """
    t0 = time.perf_counter()
    src = src or Sources.open(cfg)
    _guard_disk(cfg, block, round_, src)
    plans = plan_caches(cfg, block, round_, verify=verify, src=src)
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
    cfg: Config, block: int, round_: int = 0, *, log=print, src: Sources | None = None
) -> dict:
    """Boundary `block` from the complete boundary block-1 cache, running block-1 alone."""
    t0 = time.perf_counter()
    if block < 2:
        raise ConfigError(
            f"--block {block}: refresh needs a boundary-{block - 1} cache; "
            "boundary 1 is built from tokens with `cache build --block 1`"
        )
    src = src or Sources.open(cfg)
    prev = plan_caches(cfg, block - 1, round_, create=False, src=src)
    stale = [p for p in prev if not is_complete(cfg.cache.root, p.fingerprint)]
    if stale:
        raise ConfigError(
            f"no current boundary-{block - 1} cache for the checkpoint as it is now "
            f"(missing {', '.join(f'{p.split} {p.fingerprint}' for p in stale)}); "
            f"run `preinfer cache build --block {block - 1}` or `cache build --block {block}`"
        )
    _guard_disk(cfg, block, round_, src)
    plans = plan_caches(cfg, block, round_, src=src)
    if all(p.complete for p in plans):
        log(f"cache refresh: boundary {block} is current ({_fps(plans)}); nothing to do")
        return {"action": "reused", **_result(plans)}
    todo = sum(len(p.missing) for p in plans)
    sources = {p.fingerprint: q.fingerprint for p, q in zip(plans, prev, strict=True)}
    stats = _run_workers(cfg, plans, block, block - 1, sources, src.store.seq_len, log)
    stats["finalize_s"] = _finish(cfg, plans)
    stats["plan_s"] = time.perf_counter() - t0 - stats["seconds"] - stats["finalize_s"]
    _log_done(log, "refresh", block, plans, stats, todo, src.store.seq_len)
    return {"action": "refreshed", **_result(plans), **stats}


def _guard_disk(cfg: Config, block: int, round_: int, src: Sources) -> None:
    """Refuse before anything is written when the boundary's caches cannot fit the free disk."""

    if not all(p.complete for p in plan_caches(cfg, block, round_, create=False, src=src)):
        check_disk_for_cache(cfg, block)


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
