"""Cache identity: a boundary cache's fingerprint and meta, and whether it is on disk.

A boundary cache holds the round's rows its visits read (preinfer.schedule.rotation). Its fingerprint
names the tokens, the frozen prefix, the model, the stored dtype and codec, which rows
(`sampling_spec`) and the compute dtype, so a cache is reused exactly when all of them match.
`plan_boundary` turns one boundary, made for some visits of a round, into its train and val
caches' plans; preinfer.schedule.visit_plan asks it for every boundary a visit reads or makes, and
everything else reads that plan. Also the `preinfer:` config section (the library reads
sample_fraction, compute_dtype and micro_batch; the Ray stage the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from core.config import ConfigError
from core.fingerprint import cache_fingerprint
from preinfer.checkpoint.store import Checkpoint
from preinfer.runtime.device import ComputeChoice, compute_dtype, compute_dtype_key
from preinfer.schedule.rotation import VisitBudget, boundary_rows, row_order, sample_indices
from storage.config import CacheConfig
from storage.layout import is_complete
from storage.tokens import TokenStore

SPLITS = ("train", "val")


@dataclass(kw_only=True)
class PreinferConfig:
    actors: int = 2
    """Size of the Ray actor pool running the prefix (cache build, refresh) or the layers (cache extract)."""
    cpus_per_actor: float = 0.5
    """CPUs each actor asks Ray for when no GPU is present (fractional keeps the read stage alive)."""
    gpus_per_actor: float = 1.0
    """GPUs each actor asks for when GPUs exist."""
    micro_batch: int = 16
    """Samples per forward call inside an actor."""
    executor: Literal["auto", "local", "ray"] = "auto"
    """Where the prefix (cache build, refresh) and the layers (cache extract) run: local = this process; ray = an actor pool; auto = ray for a Ray cluster job (RAY_ADDRESS) or several GPUs, else local."""
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
        if self.gpus_per_actor < 0:
            raise ConfigError(f"preinfer.gpus_per_actor must be >= 0, got {self.gpus_per_actor}")
        if self.max_restarts < 0:
            raise ConfigError(f"preinfer.max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_task_retries < -1:
            raise ConfigError(
                f"preinfer.max_task_retries must be >= 0, or -1 (unbounded), got "
                f"{self.max_task_retries}"
            )


def sampling_spec(
    budget: VisitBudget, split: str, round_: int, visits: Sequence[int] | None = None
) -> dict:
    """The fingerprint's record of which rows: as before train.epochs existed where the rows
    are the ones that rule gave (those caches keep their fingerprints), plus `rows` otherwise,
    plus `windows` (the visits served) where a train cache holds only some of the round's rows."""
    if split == "train" and visits is not None:
        held = len(boundary_rows(budget, visits))
        if held < budget.rows:
            return {**sampling_spec(budget, split, round_),
                    "windows": {"visits": list(visits), "rows": held}}  # fmt: skip
    if split == "val":  # a part of val: rotation.val_indices' strata sample (before it: the
        # first rows, whose caches therefore have other fingerprints)
        rows = {"rows": budget.val_rows, "sample": "strata", "seed": budget.seed}
        return {"fraction": 1.0, **(rows if budget.val_rows < budget.n_val else {})}
    order = {"order": "shuffled", "order_seed": [budget.seed, round_]}
    frac = budget.sample_fraction
    legacy = budget.n_train if frac >= 1.0 else max(1, round(budget.n_train * frac))
    rows = {"rows": budget.rows} if budget.rows != legacy else {}
    if frac >= 1.0 and not rows:
        return {"fraction": 1.0, **order}
    return {"fraction": frac, "seed": budget.seed, "round": round_, **order, **rows}


def codec_spec(cache: CacheConfig) -> dict:
    """The fingerprint's record of how the values are compressed."""
    return {"codec": cache.codec, "shuffle": cache.shuffle, "level": cache.level,
            "shard_mb": cache.shard_mb}  # fmt: skip


def compute_choice(preinfer: PreinferConfig, cache: CacheConfig, device: str) -> ComputeChoice:
    """The dtype the prefix computes in for these settings on this machine (run.device
    `device`; see compute_dtype)."""
    return compute_dtype(preinfer.compute_dtype, cache.dtype, device)


