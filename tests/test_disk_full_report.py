"""`preinfer report` and `preinfer eval` on a full disk (#53): one line naming the file they
could not write, exit 1, no traceback and no "Exception in thread" report, and no plot left cut
short (plots are written by temp file + rename like every other file).

The full disk is a file-size limit (RLIMIT_FSIZE: a real EFBIG on the first byte past it, for
any user) on the CLI's own process; TensorBoard's writer, which writes from a thread of its own,
gets a real ENOSPC from its record writer (the one write it makes past a full page)."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.eval import run_eval
from tests.pipeline_fixtures import TINY, quiet

ROOT = Path(__file__).resolve().parents[1]


def _fsize(nbytes: int):
    def pre():  # EFBIG instead of the SIGXFSZ that would kill the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return pre


# the CLI with TensorBoard's record writer failing as on a full disk (it runs in the writer's
# own thread: the thread's error reaches the stage through the writer's next flush)
FULL_TB = """
import errno, sys
from tensorboard.summary.writer import record_writer
def full(self, data):
    raise OSError(errno.ENOSPC, "No space left on device")
record_writer.RecordWriter.write = full
from pipelines.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(run: Path, *args: str, fsize: int | None = None, code: str | None = None):
    cmd = [*args, "--config", "configs/demo.yaml"]
    cmd += [a for s in [*TINY, f"run.dir={run}"] for a in ("--set", s)]
    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "pipelines.cli"]
    return subprocess.run([*head, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=_fsize(fsize) if fsize else None)  # fmt: skip


def _line(r: subprocess.CompletedProcess, cmd: str) -> str:
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, r.stderr[-3000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"preinfer {cmd}: error: the disk is full writing "), line
    assert "writing a file" not in line and "rerun the same command" in line
    return line


@pytest.mark.slow
@pytest.mark.functional
def test_report_and_eval_on_a_full_disk_name_the_file_and_leave_no_cut_plot(tiny_run):
    cfg = tiny_run("run.tensorboard=false")
    run = Path(cfg.run.dir)
    run_eval(cfg, max_batches=1, log=quiet)  # a metrics.jsonl to report (and to append to)
    # report: the first plot passes the limit (was: a cut progress.png, "writing a file")
    line = _line(_cli(run, "report", fsize=4096), "report")
    assert f"writing {run / 'report' / 'progress.png'} (" in line
    assert sorted(p.name for p in (run / "report").iterdir()) == []  # no plot, no temp
    # eval: metrics.jsonl is past the limit already (was: "writing a file")
    size = (run / "metrics.jsonl").stat().st_size
    line = _line(_cli(run, "eval", "--batches", "1", fsize=size), "eval")
    assert f"writing {run / 'metrics.jsonl'} (" in line
    # eval whose record is written but whose TensorBoard mirror is not: its directory is named
    # (the event file where it was begun), and the writer thread's error is not printed (was:
    # "Exception in thread Thread-1" and a traceback after the line)
    r = _cli(run, "eval", "--batches", "1", "--set", "run.tensorboard=true", code=FULL_TB)
    line = _line(r, "eval")
    assert f"writing {run / 'tensorboard'}" in line
    assert list((run / "tensorboard").glob("events.*")) == []  # the empty one it began is gone
    assert (run / "metrics.jsonl").read_text().count('"event": "eval"') == 2
    # space back: the report is written whole
    assert _cli(run, "report").returncode == 0
    assert (run / "report" / "progress.png").stat().st_size > 1000
