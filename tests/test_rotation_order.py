"""Rotation options of issue #15 (B-F multiplier study): train.order=descending (blocks M-1..0,
each boundary of a round built once at its start), train.order=random (issue #27: a permutation
per round from (seed, round), recorded in state.json) and train.schedule=run (one warmup +
cosine over the whole rotation)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core import faults
from core.config import ConfigError
from pipelines.bcd import run_bcd
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.plan.guards import DiskSpaceError, check_disk_for_rotation
from preinfer.run.visit import VisitHooks
from preinfer.schedule.rotation import round_blocks, store_budget
from preinfer.train.config import TrainConfig
from storage.tokens import TokenStore
from tests.pipeline_fixtures import TINY, assert_same_weights, quiet, tiny_cfg

ROOT = Path(__file__).resolve().parents[1]
FAST = ("train.eval_every=0", "train.checkpoint_every=0")


def hashes(cfg) -> list[str]:
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    return [ckpt.block_hash(b) for b in range(ckpt.num_blocks)]


def weights(cfg) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load()
    out = {}
    for b in range(ckpt.num_blocks):
        out.update({n: t.clone() for n, t in ckpt.block_state(model, adapter, b).items()})
    return out


def cache_dirs(cfg) -> set[str]:
    root = Path(cfg.cache.root)
    return {p.name for p in root.iterdir() if p.is_dir()} if root.is_dir() else set()


def in_order(batches_of):
    """Visit hooks that read every visit's rows unshuffled (the cache's row order), so a visit
    from the cache and one from tokens see the same batches; batches_of(visit) is called too."""

    def batches(visit, default):
        batches_of(visit)
        default.shuffle = False
        return default

    return VisitHooks(batches=batches)


def test_descending_trains_last_block_first_each_from_its_rounds_cache(tiny_run):
    cfg = tiny_run("train.order=descending", "train.rounds=2", "train.max_steps=2", *FAST)
    on_disk = []  # (round, block, cache dirs present as the visit starts)
    hooks = in_order(lambda v: on_disk.append((v.spec.round, v.K, cache_dirs(cfg))))
    res = run_bcd(cfg, log=quiet, hooks=hooks)
    visits = res["visits"]
    assert [(v["round"], v["block"]) for v in visits] == [(r, k) for r in (0, 1) for k in (2, 1, 0)]
    # each round: boundary 1 built from tokens, 2 refreshed from 1 (ascending's compute), both
    # before block 2 trains; block 0 from tokens
    assert [v["cache"] for v in visits] == ["refreshed", "built", "tokens"] * 2
    state = json.loads(Path(cfg.run.dir, "state.json").read_text())
    made = {
        (e["round"], e["boundary"]): e["fingerprints"]
        for e in state["events"]
        if e["action"] in ("built", "refreshed")
    }
    assert sorted(made) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert [(e["round"], e["boundary"]) for e in state["events"]] == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
    ]
    for v in visits:
        r, k, spec = v["round"], v["block"], v["spec"]
        want = made.get((r, k), {"train": None, "val": None})
        assert (spec["cache_train"], spec["cache_val"]) == (want["train"], want["val"]), (r, k)
    # disk: every boundary of the round until its block has trained, then dropped
    fps = {rk: set(f.values()) for rk, f in made.items()}
    for r in (0, 1):
        seen = {k: dirs for rr, k, dirs in on_disk if rr == r}
        assert seen[2] == fps[(r, 1)] | fps[(r, 2)]
        assert seen[1] == fps[(r, 1)]
        assert seen[0] == set()
    assert cache_dirs(cfg) == set() and state["caches_in_use"] == []
    assert state["order"] == "descending" and state["schedule"] == "run"  # the default


def test_descending_from_the_cache_equals_descending_with_the_prefix_recomputed(tiny_run, tmp_path):
    """Every visit's input is the right boundary: training M-1..1 from caches made at the round's
    start gives the weights of rerunning the (current) prefix on every step. fp32 cache
    (TINY), the same rows in the same order; tolerance as tests/test_train.py's one-step parity."""
    over = ("train.order=descending", "train.rounds=2", "train.max_steps=2", *FAST)
    cached = tiny_run(*over)
    start = weights(cached)
    other = tmp_path / "recompute"
    shutil.copytree(tmp_path / "run", other)
    recompute = tiny_cfg(other, *over, "train.mode=bcd-recompute")
    a = run_bcd(cached, log=quiet, hooks=in_order(lambda v: None))
    b = run_bcd(recompute, log=quiet, hooks=in_order(lambda v: None))
    assert [v["block"] for v in a["visits"]] == [v["block"] for v in b["visits"]] == [2, 1, 0] * 2
    got, want = weights(cached), weights(recompute)
    assert got.keys() == want.keys() == start.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert sum(not torch.equal(got[n], start[n]) for n in got) > 0.5 * len(got)


