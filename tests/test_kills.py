"""Real kills of a Ray cache build (executor=ray, 2 actors), never simulated: SIGKILL of the
driver mid-build, and an actor exiting inside a shard write (core/faults.py). Each time the
cache the build ends with holds a clean build's bytes, and no process of the killed build
writes after the rerun starts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from core.faults import KILL_ONCE, KILL_POINT, SHARD_DELAY_S, SHARD_LOG
from pipelines.cache_build import build_cache
from storage import atomic
from storage.cache_tools import gc_caches
from storage.layout import MANIFEST, is_complete
from storage.reader import open_cache
from tests.pipeline_fixtures import TINY, quiet

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SHARDS = "cache.shard_mb=0.02"  # 10 rows a shard: 27 train + 2 val shards at boundary 1


def cache_files(cdir: Path) -> dict[str, bytes]:
    """Every file of a cache but temps, leases and the two files that record the config
    (manifest.json, build.json: cache.root and preinfer.executor differ between builds)."""
    return {
        str(p.relative_to(cdir)): p.read_bytes()
        for p in sorted(cdir.rglob("*"))
        if p.is_file()
        and not atomic.is_partial(p)
        and p.relative_to(cdir).parts[0] not in ("leases", MANIFEST, "build.json")
    }


def assert_same_cache(root_a, root_b, fp: str) -> None:
    """The caches `fp` under two roots hold the same bytes: every shard, marker, samples and
    array metadata file, and the same manifest but for its creation time and config."""
    a, b = Path(root_a) / fp, Path(root_b) / fp
    fa, fb = cache_files(a), cache_files(b)
    assert sorted(fa) == sorted(fb), set(fa) ^ set(fb)
    assert [k for k in fa if fa[k] != fb[k]] == []
    ma, mb = (json.loads((d / MANIFEST).read_text()) for d in (a, b))
    for m in (ma, mb):
        m.pop("created"), m["meta"].pop("config")
    assert ma == mb  # shard checksums, sizes, stats
    assert open_cache(root_b, fp, lease_s=None).verify() == []


def shard_log(path: Path) -> list[tuple[int, str, int, float]]:
    """(pid, fingerprint, shard, time) of every shard task start (core.faults.SHARD_LOG)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        pid, fp, shard, t = line.split()
        rows.append((int(pid), fp, int(shard), float(t)))
    return rows


def retried(log) -> dict[tuple[str, int], list[int]]:
    """{(fingerprint, shard): pids} of the shards started more than once."""
    by: dict[tuple[str, int], list[int]] = {}
    for pid, fp, shard, _ in log:
        by.setdefault((fp, shard), []).append(pid)
    return {k: v for k, v in by.items() if len(v) > 1}


def alive(procs: dict[int, float]) -> list[int]:
    """Pids of {pid: create_time} still running (the same process, not a reused pid)."""
    out = []
    for pid, created in procs.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


WRITE = """
import sys
import numpy as np
from storage.cache import CacheWriter
from storage.config import CacheConfig
root, n = sys.argv[1], 20
cfg = CacheConfig(dtype="int8", codec="zstd", shuffle="none", shard_mb=8 * 4 * 8 / 2**20)
ids = np.zeros((n, 4), np.int32)
w = CacheWriter.create(root, "ab12cd34", samples=(np.arange(n), ids, ids), seq_len=4,
                       hidden_size=8, cache_cfg=cfg, meta={"boundary": 1})
x = np.random.default_rng(0).standard_normal((n, 4, 8)).astype(np.float32)
for i in w.missing_shards():
    w.write_shard(i, x[slice(*w.shard_range(i))])
w.finalize()
"""


@pytest.mark.parametrize("point", ["cache.shard_tmp@2", "cache.shard_file@3"])
def test_a_writer_killed_inside_a_shard_write_resumes_to_the_same_bytes(
    tmp_path, point, monkeypatch
):
    """A real exit (137) inside write_shard: shard 1's files written aside (shard_tmp@2), or
    its values in place and its scales not (shard_file@3; int8: 2 files a shard). No marker
    names shard 1, so the resumed writer rewrites it and the cache equals an unbroken one."""
    env = {**os.environ, KILL_POINT: point}
    run = [sys.executable, "-c", WRITE]
    died = subprocess.run([*run, str(tmp_path / "a")], cwd=REPO, env=env, capture_output=True)
    assert died.returncode == 137, died.stderr.decode()[-2000:]
    cdir = tmp_path / "a" / "ab12cd34"
    assert sorted(p.name for p in (cdir / "done").iterdir()) == ["00000.json"]
    assert list(cdir.rglob("*.partial"))  # what the dead writer left aside
    for root in ("a", "b"):  # resume the killed one; write another one unbroken (here)
        monkeypatch.setattr(sys, "argv", ["-c", str(tmp_path / root)])
        exec(compile(WRITE, "WRITE", "exec"), {"__name__": "__write__"})
    assert cache_files(cdir) == cache_files(tmp_path / "b" / "ab12cd34")
    assert open_cache(tmp_path / "a", "ab12cd34", lease_s=None).verify() == []


