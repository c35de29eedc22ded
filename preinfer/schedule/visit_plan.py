"""A visit's plan: one (round, block) of the rotation, made once by `plan_visit`.

It holds where the visit stands in its round (train.order), the rows it reads (its window of
the round's rows, preinfer.schedule.rotation), the boundary cache it reads and, planned against the
checkpoint as it is now, the boundaries it needs current first (preinfer.schedule.cache_identity):
their fingerprints and what is on disk. The rotation (pipelines/bcd.py) makes one per visit
and hands it on; the cache stages, the Visit and the planner read it, never derive it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from preinfer.schedule.cache_identity import BoundaryPlan, CachePlan, Sources, plan_boundary
from preinfer.schedule.rotation import (
    VisitBudget,
    boundary_rows,
    boundary_visits,
    cache_window,
    round_blocks,
    visit_data_seed,
    visit_train_rows,
    visit_window,
)
from preinfer.train.config import TrainConfig


@dataclass(frozen=True)
class VisitPlan:
    """One visit of the rotation, (round, block): the rows it reads and the caches it needs."""

    round: int
    """The round the visit belongs to."""
    block: int
    """The block it trains."""
    mode: str
    """bcd, bcd-recompute or full (full: every train row, outside any round's order)."""
    order: tuple[int, ...]
    """The round's block order (train.order); () for full."""
    position: int
    """The visit's place in that order: it picks its window of the round's rows."""
    budget: VisitBudget
    """The round's rows, and the visit's rows and steps."""
    window: tuple[int, int]
    """(start, rows) of its window of the round's train rows, in cache row order."""
    data_seed: int
    """Seed of its batch order."""
    boundary: int | None
    """The boundary whose caches it reads (bcd, block K > 0: K); None: it reads tokens."""
    serves: tuple[int, ...]
    """Positions of the visits that boundary's caches serve (they hold those windows)."""
    cache_window: tuple[int, int] | None
    """(start, rows) of its window among that boundary's train rows."""
    keeps: tuple[int, ...]
    """Boundaries below its own that a later visit of the round reads while they stay current."""
    makes: tuple[BoundaryPlan, ...]
    """Boundaries it needs current first, lowest first, its own last (() without sources)."""
    adapts_prefix: bool = False
    """The round's last visit under train.prefix_adapters=last (block > 0): adapters on the
    blocks before its own too, its prefix run from tokens; it reads no boundary."""

    @property
    def reads(self) -> BoundaryPlan | None:
        """The plan of the boundary it reads (None: tokens, or planned without a checkpoint)."""
        return self.makes[-1] if self.boundary is not None and self.makes else None

    @property
    def caches(self) -> tuple[CachePlan, ...]:
        """The train and val caches it reads (() where `reads` is None)."""
        return self.reads.caches if self.reads is not None else ()

    @property
    def fingerprints(self) -> dict[str, str] | None:
        """Those caches' fingerprints by split."""
        return self.reads.fingerprints if self.reads is not None else None

    @property
    def cache_rows(self) -> int | None:
        """Train rows the boundary it reads holds (None: it reads tokens)."""
        if self.boundary is None:
            return None
        return len(boundary_rows(self.budget, self.serves))

    def train_rows(self) -> np.ndarray | None:
        """Token-store train rows it reads from tokens, in cache row order (None: full reads
        every train row)."""
        if self.mode == "full":
            return None
        return visit_train_rows(self.budget, self.round, self.position)


def plan_visit(
    train: TrainConfig,
    budget: VisitBudget,
    M: int,
    round_: int,
    block: int,
    *,
    mode: str = "bcd",
    sources: Sources | None = None,
) -> VisitPlan:
    """Block `block`'s visit of round `round_` of a rotation over M blocks.

    The boundaries it needs current: its own (bcd, block K > 0), and below it those a later
    visit of the round reads before any block below them trains (`keeps`: descending, all of
    them; random, some), made on the way from the lowest (the compute of building K from
    tokens). Each serves the run of visits around this one whose blocks are all above it
    (rotation.boundary_visits). sources: the checkpoint and token store as they are now, to
    plan those boundaries' caches (`makes`; None: rows only)."""
    if not 0 <= block < M:
        raise ValueError(f"--block {block} is out of range: the rotation has blocks 0..{M - 1}")
    full = mode == "full"
    order = () if full else tuple(round_blocks(train, M, round_))
    q = 0 if full else order.index(block)
    # train.prefix_adapters=last: the round's last visit reads tokens, so the boundaries serve
    # (and keep for) the visits before it only
    last_reads_tokens = not full and train.prefix_adapters == "last" and order[-1] > 0
    adapts_prefix = last_reads_tokens and q == M - 1
    reading = order[: M - 1] if last_reads_tokens else order
    later = reading[q + 1 :]
    keeps = tuple(j for i, j in enumerate(later)
                  if 0 < j < block and all(b >= j for b in later[:i]))  # fmt: skip
    boundary = block if mode == "bcd" and block > 0 and not adapts_prefix else None
    serves, within = (), None
    if boundary is not None:
        serves = tuple(boundary_visits(reading, boundary, q))
        within = cache_window(budget, boundary_rows(budget, serves), q)
    makes: list[BoundaryPlan] = []
    if boundary is not None and sources is not None:
        lowest = min([*keeps, boundary])
        below = None
        if lowest >= 2:  # what a refresh of the lowest one would read
            below = plan_boundary(sources, budget, round_, lowest - 1,
                                  boundary_visits(reading, lowest - 1, q))  # fmt: skip
        for j in range(lowest, boundary + 1):
            below = plan_boundary(sources, budget, round_, j, boundary_visits(reading, j, q), below)
            makes.append(below)
    return VisitPlan(
        round=round_, block=block, mode=mode, order=order, position=q, budget=budget,
        window=visit_window(budget, q), data_seed=visit_data_seed(budget.seed, round_, block),
        boundary=boundary, serves=serves, cache_window=within, keeps=keeps, makes=tuple(makes),
        adapts_prefix=adapts_prefix,
    )  # fmt: skip