def test_disk_guard_counts_every_boundary_of_a_descending_round(tiny_run):
    """Descending keeps boundaries 1..M-1 until their blocks train: M-1 at once, not 2."""
    cfg = tiny_run()
    init_checkpoint(cfg.model, 4, cfg.run.checkpoint, force=True)
    hidden = Checkpoint.open(cfg.run.checkpoint).hidden_size

    def rotation(c, free):
        store = TokenStore(c.data.out_dir)
        budget = store_budget(c.train, c.preinfer.sample_fraction, store)
        return check_disk_for_rotation(c.cache, c.train, budget, hidden=hidden, seq=store.seq_len,
                                       M=4, free_bytes=free)  # fmt: skip

    ascending = rotation(cfg, 10**12)
    per = ascending["per_boundary"]["expected"]
    assert ascending["need"] == 2 * per
    descending = tiny_run("train.order=descending")
    assert rotation(descending, 10**12)["need"] == 3 * per
    with pytest.raises(DiskSpaceError, match="3 boundaries at once"):
        rotation(descending, 3 * per - 1)


def _killed_cli(run_dir: Path, kill_at: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pipelines.cli", "bcd", "--config", "configs/demo.yaml"]
    sets = [f"run.dir={run_dir}", *TINY, *KILL_SETS]
    args += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, faults.KILL_AT: kill_at}
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


KILL_SETS = ["train.order=descending", "train.max_steps=4"]  # TINY: checkpoint_every=2