@dataclass(frozen=True)
class Sources:
    """What a cache is made from, as one rotation step sees it: the checkpoint and the token
    store as they are now, and how this config stores and computes caches."""

    ckpt: Checkpoint
    """The checkpoint: its prefix hashes name the boundaries."""
    store: TokenStore
    """The token store the rows come from."""
    cache: CacheConfig
    """Where caches live and how their values are stored."""
    compute: ComputeChoice
    """The dtype the prefix computes in (compute_choice)."""


@dataclass(frozen=True, eq=False)
class CachePlan:
    """One cache of a boundary: which fingerprint, which rows, whether it is on disk."""

    split: str
    """train or val."""
    fingerprint: str
    """Its name under cache.root."""
    indices: np.ndarray
    """(N,) token-store rows of this split that the cache holds, in cache row order."""
    complete: bool
    """On disk with its manifest when planned (a reused cache's shards are checked again)."""


@dataclass(frozen=True, eq=False)
class BoundaryPlan:
    """One boundary's caches as made for some visits of a round."""

    boundary: int
    """The block whose input the caches hold (1..M-1)."""
    round: int
    """The round whose rows they hold."""
    serves: tuple[int, ...]
    """Positions, in the round's block order, of the visits they serve (they hold their windows)."""
    caches: tuple[CachePlan, ...]
    """The train and the val cache (SPLITS order)."""
    source: BoundaryPlan | None = None
    """Boundary - 1 as made for the same visit, which a refresh reads (None at boundary 1)."""

    @property
    def fingerprints(self) -> dict[str, str]:
        """The caches' fingerprints by split."""
        return {p.split: p.fingerprint for p in self.caches}

    @property
    def complete(self) -> bool:
        """Whether every cache was on disk when planned."""
        return all(p.complete for p in self.caches)


def fingerprint_for(
    src: Sources, budget: VisitBudget, block: int, split: str, round_: int,
    visits: Sequence[int] | None = None,
) -> str:  # fmt: skip
    """The fingerprint of boundary `block`'s `split` cache serving the visits at `visits`."""
    return cache_fingerprint(
        tokens=src.store.fingerprint,
        split=split,
        prefix=src.ckpt.prefix_hash(block),
        boundary=block,
        model=src.ckpt.model_config_dict,
        dtype=src.cache.dtype,
        codec=codec_spec(src.cache),
        sampling=sampling_spec(budget, split, round_, visits),
        compute=compute_dtype_key(src.compute, src.cache.dtype),
    )


def cache_meta(
    src: Sources, budget: VisitBudget, bp: BoundaryPlan, split: str, *, config: dict,
    checkpoint: str,
) -> dict:  # fmt: skip
    """What a new cache of `bp` records beside its shards: its identity in words, the resolved
    `config` (credentials masked) and the `checkpoint` path it was made from."""
    return {
        "boundary": bp.boundary,
        "split": split,
        "round": bp.round,
        "tokens": src.store.fingerprint,
        "prefix": src.ckpt.prefix_hash(bp.boundary),
        "model": src.ckpt.model_config_dict,
        "sampling": sampling_spec(budget, split, bp.round, bp.serves),
        "budget": budget.why,
        "compute_dtype": src.compute.compute,
        "config": config,
        "checkpoint": checkpoint,
    }


def plan_boundary(
    src: Sources, budget: VisitBudget, round_: int, block: int, serves: Sequence[int],
    source: BoundaryPlan | None = None,
) -> BoundaryPlan:  # fmt: skip
    """The train and val caches of boundary `block` in round `round_` serving the visits at
    `serves` (rotation.boundary_visits): their fingerprints, the token-store rows they hold in
    cache row order, and whether each is on disk. `source`: the plan of boundary block - 1 for
    the same visit, which a refresh reads."""
    if not 1 <= block < src.ckpt.num_blocks:
        raise ValueError(f"boundary {block} is out of range 1..{src.ckpt.num_blocks - 1}")
    caches = []
    for split in SPLITS:
        fp = fingerprint_for(src, budget, block, split, round_, serves)
        rows = sample_indices(budget, split, round_)  # ascending
        order = row_order(budget.seed, split, round_, len(rows))
        if split == "train":  # the windows of the visits this boundary serves
            order = order[boundary_rows(budget, serves)]
        complete = is_complete(src.cache.root, fp)
        caches.append(
            CachePlan(split=split, fingerprint=fp, indices=rows[order], complete=complete)
        )
    return BoundaryPlan(boundary=block, round=round_, serves=tuple(serves), caches=tuple(caches),
                        source=source)  # fmt: skip
