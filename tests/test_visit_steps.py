"""train.visit_steps (issue #54 lever 3): how a round's steps are shared by its visits. equal:
the budget's steps each; cost: inversely to the block's predicted step cost (the cache makes a
deep block's visit cheaper), the round's predicted time kept; a list: one weight per block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import ConfigError
from pipelines.bcd import run_bcd
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.shape import model_shape
from preinfer.plan.costmodel import Flops, block_step_costs, visit_steps
from preinfer.run.config import load_config
from preinfer.schedule.rotation import (
    VisitBudget,
    rotation_steps,
    round_blocks,
    store_budget,
    visit_steps_at,
)
from preinfer.train.config import TrainConfig
from storage.tokens import TokenStore
from tests.pipeline_fixtures import quiet
from tests.test_rotation_order import FAST, LR, cosine, step_lrs


def budget(steps: int) -> VisitBudget:
    return VisitBudget(rows=64, visit_rows=32, steps=steps, val_rows=8, n_train=64, n_val=8,
                       batch_size=4, seed=0, sample_fraction=1.0, why="")  # fmt: skip


def test_equal_cost_and_weights_share_a_rounds_steps():
    b = budget(30)
    assert rotation_steps(TrainConfig(), b, 3) == [[30, 30, 30]]
    # cost: steps x mean(c) / c_k, so sum(steps x c) is the equal rotation's
    costs = [632.0, 560.0, 369.0]
    got = rotation_steps(TrainConfig(visit_steps="cost"), b, 3, costs)[0]
    mean = sum(costs) / 3
    assert got == [round(30 * mean / c) for c in costs] == [25, 28, 42]
    assert sum(n * c for n, c in zip(got, costs, strict=True)) == pytest.approx(
        30 * sum(costs), rel=0.02
    )
    # weights: the round's steps as at equal, shared w_k / mean(w)
    w = TrainConfig(visit_steps=[2.0, 1.0, 1.0], rounds=2, order="descending")
    assert rotation_steps(w, b, 3) == [[22, 22, 45]] * 2  # [block 2, 1, 0]; 22.5 rounds to 22
    assert rotation_steps(TrainConfig(visit_steps=[1.0, 1e-6]), budget(3), 2) == [[6, 1]]
    # (steps, offset, total) of each visit: the lr schedule's positions under schedule=run
    steps = [[3, 1, 2], [2, 3, 1]]
    assert [visit_steps_at(steps, r, q) for r in (0, 1) for q in (0, 1, 2)] == [
        (3, 0, 12), (1, 3, 12), (2, 4, 12), (2, 6, 12), (3, 8, 12), (1, 11, 12),
    ]  # fmt: skip


def test_bad_visit_steps_are_refused_with_what_to_do():
    for bad in ([], [1.0, 0.0, 1.0], [1.0, -2.0]):
        with pytest.raises(ConfigError, match="one weight > 0 per block"):
            TrainConfig(visit_steps=bad)
    with pytest.raises(ConfigError, match="train.visit_steps"):
        load_config(None, ["train.visit_steps=longest"])
    with pytest.raises(ConfigError, match="lists 2 weights, but the rotation has 3 blocks"):
        rotation_steps(TrainConfig(visit_steps=[1.0, 2.0]), budget(4), 3)
    with pytest.raises(ValueError, match="needs M=3 step costs"):
        rotation_steps(TrainConfig(visit_steps="cost"), budget(4), 3)


def test_block_step_costs_price_the_cache_and_what_each_visit_trains(tiny_run):
    cfg = tiny_run()
    part = Checkpoint.open(cfg.run.checkpoint).partition
    fl = Flops(sh=model_shape(cfg.model), part=part, seq=cfg.data.seq_len)
    costs = block_step_costs(fl, cfg.train)
    # a visit from boundary k runs layers k.. only: each deeper block's step is cheaper
    assert costs[0] > costs[1] > costs[2] > 0
    # Flops.bcd's rule where nothing is frozen and the head is tied (block 0 trains the matrix)
    assert fl.sh.tied and costs == pytest.approx([fl.bcd(k) for k in range(3)])
    frozen = block_step_costs(fl, TrainConfig(freeze=["embed"]))
    assert frozen[0] == pytest.approx(costs[0] - 2 * fl.sh.head_matrix) and frozen[1:] == costs[1:]


def test_a_rotation_takes_each_visits_steps_on_one_schedule(tiny_run):
    """The visits take rotation_steps' steps (fails when train.visit_steps is disconnected),
    and the lr runs one cosine over all of them (schedule=run); cost gives the cheaper deep
    blocks more steps, and the log says so."""
    cfg = tiny_run(*LR, "train.max_steps=3", "train.visit_steps=[3, 1, 2]", *FAST)
    run_bcd(cfg, log=quiet)
    got = step_lrs(cfg)
    per = [(r, k) for r in (0, 1) for k in (0, 1, 2)]
    # 3 x w / mean(w) = 4.5, 1.5, 3.0, rounded half to even: 4, 2, 3
    b = store_budget(cfg.train, cfg.preinfer.sample_fraction, TokenStore(cfg.data.out_dir))
    assert [n for r in rotation_steps(cfg.train, b, 3) for n in r] == [4, 2, 3] * 2
    want_steps = [4, 2, 3] * 2
    assert [sum(1 for r, k, *_ in got if (r, k) == v) for v in per] == want_steps
    total = sum(want_steps)
    want = [cosine(g, total, peak=0.01, warmup=2, floor=0.1) for g in range(total)]
    assert [lr for *_, lr in got] == pytest.approx(want, rel=1e-12)
    summaries = json.loads(Path(cfg.run.dir, "state.json").read_text())["visits"]
    assert [summaries[f"r{r}-b{k}"]["steps"] for r, k in per] == want_steps


def test_cost_shares_steps_by_price_and_a_resume_keeps_its_rule(tiny_run):
    cfg = tiny_run("train.max_steps=4", "train.visit_steps=cost", "train.rounds=1", *FAST)
    lines = []
    run_bcd(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    b = store_budget(cfg.train, cfg.preinfer.sample_fraction, TokenStore(cfg.data.out_dir))
    steps = visit_steps(cfg, Checkpoint.open(cfg.run.checkpoint).partition, b)[0]
    assert steps[0] < steps[2] and sum(steps) >= 3 * 4 - 1
    assert any(f"train.visit_steps=cost): {steps}" in x for x in lines)
    summaries = json.loads(Path(cfg.run.dir, "state.json").read_text())["visits"]
    assert [summaries[f"r0-b{k}"]["steps"] for k in round_blocks(cfg.train, 3, 0)] == steps
    # the rotation's steps and lr positions follow the rule: another one is refused, and the
    # run is left as it was
    before = Path(cfg.run.dir, "state.json").read_text()
    with pytest.raises(ConfigError, match="train.visit_steps=cost; rerun with"):
        run_bcd(tiny_run("train.max_steps=4", "train.rounds=1", *FAST), log=quiet)
    assert Path(cfg.run.dir, "state.json").read_text() == before