def test_killed_descending_rotation_resumes_to_identical_weights(tiny_base, tmp_path):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    shutil.copytree(tiny_base, clean)
    shutil.copytree(tiny_base, killed)
    run_bcd(tiny_cfg(clean, *KILL_SETS), log=quiet)
    # block 1 (the round's 2nd visit), before step 3: a real process exit mid-block
    r = _killed_cli(killed, "0:1:3")
    assert r.returncode == 137, r.stderr[-3000:]
    cfg = tiny_cfg(killed, *KILL_SETS)
    state = json.loads((killed / "state.json").read_text())
    assert list(state["visits"]) == ["r0-b2"] and state["pending"]["key"] == "r0-b1"
    boundary1 = {
        fp for e in state["events"] if e["boundary"] == 1
        for fp in e["fingerprints"].values()
    }  # fmt: skip
    assert cache_dirs(cfg) == boundary1  # boundary 2 dropped once block 2 trained
    said = []
    res = run_bcd(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert "  resumed bcd block 1 round 0 at step 2" in said
    assert [v["cache"] for v in res["visits"]] == ["refreshed", "reused", "tokens"]
    assert_same_weights(tiny_cfg(clean, *KILL_SETS).run.checkpoint, cfg.run.checkpoint)
    assert hashes(cfg)[1] != hashes(tiny_cfg(tiny_base))[1]
    assert cache_dirs(cfg) == set()


def test_round_blocks_orders():
    assert round_blocks(TrainConfig(), 4, 3) == [0, 1, 2, 3]
    assert round_blocks(TrainConfig(order="descending"), 4, 3) == [3, 2, 1, 0]
    drawn = {
        tuple(round_blocks(TrainConfig(order="random", seed=s), 5, r))
        for s in range(3)
        for r in range(4)
    }
    assert all(sorted(o) == [0, 1, 2, 3, 4] for o in drawn)
    assert len(drawn) > 6  # rounds and seeds draw different permutations
    again = round_blocks(TrainConfig(order="random", seed=1), 5, 2)
    assert again == round_blocks(TrainConfig(order="random", seed=1), 5, 2)


RANDOM = ("train.order=random", "train.rounds=2", "train.max_steps=2")  # seed 0: 1,0,2 / 0,2,1


def test_random_order_trains_each_rounds_permutation_from_current_caches(tiny_run, tmp_path):
    """Every block of every round trains once, in the recorded permutation, each from the
    boundary that is current when it trains: the cache path gives the weights of rerunning
    the prefix on every step (tolerance as the descending one)."""
    cached = tiny_run(*RANDOM, *FAST)
    want_order = [round_blocks(cached.train, 3, r) for r in (0, 1)]
    assert want_order[0] != want_order[1] and want_order[0] != [0, 1, 2]
    other = tmp_path / "recompute"
    shutil.copytree(tmp_path / "run", other)
    recompute = tiny_cfg(other, *RANDOM, *FAST, "train.mode=bcd-recompute")
    said = []
    a = run_bcd(
        cached,
        log=lambda *m, **k: said.append(" ".join(map(str, m))),
        hooks=in_order(lambda v: None),
    )
    b = run_bcd(recompute, log=quiet, hooks=in_order(lambda v: None))
    flat = [k for o in want_order for k in o]
    assert [v["block"] for v in a["visits"]] == [v["block"] for v in b["visits"]] == flat
    assert [v["round"] for v in a["visits"]] == [0, 0, 0, 1, 1, 1]
    state = json.loads(Path(cached.run.dir, "state.json").read_text())
    assert state["order"] == "random"
    assert state["block_orders"] == {"0": want_order[0], "1": want_order[1]}
    assert any("block order (train.order=random, seed 0)" in m for m in said)
    got, want = weights(cached), weights(recompute)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert cache_dirs(cached) == set() and state["caches_in_use"] == []  # round ends with block 1


def test_random_order_keeps_a_boundary_a_later_visit_reuses(tiny_run):
    """Order 2, 1, 0 drawn at random: block 2's boundary is made as 1 built, 2 refreshed from it
    (the compute of building 2 from tokens), and boundary 1, current while block 2 trains, is
    kept for block 1's visit (reused, not rebuilt)."""
    seed = next(
        s
        for s in range(100)
        if round_blocks(TrainConfig(order="random", seed=s), 3, 0) == [2, 1, 0]
    )
    cfg = tiny_run("train.order=random", f"train.seed={seed}", "train.max_steps=1", *FAST)
    res = run_bcd(cfg, log=quiet)
    assert [v["block"] for v in res["visits"]] == [2, 1, 0]
    assert [v["cache"] for v in res["visits"]] == ["refreshed", "reused", "tokens"]
    state = json.loads(Path(cfg.run.dir, "state.json").read_text())
    assert [(e["action"], e["boundary"]) for e in state["events"]] == [
        ("built", 1), ("refreshed", 2), ("reused", 1)
    ]  # fmt: skip
    assert cache_dirs(cfg) == set()  # all dropped once block 0 trained


def test_random_order_resume_refuses_another_seed(tiny_run):
    fast = ("train.mode=bcd-recompute", "train.max_steps=1", "train.order=random", *FAST)
    cfg = tiny_run(*fast)
    run_bcd(cfg, log=quiet)
    state_file = Path(cfg.run.dir, "state.json")
    before, weights_before = state_file.read_bytes(), hashes(cfg)
    other = next(
        s
        for s in range(1, 100)
        if round_blocks(TrainConfig(order="random", seed=s), 3, 0) != round_blocks(cfg.train, 3, 0)
    )
    with pytest.raises(ConfigError, match=r"train.seed the rotation started with"):
        run_bcd(tiny_run(*fast, f"train.seed={other}"), log=quiet)
    assert state_file.read_bytes() == before and hashes(cfg) == weights_before


RANDOM_KILL = ["train.order=random", "train.rounds=2", "train.max_steps=4"]


def test_killed_random_rotation_resumes_to_identical_weights(tiny_base, tmp_path):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    shutil.copytree(tiny_base, clean)
    shutil.copytree(tiny_base, killed)
    run_bcd(tiny_cfg(clean, *RANDOM_KILL), log=quiet)
    order = round_blocks(tiny_cfg(clean, *RANDOM_KILL).train, 3, 1)
    # round 1's 2nd visit, before step 3: a real process exit mid-block
    args = [sys.executable, "-m", "pipelines.cli", "bcd", "--config", "configs/demo.yaml"]
    sets = [f"run.dir={killed}", *TINY, *RANDOM_KILL]
    args += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, faults.KILL_AT: f"1:{order[1]}:3"}
    r = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 137, r.stderr[-3000:]
    cfg = tiny_cfg(killed, *RANDOM_KILL)
    state = json.loads((killed / "state.json").read_text())
    assert state["pending"]["key"] == f"r1-b{order[1]}"
    said = []
    res = run_bcd(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert f"  resumed bcd block {order[1]} round 1 at step 2" in said
    assert [v["block"] for v in res["visits"]] == [*round_blocks(cfg.train, 3, 0), *order]
    assert_same_weights(tiny_cfg(clean, *RANDOM_KILL).run.checkpoint, cfg.run.checkpoint)


@pytest.mark.parametrize(
    ("key", "first", "then"), [("order", "descending", "ascending"), ("schedule", "run", "visit")]
)
def test_another_order_or_schedule_on_a_run_dir_is_refused(tiny_run, key, first, then):
    fast = ("train.mode=bcd-recompute", "train.max_steps=1", *FAST)
    cfg = tiny_run(*fast, f"train.{key}={first}")
    run_bcd(cfg, log=quiet)
    state_file = Path(cfg.run.dir, "state.json")
    before, weights_before = state_file.read_bytes(), hashes(cfg)
    with pytest.raises(ConfigError) as e:
        run_bcd(tiny_run(*fast, f"train.{key}={then}", "train.rounds=2"), log=quiet)
    msg = str(e.value)
    assert f"train.{key}={first}" in msg and str(state_file) in msg and "another run.dir" in msg
    assert state_file.read_bytes() == before and hashes(cfg) == weights_before
    # the same settings are accepted (finished: nothing left to train)
    assert len(run_bcd(cfg, log=quiet)["visits"]) == 3 and hashes(cfg) == weights_before


def test_a_state_json_from_before_the_order_was_recorded_is_ascending(tiny_run):
    fast = ("train.mode=bcd-recompute", "train.max_steps=1", *FAST)
    cfg = tiny_run(*fast)
    run_bcd(cfg, log=quiet)
    state_file = Path(cfg.run.dir, "state.json")
    state = json.loads(state_file.read_text())
    assert state["order"] == "ascending"
    del state["order"], state["schedule"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="train.order=ascending"):
        run_bcd(tiny_run(*fast, "train.order=descending"), log=quiet)


def cosine(g: int, total: int, *, peak: float, warmup: int, floor: float) -> float:
    """The schedule written out: linear warmup over `warmup` steps, then cosine to floor*peak."""
    if g < warmup:
        return peak * (g + 1) / warmup
    t = min(1.0, (g - warmup) / max(1, total - warmup))
    return floor * peak + (peak - floor * peak) * 0.5 * (1 + math.cos(math.pi * t))


def step_lrs(cfg) -> list[tuple[int, int, int, float]]:
    """(round, block, step, lr) of every training step, in the order taken."""
    lines = Path(cfg.run.dir, "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    return [(r["round"], r["block"], r["step"], r["lr"]) for r in recs if r["event"] == "step"]


LR = ("train.lr=0.01", "train.warmup_steps=2", "train.min_lr_ratio=0.1", "train.rounds=2")
STEPS = 3  # per visit; 2 rounds x 3 blocks x 3 = 18 steps


@pytest.mark.parametrize("order", ["ascending", "descending", "random"])
def test_run_schedule_is_one_cosine_over_the_rotation(tiny_run, tiny_base, tmp_path, order):
    cfg = tiny_run(
        *LR, f"train.max_steps={STEPS}", "train.mode=bcd-recompute", "train.schedule=run",
        f"train.order={order}", *FAST,
    )  # fmt: skip
    run_bcd(cfg, log=quiet)
    got = step_lrs(cfg)
    blocks = [round_blocks(cfg.train, 3, r) for r in (0, 1)]
    assert [(r, b) for r, b, s, _ in got[::STEPS]] == [(r, k) for r in (0, 1) for k in blocks[r]]
    total = 2 * 3 * STEPS
    want = [cosine(g, total, peak=0.01, warmup=2, floor=0.1) for g in range(total)]
    assert [lr for *_, lr in got] == pytest.approx(want, rel=1e-12)
    # visit v's steps are positions [v*steps, (v+1)*steps) of it
    for g, (r, b, s, _) in enumerate(got):
        assert g == (r * 3 + blocks[r].index(b)) * STEPS + s - 1
    if order != "ascending":
        return
    # the same lr sequence as --mode full over its own rounds x M x steps steps (which
    # train.schedule and train.order do not change)
    shutil.copytree(tiny_base, tmp_path / "full")
    full = tiny_cfg(
        tmp_path / "full", *LR, f"train.max_steps={STEPS}", "train.mode=full",
        "train.schedule=run", f"train.order={order}", *FAST,
    )  # fmt: skip
    run_bcd(full, log=quiet)
    assert [lr for *_, lr in step_lrs(full)] == pytest.approx(want, rel=1e-12)


def test_rewarm_ramps_every_visit_but_the_first(tiny_run):
    """train.rewarm_steps (issue #54 lever 2): the rotation's one cosine, scaled by (s+1)/n over
    the first n steps of every visit after the rotation's first; fails when it is disconnected."""
    cfg = tiny_run(*LR, f"train.max_steps={STEPS}", "train.mode=bcd-recompute", *FAST,
                   "train.rewarm_steps=2")  # fmt: skip
    run_bcd(cfg, log=quiet)
    got = step_lrs(cfg)
    total = 2 * 3 * STEPS
    assert len(got) == total
    for g, (*_, s, lr) in enumerate(got):
        ramp = 1.0 if g < STEPS else min(1.0, s / 2)  # s: 1-based step of the visit
        want = cosine(g, total, peak=0.01, warmup=2, floor=0.1) * ramp
        assert lr == pytest.approx(want, rel=1e-12), (g, s)
    assert got[STEPS][-1] < got[STEPS - 1][-1]  # the second visit starts at half its lr


def test_rewarm_with_a_per_visit_schedule_is_refused():
    with pytest.raises(ConfigError, match="rewarm_steps=3.*schedule=visit"):
        TrainConfig(rewarm_steps=3, schedule="visit")


def test_visit_schedule_restarts_in_every_visit(tiny_run):
    cfg = tiny_run(*LR, f"train.max_steps={STEPS}", "train.mode=bcd-recompute", *FAST,
                   "train.schedule=visit")  # fmt: skip
    run_bcd(cfg, log=quiet)
    got = step_lrs(cfg)
    assert len(got) == 2 * 3 * STEPS
    for *_, s, lr in got:
        assert lr == pytest.approx(cosine(s - 1, STEPS, peak=0.01, warmup=2, floor=0.1), rel=1e-12)
