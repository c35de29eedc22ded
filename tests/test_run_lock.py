"""One run per run.dir: real processes holding, refused by, and dying with the run.dir lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from preinfer.run.lock import LOCK_NAME, RunDirLocked, run_lock

ROOT = Path(__file__).resolve().parents[1]

# a second process that takes the lock, says so, and holds it until its stdin closes
HOLDER = """
import sys
from preinfer.run.lock import run_lock
with run_lock(sys.argv[1], "holder"):
    print("held", flush=True)
    sys.stdin.read()
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "held"
    return p


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.cli", *args, "--config", "configs/demo.yaml"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_second_run_on_a_held_run_dir_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        r = _cli("bcd", "--set", f"run.dir={run}")
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"pid {holder.pid} on host {socket.gethostname()}" in r.stderr
        assert "`holder`" in r.stderr and "one run per run.dir" in r.stderr
        assert not (run / "state.json").exists() and not (run / "config.json").exists()
        # and in this process
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid}"), run_lock(run, "test"):
            pass
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    # a clean exit leaves no record: the next run takes it without a word
    assert (run / LOCK_NAME).read_text() == ""
    said = []
    with run_lock(run, "test", log=said.append):
        rec = json.loads((run / LOCK_NAME).read_text())
        assert rec["pid"] == os.getpid() and rec["command"] == "test"
    assert said == []


def test_a_sigkilled_holders_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    holder.stdin.close()
    rec = json.loads((run / LOCK_NAME).read_text())
    assert rec["pid"] == holder.pid  # the dead holder's record is still there
    said = []
    with run_lock(run, "after", log=said.append):
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"took over the stale lock of pid {holder.pid}" in said[0]


def test_a_lock_recorded_by_another_host_is_never_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rec = {"pid": os.getpid(), "host": "gpu-node-17.example", "command": "bcd --mode bcd",
           "started": "2031-01-01T00:00:00+0000"}  # fmt: skip
    (run / LOCK_NAME).write_text(json.dumps(rec))
    r = _cli("demo", "--set", f"run.dir={run}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "gpu-node-17.example" in r.stderr and "never taken over" in r.stderr
    assert f"delete {(run / LOCK_NAME).resolve()}" in r.stderr
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # the demo did nothing
    assert json.loads((run / LOCK_NAME).read_text()) == rec


def test_a_live_local_record_without_the_kernel_lock_is_still_refused(tmp_path):
    """The holder's file was replaced (or flock is not honoured there): the record of a live
    process on this host still refuses; nothing is taken from a running process."""
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        rec = (run / LOCK_NAME).read_text()
        (run / LOCK_NAME).unlink()  # a new inode, unlocked, with the holder's record
        (run / LOCK_NAME).write_text(rec)
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid}"), run_lock(run, "test"):
            pass
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_taken_twice_in_one_process_it_is_held_once(tmp_path):
    run = tmp_path / "run"
    with run_lock(run, "outer"):
        with run_lock(run, "inner"):
            pass
        # the inner exit released nothing: another process is still refused
        r = subprocess.run([sys.executable, "-c", HOLDER, str(run)], cwd=ROOT, input="",
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode != 0 and f"pid {os.getpid()}" in r.stderr
        assert json.loads((run / LOCK_NAME).read_text())["command"] == "outer"
    assert (run / LOCK_NAME).read_text() == ""
