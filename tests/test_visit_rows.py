"""Rows per visit (issue #27 item 2): train.cache_visits caches several visits' worth of rows per
round, and the visits of a round read successive windows of them (different rows, where the
round's rows allow), the same from a cache as from tokens, and again on a resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core import faults
from core.config import ConfigError
from pipelines.bcd import run_bcd
from pipelines.cache_build import source_rows
from preinfer.run.config import load_config
from preinfer.run.visit import VisitHooks
from preinfer.schedule.cache_identity import CachePlan
from preinfer.schedule.rotation import (
    boundary_rows,
    boundary_visits,
    cache_window,
    round_blocks,
    visit_budget,
    visit_window,
)
from preinfer.train.batches import CacheBatches, CacheWindow, TokenBatches
from storage.dataset import CacheDataset
from storage.reader import open_cache
from tests.pipeline_fixtures import TINY, assert_same_weights, quiet, tiny_cfg, write_small_cache

ROOT = Path(__file__).resolve().parents[1]
FAST = ("train.eval_every=0", "train.checkpoint_every=0")
# a visit reads 3 steps x batch 8 = 24 rows once (the tiny store has 261 train rows)
ROWS = ("train.epochs=1", "train.max_steps=3")


def budget(*sets, n_train=1000):
    cfg = load_config("configs/demo.yaml", list(sets))
    return visit_budget(cfg.train, cfg.preinfer.sample_fraction, n_train, 100)


def test_cache_visits_sizes_the_rounds_rows_and_the_windows():
    one = budget("train.max_steps=10", "train.batch_size=4", "train.cache_visits=1")
    assert (one.rows, one.visit_rows, one.steps) == (40, 40, 10)
    default = budget("train.max_steps=10", "train.batch_size=4")  # null -> M (demo: 3)
    assert (default.rows, default.visit_rows) == (120, 40)
    assert [visit_window(one, p) for p in range(3)] == [(0, 40)] * 3  # today's: the same rows
    three = budget("train.max_steps=10", "train.batch_size=4", "train.cache_visits=3")
    assert (three.rows, three.visit_rows, three.steps, three.passes) == (120, 40, 10, 1.0)
    assert [visit_window(three, p) for p in range(3)] == [(0, 40), (40, 40), (80, 40)]
    assert "the round samples 120 rows (cache_visits 3)" in three.why
    # the sampled rows cap the round's: windows wrap, every visit still reads 40 rows
    capped = budget("train.max_steps=10", "train.batch_size=4", "train.cache_visits=3", n_train=100)
    assert (capped.rows, capped.visit_rows) == (100, 40)
    assert [visit_window(capped, p) for p in range(3)] == [(0, 40), (40, 40), (80, 40)]
    assert "capped by 100 sampled rows" in capped.why
    # epochs=null: every visit reads every sampled row already
    everything = budget("train.epochs=null", "train.cache_visits=3", n_train=500)
    assert everything.rows == everything.visit_rows == 500
    with pytest.raises(ConfigError, match="train.cache_visits must be >= 1"):
        budget("train.cache_visits=0.5")


def test_cache_window_reads_the_caches_rows_wrapping(tmp_path):
    write_small_cache(tmp_path, "c" * 64, N=24)  # 3 shards of 8 rows
    cache = open_cache(tmp_path, "c" * 64)
    for start, n in [(0, 24), (5, 10), (20, 9), (13, 24)]:
        w = CacheWindow(cache, start, n)
        rows = (start + np.arange(n)) % 24
        want = np.concatenate([cache.read_stored(int(r), int(r) + 1)[0] for r in rows])
        assert np.array_equal(w.read_stored(0, n)[0], want)
        assert torch.equal(w.read_labels(0, n)[1], torch.as_tensor(rows))
        ranges = [w.shard_range(i) for i in range(w.num_shards)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a < b and b - a <= 8 for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
        # a shuffled epoch reads each window row once
        ds = CacheDataset(w, batch_size=3, shuffle=True, seed=1, buffer_size=4, drop_last=True)
        seen = torch.cat([lab for _, lab in ds])
        assert len(seen) == n // 3 * 3
    with pytest.raises(ConfigError, match="does not fit"):
        CacheWindow(cache, 24, 1)


def read_rows(record):
    """Visit hooks: every visit's rows (token-store ids) into record[(round, block)], read in
    cache row order (unshuffled) so the cache and tokens paths train on the same batches."""

    def batches(visit, default):
        if isinstance(default, TokenBatches):
            ids = default.rows
        else:
            assert isinstance(default, CacheBatches)
            cache = default.cache
            ids = cache.read_labels(0, cache.num_samples)[1].numpy()
        record[(visit.spec.round, visit.K)] = np.asarray(ids)
        default.shuffle = False
        return default

    return VisitHooks(batches=batches)


def cached_and_recomputed(tiny_run, tmp_path, sets, hooks):
    """The same rotation from its caches and recomputing its prefix (a copy of the run dir),
    each visit's record (`hooks(record)`) in got and ref: (cached cfg, recompute cfg, got, ref)."""
    cached = tiny_run(*sets, "cache.keep=true")
    other = tmp_path / "recompute"
    shutil.copytree(tmp_path / "run", other)
    recompute = tiny_cfg(other, *sets, "train.mode=bcd-recompute")
    got, ref = {}, {}
    run_bcd(cached, log=quiet, hooks=hooks(got))
    run_bcd(recompute, log=quiet, hooks=hooks(ref))
    assert got.keys() == ref.keys() and len(got) == 6
    return cached, recompute, got, ref


