"""A visit that commits without diverging but does not learn is said so (issue #53: a pretraining
run at a suffix lr 10x too high sat at the unigram level, every visit committed, nothing said
it): bcd logs a warning at the visit and at the run's end, returns the flags, and the report has
a section for them (preinfer/run/health.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipelines.bcd import run_bcd
from pipelines.report import run_report
from preinfer.run.health import flag_visits, train_counts, unigram_record
from storage.tokens import TokenStore


def test_the_unigram_record_is_the_train_splits_token_distribution(tiny_run):
    store = TokenStore(tiny_run().data.out_dir)
    n, n_val = store.num_samples("train"), store.num_samples("val")
    rec = unigram_record(store, np.arange(n_val))
    t = store.read("train", 0, n)[:, 1:].ravel()
    c = np.bincount(t, minlength=store.vocab_size)
    p = c[c > 0] / c.sum()
    assert rec["entropy"] == np.float64(-(p * np.log(p)).sum())
    assert rec["fingerprint"] == store.fingerprint and rec["val_rows"] == n_val
    q = (c + 0.5) / (c.sum() + 0.5 * len(c))
    v = store.read("val", 0, n_val)[:, 1:].ravel()
    assert abs(rec["loss"] - float(-np.log(q[v]).mean())) < 1e-9
    # past max_tokens: evenly spaced windows of rows hold about that many targets
    some = train_counts(store, max_tokens=n * store.seq_len // 3)
    assert 0 < some.sum() <= n * store.seq_len // 3 and some.sum() < c.sum()


def test_flags_say_which_visits_rose_or_sit_at_the_unigram_level():
    visits = [
        {"key": "r0-b0", "val_loss": 4.0, "first_loss": 6.0},  # learned
        {"key": "r0-b1", "val_loss": 4.5},  # rose from 4.0
        {"key": "r0-b2", "val_loss": 4.4},  # fell: fine
        {"key": "r1-b0", "val_loss": 4.96},  # rose from 4.4, and within 1% of the unigram 5.0
        {"key": "r1-b1", "val_loss": None},  # no val loss: no flag
    ]
    flags = flag_visits(visits, 5.0)
    assert sorted(flags) == ["r0-b1", "r1-b0"]
    assert "rose from 4.000 to 4.500" in flags["r0-b1"][0]
    assert len(flags["r1-b0"]) == 2 and "unigram level (5.000" in flags["r1-b0"][1]
    # the first visit starts from its first step's loss
    assert "rose" in flag_visits([{"key": "a", "val_loss": 7.0, "first_loss": 6.0}], None)["a"][0]
    assert flag_visits(visits, None) == {k: f[:1] for k, f in flags.items()}  # no level: rises only


def test_a_bad_lr_is_flagged_at_the_visit_in_the_summary_and_the_report(tiny_run):
    lines: list[str] = []
    cfg = tiny_run("train.lr=1.0")  # finite, but far past what this model trains at
    res = run_bcd(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert any("val loss rose" in f for f in res["flags"]["r0-b0"]), res["flags"]
    assert any(ln.strip().startswith("warning: round 0 block 0: val loss rose") for ln in lines)
    assert "did not learn" in lines[-1] and "r0-b0" in lines[-1]
    state = json.loads((Path(cfg.run.dir) / "state.json").read_text())
    assert state["unigram"]["fingerprint"] == TokenStore(cfg.data.out_dir).fingerprint
    run_report(cfg, log=lambda *a: None)
    md = (Path(cfg.run.dir) / "report" / "summary.md").read_text()
    section = md.split("## Visits that did not learn", 1)[1].split("\n## ", 1)[0]
    assert "| r0-b0 | val loss rose" in section and "did not learn" in section


def test_a_good_lr_does_not_rise(tiny_run):
    res = run_bcd(tiny_run(), log=lambda *a: None)  # the tiny run's own lr, 3e-3
    assert not any("rose" in f for fs in res["flags"].values() for f in fs), res["flags"]