def ray_worker(cmdline: str) -> bool:
    """A process of a Ray instance that runs tasks and actors, or starts what does, by its
    command line: a worker starts as default_worker.py and retitles itself ray::IDLE,
    ray::<Actor>.<method>, ...; the raylet, which starts workers, names default_worker.py in
    its arguments. The node's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) run none."""
    return "default_worker.py" in cmdline or (
        cmdline.startswith("ray::") and not cmdline.split()[0].endswith("Agent")
    )


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.ray
@pytest.mark.slow  # a driver process, then a rerun: two Ray starts (~1-2 min on 2 busy CPUs)
@pytest.mark.functional
def test_sigkill_of_the_build_driver_then_rerun_gives_a_clean_builds_bytes(
    tiny_run, tmp_path, monkeypatch
):
    """SIGKILL the driver of `preinfer cache build` (executor=ray, 2 actors) while its actors
    write shards. Ray fate-shares a driver's actors: they are gone within seconds, and nothing
    under the cache changes after that. The rerun computes only the shards without a valid
    marker, and the cache it finishes equals a clean build's bytes."""
    clean = tiny_run(f"cache.root={tmp_path / 'clean'}", SHARDS)
    fps = build_cache(clean, 1, log=quiet)["fingerprints"]
    root, log = tmp_path / "faulty", tmp_path / "shards.log"
    extra = [f"cache.root={root}", SHARDS, "preinfer.executor=ray"]
    sets = [*TINY, f"run.dir={clean.run.dir}", *extra]
    env = {**os.environ, SHARD_DELAY_S: "0.5", SHARD_LOG: str(log)}
    env.pop("RAY_ADDRESS", None)
    cmd = [str(BIN / "preinfer"), "cache", "build", "--block", "1", "--config", "configs/demo.yaml"]
    driver = subprocess.Popen(
        [*cmd, *[a for s in sets for a in ("--set", s)]], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    family: dict[int, float] = {}  # the driver's descendants: its Ray instance and actors
    names: dict[int, str] = {}  # their command lines, as last seen

    def collect() -> None:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(driver.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    created, name = p.create_time(), " ".join(p.cmdline())
                    if family.setdefault(p.pid, created) == created:  # not a reused pid
                        names[p.pid] = name

    try:
        deadline = time.time() + 300
        while True:  # both actors have started shards and at least two are committed
            assert driver.poll() is None, driver.stdout.read()[-4000:]
            assert time.time() < deadline, "the build did not get going"
            collect()
            actors = {pid for pid, *_ in shard_log(log)}
            if len(actors) >= 2 and len(list(root.glob("*/done/*.json"))) >= 2:
                break
            time.sleep(0.2)
        collect()
        assert actors <= set(family), "the shard tasks ran outside the driver's Ray instance"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)
        actors = {pid for pid, *_ in shard_log(log)}  # every process that started a shard
        assert actors <= set(family), "a shard task ran outside the driver's Ray instance"
        killed_at = time.time()
        while alive({a: family[a] for a in actors}) and time.time() < killed_at + 60:
            time.sleep(0.5)
        assert not alive({a: family[a] for a in actors}), "the killed driver's actors live on"
        assert not all(is_complete(root, fp) for fp in fps.values()), "killed after the build"
        before = snapshot(root)
        # the check below is meaningful once no process that could write is left, not after
        # a guessed time: every Ray worker of the killed instance (the actors, any other
        # worker that could take a task) and its raylet have exited, so the window below
        # covers all the rest of their lives. Its agents outlive it (finally) but run no task
        workers = {pid: t for pid, t in family.items() if pid in actors or ray_worker(names[pid])}
        while alive(workers) and time.time() < killed_at + 120:
            time.sleep(0.2)
        assert not alive(workers), [names[p] for p in alive(workers)]
        assert snapshot(root) == before, "files changed after the driver and its actors died"
        done = len(list(root.glob("*/done/*.json")))
        total = sum(
            open_cache(clean.cache.root, fp, lease_s=None).num_shards for fp in fps.values()
        )

        rerun_at = time.time()
        monkeypatch.setenv(SHARD_LOG, str(log))
        res = build_cache(tiny_run(*extra), 1, log=quiet)
        assert res["action"] == "built" and res["shards"] == total - done > 0
        late = {pid for pid, _, _, t in shard_log(log) if t >= rerun_at}
        assert late and not late & actors, "a killed build's actor ran a shard after the rerun"
        for fp in fps.values():
            assert_same_cache(clean.cache.root, root, fp)
    finally:
        driver.kill()
        # what of its Ray instance outlives it: its DashboardAgent and RuntimeEnvAgent
        # processes (seen > 60 s; they write nothing under the cache)
        for pid in alive(family):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).send_signal(signal.SIGKILL)