def assert_weights_match(cached, recompute):
    """Same tolerance as tests/test_rotation_order.py."""
    from tests.test_rotation_order import weights

    w_cache, w_ref = weights(cached), weights(recompute)
    for name in w_cache:
        torch.testing.assert_close(w_cache[name], w_ref[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("visits", [3, 2.5])
def test_visits_of_a_round_read_different_rows(tiny_run, tmp_path, visits):
    """cache_visits 3: three disjoint windows of 24 rows; 2.5 (60 rows): the third wraps to the
    first rows. The rows are the same whether a visit reads the cache or tokens, and training
    from the cache gives the weights of rerunning the prefix (same tolerance as
    tests/test_rotation_order.py)."""
    sets = (*ROWS, f"train.cache_visits={visits}", "train.rounds=2", *FAST)
    cached = tiny_run(*sets, "cache.keep=true")
    other = tmp_path / "recompute"
    shutil.copytree(tmp_path / "run", other)
    recompute = tiny_cfg(other, *sets, "train.mode=bcd-recompute")
    got, ref = {}, {}
    res = run_bcd(cached, log=quiet, hooks=read_rows(got))
    run_bcd(recompute, log=quiet, hooks=read_rows(ref))
    assert got.keys() == ref.keys() and len(got) == 6
    for key in got:
        assert np.array_equal(got[key], ref[key]), key
        assert len(got[key]) == 24
    for r in (0, 1):
        a, b, c = (set(got[(r, k)].tolist()) for k in range(3))
        assert not a & b and not b & c
        if visits == 3:
            assert not a & c
        else:  # 60 rows: the third window is rows 48..59 and 0..11 of the round's
            assert len(a & c) == 12
    assert got[(0, 0)].tolist() != got[(1, 0)].tolist()  # each round its own sample
    windows = [(v["round"], v["block"], v["rows"]) for v in res["visits"]]
    R = 72 if visits == 3 else 60
    assert windows[:3] == [(0, k, {"start": 24 * k % R, "rows": 24, "of": R}) for k in range(3)]
    state = json.loads(Path(cached.run.dir, "state.json").read_text())
    assert state["cache_visits"] == visits
    # boundary K holds the windows of visits K..M-1 only: 48 and 24 train rows, not R and R;
    # boundary 2 refreshed from boundary 1's rows (a subset of them)
    held = [(e["action"], e["boundary"],
             open_cache(cached.cache.root, e["fingerprints"]["train"]).num_samples)
            for e in state["events"] if e["round"] == 1]  # fmt: skip
    assert held == [("built", 1, 48), ("refreshed", 2, 24)]
    assert_weights_match(cached, recompute)


def test_a_boundary_holds_the_windows_of_the_visits_it_serves():
    """boundary_visits: the run of the round's positions around the visit whose blocks are all
    >= K (no block below K trains in it, so the cache stays current); the same from any
    position of the run, so a resumed round plans the caches it made."""
    cfg = load_config("configs/demo.yaml", ["train.seed=0"])
    M = 4
    order = round_blocks(cfg.train, M, 0)
    assert [boundary_visits(order, k) for k in (1, 2, 3)] == [[1, 2, 3], [2, 3], [3]]
    cfg.train.order = "descending"  # blocks 3 2 1 0: every boundary made at the round's start
    order = round_blocks(cfg.train, M, 0)
    assert [boundary_visits(order, k) for k in (1, 2, 3)] == [[0, 1, 2], [0, 1], [0]]
    assert boundary_visits(order, 1, position=2) == [0, 1, 2]
    cfg.train.order = "random"
    for r in range(6):
        order = round_blocks(cfg.train, M, r)
        for q, b in enumerate(order):
            for k in range(1, b + 1):
                run = boundary_visits(order, k, position=q)
                assert q in run and all(order[p] >= k for p in run)
                assert all(order[p] < k for p in (run[0] - 1, run[-1] + 1) if 0 <= p < M)
                if k >= 2:  # a refresh's source serves every visit its target does
                    assert set(run) <= set(boundary_visits(order, k - 1, position=q))
    with pytest.raises(ConfigError, match="trains a block below 2"):
        boundary_visits(round_blocks(load_config("configs/demo.yaml", []).train, M, 0), 2, 1)
    # windows: 3 visits of 40 rows of 100 (capped): the third wraps to rows 0..19
    b = budget("train.max_steps=10", "train.batch_size=4", "train.cache_visits=3", n_train=100)
    held = boundary_rows(b, [1, 2])
    assert held.tolist() == [*range(0, 20), *range(40, 100)]
    assert cache_window(b, held, 1) == (20, 40) and cache_window(b, held, 2) == (60, 40)
    with pytest.raises(ConfigError, match="not the window"):
        cache_window(b, boundary_rows(b, [2]), 1)


def test_a_refresh_source_must_hold_the_targets_samples():
    def plan(ids):
        return CachePlan(split="train", fingerprint="f" * 64, indices=np.asarray(ids),
                         complete=False)  # fmt: skip

    assert source_rows(plan([5, 9, 2]), plan([5, 9, 2])) is None
    assert source_rows(plan([9, 2]), plan([7, 5, 9, 2])).tolist() == [2, 3]
    with pytest.raises(ConfigError, match="lacks samples"):
        source_rows(plan([9, 4]), plan([7, 5, 9, 2]))


@pytest.mark.parametrize("order", ["descending", "random"])
def test_windowed_caches_train_as_recompute_in_every_order(tiny_run, tmp_path, order):
    """Descending makes every boundary at the round's start, random around each visit: each
    holds the windows of the visits it serves, and a visit from the cache reads the rows, and
    trains to the weights, of rerunning the prefix."""
    sets = (*ROWS, "train.cache_visits=3", "train.rounds=2", f"train.order={order}", *FAST)
    cached, recompute, got, ref = cached_and_recomputed(tiny_run, tmp_path, sets, read_rows)
    for key in got:
        assert np.array_equal(got[key], ref[key]), key
    state = json.loads(Path(cached.run.dir, "state.json").read_text())
    sizes = {open_cache(cached.cache.root, fp).num_samples
             for e in state["events"] for fp in [e["fingerprints"]["train"]]}  # fmt: skip
    assert max(sizes) < 72  # no boundary holds all three windows
    assert_weights_match(cached, recompute)


class Recorded:
    """A visit's batches as they are, each batch's labels kept in `out` (a list)."""

    def __init__(self, inner, out: list):
        self.inner, self.out, self.steps_per_epoch = inner, out, inner.steps_per_epoch

    def epoch(self, e: int):
        for x, labels in self.inner.epoch(e):
            self.out.append(labels.clone())
            yield x, labels


def record_batches(record):
    def batches(visit, default):
        return Recorded(default, record.setdefault((visit.spec.round, visit.K), []))

    return VisitHooks(batches=batches)


@pytest.mark.parametrize("order", ["ascending", "random"])
def test_shuffled_cache_visits_read_recomputes_batches_step_for_step(tiny_run, tmp_path, order):
    """A window that fits the shuffle buffer is read whole and drawn in TokenBatches' order: a
    shuffled visit from the cache reads, batch by batch, the rows recomputing its prefix reads
    (two epochs of its window: max_steps 6 over 24 rows), and trains to its weights."""
    sets = ("train.epochs=1", "train.max_steps=6", "train.cache_visits=3", "train.rounds=2",
            f"train.order={order}", *FAST)  # fmt: skip
    cached, recompute, got, ref = cached_and_recomputed(tiny_run, tmp_path, sets, record_batches)
    for key in got:
        assert len(got[key]) == len(ref[key]) == 6
        for step, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
            assert torch.equal(a, b), (key, step)
        assert not torch.equal(got[key][0], got[key][3])  # the second epoch: another order
    assert_weights_match(cached, recompute)


def test_a_cache_past_the_shuffle_buffer_streams_in_shard_order(tmp_path):
    """CacheBatches reads a cache larger than its buffer through CacheDataset (every row once
    per epoch, in another order than TokenBatches'), one that fits in TokenBatches' order."""
    write_small_cache(tmp_path, "c" * 64, N=24, row_labels=True)  # 3 shards of 8 rows
    cache = open_cache(tmp_path, "c" * 64)
    row_mb = cache.seq_len * cache.hidden_size * 2 / 2**20
    whole = CacheBatches(cache, batch_size=4, seed=3, buffer_mb=24 * row_mb)
    stream = CacheBatches(cache, batch_size=4, seed=3, buffer_mb=8 * row_mb)
    assert whole.fits and not stream.fits
    rows = next(iter(CacheBatches(cache, batch_size=24, seed=0, shuffle=False).epoch(0)))[0]
    want = rows[np.random.default_rng([3, 1]).permutation(24)]  # (24, S, H) fp32
    assert torch.equal(torch.cat([x for x, _ in whole.epoch(1)]), want)
    streamed = torch.cat([x for x, _ in stream.epoch(1)])
    key = lambda t: sorted(t[:, 0, 0].tolist())  # noqa: E731 - a row's first value names it
    assert key(streamed) == key(rows) and not torch.equal(streamed, want)
    for batches in (whole, stream):  # each row's labels stay with its values: labels = row id
        for x, lab in batches.epoch(2):
            assert torch.equal(x, rows[lab[:, 0]]) and bool((lab == lab[:, :1]).all())
    # DDP: rank r of 2 gets TokenBatches' rank r rows of each global batch, as drawn
    order = np.random.default_rng([3, 1]).permutation(24)
    for r in (0, 1):
        ranked = CacheBatches(cache, batch_size=4, seed=3, rank=r, world=2, buffer_mb=24 * row_mb)
        got = [lab[:, 0].tolist() for _, lab in ranked.epoch(1)]
        assert got == [order[s * 4 : (s + 1) * 4][r::2].tolist() for s in range(6)]
    x, _ = next(iter(whole.epoch(0)))
    assert x.dtype == torch.float32 and x.shape == (4, cache.seq_len, cache.hidden_size)


def test_random_order_windows_follow_the_visits_place_in_its_round(tiny_run):
    cfg = tiny_run(*ROWS, "train.cache_visits=3", "train.order=random", "train.max_steps=3",
                   "train.mode=bcd-recompute", *FAST)  # fmt: skip
    res = run_bcd(cfg, log=quiet)
    order = json.loads(Path(cfg.run.dir, "state.json").read_text())["block_orders"]["0"]
    assert [v["block"] for v in res["visits"]] == order
    assert [v["rows"]["start"] for v in res["visits"]] == [0, 24, 48]


def test_another_cache_visits_on_a_started_rotation_is_refused(tiny_run):
    fast = (*ROWS, "train.mode=bcd-recompute", "train.max_steps=1", *FAST)
    cfg = tiny_run(*fast, "train.cache_visits=3")
    run_bcd(cfg, log=quiet)
    with pytest.raises(ConfigError, match=r"train.cache_visits=3"):
        run_bcd(tiny_run(*fast, "train.rounds=2"), log=quiet)


KILL_SETS = [*ROWS, "train.max_steps=4", "train.cache_visits=3"]  # TINY: checkpoint_every=2


def test_killed_rotation_with_windows_resumes_to_identical_weights(tiny_base, tmp_path):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    shutil.copytree(tiny_base, clean)
    shutil.copytree(tiny_base, killed)
    run_bcd(tiny_cfg(clean, *KILL_SETS), log=quiet)
    args = [sys.executable, "-m", "pipelines.cli", "bcd", "--config", "configs/demo.yaml"]
    sets = [f"run.dir={killed}", *TINY, *KILL_SETS]
    args += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, faults.KILL_AT: "0:1:3"}  # block 1 (its window: rows 32..63), step 3
    r = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 137, r.stderr[-3000:]
    said = []
    res = run_bcd(
        tiny_cfg(killed, *KILL_SETS), log=lambda *a, **k: said.append(" ".join(map(str, a)))
    )
    assert "  resumed bcd block 1 round 0 at step 2" in said
    assert [v["rows"]["start"] for v in res["visits"]] == [0, 32, 64]
    assert_same_weights(
        tiny_cfg(clean, *KILL_SETS).run.checkpoint, tiny_cfg(killed, *KILL_SETS).run.checkpoint
    )
