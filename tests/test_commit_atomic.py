"""A multi-block commit (--mode full writes all M blocks) is ONE atomic step: a process really
killed (os._exit through core/faults.py) at any point of the commit, or of the visit's state
saves around it, resumes to the same checkpoint bytes (block files, optimizer files,
checkpoint.json) as a run never killed; a kill after the commit goes through bcd's pending branch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model_config
from core import faults
from pipelines.bcd import run_bcd
from preinfer.checkpoint.format import INDEX, LOCK
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from tests.pipeline_fixtures import assert_same_weights, quiet, tiny_cfg

ROOT = Path(__file__).resolve().parent.parent
# full mode: 2 x 3 = 6 steps, a state save every 2, evaluations at 3 and 6
SMALL = ["train.max_steps=2", "train.checkpoint_every=2", "train.eval_every=3"]
KEEP = ["train.keep_optimizer_state=true"]
CHILD = (
    "import sys; from pipelines.bcd import run_bcd; from tests.pipeline_fixtures import "
    "tiny_cfg, quiet; run_bcd(tiny_cfg(sys.argv[1], *sys.argv[2:]), mode='full', log=quiet)"
)
# what a visit record says about training (not how long it took)
STABLE = ("mode", "round", "block", "steps", "stopped", "loss", "val_loss", "cache")
AFTER_COMMIT = {"checkpoint.index", "checkpoint.unlink", "visit.committed", "visit.done"}


def _snapshot(run: Path) -> dict[str, bytes]:
    ck = run / "checkpoint"
    return {p.name: p.read_bytes() for p in sorted(ck.iterdir()) if p.name != LOCK}


def _assert_same_checkpoint(run: Path, ref: Path) -> None:
    """The same checkpoint files, bytes included, as the uninterrupted run's; where a process
    computed its first products an ulp apart (docs/failures.md), the same files by kind, the
    weights and optimizer states within fp32 rounding (tests.pipeline_fixtures)."""
    got, want = _snapshot(run), _snapshot(ref)
    if got == want:
        return
    kind = lambda names: sorted(n.split("-")[0] for n in names)  # noqa: E731 (block_000-<hash>)
    assert kind(got) == kind(want)
    assert_same_weights(ref / "checkpoint", run / "checkpoint")
    for name in [n for n in want if n.startswith("optim_")]:
        other = next(n for n in got if n.split("-")[0] == name.split("-")[0])
        a, b = load_file(ref / "checkpoint" / name), load_file(run / "checkpoint" / other)
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-3)


def _visit(run: Path) -> dict:
    rec = json.loads((run / "state.json").read_text())["visits"]["r0-b0"]
    return {k: rec.get(k) for k in STABLE}


def _steps_logged(run: Path) -> int:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return sum(json.loads(x).get("event") == "step" for x in lines if x.strip())


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory):
    """The uninterrupted --mode full run, per keep_optimizer_state (made when first asked)."""
    import shutil

    made = {}

    def get(keep: bool) -> Path:
        if keep not in made:
            run = tmp_path_factory.mktemp("ref") / "run"
            shutil.copytree(tiny_base, run)
            run_bcd(tiny_cfg(run, *SMALL, *KEEP * keep), mode="full", log=quiet)
            made[keep] = run
        return made[keep]

    return get


POINTS = [  # (kill point, keep_optimizer_state); each costs a fresh interpreter (~10 s)
    ("checkpoint.file@2", False),  # between two block files: issue #16
    ("checkpoint.index", False),  # committed, old files not yet deleted: the pending branch
    ("visit.committed", False),  # between the commit and state.json: the pending branch
    ("checkpoint.file@5", True),  # block 2's weights after blocks 0-1 and their optimizer files
]
SLOW = [  # every other point of the commit and of the visit's state saves
    ("checkpoint.index_tmp", False),
    *[(f"checkpoint.file_tmp@{n}", False) for n in (1, 2, 3)],
    ("checkpoint.file@1", False),
    ("checkpoint.file@3", False),
    *[(f"checkpoint.unlink@{n}", False) for n in (1, 2, 3)],
    ("visit.done", False),
    *[(f"visit.state_tmp@{n}", False) for n in (1, 2, 3)],
    *[(f"visit.state@{n}", False) for n in (1, 2, 3)],
    *[(f"checkpoint.file@{n}", True) for n in (1, 3, 4, 6)],
    ("checkpoint.file_tmp@4", True),
    ("checkpoint.index_tmp", True),
    ("checkpoint.index", True),
    *[(f"checkpoint.unlink@{n}", True) for n in (1, 3)],  # the 3 old block files
    ("visit.committed", True),
]


@pytest.mark.parametrize(
    "point, keep",
    POINTS + [pytest.param(*p, marks=[pytest.mark.slow, pytest.mark.functional]) for p in SLOW],
    ids=lambda v: v if isinstance(v, str) else ("keep" if v else "nokeep"),
)
def test_full_mode_killed_anywhere_resumes_to_the_same_bytes(tiny_base, tmp_path, reference,
                                                             point, keep):  # fmt: skip
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_base, run)
    extra = [*SMALL, *KEEP * keep]
    start = Checkpoint.open(run / "checkpoint").prefix_hash(3)
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(run), *extra],
        env={**os.environ, faults.KILL_POINT: point},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 137, r.stderr[-3000:]
    state = json.loads((run / "state.json").read_text())
    assert state["pending"]["key"] == "r0-b0" and not state["visits"]
    # the checkpoint on disk is the old one or the new one, never a mix
    on_disk = Checkpoint.open(run / "checkpoint")
    committed = point.partition("@")[0] in AFTER_COMMIT
    assert (on_disk.prefix_hash(3) != start) == committed
    on_disk.load()  # every block file it names is there and hash-valid
    steps = _steps_logged(run)

    run_bcd(tiny_cfg(run, *extra), mode="full", log=quiet)  # the rerun, in this process

    ref = reference(keep)
    _assert_same_checkpoint(run, ref)
    got, want = _visit(run), _visit(ref)
    for k in ("loss", "val_loss"):
        assert got.pop(k) == pytest.approx(want.pop(k), rel=1e-5), k
    assert got == want
    assert not list((run / "train_state").iterdir())  # no state, no temps left
    if committed:  # bcd's pending branch recorded the visit: nothing was trained again
        assert _steps_logged(run) == steps


def test_commit_blocks_is_one_commit_and_sweeps_leftovers(tmp_path):
    ck = init_checkpoint(tiny_model_config("gpt2"), 3, tmp_path / "ck")
    model, ad = ck.load()
    old = {b: ck.block_file(b).name for b in range(3)}
    # what commits killed before their end leave: an unnamed block file, writers' temps
    junk = ["block_001-deadbeef.safetensors", ".block_002-0123abcd.safetensors.1.ab.partial",
            f".{INDEX}.1.cd.partial", "optim_000-0badf00d.safetensors"]  # fmt: skip
    for name in junk:
        (ck.path / name).write_bytes(b"x")
    states = {b: {n: t + 1 for n, t in ck.block_state(model, ad, b).items()} for b in range(3)}
    hashes = ck.commit_blocks(states)
    again = Checkpoint.open(ck.path)
    assert again.index["generation"] == 1  # one index replace for the three blocks
    assert [again.block_hash(b) for b in range(3)] == [hashes[b] for b in range(3)]
    assert all(old[b] != again.block_file(b).name for b in range(3))
    names = sorted(p.name for p in ck.path.iterdir())
    assert names == sorted([LOCK, INDEX, *(again.block_file(b).name for b in range(3))])
    loaded, _ = again.load()
    assert torch.equal(loaded.transformer.wpe.weight, model.transformer.wpe.weight + 1)
    assert again.commit_blocks(states) == hashes and Checkpoint.open(ck.path).index == again.index
    (ck.path / junk[0]).write_bytes(b"x")
    again.tidy()
    assert not (ck.path / junk[0]).exists() and again.block_file(1).exists()


def test_unknown_kill_point_is_named(monkeypatch):
    monkeypatch.setenv(faults.KILL_POINT, "checkpoint.nope@1")
    with pytest.raises(ValueError, match="no kill point 'checkpoint.nope'"):
        faults.kill_point("checkpoint.file")
