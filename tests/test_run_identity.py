"""A run.dir tells the truth about what trained it (issue #40, defects 1-4): state.json names
the checkpoint its visits were committed to, every stage that reads the run holds the two
together, `init --force` takes the run.dir lock and moves the old run's records aside, and a
refused init / bcd writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.bcd import run_bcd
from pipelines.cli import main
from pipelines.eval import run_eval
from pipelines.export import run_export
from pipelines.init import run_init
from pipelines.report import run_report
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.lock import RunDirLocked, run_lock
from tests.pipeline_fixtures import quiet

ONE_ROUND = ("train.max_steps=2", "train.eval_every=0", "train.checkpoint_every=0")


def _run_files(run: Path) -> dict[str, bytes]:
    """Every file under the run.dir (relative path -> bytes), the lock's record aside."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_reinit_force_then_bcd_trains_the_new_checkpoint(tiny_run, capsys):
    """Defect 1: bcd to the end, `init --force` with another model, bcd again: the new
    checkpoint is trained (every block changes), eval reads it, report counts only its visits."""
    cfg = tiny_run(*ONE_ROUND)
    run_bcd(cfg, log=quiet)
    run = Path(cfg.run.dir)
    assert len(json.loads((run / "state.json").read_text())["visits"]) == 3

    cfg2 = tiny_run(*ONE_ROUND, "model.hidden_size=48")
    run_init(cfg2, force=True, log=quiet)
    fresh = [b["hash"] for b in Checkpoint.open(cfg2.run.checkpoint).index["blocks"]]
    assert not (run / "state.json").exists()  # the old run's records moved aside, kept
    moved = list((run / "replaced").iterdir())
    assert len(moved) == 1 and (moved[0] / "state.json").is_file()
    assert (moved[0] / "metrics.jsonl").is_file()

    res = run_bcd(cfg2, log=quiet)
    assert len(res["visits"]) == 3 and all(v.get("steps") == 2 for v in res["visits"])
    trained = [b["hash"] for b in Checkpoint.open(cfg2.run.checkpoint).index["blocks"]]
    assert all(a != b for a, b in zip(fresh, trained, strict=True))
    rep = run_report(cfg2, log=quiet)
    assert len(rep["visits"]) == 3


