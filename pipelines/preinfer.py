"""Stages `preinfer cache build` and `preinfer cache refresh` (Ray Data).

build K:   token rows --(blocks 0..K-1)--> hidden entering block K
refresh K: boundary K-1 cache --(block K-1 alone)--> hidden entering block K

The driver plans the caches (fingerprints, shards still missing), then a Ray Data pipeline
maps shard descriptors over an actor pool. Each actor loads only the blocks it runs (paths
travel, not objects), computes one whole shard per task in micro-batches and writes it itself;
only a small marker comes back. The driver finalizes (manifest last). Rerunning the same
command resumes: shards with a valid done marker are skipped.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from preinfer.checkpoint import Checkpoint
from preinfer.config import Config, config_from_dict
from preinfer.confload import ConfigError
from preinfer.device import ComputeChoice, compute_dtype, compute_dtype_key, torch_dtype
from preinfer.fingerprint import cache_fingerprint
from storage import codecs, fs
from storage.tokens import TokenStore

SPLITS = ("train", "val")
FAULT_ENV = (
    "PREINFER_TEST_DIE_ONCE"  # test-only: path of a marker; the first task to see it absent dies
)
SLOW_ENV = "PREINFER_TEST_SHARD_DELAY_S"  # test-only: each shard task sleeps this long first
PHASES = ("read_s", "compute_s", "write_s")  # a shard's seconds: source rows, blocks, write_shard


@dataclass(kw_only=True)
class CachePlan:
    """One cache to produce: which rows, which fingerprint, which shards are missing."""

    split: str
    fingerprint: str
    indices: np.ndarray
    """(N,) token-store rows of this split that the cache holds, in cache row order."""
    complete: bool
    missing: list[int]


def sample_indices(cfg: Config, store: TokenStore, split: str, round_: int) -> np.ndarray:
    """Rows cached for (split, round): all of val; a deterministic fraction of train."""
    n = store.num_samples(split)
    frac = cfg.preinfer.sample_fraction
    if split == "val" or frac >= 1.0:
        return np.arange(n)
    k = max(1, int(round(n * frac)))
    rng = np.random.default_rng([cfg.train.seed, round_, 7919])
    return np.sort(rng.choice(n, size=k, replace=False))


def row_order(cfg: Config, split: str, round_: int, n: int) -> np.ndarray:
    """Permutation of the split's sampled rows into cache row order.

    The token store packs documents in order, so rows next to each other come from the same
    or neighbouring documents. Train caches store their rows in a seeded random order, so a
    shard (and a batch drawn from a one-shard shuffle buffer) mixes the whole corpus: a
    document-ordered cache trains measurably worse (docs/quality.md, 'Cache batch order').
    Val keeps token order. Every boundary of one (seed, round) shares the order, so refresh
    maps row i of boundary K-1 to row i of boundary K.
    """
    if split == "val":
        return np.arange(n)
    return np.random.default_rng([cfg.train.seed, round_, 104729]).permutation(n)


def sampling_spec(cfg: Config, split: str, round_: int) -> dict:
    if split == "val":
        return {"fraction": 1.0}
    order = {"order": "shuffled", "order_seed": [cfg.train.seed, round_]}
    if cfg.preinfer.sample_fraction >= 1.0:
        return {"fraction": 1.0, **order}
    return {
        "fraction": cfg.preinfer.sample_fraction,
        "seed": cfg.train.seed,
        "round": round_,
        **order,
    }


def codec_spec(cfg: Config) -> dict:
    c = cfg.cache
    return {"codec": c.codec, "shuffle": c.shuffle, "level": c.level, "shard_mb": c.shard_mb}


def compute_choice(cfg: Config) -> ComputeChoice:
    """The dtype the prefix computes in for this config on this machine (see compute_dtype)."""
    return compute_dtype(cfg.preinfer.compute_dtype, cfg.cache.dtype, cfg.run.device)


def fingerprint_for(
    cfg: Config, ckpt: Checkpoint, store: TokenStore, block: int, split: str, round_: int
) -> str:
    return cache_fingerprint(
        tokens=store.fingerprint,
        split=split,
        prefix=ckpt.prefix_hash(block),
        boundary=block,
        model=ckpt.model_config_dict,
        dtype=cfg.cache.dtype,
        codec=codec_spec(cfg),
        sampling=sampling_spec(cfg, split, round_),
        compute=compute_dtype_key(compute_choice(cfg), cfg.cache.dtype),
    )


def cache_meta(
    cfg: Config, ckpt: Checkpoint, store: TokenStore, block: int, split: str, round_: int
) -> dict:
    return {
        "boundary": block,
        "split": split,
        "round": round_,
        "tokens": store.fingerprint,
        "prefix": ckpt.prefix_hash(block),
        "model": ckpt.model_config_dict,
        "sampling": sampling_spec(cfg, split, round_),
        "compute_dtype": compute_choice(cfg).compute,
        "config": cfg.to_dict(),
        "checkpoint": str(fs.path(cfg.run.checkpoint).resolve()),  # a URL stays a URL
    }


def plan_caches(
    cfg: Config, block: int, round_: int = 0, *, create: bool = True, verify: bool = False
) -> list[CachePlan]:
    """Fingerprints and missing shards of the train and val caches at boundary `block`.

    verify: recompute the checksums of a complete cache; shards that fail are planned again
    (a repair rewrites exactly those, then the manifest).
    """
    from storage.cache import CacheWriter, is_complete

    ckpt = Checkpoint.open(cfg.run.checkpoint)
    if not 1 <= block < ckpt.num_blocks:
        raise ConfigError(
            f"--block {block}: a cache exists only for boundaries 1..{ckpt.num_blocks - 1} "
            f"(block 0 trains from tokens; the checkpoint has {ckpt.num_blocks} blocks)"
        )
    store = TokenStore(cfg.data.out_dir)
    plans = []
    for split in SPLITS:
        fp = fingerprint_for(cfg, ckpt, store, block, split, round_)
        sorted_idx = sample_indices(cfg, store, split, round_)  # ascending
        order = row_order(cfg, split, round_, len(sorted_idx))
        idx = sorted_idx[order]
        if is_complete(cfg.cache.root, fp):
            bad = CacheWriter.open(cfg.cache.root, fp).missing_shards(verify=True) if verify else []
            plans.append(
                CachePlan(split=split, fingerprint=fp, indices=idx, complete=not bad, missing=bad)
            )
            continue
        missing: list[int] = []
        if create:
            rows = store.read_indices(split, sorted_idx)[order]  # (N, S+1) int32, row order
            writer = CacheWriter.create(
                cfg.cache.root,
                fp,
                samples={
                    "sample_id": idx.astype(np.int64),
                    "input_ids": rows[:, :-1],
                    "labels": rows[:, 1:],
                },
                seq_len=store.seq_len,
                hidden_size=ckpt.hidden_size,
                cache_cfg=cfg.cache,
                meta=cache_meta(cfg, ckpt, store, block, split, round_),
            )
            missing = writer.missing_shards()
        plans.append(
            CachePlan(split=split, fingerprint=fp, indices=idx, complete=False, missing=missing)
        )
    return plans


class PrefixWorker:
    """Ray actor: runs blocks [first, block) of the checkpoint and writes whole cache shards.

    first = 0 (build, input = token ids) or block-1 (refresh, input = the boundary-(block-1)
    cache). Constructed once per actor from plain data (config dict, paths, and the compute
    dtype the driver resolved, so every actor computes alike).
    """

    def __init__(
        self,
        cfg_dict: dict,
        block: int,
        first: int,
        sources: dict[str, str],
        compute: str,
        round_to: str | None,
    ):
        from preinfer.adapters import forward_blocks
        from preinfer.device import resolve_device
        from preinfer.hostmem import pin_malloc, pinned
        from storage.cache import CacheWriter

        pin_malloc()  # the fp32 weights loaded and cast below go back to the OS when freed

        self.cfg = config_from_dict(cfg_dict)
        self.block, self.first, self.sources = block, first, sources
        self.device = resolve_device(self.cfg.run.device)
        self.dtype = torch_dtype(compute)
        self.round_to = torch_dtype(round_to) if round_to else None
        ckpt = Checkpoint.open(self.cfg.run.checkpoint)
        self.model, self.adapter = ckpt.load(range(first, block), device=self.device)
        self.model.to(self.dtype).eval()
        # compute: glibc's largest (32 MiB) threshold, fixed, so per-micro-batch activations
        # come from the heap (mmap + page faults for each of them halved build throughput)
        if pinned() is not None:  # (not when PREINFER_MALLOC_MMAP_THRESHOLD=0 turned it off)
            pin_malloc(COMPUTE_MMAP_THRESHOLD)
        self.part = ckpt.partition
        self._forward = forward_blocks
        self._open_writer = CacheWriter.open
        self._writers: dict[str, CacheWriter] = {}  # by fingerprint of the cache being written
        self._sources: dict = {}  # fingerprint -> open boundary-(block-1) cache (refresh)
        # [0] reads the next shard's input, [1] encodes + writes the last computed shard
        self._lock = threading.Lock()
        self._helpers = [ThreadPoolExecutor(1, thread_name_prefix=n) for n in ("input", "write")]

    def _maybe_die(self) -> None:
        time.sleep(float(os.environ.get(SLOW_ENV) or 0))  # test-only (a node killed mid-build)
        marker = os.environ.get(FAULT_ENV)
        if marker and not os.path.exists(marker):
            Path(marker).write_text(str(os.getpid()))
            os._exit(1)  # an actor dying on its first shard; Ray restarts it and retries the task

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
                self._maybe_die()
                out["started"].append(time.time())  # wall clock: the driver finds start-up
                t0 = time.perf_counter()
                x, rows, read_s = nxt.result()
                if j + 1 < len(items):
                    nxt = self._helpers[0].submit(self._input, *items[j + 1])
                t1 = time.perf_counter()
                hidden = self._compute(x)
                t2 = time.perf_counter()
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
        return codecs.decode(stored, scale, src.dtype, self.dtype)

    def _source(self, fp: str):
        from storage.reader import open_cache

        src_fp = self.sources[fp]
        if src_fp not in self._sources:
            self._sources[src_fp] = open_cache(
                self.cfg.cache.root, src_fp, expected_fingerprint=src_fp
            )
        return self._sources[src_fp]


COMPUTE_MMAP_THRESHOLD = 32 * 2**20
SHARDS_PER_TASK = int(os.environ.get("PREINFER_SHARDS_PER_TASK") or 2)


def shards_per_task(shards: int, actors: int) -> int:
    """Shards per actor call: SHARDS_PER_TASK (a call pipelines its shards: the next input is
    read while one computes, the last is written while the next computes), fewer when there
    are under two calls per actor (so no actor idles while another works through a long call)."""
    return max(1, min(SHARDS_PER_TASK, shards // (2 * actors)))


def actor_env() -> dict[str, str]:
    """Environment of the worker processes: the allocator's (hostmem.worker_env: two malloc
    arenas, so a worker's peak depends less on which thread freed what) and the test-only
    fault switches when set."""
    from preinfer.hostmem import worker_env

    return {**worker_env(), **{k: os.environ[k] for k in (FAULT_ENV, SLOW_ENV) if k in os.environ}}


def _run_workers(
    cfg: Config,
    plans: list[CachePlan],
    block: int,
    first: int,
    sources: dict[str, str],
    seq_len: int,
    log,
) -> dict:
    """Map missing shards over the actor pool; returns counts and timing."""
    import ray

    from pipelines.ray_env import actor_resources, ensure_ray

    items = [{"fingerprint": p.fingerprint, "shard": s} for p in plans for s in p.missing]
    if not items:
        return {"shards": 0, "rows": 0, "seconds": 0.0, "startup_s": 0.0,
                **dict.fromkeys(PHASES, 0.0)}  # fmt: skip
    ensure_ray()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    choice = compute_choice(cfg)
    log(f"  compute dtype {choice.compute} ({choice.reason})")
    pool = min(cfg.preinfer.actors, len(items))
    per_task = shards_per_task(len(items), pool)
    env = actor_env()
    with warnings.catch_warnings():
        # restart/retry bounds are only accepted as (deprecated) free-form remote args
        warnings.simplefilter("ignore")
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            PrefixWorker,
            fn_constructor_kwargs={
                "cfg_dict": cfg.to_dict(),
                "block": block,
                "first": first,
                "sources": sources,
                "compute": choice.compute,
                "round_to": choice.round_to,
            },
            batch_size=per_task,
            compute=ray.data.ActorPoolStrategy(size=pool),
            runtime_env={"env_vars": env} if env else None,
            max_restarts=cfg.preinfer.max_restarts,
            max_task_retries=cfg.preinfer.max_task_retries,
            **actor_resources(cfg),
        )
    t0, wall0 = time.perf_counter(), time.time()
    rows = shards = 0
    phases = dict.fromkeys(PHASES, 0.0)
    first = float("inf")  # wall clock of the first shard any actor began (after its start-up)
    bar = tqdm(total=len(items), desc=f"preinfer block {block}", unit="shard", disable=None)
    for rec in ds.iter_rows():
        shards += 1
        rows += int(rec["rows"])
        for k in PHASES:
            phases[k] += float(rec[k])
        first = min(first, float(rec["started"]))
        bar.update(1)
        bar.set_postfix(tok_s=f"{rows * seq_len / (time.perf_counter() - t0):,.0f}")
    bar.close()
    # startup_s: job start to the first shard begun (actor processes, imports, weight loading)
    return {"shards": shards, "rows": rows, "seconds": time.perf_counter() - t0,
            "startup_s": max(0.0, first - wall0) if shards else 0.0, **phases}  # fmt: skip


def _finish(cfg: Config, plans: list[CachePlan]) -> None:
    from storage.cache import CacheWriter

    for p in plans:
        if not p.complete:
            CacheWriter.open(cfg.cache.root, p.fingerprint).finalize()


def build_cache(
    cfg: Config, block: int, round_: int = 0, *, verify: bool = False, log=print
) -> dict:
    """Hidden states entering `block` for train and val, from tokens through blocks 0..block-1.

    verify: also check a complete cache's shards and rewrite any that fail (repair).
    """
    _guard_disk(cfg, block, round_)
    plans = plan_caches(cfg, block, round_, verify=verify)
    todo = sum(len(p.missing) for p in plans)
    if all(p.complete for p in plans):
        log(f"cache build: boundary {block} is current ({_fps(plans)}); nothing to do")
        return {"action": "reused", **_result(plans)}
    store = TokenStore(cfg.data.out_dir)
    stats = _run_workers(cfg, plans, block, 0, {}, store.seq_len, log)
    _finish(cfg, plans)
    _log_done(log, "build", block, plans, stats, todo, store.seq_len)
    return {"action": "built", **_result(plans), **stats}


def refresh_cache(cfg: Config, block: int, round_: int = 0, *, log=print) -> dict:
    """Boundary `block` from the complete boundary block-1 cache, running block-1 alone."""
    from storage.cache import is_complete

    if block < 2:
        raise ConfigError(
            f"--block {block}: refresh needs a boundary-{block - 1} cache; "
            "boundary 1 is built from tokens with `cache build --block 1`"
        )
    prev = plan_caches(cfg, block - 1, round_, create=False)
    stale = [p for p in prev if not is_complete(cfg.cache.root, p.fingerprint)]
    if stale:
        raise ConfigError(
            f"no current boundary-{block - 1} cache for the checkpoint as it is now "
            f"(missing {', '.join(f'{p.split} {p.fingerprint}' for p in stale)}); "
            f"run `preinfer cache build --block {block - 1}` or `cache build --block {block}`"
        )
    _guard_disk(cfg, block, round_)
    plans = plan_caches(cfg, block, round_)
    if all(p.complete for p in plans):
        log(f"cache refresh: boundary {block} is current ({_fps(plans)}); nothing to do")
        return {"action": "reused", **_result(plans)}
    todo = sum(len(p.missing) for p in plans)
    sources = {p.fingerprint: q.fingerprint for p, q in zip(plans, prev, strict=True)}
    store = TokenStore(cfg.data.out_dir)
    stats = _run_workers(cfg, plans, block, block - 1, sources, store.seq_len, log)
    _finish(cfg, plans)
    _log_done(log, "refresh", block, plans, stats, todo, store.seq_len)
    return {"action": "refreshed", **_result(plans), **stats}


def _guard_disk(cfg: Config, block: int, round_: int) -> None:
    """Refuse before anything is written when the boundary's caches cannot fit the free disk."""
    from preinfer.guards import check_disk_for_cache

    if not all(p.complete for p in plan_caches(cfg, block, round_, create=False)):
        check_disk_for_cache(cfg, block)


def _fps(plans: list[CachePlan]) -> str:
    return ", ".join(f"{p.split} {p.fingerprint[:12]}" for p in plans)


def _result(plans: list[CachePlan]) -> dict:
    return {"fingerprints": {p.split: p.fingerprint for p in plans}}


def _log_done(log, what, block, plans, stats, todo, seq_len) -> None:
    tok_s = stats["rows"] * seq_len / max(stats["seconds"], 1e-9)
    log(
        f"cache {what}: boundary {block}: {stats['shards']}/{todo} shards, {stats['rows']} samples "
        f"in {stats['seconds']:.1f}s ({tok_s:,.0f} tok/s; actors ready after "
        f"{stats['startup_s']:.1f}s; worker seconds: "
        + ", ".join(f"{k[:-2]} {stats[k]:.1f}" for k in PHASES)
        + f") -> {_fps(plans)}"
    )
