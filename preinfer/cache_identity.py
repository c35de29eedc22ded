"""Cache identity: which rows a boundary cache holds, its fingerprint and its meta.

A round's visits read a per-(seed, round) sample of the train split sized by train.epochs and
train.cache_visits (`visit_budget`), in a seeded row order every boundary of the round shares;
each visit reads its own window of it (`visit_window`). A boundary cache holds the windows of
the visits it serves (`boundary_visits`, `boundary_rows`): its own visit's and those of the
boundaries refreshed from it before a block below it trains, so at cache_visits M an ascending
round's boundary K holds M-K windows, not M (a refresh maps each row of K to the same sample's
row of K-1). It also holds the val rows the in-visit evaluations read. `plan_caches` turns that into fingerprints and the
shards still missing; the trainer, the rotation and the Ray stage all ask it, never each other.
Also the `preinfer:` config section (the library reads sample_fraction, compute_dtype and
micro_batch; the Ray stage the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from core.config import ConfigError
from core.fingerprint import cache_fingerprint
from preinfer.checkpoint import Checkpoint
from preinfer.device import ComputeChoice, compute_dtype, compute_dtype_key
from preinfer.trainer import round_blocks, visit_position
from storage import fs
from storage.cache import CacheWriter
from storage.layout import is_complete
from storage.tokens import TokenStore

SPLITS = ("train", "val")


@dataclass(kw_only=True)
class PreinferConfig:
    actors: int = 2
    """Size of the Ray actor pool running the prefix."""
    cpus_per_actor: float = 0.5
    """CPUs each actor asks Ray for when no GPU is present (fractional keeps the read stage alive)."""
    gpus_per_actor: float = 1.0
    """GPUs each actor asks for when GPUs exist."""
    micro_batch: int = 16
    """Samples per forward call inside an actor."""
    executor: Literal["auto", "local", "ray"] = "auto"
    """Where the prefix runs: local = this process; ray = an actor pool; auto = ray for a Ray cluster job (RAY_ADDRESS) or several GPUs, else local."""
    malloc_mmap_threshold_mb: float = 4.0
    """glibc mmap threshold (MiB) a worker process pins while it loads weights (32 MiB for compute), so freed weights leave RSS; 0 = allocator untouched."""
    malloc_arenas: int = 2
    """glibc malloc arenas of a worker process (MALLOC_ARENA_MAX; fewer = a steadier peak); 0 = glibc's default."""
    shards_per_task: int = 2
    """Cache shards per worker call (a call pipelines read, compute and write of its shards)."""
    write_queue: int = 4
    """Micro-batches a worker holds computed but not yet compressed (a bounded queue: each is compressed on cache.codec_threads threads while the next computes); 0 = compress each shard whole once computed."""
    sample_fraction: float = 1.0
    """Fraction of train samples cached per round (deterministic per seed and round; part of the fingerprint)."""
    compute_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Dtype the prefix computes in; auto = the cache dtype where the device runs it fast
    (CUDA, AMX-BF16 CPUs), else fp32 rounded to the cache dtype at each block boundary."""
    max_restarts: int = 2
    """How often a dead actor is restarted."""
    max_task_retries: int = -1
    """How often a failed shard task is retried; -1: while its actor lives or is restarted (so
    within max_restarts). A lost node fails its in-flight tasks fast and repeatedly ("actor
    unavailable") until Ray declares it dead: a small bound is spent in that second."""

    def __post_init__(self):
        for name in ("actors", "micro_batch", "shards_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"preinfer.{name} must be >= 1, got {getattr(self, name)}")
        if self.write_queue < 0:
            raise ConfigError(
                f"preinfer.write_queue must be >= 0 (0 = compress whole shards), got "
                f"{self.write_queue}"
            )
        if not 0.0 < self.sample_fraction <= 1.0:
            raise ConfigError(
                f"preinfer.sample_fraction must be in (0, 1], got {self.sample_fraction}"
            )
        if self.malloc_mmap_threshold_mb < 0 or self.malloc_arenas < 0:
            raise ConfigError(
                "preinfer.malloc_mmap_threshold_mb and preinfer.malloc_arenas must be >= 0 "
                "(0 = glibc's default)"
            )
        if self.cpus_per_actor <= 0:
            raise ConfigError(f"preinfer.cpus_per_actor must be > 0, got {self.cpus_per_actor}")
        if self.max_restarts < 0:
            raise ConfigError(f"preinfer.max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_task_retries < -1:
            raise ConfigError(
                f"preinfer.max_task_retries must be >= 0, or -1 (unbounded), got "
                f"{self.max_task_retries}"
            )


@dataclass(frozen=True)
class VisitBudget:
    """What one bcd visit of a round reads, decided once from the config and the token store."""

    rows: int
    """Train rows a round's boundary caches hold (and its visits read), per (seed, round)."""
    visit_rows: int
    """Train rows one visit reads: a window of the round's rows (all of them at cache_visits 1)."""
    steps: int
    """Optimizer steps of the visit."""
    val_rows: int
    """Val rows its evaluations read (the first ones: evaluation reads val in order)."""
    n_train: int
    n_val: int
    batch_size: int
    why: str
    """One line: how rows and steps were chosen."""

    @property
    def passes(self) -> float:
        """Passes over the visit's rows that its steps make."""
        return self.steps * self.batch_size / max(self.visit_rows, 1)


def visit_budget(cfg, n_train: int, n_val: int) -> VisitBudget:
    """The one rule for a visit's rows and steps, and a round's cached rows.

    train.epochs = E: a visit reads V = min(N_train x sample_fraction, max_steps x batch / E)
    rows (at least one batch), steps = min(max_steps, ceil(E x V / batch)): every row it reads
    is read E times, and a step cap below one pass shrinks the rows, never the passes. The
    round caches R = min(N_train x sample_fraction, floor(train.cache_visits x V)) rows, and
    its visits read successive V-row windows of them (visit_window): cache_visits 1 = every
    visit the same rows, the smallest cache; cache_visits M = each visit rows of its own where
    the train split holds M x V. train.epochs = null: every sampled row (N_train x
    sample_fraction), in every visit, and max_steps steps (rows read any number of times, or
    never). Val: the first eval_batches x batch rows (all of val when eval_batches = 0).
    """
    tc, B = cfg.train, cfg.train.batch_size
    cap = max(1, round(n_train * cfg.preinfer.sample_fraction))
    if tc.epochs is None:
        rows, steps = cap, tc.max_steps
        visit_rows = rows
        why = f"train.epochs=null: every sampled row ({rows} of {n_train}), {steps} steps"
    else:
        want = max(B, math.floor(tc.max_steps * B / tc.epochs))
        visit_rows = min(cap, want)
        steps = min(tc.max_steps, math.ceil(tc.epochs * visit_rows / B))
        rows = min(cap, max(visit_rows, math.floor(tc.cache_visits * visit_rows)))
        limit = (
            f"max_steps {tc.max_steps} x batch {B} / epochs {tc.epochs:g}"
            if want < cap
            else f"{n_train} train rows x sample_fraction {cfg.preinfer.sample_fraction:g}"
        )
        why = f"{visit_rows} of {n_train} train rows ({limit}), {steps} steps"
        if tc.cache_visits != 1:
            why += (
                f"; the round samples {rows} rows (cache_visits {tc.cache_visits:g}"
                + (
                    f", capped by {cap} sampled rows"
                    if rows == cap < tc.cache_visits * visit_rows
                    else ""
                )
                + "), visits read successive windows of them, and a boundary caches the "
                "windows of the visits it serves"
            )
    val_rows = n_val if not tc.eval_batches else min(n_val, tc.eval_batches * B)
    why += f"; {val_rows} of {n_val} val rows" + (
        f" (eval_batches {tc.eval_batches} x batch {B})" if val_rows < n_val else ""
    )
    return VisitBudget(rows=rows, visit_rows=visit_rows, steps=steps, val_rows=val_rows,
                       n_train=n_train, n_val=n_val, batch_size=B, why=why)  # fmt: skip


def visit_window(budget: VisitBudget, position: int) -> tuple[int, int]:
    """(start, rows) of the window of the round's cached train rows (cache row order) that the
    visit at `position` in its round reads: rows start, start+1, ... wrapping at budget.rows.
    Successive visits take successive windows, so they read different rows until the round's
    rows run out (then they wrap around to the first ones)."""
    return position * budget.visit_rows % budget.rows, budget.visit_rows


def boundary_visits(cfg, M: int, round_: int, block: int, position: int | None = None) -> list[int]:
    """Positions (in round `round_`'s block order, train.order) of the visits a boundary-`block`
    cache serves when it is made for the visit at `position` (None: block `block`'s own visit):
    the longest run of positions around it whose blocks are all >= `block`. Within that run
    no block below `block` trains, so the cache stays current; every visit of the run reads it
    or a boundary refreshed from it. ascending: K..M-1; descending: 0..M-1-K (the round makes
    all its boundaries first); random: the run around the visit. The run does not depend on
    which of its positions asks, so a resumed round plans the caches it made before."""
    order = round_blocks(cfg.train, M, round_)
    q = visit_position(cfg.train, M, round_, block) if position is None else position
    if not (0 <= q < M and order[q] >= block):
        raise ConfigError(
            f"the visit at position {position} of round {round_} (blocks {order}) does not read "
            f"a boundary-{block} cache: it trains a block below {block}"
        )
    lo, hi = q, q
    while lo > 0 and order[lo - 1] >= block:
        lo -= 1
    while hi + 1 < M and order[hi + 1] >= block:
        hi += 1
    return list(range(lo, hi + 1))


def boundary_rows(budget: VisitBudget, visits: list[int]) -> np.ndarray:
    """Ascending positions, among the round's budget.rows train rows (cache row order), that a
    boundary serving the visits at `visits` holds: the union of their windows. A window keeps
    its cyclic order in it, so a visit reads the same rows in the same order from any cache
    that holds its window (`cache_window`)."""
    R = budget.rows
    got = [(visit_window(budget, p)[0] + np.arange(budget.visit_rows)) % R for p in visits]
    return np.unique(np.concatenate(got)) if got else np.arange(0)


def cache_window(budget: VisitBudget, held: np.ndarray, position: int) -> tuple[int, int]:
    """(start, rows) of the visit at `position`'s window among a boundary cache's rows, when
    the cache holds the round's rows `held` (boundary_rows): rows start, start+1, ... wrapping
    at len(held)."""
    start, n = visit_window(budget, position)
    i = int(np.searchsorted(held, start))
    if i >= len(held) or held[i] != start or n > len(held):
        raise ConfigError(
            f"the boundary cache holds {len(held)} of the round's {budget.rows} train rows, not "
            f"the window [{start}, +{n}) of the visit at position {position}"
        )
    return i, n


def store_budget(cfg, store: TokenStore) -> VisitBudget:
    return visit_budget(cfg, store.num_samples("train"), store.num_samples("val"))


def sample_indices(cfg, budget: VisitBudget, split: str, round_: int) -> np.ndarray:
    """Token-store rows of (split, round) that the visit reads, ascending: the first val_rows of
    val; a deterministic per-(seed, round) sample of budget.rows train rows."""
    if split == "val":
        return np.arange(budget.val_rows)
    n, k = budget.n_train, budget.rows
    if k >= n:
        return np.arange(n)
    rng = np.random.default_rng([cfg.train.seed, round_, 7919])
    return np.sort(rng.choice(n, size=k, replace=False))


def row_order(cfg, split: str, round_: int, n: int) -> np.ndarray:
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


def visit_data_seed(cfg, round_: int, block: int) -> int:
    """The seed of a bcd visit's batch order (the shuffle of its rows), per (train.seed, round,
    block)."""
    return (cfg.train.seed * 1000 + round_) * 1000 + block


def visit_train_rows(cfg, budget: VisitBudget, round_: int, position: int) -> np.ndarray:
    """Token-store train row indices a bcd visit reads, in the order its boundary cache holds
    them: the round's sampled rows (sample_indices) in cache row order (row_order), and of
    them the window of the visit at `position` in its round (visit_window). A visit from the
    cache reads the same rows at cache indices [start, start + rows) (wrapping)."""
    rows = sample_indices(cfg, budget, "train", round_)
    rows = rows[row_order(cfg, "train", round_, len(rows))]
    start, n = visit_window(budget, position)
    return rows if n >= len(rows) else rows[(start + np.arange(n)) % len(rows)]


def sampling_spec(
    cfg, budget: VisitBudget, split: str, round_: int, visits: list[int] | None = None
) -> dict:
    """The fingerprint's record of which rows: as before train.epochs existed where the rows
    are the ones that rule gave (those caches keep their fingerprints), plus `rows` otherwise,
    plus `windows` (the visits served) where a train cache holds only some of the round's rows."""
    if split == "train" and visits is not None:
        held = len(boundary_rows(budget, visits))
        if held < budget.rows:
            return {**sampling_spec(cfg, budget, split, round_),
                    "windows": {"visits": visits, "rows": held}}  # fmt: skip
    if split == "val":
        rows = {"rows": budget.val_rows} if budget.val_rows < budget.n_val else {}
        return {"fraction": 1.0, **rows}
    order = {"order": "shuffled", "order_seed": [cfg.train.seed, round_]}
    frac = cfg.preinfer.sample_fraction
    legacy = budget.n_train if frac >= 1.0 else max(1, round(budget.n_train * frac))
    rows = {"rows": budget.rows} if budget.rows != legacy else {}
    if frac >= 1.0 and not rows:
        return {"fraction": 1.0, **order}
    return {"fraction": frac, "seed": cfg.train.seed, "round": round_, **order, **rows}


def codec_spec(cfg) -> dict:
    c = cfg.cache
    return {"codec": c.codec, "shuffle": c.shuffle, "level": c.level, "shard_mb": c.shard_mb}


def compute_choice(cfg) -> ComputeChoice:
    """The dtype the prefix computes in for this config on this machine (see compute_dtype)."""
    return compute_dtype(cfg.preinfer.compute_dtype, cfg.cache.dtype, cfg.run.device)


@dataclass(kw_only=True)
class CachePlan:
    """One cache to produce: which rows, which fingerprint, which shards are missing."""

    split: str
    fingerprint: str
    indices: np.ndarray
    """(N,) token-store rows of this split that the cache holds, in cache row order."""
    complete: bool
    missing: list[int]


@dataclass
class Sources:
    """The checkpoint and token store a plan reads, opened once per rotation step."""

    ckpt: Checkpoint
    store: TokenStore
    budget: VisitBudget

    @classmethod
    def open(cls, cfg) -> Sources:
        store = TokenStore(cfg.data.out_dir)
        return cls(Checkpoint.open(cfg.run.checkpoint), store, store_budget(cfg, store))


def fingerprint_for(
    cfg, src: Sources, block: int, split: str, round_: int, visits: list[int] | None = None
) -> str:
    return cache_fingerprint(
        tokens=src.store.fingerprint,
        split=split,
        prefix=src.ckpt.prefix_hash(block),
        boundary=block,
        model=src.ckpt.model_config_dict,
        dtype=cfg.cache.dtype,
        codec=codec_spec(cfg),
        sampling=sampling_spec(cfg, src.budget, split, round_, visits),
        compute=compute_dtype_key(compute_choice(cfg), cfg.cache.dtype),
    )


def cache_meta(
    cfg, src: Sources, block: int, split: str, round_: int, visits: list[int] | None = None
) -> dict:
    return {
        "boundary": block,
        "split": split,
        "round": round_,
        "tokens": src.store.fingerprint,
        "prefix": src.ckpt.prefix_hash(block),
        "model": src.ckpt.model_config_dict,
        "sampling": sampling_spec(cfg, src.budget, split, round_, visits),
        "budget": src.budget.why,
        "compute_dtype": compute_choice(cfg).compute,
        "config": cfg.to_dict(),
        "checkpoint": str(fs.path(cfg.run.checkpoint).resolve()),  # a URL stays a URL
    }


def plan_caches(
    cfg,
    block: int,
    round_: int = 0,
    *,
    position: int | None = None,
    create: bool = True,
    verify: bool = False,
    src: Sources | None = None,
) -> list[CachePlan]:
    """Fingerprints and missing shards of the train and val caches at boundary `block`, made
    for the visit at `position` of the round (None: block `block`'s own; boundary_visits).

    create: open (or create) the caches' writers, so `missing` lists the shards to compute;
    verify: recompute the checksums of a complete cache; shards that fail are planned again
    (a repair rewrites exactly those, then the manifest). src: the checkpoint and token store,
    when the caller has them open.
    """
    src = src or Sources.open(cfg)
    if not 1 <= block < src.ckpt.num_blocks:
        raise ConfigError(
            f"--block {block}: a cache exists only for boundaries 1..{src.ckpt.num_blocks - 1} "
            f"(block 0 trains from tokens; the checkpoint has {src.ckpt.num_blocks} blocks)"
        )
    visits = boundary_visits(cfg, src.ckpt.num_blocks, round_, block, position)
    plans = []
    for split in SPLITS:
        fp = fingerprint_for(cfg, src, block, split, round_, visits)
        sorted_idx = sample_indices(cfg, src.budget, split, round_)  # ascending
        order = row_order(cfg, split, round_, len(sorted_idx))
        if split == "train":  # the windows of the visits this boundary serves
            order = order[boundary_rows(src.budget, visits)]
        idx = sorted_idx[order]
        if is_complete(cfg.cache.root, fp):
            bad = CacheWriter.open(cfg.cache.root, fp).missing_shards(verify=True) if verify else []
            plans.append(
                CachePlan(split=split, fingerprint=fp, indices=idx, complete=not bad, missing=bad)
            )
            continue
        missing: list[int] = []
        if create:
            # (N, S+1) ids and (N, S) labels (IGNORE where masked) int32, in row order
            held = np.unique(order)
            rows, labels = src.store.read_indices_with_labels(split, sorted_idx[held])
            at = np.searchsorted(held, order)
            rows, labels = rows[at], labels[at]
            writer = CacheWriter.create(
                cfg.cache.root,
                fp,
                samples={
                    "sample_id": idx.astype(np.int64),
                    "input_ids": rows[:, :-1],
                    "labels": labels,
                },
                seq_len=src.store.seq_len,
                hidden_size=src.ckpt.hidden_size,
                cache_cfg=cfg.cache,
                meta=cache_meta(cfg, src, block, split, round_, visits),
            )
            missing = writer.missing_shards()
        plans.append(
            CachePlan(split=split, fingerprint=fp, indices=idx, complete=False, missing=missing)
        )
    return plans
