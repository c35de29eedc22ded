"""The rotation's schedule: each round's block order, and the train rows its visits read.

A round's visits read a per-(seed, round) sample of the train split sized by train.epochs and
train.cache_visits (`visit_budget`), in a seeded row order every boundary of the round shares;
each visit reads its own window of it (`visit_window`). A boundary cache holds the windows of
the visits it serves (`boundary_visits`, `boundary_rows`): its own visit's and those of the
boundaries refreshed from it before a block below it trains, so at cache_visits M an ascending
round's boundary K holds M-K windows, not M (a refresh maps each row of K to the same sample's
row of K-1). It also holds the val rows the in-visit evaluations read.

Arithmetic over train.*, preinfer.sample_fraction and the split sizes only: one visit's share of
it is preinfer.schedule.visit_plan's VisitPlan, a cache's name preinfer.schedule.cache_identity's fingerprint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.config import ConfigError
from preinfer.train.config import TrainConfig
from storage.tokens import TokenStore


def round_blocks(train: TrainConfig, M: int, round_: int) -> list[int]:
    """The blocks of round `round_` in the order they train (train.order; bcd modes). random:
    a permutation of 0..M-1 drawn from (train.seed, round) alone, so a resumed rotation, a
    single `preinfer train` visit and the planner all see the same order."""
    if train.order == "ascending":
        return list(range(M))
    if train.order == "descending":
        return list(range(M - 1, -1, -1))
    return [int(b) for b in np.random.default_rng([train.seed, round_, 31]).permutation(M)]


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
    """Train rows of the token store."""
    n_val: int
    """Val rows of the token store."""
    batch_size: int
    """train.batch_size."""
    seed: int
    """train.seed: which rows a round samples, and their cache row order."""
    sample_fraction: float
    """preinfer.sample_fraction: the share of the train split a round may sample."""
    why: str
    """One line: how rows and steps were chosen."""

    @property
    def passes(self) -> float:
        """Passes over the visit's rows that its steps make."""
        return self.steps * self.batch_size / max(self.visit_rows, 1)


def visit_budget(
    train: TrainConfig, sample_fraction: float, n_train: int, n_val: int
) -> VisitBudget:
    """The one rule for a visit's rows and steps, and a round's cached rows.

    train.epochs = E: a visit reads V = min(N_train x sample_fraction, max_steps x batch / E)
    rows (at least one batch), steps = min(max_steps, ceil(E x V / batch)): every row it reads
    is read E times, and a step cap below one pass shrinks the rows, never the passes. The
    round caches R = min(N_train x sample_fraction, floor(train.cache_visits x V)) rows, and
    its visits read successive V-row windows of them (visit_window): cache_visits 1 = every
    visit the same rows, the smallest cache; cache_visits M = each visit rows of its own where
    the train split holds M x V. train.epochs = null: every sampled row (N_train x
    sample_fraction), in every visit, and max_steps steps (rows read any number of times, or
    never). Val: eval_batches x batch rows spread over the split (val_indices; all of val when
    eval_batches = 0).
    """
    tc, B = train, train.batch_size
    cap = max(1, round(n_train * sample_fraction))
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
            else f"{n_train} train rows x sample_fraction {sample_fraction:g}"
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
        f" (eval_batches {tc.eval_batches} x batch {B}, a seeded sample spread over the split)"
        if val_rows < n_val
        else ""
    )
    return VisitBudget(rows=rows, visit_rows=visit_rows, steps=steps, val_rows=val_rows,
                       n_train=n_train, n_val=n_val, batch_size=B, seed=tc.seed,
                       sample_fraction=sample_fraction, why=why)  # fmt: skip


