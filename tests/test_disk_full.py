"""The disk fills in every stage (token store, checkpoint block files, cache shards / markers /
manifest, the visit state, state.json): a real OS error, nothing already written is lost, and
rerunning the same commands once space is back ends with the same checkpoint as a run that never
hit it.

The error is real: ENOSPC from a small tmpfs where this machine can mount one (root), else
EFBIG from a file-size limit (RLIMIT_FSIZE, unprivileged) on the stages' process, so the test
never skips. The stages run in a child process (the limit must not touch pytest's own files).
A Ray build's actors get the limit once they run (resource.prlimit on their pids: a limit set
before Ray starts stops Ray itself, whose object store and logs are files too); Python ignores
SIGXFSZ, so their writes past it fail with EFBIG. The commands a user runs (`preinfer cache
build`, `preinfer bcd`) must each end with exit 1 and one line naming the file.
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
from pipelines.cache_build import build_cache
from preinfer.checkpoint.store import Checkpoint
from storage.cache import CacheWriter
from storage.layout import MANIFEST
from storage.tokens import TokenStore
from tests.pipeline_fixtures import TINY, assert_same_weights, quiet
from tests.test_kills import assert_same_cache, shard_log

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
from preinfer.checkpoint.format import CheckpointExists
from preinfer.run.config import load_config
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


def _fill(mnt: Path) -> None:
    """Fill the disk at `mnt` whole (someone else's file): the next page written is an ENOSPC."""
    free = shutil.disk_usage(mnt).free
    with open(mnt / "filler", "wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * free)


def _communicate(p: subprocess.Popen, timeout: float = 900) -> tuple[str, str]:
    """(stdout, stderr) of `p` once it exits; killed (and the test failed) past `timeout`."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise


def _stages(run_dir: Path, fsize: int | None = None, fill_after_shards: int = 0,
            extra: tuple[str, ...] = (), env: dict | None = None, rc: int = 0) -> dict:  # fmt: skip
    """tokenize -> init -> bcd in a child; fill_after_shards: once that many cache shards are
    done, fill the disk under the child (someone else's file), as a build goes on writing.
    env: more environment (fault switches); rc: the exit status expected ({} unless 0)."""
    env = {**os.environ, **(env or {})}
    if fill_after_shards:
        env[faults.SHARD_DELAY_S] = "0.3"  # time to fill the disk between two shards
    p = subprocess.Popen([sys.executable, "-c", _CHILD, f"run.dir={run_dir}", *OVER, *extra], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=_limit(fsize))  # fmt: skip
    if fill_after_shards:
        while p.poll() is None and len(list(run_dir.glob("cache/*/done/*"))) < fill_after_shards:
            time.sleep(0.05)
        _fill(run_dir.parent)
    out, err = _communicate(p)
    assert p.returncode == rc, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]) if rc == 0 else {}


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
                     ("train_state", "visit state"), ("visit_state.py", "visit state"),
                     ("checkpoint", "checkpoint"), ("state.json", "state.json")):  # fmt: skip
        if key in text:
            return cat
    return f"other ({res['file']}: {res['where'][-300:]})"


def _same_as_clean(run: Path, clean: Path) -> None:
    assert_same_weights(clean / "checkpoint", run / "checkpoint")
    b = Checkpoint.open(run / "checkpoint")
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
    # init writes weights only; the trained blocks' optimizer states come with their commits
    sizes["checkpoint"] -= sum(f.stat().st_size for f in (run / "checkpoint").glob("optim_*"))
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


RAY_LIMIT = 4096  # bytes an actor may write to a file: a done marker (~350 B), not a shard


@contextlib.contextmanager
def _small_disk(size: int):
    """A tmpfs of `size` bytes where this machine can mount one (its path), else None: the
    caller then puts a file-size limit on the processes that write."""
    mnt = Path(f"/tmp/preinfer-full-{uuid.uuid4().hex[:8]}")
    mounted = _mount(mnt, size)
    try:
        yield mnt if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)


def _cli(args: list[str], sets: list[str], *, env: dict | None = None,
         fsize: int | None = None) -> subprocess.Popen:  # fmt: skip
    """`preinfer <args> --set ...` started as a user runs it (stdout, stderr piped)."""
    cmd = [sys.executable, "-m", "pipelines.cli", *args, "--config", "configs/demo.yaml",
           *[x for s in sets for x in ("--set", s)]]  # fmt: skip
    env = {**os.environ, **(env or {})}
    env.pop("RAY_ADDRESS", None)  # its own Ray instance
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=_limit(fsize))  # fmt: skip


def _one_line(err: str, cmd: str, under: Path, code: int) -> str:
    """The one disk-full line of `preinfer <cmd>` naming a file under `under` and the OS error
    `code` (ENOSPC: the tmpfs, EFBIG: the file-size limit); no traceback (Ray's "Unhandled
    error" reports carry one) and no other error line."""
    assert "Traceback" not in err and "Unhandled error" not in err, err[-4000:]
    lines = [x for x in err.splitlines() if "error" in x.lower()]
    assert len(lines) == 1 and lines[0].startswith(f"preinfer {cmd}: error: the disk is full"), err
    assert f"writing {under}/" in lines[0] and f"({os.strerror(code)})" in lines[0], lines[0]
    assert "rerun the same command" in lines[0]
    return lines[0]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "filler"}  # fmt: skip


def _done(root: Path, fps: list[str]) -> int:
    return sum(len(list((root / fp / "done").glob("*.json"))) for fp in fps)


@pytest.mark.ray
# two Ray starts and three commands: ~60-180 s on 2 busy CPUs
def test_a_ray_build_on_a_full_disk_fails_in_one_line_keeps_every_cache_and_resumes(
    tiny_run, tmp_path
):
    """`preinfer cache build` over Ray actors (executor=ray) on a disk that fills (a) while the
    actors write shards, (b) as the driver writes the manifests (every shard in). Each time:
    exit 1 and one line naming the file (not Ray's wrapper of the actor's OSError, which has no
    errno and prints as a traceback), the earlier complete caches and every committed shard
    intact, and the rerun once space is back ends with a clean build's bytes."""
    clean = tiny_run(f"cache.root={tmp_path / 'clean'}")
    fps = list(build_cache(clean, 2, log=quiet)["fingerprints"].values())  # local, with room
    total = sum(CacheWriter.open(clean.cache.root, fp).num_shards for fp in fps)
    with _small_disk(16 << 20) as mnt:
        code = errno.ENOSPC if mnt else errno.EFBIG
        root = (mnt or tmp_path) / "cache"
        ray_sets = [f"cache.root={root}", "preinfer.executor=ray"]
        sets = [*TINY, f"run.dir={clean.run.dir}", *ray_sets]
        build_cache(tiny_run(f"cache.root={root}"), 1, log=quiet)  # an earlier complete boundary
        earlier = _files(root)

        # (a) the disk fills once two shards are committed, the actors writing on
        log = tmp_path / "shards.log"
        p = _cli(["cache", "build", "--block", "2"], sets,
                 env={faults.SHARD_DELAY_S: "0.5", faults.SHARD_LOG: str(log)})  # fmt: skip
        limited: set[int] = set()
        while p.poll() is None:
            if _done(root, fps) >= 2 and mnt is not None and not (mnt / "filler").exists():
                _fill(mnt)
            elif _done(root, fps) >= 2 and mnt is None:  # each actor, before its next write
                for pid in {row[0] for row in shard_log(log)} - limited:
                    with contextlib.suppress(ProcessLookupError):
                        resource.prlimit(pid, resource.RLIMIT_FSIZE, (RAY_LIMIT, RAY_LIMIT))
                    limited.add(pid)
            time.sleep(0.05)
        err = _communicate(p)[1]
        assert p.returncode == 1, err[-4000:]
        _one_line(err, "cache", root, code)
        assert {k: v for k, v in _files(root).items() if k in earlier} == earlier
        for fp in fps:  # a marker on disk = a shard whose files verify; no manifest
            marked = {int(m.stem) for m in (root / fp / "done").glob("*.json")}
            w = CacheWriter.open(root, fp)
            assert set(range(w.num_shards)) - set(w.missing_shards()) == marked
            assert not (root / fp / MANIFEST).exists()
        committed = _done(root, fps)
        assert 2 <= committed < total
        if mnt is not None:
            (mnt / "filler").unlink()
        res = build_cache(tiny_run(*ray_sets), 2, log=quiet)
        assert res["action"] == "built" and res["shards"] == total - committed
        for fp in fps:
            assert_same_cache(clean.cache.root, root, fp)
        assert not list(root.rglob("*.partial"))

        # (b) every shard in, no manifest (a driver gone before its finalize leaves that);
        # the resumed build computes nothing (no Ray) and writes the manifests on a full disk
        for fp in fps:
            (root / fp / MANIFEST).unlink()
        before = _files(root)
        if mnt is not None:
            _fill(mnt)
        smallest = min((Path(clean.cache.root) / fp / MANIFEST).stat().st_size for fp in fps)
        p = _cli(["cache", "build", "--block", "2"], sets, fsize=None if mnt else smallest - 1)
        err = _communicate(p)[1]
        assert p.returncode == 1, err[-4000:]
        assert MANIFEST in _one_line(err, "cache", root, code)
        assert _files(root) == before  # nothing lost, nothing half-written left
        if mnt is not None:
            (mnt / "filler").unlink()
        res = build_cache(tiny_run(*ray_sets), 2, log=quiet)
        assert res["action"] == "built" and res["shards"] == 0
        for fp in fps:
            assert_same_cache(clean.cache.root, root, fp)


def _block_hashes(run: Path) -> list[str]:
    ck = Checkpoint.open(run / "checkpoint")
    return [ck.block_hash(i) for i in range(ck.num_blocks)]


# a rotation killed, then finished: ~30-45 s on 2 busy CPUs
def test_a_full_disk_at_state_json_keeps_the_last_one_and_a_rerun_completes(
    clean_run, tiny_base, tmp_path
):
    """`preinfer bcd` resuming a killed rotation rewrites state.json first, on a full disk:
    exit 1 and one line naming state.json; the killed rotation's state.json, checkpoint and
    caches are kept byte for byte; the rerun once space is back ends where a clean run does."""
    clean, _ = clean_run
    with _small_disk(16 << 20) as mnt:
        code = errno.ENOSPC if mnt else errno.EFBIG
        run = (mnt or tmp_path) / "run"
        shutil.copytree(tiny_base, run)  # tokens and a fresh checkpoint, as the clean run's
        # killed in block 1's visit: state.json has visit r0-b0 and r0-b1 pending
        _stages(run, env={faults.KILL_AT: "0:1:1"}, rc=137)
        state = (run / "state.json").read_bytes()
        assert list(json.loads(state)["visits"]) == ["r0-b0"]
        blocks, caches = _block_hashes(run), _files(run / "cache")
        if mnt is not None:
            _fill(mnt)
        # the limit: past the run lock's record (~300 B), short of state.json
        p = _cli(["bcd"], [f"run.dir={run}", *OVER], fsize=None if mnt else len(state) // 2)
        err = _communicate(p)[1]
        assert p.returncode == 1, err[-4000:]
        assert "state.json" in _one_line(err, "bcd", run, code)
        assert (run / "state.json").read_bytes() == state
        assert _block_hashes(run) == blocks and _files(run / "cache") == caches
        assert not list(run.rglob("*.partial"))
        if mnt is not None:
            (mnt / "filler").unlink()
        assert _stages(run) == {"ok": True}
        _same_as_clean(run, clean)
