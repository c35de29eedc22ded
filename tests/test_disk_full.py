"""The disk fills in every stage (token store, checkpoint block files, cache shards / markers /
manifest, the visit state, state.json): a real OS error, nothing already written is lost, and
rerunning the same commands once space is back ends with the same checkpoint as a run that never
hit it.

The error is real: ENOSPC from a small tmpfs where this machine can mount one (root), else
EFBIG from a file-size limit (RLIMIT_FSIZE, unprivileged) on the stages' process, so the test
never skips. The stages run in a child process (the limit must not touch pytest's own files).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from core import faults
from preinfer.checkpoint import Checkpoint
from storage.tokens import TokenStore
from tests.pipeline_fixtures import TINY

ROOT = Path(__file__).resolve().parents[1]
OVER = [*TINY, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=2",
        "preinfer.executor=local",
        ]  # fmt: skip

# Runs tokenize -> init -> bcd in one process and reports the first failure (stage, errno,
# file name) as JSON on its last line; a stage whose output is complete does nothing on rerun.
_CHILD = r"""
import json, sys, traceback
from pipelines.bcd import run_bcd
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint_format import CheckpointExists
from preinfer.config import load_config
cfg = load_config("configs/demo.yaml", sys.argv[1:])
quiet = lambda *a, **k: None
stage = "tokenize"
try:
    run_tokenize(cfg, log=quiet)
    stage = "init"
    try:
        run_init(cfg, log=quiet)
    except CheckpointExists:
        pass
    stage = "bcd"
    run_bcd(cfg, log=quiet)
    print(json.dumps({"ok": True}))
except OSError as e:
    print(json.dumps({"ok": False, "stage": stage, "errno": e.errno, "file": str(e.filename),
                      "where": traceback.format_exc()[-1500:]}))
"""


def _limit(nbytes: int | None):
    def pre():
        if nbytes is not None:  # EFBIG instead of the SIGXFSZ that would kill the process
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return pre


def _stages(run_dir: Path, fsize: int | None = None, fill_after_shards: int = 0,
            extra: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """tokenize -> init -> bcd in a child; fill_after_shards: once that many cache shards are
    done, fill the disk under the child (someone else's file), as a build goes on writing."""
    env = dict(os.environ)
    if fill_after_shards:
        env[faults.SHARD_DELAY_S] = "0.3"  # time to fill the disk between two shards
    p = subprocess.Popen([sys.executable, "-c", _CHILD, f"run.dir={run_dir}", *OVER, *extra], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=_limit(fsize))  # fmt: skip
    if fill_after_shards:
        while p.poll() is None and len(list(run_dir.glob("cache/*/done/*"))) < fill_after_shards:
            time.sleep(0.05)
        free = shutil.disk_usage(run_dir).free
        with open(run_dir.parent / "filler", "wb") as f, contextlib.suppress(OSError):
            f.write(b"\0" * free)  # fills it whole: the next page written is an ENOSPC
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _mount(mnt: Path, size: int) -> bool:
    mnt.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
                       capture_output=True, text=True)  # fmt: skip
    return r.returncode == 0


def _remount(mnt: Path, size: int) -> None:
    r = subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], capture_output=True)
    assert r.returncode == 0, r.stderr


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _category(res: dict) -> str:
    """What was being written: from the file name, else from the writer in the traceback."""
    text = f"{res['file']}\n{res['where']}"
    for key, cat in (("tokens", "tokens"), ("/cache/", "cache"), ("storage/cache.py", "cache"),
                     ("train_state", "visit state"), ("_save_state", "visit state"),
                     ("checkpoint", "checkpoint"), ("state.json", "state.json")):  # fmt: skip
        if key in text:
            return cat
    return f"other ({res['file']}: {res['where'][-300:]})"


def _same_as_clean(run: Path, clean: Path) -> None:
    a, b = Checkpoint.open(clean / "checkpoint"), Checkpoint.open(run / "checkpoint")
    assert [b.block_hash(i) for i in range(b.num_blocks)] == [
        a.block_hash(i) for i in range(a.num_blocks)
    ]
    b.verify()
    TokenStore(run / "tokens").verify()
    state = json.loads((run / "state.json").read_text())
    assert list(state["visits"]) == ["r0-b0", "r0-b1", "r0-b2"] and not state.get("pending")


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> tuple[Path, dict]:
    """A run that never hits a full disk, and the bytes each stage leaves (and the peak)."""
    run = tmp_path_factory.mktemp("clean") / "run"
    assert _stages(run) == {"ok": True}
    sizes = {k: _du(run / k) for k in ("tokens", "checkpoint")}
    return run, sizes


def test_disk_full_in_every_stage_loses_nothing_and_a_rerun_completes(clean_run, tmp_path):
    clean, sizes = clean_run
    tok, ck = sizes["tokens"], sizes["checkpoint"]
    mnt = Path(f"/tmp/preinfer-full-{uuid.uuid4().hex[:8]}")
    if _mount(mnt, 64 << 20):
        subprocess.run(["umount", str(mnt)], capture_output=True)
        # tmpfs sizes (page-rounded) that fill inside each stage, from the clean run's sizes;
        # the cache: a disk with room for the build (the disk guard passes) filled mid-build
        # a visit state (block 0 + its AdamW moments) on a run.dir with less room than it
        # needs, caches on another disk (their guard passes)
        elsewhere = (f"cache.root={tmp_path / 'cache'}",)
        points = {"tokens": (tok // 2, 0, ()), "checkpoint": (tok + ck // 2, 0, ()),
                  "visit state": (tok + ck + (64 << 10), 0, elsewhere),
                  "cache": (64 << 20, 2, ())}  # fmt: skip
        seen = set()
        try:
            for want, (size, fill_after, extra) in points.items():
                _mount(mnt, max(size, 16 << 10))
                run = mnt / "run"
                res = _stages(run, fill_after_shards=fill_after, extra=extra)
                assert not res["ok"] and res["errno"] == errno.ENOSPC, (want, res)
                seen.add(_category(res))
                (mnt / "filler").unlink(missing_ok=True)
                _remount(mnt, 256 << 20)  # space is back
                assert _stages(run, extra=extra) == {"ok": True}, want
                _same_as_clean(run, clean)
                subprocess.run(["umount", str(mnt)], capture_output=True)
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
            shutil.rmtree(mnt, ignore_errors=True)
        assert {"tokens", "checkpoint", "visit state", "cache"} <= seen, seen
    else:  # no mount rights: a file-size limit gives a real EFBIG on the first file past it
        biggest = max(f.stat().st_size for f in clean.rglob("*") if f.is_file())
        for lim in (4096, biggest // 2):
            run = tmp_path / f"lim{lim}"
            res = _stages(run, fsize=lim)
            assert not res["ok"] and res["errno"] == errno.EFBIG, res
            assert _stages(run) == {"ok": True}
            _same_as_clean(run, clean)


def test_the_cli_says_the_disk_is_full_in_one_line(tmp_path):
    """What a user sees: one line naming the file and what to do, exit 1, no traceback."""
    args = [sys.executable, "-m", "pipelines.cli", "tokenize", "--config", "configs/demo.yaml",
            "--set", f"run.dir={tmp_path / 'run'}", *[x for s in TINY for x in ("--set", s)]]  # fmt: skip
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit(2048), env={**os.environ})  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("preinfer tokenize: error:")]
    assert "File too large" in line or "No space left" in line
    assert str(tmp_path / "run") in line and "rerun" in line
