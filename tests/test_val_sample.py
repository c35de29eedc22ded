"""A val figure that does not read the whole split reads a seeded sample spread over all of it,
and says so (issue #58): "over N of M val rows", with its standard error. The token store packs
val documents in corpus order, so the first rows (what every evaluation read before) are a
few documents, not a sample."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from core.config import ConfigError
from pipelines import cli
from pipelines.cache_build import build_cache
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.model.evaluation import (
    NothingToEvaluate,
    evaluate_tokens,
    paired_ratio,
    val_estimate,
)
from preinfer.run.visit import Visit, VisitSpec
from preinfer.schedule.rotation import sample_indices, store_budget, val_indices
from storage.reader import open_cache
from storage.tokens import TokenStore, TokenStoreWriter
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg

WIDE = ("data.max_documents=40",)

CPU = torch.device("cpu")
EASY, V, S = 5, 100, 16


def _biased_store(path, n_val=400, easy=80, seed=0) -> TokenStore:
    """A store whose first `easy` val rows are all token EASY (a forward that favours EASY
    scores them ~0) and the rest random tokens (~8 nats): the first rows are not the split."""
    rng = np.random.default_rng(seed)
    w = TokenStoreWriter(path, seq_len=S, shard_rows=64)
    w.add("train", rng.integers(0, V, (8, S + 1)).astype(np.int32))
    rows = rng.integers(0, V, (n_val, S + 1)).astype(np.int32)
    rows[:easy] = EASY
    w.add("val", rows)
    w.commit({"vocab_size": V})
    return TokenStore(path)


def _favours_easy(ids: torch.Tensor) -> torch.Tensor:
    logits = torch.zeros(*ids.shape, V)
    logits[..., EASY] = 8.0
    return logits


def test_val_indices_are_spread_seeded_and_all_when_asked():
    a = val_indices(1000, 32, seed=0)
    assert len(a) == 32 and np.all(np.diff(a) > 0) and a[0] < 1000 // 32 and a[-1] >= 1000 - 32
    assert np.array_equal(a, val_indices(1000, 32, seed=0))  # the same rows every time
    assert not np.array_equal(a, val_indices(1000, 32, seed=1))
    assert np.array_equal(val_indices(20, 0, seed=3), np.arange(20))  # 0: all of it
    assert np.array_equal(val_indices(20, 64, seed=3), np.arange(20))  # more than there are


def test_a_sample_of_a_biased_store_lands_within_its_error_and_the_first_rows_do_not(tmp_path):
    store = _biased_store(tmp_path / "tokens")
    n = store.num_samples("val")
    whole = evaluate_tokens(_favours_easy, store, batch_size=16)
    assert whole["rows"] == whole["of_rows"] == n and whole["se"] == 0.0
    within = 0
    for seed in range(10):
        est = evaluate_tokens(_favours_easy, store, batch_size=16, rows=val_indices(n, 32, seed))
        assert est["rows"] == 32 and est["of_rows"] == n and est["se"] > 0
        within += abs(est["loss"] - whole["loss"]) <= 3 * est["se"]
    assert within >= 9, within  # 3 s.e.: 99.7% of samples
    first = evaluate_tokens(_favours_easy, store, batch_size=16, rows=np.arange(32))
    assert abs(first["loss"] - whole["loss"]) > 3 * est["se"] + 3  # the old rows: ~0 vs ~6.4


def test_val_estimate_of_nothing_is_an_error_never_a_loss():
    with pytest.raises(NothingToEvaluate, match="no position of the 2 val row"):
        val_estimate([0.0, 0.0], [0, 0], of_rows=10)
    est = val_estimate([8.0, 2.0, 4.0], [4, 2, 2], of_rows=3)
    assert est["loss"] == pytest.approx(14 / 8) and est["se"] == 0.0 and est["tokens"] == 8


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory):
    """The tiny run on 40 documents: a val split of more rows than an evaluation reads."""
    base = tmp_path_factory.mktemp("wide")
    cfg = tiny_cfg(base, *WIDE)
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    return base


@pytest.fixture
def wide_run(wide_base, tmp_path):
    shutil.copytree(wide_base, tmp_path / "run")
    return lambda *extra: tiny_cfg(tmp_path / "run", *WIDE, *extra)


def test_eval_batches_reads_the_same_spread_rows_and_says_so(wide_run, capsys):
    cfg = wide_run()
    n = TokenStore(cfg.data.out_dir).num_samples("val")
    assert n > 16, n
    said: list[str] = []
    a = run_eval(cfg, max_batches=1, log=said.append)
    b = run_eval(cfg, max_batches=1, log=quiet)
    assert a["rows"] == 8 and a["of_rows"] == n and a["se"] > 0
    assert a["loss"] == b["loss"]  # the same rows at every evaluation
    assert f"of 8 of {n:,} val rows" in said[0] and "+-" in said[0]
    whole = run_eval(cfg, log=said.append)
    assert whole["rows"] == n and whole["se"] == 0 and f"the whole val split, {n:,} rows" in said[1]
    with pytest.raises(ConfigError, match="--batches must be >= 0"):
        run_eval(cfg, max_batches=-1, log=quiet)
    sets = [x for o in [f"run.dir={cfg.run.dir}", *TINY, *WIDE]
            for x in ("--set", o)]  # fmt: skip
    assert cli.main(["eval", "--config", "configs/demo.yaml", *sets, "--batches", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("preinfer eval: error: --batches must be >= 0") and "\n" not in err


def test_the_val_cache_holds_the_sampled_rows_and_visits_evaluate_on_them(wide_run):
    """A visit from the cache and the same visit with its prefix recomputed evaluate the same
    spread rows (the cache holds exactly them), to the same figure, every time."""
    cfg = wide_run("train.eval_batches=1")
    store = TokenStore(cfg.data.out_dir)
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, store)
    want = sample_indices(budget, "val", 0)
    n = store.num_samples("val")
    assert len(want) == 8 < n and want[-1] >= 8  # spread, not the first rows
    assert np.array_equal(want, val_indices(n, 8, cfg.train.seed))
    assert np.array_equal(want, sample_indices(budget, "val", 1))  # every round: the same
    fps = build_cache(cfg, 1, log=quiet)["fingerprints"]
    held = open_cache(cfg.cache.root, fps["val"]).read_labels(0, 8)[1].numpy()
    np.testing.assert_array_equal(held, want)

    spec = VisitSpec(block=1, mode="bcd", cache_train=fps["train"], cache_val=fps["val"])
    cached = Visit(cfg, spec, device=CPU)
    a, b = cached.evaluate(), cached.evaluate()
    assert a == b and a["rows"] == 8 and a["of_rows"] == n
    recompute = Visit(cfg, VisitSpec(block=1, mode="bcd-recompute"), device=CPU)
    np.testing.assert_array_equal(recompute.val_rows(), want)
    r = recompute.evaluate()
    assert r["tokens"] == a["tokens"]
    torch.testing.assert_close(r["loss"], a["loss"], rtol=1e-5, atol=1e-6)


def test_paired_ratio_error_is_the_delta_method_and_pairing_removes_shared_row_noise():
    """paired_ratio (issue #58: the headline ratios' error paired over val rows)."""
    rng = np.random.default_rng(0)
    hard = rng.gamma(2.0, 20.0, size=200)  # rows differ a lot in difficulty, for both arms
    b = hard * (1 + 0.02 * rng.standard_normal(200))
    a = 0.97 * hard * (1 + 0.02 * rng.standard_normal(200))
    got = paired_ratio(a, b)
    assert got["ratio"] == pytest.approx(a.sum() / b.sum()) and got["rows"] == 200
    resid = a - got["ratio"] * b
    assert got["se"] == pytest.approx(np.sqrt((resid**2).sum() / (200 * 199)) / b.mean())
    # unpaired, the rows' spread in difficulty would dominate: paired it is a few % of it
    unpaired = got["ratio"] * np.hypot(a.std(ddof=1) / a.mean(), b.std(ddof=1) / b.mean())
    assert got["se"] < 0.1 * unpaired / np.sqrt(200)
    # an empirical check: the ratio's spread over resampled row sets matches the error
    boot = [a[i].sum() / b[i].sum() for i in rng.integers(0, 200, size=(2000, 200))]
    assert np.std(boot) == pytest.approx(got["se"], rel=0.15)
    assert np.isnan(paired_ratio(a[:1], b[:1])["se"])
    with pytest.raises(ValueError, match="same rows"):
        paired_ratio(a, b[:-1])