def rotation_steps(
    train: TrainConfig,
    budget: VisitBudget,
    M: int,
    costs: Sequence[float] | None = None,
    *,
    rounds: int | None = None,
) -> list[list[int]]:
    """Optimizer steps of every bcd visit of the rotation, [round][position in its block order]
    for `rounds` rounds (None = train.rounds; more for a visit run by hand past them)
    (train.visit_steps; round_blocks gives the orders). equal: budget.steps each. cost: steps x
    mean(c) / c_k, c_k = `costs[k]`, block k's predicted step cost (block 0 first;
    preinfer.plan.costmodel.block_step_costs), so sum(steps x c) stays steps x sum(c): each visit
    about the same time, the round as long as at equal. A list w (one weight per block): steps x
    w_k / mean(w), the round's steps as at equal. At least 1 step a visit."""
    rule, steps = train.visit_steps, budget.steps
    if rule == "equal":
        share = [1.0] * M
    else:
        if rule == "cost":
            if costs is None or len(costs) != M or not all(c > 0 for c in costs):
                raise ValueError(f"train.visit_steps=cost needs M={M} step costs > 0, got {costs}")
            share = [sum(costs) / M / c for c in costs]
        else:
            if len(rule) != M:
                raise ConfigError(
                    f"train.visit_steps lists {len(rule)} weights, but the rotation has {M} "
                    f"blocks: give one weight per block (block 0 first), or equal / cost"
                )
            share = [w * M / sum(rule) for w in rule]
    per_block = [max(1, round(steps * x)) for x in share]
    n = train.rounds if rounds is None else rounds
    return [[per_block[k] for k in round_blocks(train, M, r)] for r in range(n)]


def visit_steps_at(steps: list[list[int]], round_: int, position: int) -> tuple[int, int, int]:
    """(steps, offset, total) of the visit at (round_, position) of rotation_steps' `steps`:
    its steps, the rotation's steps before it (where its lr schedule position starts under
    train.schedule=run), and the rotation's steps in all."""
    flat = [n for r in steps for n in r]
    i = round_ * len(steps[0]) + position
    return flat[i], sum(flat[:i]), sum(flat)


def store_budget(train: TrainConfig, sample_fraction: float, store: TokenStore) -> VisitBudget:
    """visit_budget over the token store's split sizes."""
    n_train, n_val = store.num_samples("train"), store.num_samples("val")
    return visit_budget(train, sample_fraction, n_train, n_val)


def visit_window(budget: VisitBudget, position: int) -> tuple[int, int]:
    """(start, rows) of the window of the round's cached train rows (cache row order) that the
    visit at `position` in its round reads: rows start, start+1, ... wrapping at budget.rows.
    Successive visits take successive windows, so they read different rows until the round's
    rows run out (then they wrap around to the first ones)."""
    return position * budget.visit_rows % budget.rows, budget.visit_rows


def boundary_visits(order: Sequence[int], block: int, position: int | None = None) -> list[int]:
    """Positions (in a round's block order, `order`) of the visits a boundary-`block` cache
    serves when it is made for the visit at `position` (None: block `block`'s own visit):
    the longest run of positions around it whose blocks are all >= `block`. Within that run
    no block below `block` trains, so the cache stays current; every visit of the run reads it
    or a boundary refreshed from it. ascending: K..M-1; descending: 0..M-1-K (the round makes
    all its boundaries first); random: the run around the visit. The run does not depend on
    which of its positions asks, so a resumed round plans the caches it made before."""
    M = len(order)
    q = list(order).index(block) if position is None else position
    if not (0 <= q < M and order[q] >= block):
        raise ConfigError(
            f"the visit at position {q} of its round (blocks {list(order)}) does not read a "
            f"boundary-{block} cache: it trains a block below {block}"
        )
    lo, hi = q, q
    while lo > 0 and order[lo - 1] >= block:
        lo -= 1
    while hi + 1 < M and order[hi + 1] >= block:
        hi += 1
    return list(range(lo, hi + 1))


def boundary_rows(budget: VisitBudget, visits: Sequence[int]) -> np.ndarray:
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


def val_indices(n_val: int, rows: int, seed: int) -> np.ndarray:
    """Ascending val rows an evaluation of `rows` of the split's `n_val` reads: all of them when
    rows is 0 or >= n_val; else one row drawn (seed) from each of `rows` equal strata of the
    split, so the sample spreads over all of it. The token store packs val documents in corpus
    order, so the first rows are a few documents, not a sample (issue #58). A function of
    (n_val, rows, seed) only: every evaluation of a run, every round and every arm of a bench
    with one train.seed read the same rows."""
    if not rows or rows >= n_val:
        return np.arange(n_val)
    edges = np.arange(rows + 1) * n_val // rows  # strata [edges[i], edges[i+1]), each >= 1 row
    rng = np.random.default_rng([seed, 15485863])
    return edges[:-1] + rng.integers(0, np.diff(edges))