@pytest.mark.ray
@pytest.mark.slow  # two builds, one on Ray with an actor restart (~1 min on 2 busy CPUs)
@pytest.mark.functional
def test_an_actor_killed_inside_a_shard_write_gives_a_clean_builds_bytes(
    tiny_run, tmp_path, monkeypatch
):
    """An actor exits (os._exit, core/faults.py KILL_ONCE) after one file of a shard is in
    place and before the rest and its marker (int8: values committed, scales not): past its
    first read and compute. Ray restarts it and retries the call; the shard is written again
    whole, and the cache equals a clean build's bytes. The dead actor's temp file (never read:
    no marker names it) is gone when the build returns: the build's finalize
    (CacheWriter.open) removes the `.partial` files of pids dead on this host."""
    extra = ("cache.dtype=int8", SHARDS)
    clean = tiny_run(f"cache.root={tmp_path / 'clean'}", *extra)
    fps = build_cache(clean, 1, log=quiet)["fingerprints"]
    marker, log = tmp_path / "died", tmp_path / "shards.log"
    monkeypatch.setenv(KILL_ONCE, f"cache.shard_file:{marker}")
    monkeypatch.setenv(SHARD_LOG, str(log))
    root = tmp_path / "faulty"
    res = build_cache(tiny_run(f"cache.root={root}", "preinfer.executor=ray", *extra), 1, log=quiet)
    assert marker.exists(), "the kill point was never reached"
    dead = int(marker.read_text())
    again = retried(shard_log(log))
    assert any(dead in pids and pids[-1] != dead for pids in again.values()), (dead, again)
    assert res["fingerprints"] == fps
    assert not list(root.rglob("*.partial"))
    assert not gc_caches(root, keep=set(fps.values()), dry_run=True)
    for fp in fps.values():
        assert_same_cache(clean.cache.root, root, fp)


BUILD = (
    "import sys; from pipelines.cache_build import build_cache; from tests.pipeline_fixtures "
    "import tiny_cfg, quiet; build_cache(tiny_cfg(sys.argv[1], *sys.argv[2:]), 2, log=quiet)"
)


def test_a_bf16_build_killed_in_a_shard_write_resumes_in_another_process_to_a_clean_builds_bytes(
    tiny_run, tmp_path
):
    """The path a bf16-native device takes (bf16 compute, bf16 cache; forced on any CPU): a
    build of boundary 2 in process, killed inside its 3rd shard file write, rerun by a new
    process, ends with the bytes a build never killed writes (another root, in this process)."""
    over = ("cache.dtype=bf16", "preinfer.compute_dtype=bf16", "preinfer.executor=local", SHARDS)
    cfg = tiny_run(*over)
    args = [sys.executable, "-c", BUILD, str(cfg.run.dir), *over]
    died = subprocess.run(args, cwd=REPO, env={**os.environ, KILL_POINT: "cache.shard_file@3"},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert died.returncode == 137, died.stderr[-2000:]
    again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    clean = tiny_run(*over, f"cache.root={tmp_path / 'clean'}")
    fps = build_cache(clean, 2, log=quiet)["fingerprints"]
    for fp in fps.values():
        assert_same_cache(clean.cache.root, cfg.cache.root, fp)
        manifest = json.loads((Path(cfg.cache.root) / fp / MANIFEST).read_text())
        assert manifest["meta"]["compute_dtype"] == "bf16"