def test_checkpoint_replaced_under_a_finished_run_is_refused(tiny_run, tmp_path, capsys):
    """Defect 1 by another road: a checkpoint replaced outside `init` (a copy of an untrained
    one) under a run whose state says done: bcd, eval, report and export refuse with one line
    and exit 2; none of them reports the visits or trains nothing silently."""
    cfg = tiny_run(*ONE_ROUND)
    untrained = tmp_path / "untrained"
    shutil.copytree(cfg.run.checkpoint, untrained)
    run_bcd(cfg, log=quiet)
    shutil.rmtree(cfg.run.checkpoint)
    shutil.copytree(untrained, cfg.run.checkpoint)
    run = Path(cfg.run.dir)
    before = _run_files(run)
    sets = [f"--set=run.dir={cfg.run.dir}"] + [f"--set={s}" for s in _tiny_sets(*ONE_ROUND)]
    for argv in (
        ["bcd"],
        ["eval"],
        ["report"],
        ["export", "--out", str(tmp_path / "hf")],
    ):
        capsys.readouterr()
        assert main([*argv, "-c", "configs/demo.yaml", *sets]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "does not belong to its checkpoint" in err, err
        assert "fresh run.dir" in err
    assert _run_files(run) == before
    assert not (tmp_path / "hf").exists()


def test_init_force_refused_while_a_run_holds_the_lock(tiny_run):
    """Defect 2: `init --force` while a bcd holds the run.dir is refused, naming the holder;
    the checkpoint and the run state are untouched."""
    cfg = tiny_run(*ONE_ROUND)
    run_bcd(cfg, log=quiet)
    ck = Path(cfg.run.checkpoint) / "checkpoint.json"
    before = ck.read_bytes(), (Path(cfg.run.dir) / "state.json").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(cfg.run.dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked):
            run_init(tiny_run(*ONE_ROUND, "model.hidden_size=48"), force=True, log=quiet)
    finally:
        holder.kill()
        holder.wait()
    assert (ck.read_bytes(), (Path(cfg.run.dir) / "state.json").read_bytes()) == before


_HOLD = """
import sys, time
from preinfer.run.lock import run_lock
with run_lock(sys.argv[1], "bcd --mode bcd", log=lambda *a: None):
    print("held", flush=True)
    time.sleep(600)
"""


def test_refused_init_writes_no_checkpoint(tiny_run, capsys):
    """Defect 3: init with a vocab smaller than the token store's exits 2 and writes nothing;
    the corrected rerun then succeeds, and eval works (no IndexError)."""
    cfg = tiny_run()
    shutil.rmtree(cfg.run.checkpoint)
    run = Path(cfg.run.dir)
    before = _run_files(run)
    sets = [f"--set=run.dir={cfg.run.dir}", *(f"--set={s}" for s in _tiny_sets())]
    assert main(["init", "-c", "configs/demo.yaml", *sets, "--set=model.vocab_size=256"]) == 2
    assert "embeds 256" in capsys.readouterr().err
    assert _run_files(run) == before
    assert not Path(cfg.run.checkpoint).exists()
    assert main(["init", "-c", "configs/demo.yaml", *sets]) == 0
    assert main(["eval", "-c", "configs/demo.yaml", *sets]) == 0


def test_refused_bcd_writes_no_run_state(tiny_run, capsys):
    """Defect 4: bcd with a batch larger than the train split exits 2 and writes no state.json
    or config.json, so a rerun with another train.order is not pinned to the refused one."""
    cfg = tiny_run()
    run = Path(cfg.run.dir)
    before = _run_files(run)
    sets = [f"--set=run.dir={cfg.run.dir}", *(f"--set={s}" for s in _tiny_sets(*ONE_ROUND))]
    assert main(["bcd", "-c", "configs/demo.yaml", *sets, "--set=train.batch_size=10000"]) == 2
    assert "train.batch_size (10000) is larger than the train split" in capsys.readouterr().err
    assert _run_files(run) == before
    assert main(["bcd", "-c", "configs/demo.yaml", *sets, "--set=train.order=descending"]) == 0


def test_refusal_inside_the_first_visit_leaves_the_run_as_it_was(tiny_run):
    """A check that only the visit makes (a cache whose rows do not match, here forced by a
    hook that refuses) after state.json was written: no visit committed, so state.json,
    config.json and metrics.jsonl are put back as they were (absent)."""
    from core.config import ConfigError
    from preinfer.run.visit import VisitHooks

    def refuse(visit, batches):
        raise ConfigError("refused by the test")

    cfg = tiny_run(*ONE_ROUND)
    run = Path(cfg.run.dir)
    with pytest.raises(ConfigError, match="refused by the test"):
        run_bcd(cfg, log=quiet, hooks=VisitHooks(batches=refuse))
    assert not (run / "state.json").exists() and not (run / "config.json").exists()
    assert not (run / "metrics.jsonl").exists()


def test_a_pending_visit_that_committed_is_not_a_mismatch(tiny_run):
    """A visit killed after its commit but before state.json recorded it (state "pending")
    resumes: the changed block is the pending visit's, not a replaced checkpoint."""
    from preinfer.run.state import load_run_state, run_mismatch

    cfg = tiny_run(*ONE_ROUND)
    run_bcd(cfg, log=quiet)
    state = load_run_state(cfg.run.dir)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert run_mismatch(state, ckpt) is None
    state["checkpoint"]["blocks"][1] = "0" * 16  # as if block 1's commit were not recorded
    assert "block(s) [1]" in run_mismatch(state, ckpt)
    state["pending"] = {"key": "r0-b1", "start_hash": "x", "cache": "built"}
    assert run_mismatch(state, ckpt) is None


def test_export_of_an_untrained_run_says_so(tiny_run, tmp_path):
    lines: list[str] = []
    run_export(tiny_run(), str(tmp_path / "hf"), log=lines.append)
    assert any("has not been trained" in line for line in lines)


def test_eval_after_bcd_reads_the_trained_run(tiny_run):
    cfg = tiny_run(*ONE_ROUND)
    run_bcd(cfg, log=quiet)
    assert run_eval(cfg, max_batches=1, log=quiet)["tokens"] > 0


def _tiny_sets(*extra) -> list[str]:
    from tests.pipeline_fixtures import TINY

    return [*TINY, *extra]


def test_lock_holder_helper_releases(tmp_path):
    """The lock the tests above hold from a child is released when the child dies."""
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"held"
    p.kill()
    p.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            with run_lock(tmp_path, "test", log=quiet):
                break
        except RunDirLocked:
            assert time.monotonic() < deadline, "the lock outlived its holder"
            time.sleep(0.05)
    assert os.path.isdir(tmp_path)


def test_train_by_hand_in_a_rotation_run_dir_is_recorded(tiny_run, capsys):
    """`preinfer train --block K` in a run.dir whose rotation finished: its commit becomes the
    checkpoint the run goes on from, so eval and export accept it (no false mismatch)."""
    cfg = tiny_run(*ONE_ROUND)
    run_bcd(cfg, log=quiet)
    sets = [f"--set=run.dir={cfg.run.dir}", *(f"--set={s}" for s in _tiny_sets(*ONE_ROUND))]
    assert main(["train", "--block", "0", "-c", "configs/demo.yaml", *sets]) == 0
    assert main(["eval", "-c", "configs/demo.yaml", *sets]) == 0