def sample_indices(budget: VisitBudget, split: str, round_: int) -> np.ndarray:
    """Token-store rows of (split, round) that the visit reads, ascending: val_rows of val
    spread over it (val_indices, the same every round); a deterministic per-(seed, round)
    sample of budget.rows train rows."""
    if split == "val":
        return val_indices(budget.n_val, budget.val_rows, budget.seed)
    n, k = budget.n_train, budget.rows
    if k >= n:
        return np.arange(n)
    rng = np.random.default_rng([budget.seed, round_, 7919])
    return np.sort(rng.choice(n, size=k, replace=False))


def row_order(seed: int, split: str, round_: int, n: int) -> np.ndarray:
    """Permutation of the split's `n` sampled rows into cache row order.

    The token store packs documents in order, so rows next to each other come from the same
    or neighbouring documents. Train caches store their rows in a seeded random order, so a
    shard (and a batch drawn from a one-shard shuffle buffer) mixes the whole corpus: a
    document-ordered cache trains measurably worse (docs/quality.md, 'Cache batch order').
    Val keeps token order. Every boundary of one (seed, round) shares the order, so refresh
    maps row i of boundary K-1 to row i of boundary K.
    """
    if split == "val":
        return np.arange(n)
    return np.random.default_rng([seed, round_, 104729]).permutation(n)


def visit_data_seed(seed: int, round_: int, block: int) -> int:
    """The seed of a bcd visit's batch order (the shuffle of its rows), per (train.seed, round,
    block)."""
    return (seed * 1000 + round_) * 1000 + block


def visit_train_rows(budget: VisitBudget, round_: int, position: int) -> np.ndarray:
    """Token-store train row indices a bcd visit reads, in the order its boundary cache holds
    them: the round's sampled rows (sample_indices) in cache row order (row_order), and of
    them the window of the visit at `position` in its round (visit_window). A visit from the
    cache reads the same rows at cache indices [start, start + rows) (wrapping)."""
    rows = sample_indices(budget, "train", round_)
    rows = rows[row_order(budget.seed, "train", round_, len(rows))]
    start, n = visit_window(budget, position)
    return rows if n >= len(rows) else rows[(start + np.arange(n)) % len(rows)]


def round_orders(train: TrainConfig, state: dict, mode: str, M: int, where: Path) -> list:
    """Every round's block order (train.order), as state.json (`where`) records the rotation:
    a resumed one replays its own. Refused: a rotation begun in another train.order,
    train.schedule, train.cache_visits (its visits' rows) or train.visit_steps (its visits'
    steps and lr positions; a state.json from before they were recorded: ascending, visit, 1,
    equal), or whose config draws another order (train.seed changed
    under train.order=random). full trains all blocks at once over its own steps: none."""
    if mode == "full":
        return []
    started = bool(state["visits"] or state.get("pending"))
    for key, old in (("order", "ascending"), ("schedule", "visit"), ("cache_visits", 1.0),
                     ("visit_steps", "equal")):  # fmt: skip
        was, now = state.get(key, old if started else None), getattr(train, key)
        if was is not None and was != now:
            raise ConfigError(
                f"{where} belongs to a rotation with train.{key}={was}; rerun with "
                f"train.{key}={was} to go on with it, or use another run.dir for train.{key}={now}"
            )
    recorded = state.setdefault("block_orders", {})
    orders = [round_blocks(train, M, r) for r in range(train.rounds)]
    for r, order in enumerate(orders):
        was = recorded.get(str(r))
        if was is not None and was != order:
            raise ConfigError(
                f"{where} trained round {r} in block order {was}, but this config draws {order} "
                f"(train.order={train.order}, train.seed={train.seed}); rerun with the "
                "train.seed the rotation started with, or use another run.dir"
            )
        recorded[str(r)] = order
    return orders
