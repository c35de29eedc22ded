"""Readers beside a commit (#53): a checkpoint read while a commit replaces its files is read
as the commit left it, never called damaged; only a file missing while checkpoint.json is
unchanged is damage. The commits here are the real ones (Checkpoint.commit_block), landing at
chosen points of a read; the functional test runs `preinfer export` and `eval` in a loop
beside a live `preinfer bcd`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import preinfer.checkpoint.store as store
from conftest import tiny_model_config
from core.fingerprint import tensors_hash
from preinfer.checkpoint.format import CheckpointError
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.state import check_run, checkpoint_record, save_run_state
from tests.pipeline_fixtures import TINY

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ck(tmp_path) -> Path:
    """A tiny tied GPT-2 checkpoint of 3 blocks; its directory."""
    init_checkpoint(tiny_model_config("gpt2"), 3, tmp_path / "ck")
    return tmp_path / "ck"


def commit(path: Path, b: int, step: float = 0.01) -> dict:
    """Block b of the checkpoint at `path`, every tensor + step, committed by the real commit
    code (new file, checkpoint.json, the old file deleted); the new index."""
    writer = Checkpoint.open(path)  # a block file holds exactly the tensors the block commits;
    # no model is built (build_model's meta patch is not thread-safe: the reader thread builds)
    state = {n: t + step for n, t in load_file(writer.block_file(b)).items()}
    writer.commit_block(b, state)
    return writer.index


def loaded_hashes(ckpt: Checkpoint, model) -> list[str]:
    """The content hash of each block as the loaded model holds it."""
    from preinfer.model.adapters import get_adapter

    adapter = get_adapter(model, ckpt.index["arch"])
    return [tensors_hash(ckpt.block_state(model, adapter, b)) for b in range(ckpt.num_blocks)]


def test_a_commit_after_the_index_read_is_read_as_the_new_commit(ck):
    reader = Checkpoint.open(ck)  # the index, read
    gone = reader.block_file(2)
    new = commit(ck, 2)  # replaces block 2's file and deletes the one the reader's index names
    assert not gone.exists()
    model, _ = reader.load()  # was: "block 2's file ... is missing ...; the checkpoint is damaged"
    assert reader.index == new and loaded_hashes(reader, model) == [
        b["hash"] for b in new["blocks"]
    ]
    reader = Checkpoint.open(ck)
    commit(ck, 1)
    reader.verify()


def test_a_commit_between_two_block_reads_gives_one_commits_model(ck, monkeypatch):
    """The commit lands after block 0's file was read and before block 2's: the model and
    the reader's index are the new commit's, not a mix."""
    real = store._read_file

    def commit_at_first_read(b: int) -> None:
        reads = []

        def read(path, names=None):
            out = real(path, names)
            reads.append(path.name)
            if len(reads) == 1:
                commit(ck, b)
            return out

        monkeypatch.setattr(store, "_read_file", read)

    commit_at_first_read(2)
    reader = Checkpoint.open(ck)
    old = reader.index
    model, _ = reader.load()
    assert reader.index != old and reader.index == json.loads((ck / "checkpoint.json").read_text())
    assert loaded_hashes(reader, model) == [b["hash"] for b in reader.index["blocks"]]
    # a commit of the block already read, whose other files stay: the old commit's model, whole
    commit_at_first_read(0)
    reader = Checkpoint.open(ck)
    first = reader.index
    model, _ = reader.load()
    assert reader.index == first != json.loads((ck / "checkpoint.json").read_text())
    assert loaded_hashes(reader, model) == [b["hash"] for b in first["blocks"]]


def test_a_file_missing_under_an_unchanged_index_is_damage(ck):
    reader = Checkpoint.open(ck)
    reader.block_file(1).unlink()
    with pytest.raises(CheckpointError) as e:
        reader.load()
    msg = str(e.value)
    assert "block 1's file" in msg and "is missing" in msg and "the checkpoint is damaged" in msg
    # the advice is to restore; init --force only where no run's training is to be kept
    assert "restore" in msg and "only when no run's training should be kept" in msg
    with pytest.raises(CheckpointError, match="only when no run's training should be kept"):
        reader.check_files(range(3))


def test_a_writer_that_never_stops_is_reported_as_commits_not_damage(ck, monkeypatch):
    real, n = store._read_file, [0]

    def commit_then_read(path, names=None):  # every read finds its file just replaced
        if n[0] >= 0:  # not the commit's own reads
            n[0] = -n[0] - 1
            commit(ck, 2, step=0.01 * -n[0])
            n[0] = -n[0]
        return real(path, names)

    reader = Checkpoint.open(ck)
    monkeypatch.setattr(store, "_read_file", commit_then_read)
    with pytest.raises(CheckpointError) as e:
        reader.load([2])
    msg = str(e.value)
    assert "committed to while it was read" in msg and "intact" in msg
    assert "damaged" not in msg and "init --force" not in msg
    assert n[0] == store.READ_TRIES


def test_readers_in_a_loop_beside_a_committing_thread_never_see_damage(ck):
    """Real concurrency: one thread commits block after block, another loads and verifies."""
    errors, loads, stop = [], [0], threading.Event()

    def read():
        while not stop.is_set():
            try:
                reader = Checkpoint.open(ck)
                model, _ = reader.load()
                assert loaded_hashes(reader, model) == [b["hash"] for b in reader.index["blocks"]]
                loads[0] += 1
            except Exception as e:  # noqa: BLE001 - the test reports any
                errors.append(repr(e))
                return

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(40):  # a commit every ~30 ms (bcd: one a visit, seconds apart)
            commit(ck, i % 3, step=0.001 * (i + 1))
            time.sleep(0.03)
    finally:
        stop.set()
        t.join()
    assert errors == [] and loads[0] > 0


def test_check_run_beside_a_commit_and_its_record(ck, tmp_path):
    """export/eval read the checkpoint, then state.json: bcd's commit and its record in
    state.json landing between the two is no mismatch (was: "does not belong to its
    checkpoint ... run `preinfer init --force`")."""
    run = tmp_path / "run"
    save_run_state(run, {"visits": {}, "checkpoint": checkpoint_record(Checkpoint.open(ck))})
    reader = Checkpoint.open(ck)
    commit(ck, 1)  # a visit's commit, then bcd records it
    save_run_state(
        run, {"visits": {"r0-b1": {}}, "checkpoint": checkpoint_record(Checkpoint.open(ck))}
    )
    check_run(run, reader, "export")
    assert reader.index == Checkpoint.open(ck).index
    # a checkpoint really trained elsewhere (nothing changes on a second look) is still refused
    commit(ck, 2)
    with pytest.raises(Exception, match="does not belong to its checkpoint"):
        check_run(run, Checkpoint.open(ck), "export")


# a loop of `preinfer eval --batches 1` (most of its time is the checkpoint read, where a
# commit can land) and, every 4th time, `preinfer export`, by the CLI's main in a process of its
# own beside the bcd, until the file argv[1] exists; prints each exit code and stderr line
READER = """
import contextlib, io, sys
from pathlib import Path
from pipelines.cli import main
stop, out, sets = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
n = 0
while not stop.exists() or n < 4:
    cmds = [["eval", "--batches", "1", *sets]]
    cmds += [["export", "--out", f"{out}/{n}", *sets]] if n % 4 == 0 else []
    for cmd in cmds:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(cmd)
        print(cmd[0], code, err.getvalue().strip().replace(chr(10), " | "), flush=True)
    n += 1
"""


@pytest.mark.slow
@pytest.mark.functional
def test_export_and_eval_in_a_loop_beside_a_live_bcd_never_report_damage(tiny_run, tmp_path):
    rotation = ["train.rounds=6", "train.max_steps=2"]  # 18 commits, a short visit apart
    cfg = tiny_run(*rotation)
    sets = [a for s in [*TINY, f"run.dir={cfg.run.dir}", *rotation] for a in ("--set", s)]
    sets += ["--config", "configs/demo.yaml"]
    stop = tmp_path / "stop"
    bcd = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "bcd", *sets], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(stop), str(tmp_path / "exports"), *sets],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        bcd_out, _ = bcd.communicate(timeout=900)
    finally:
        stop.touch()
        reader_out, _ = reader.communicate(timeout=300)
    assert bcd.returncode == 0, bcd_out[-3000:]
    assert reader.returncode == 0, reader_out[-3000:]
    lines = [ln for ln in reader_out.splitlines() if ln.startswith(("export ", "eval "))]
    bad = [ln for ln in lines if ln.split(" ", 2)[1] != "0"]
    assert len(lines) >= 4 and bad == [], bad[:5]
    assert "damaged" not in reader_out and "init --force" not in reader_out
    commits = Checkpoint.open(cfg.run.checkpoint).index["generation"]
    assert commits >= 18  # 6 rounds x 3 blocks committed while the readers read
    print(f"{len(lines)} reads beside {commits} commits")
