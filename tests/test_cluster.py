"""Real local Ray clusters: `ray start` nodes on 127.0.0.1 + `ray job submit` of a cache build.

Marked `cluster` (run by `make test-slow`). Each cluster gets its own temp dirs and ports, and
is always torn down, even when a test fails: every process whose command line names one of
the cluster's temp dirs, and everything below them, is killed by pid. Not `ray stop --force`:
that kills every Ray process on the machine, other users' and other tests' included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from core.faults import SHARD_DELAY_S, SHARD_LOG
from pipelines.cache_build import build_cache, plan_block
from storage.reader import open_cache
from tests.pipeline_fixtures import TINY, quiet
from tests.test_kills import assert_same_cache, retried, shard_log

pytestmark = pytest.mark.cluster
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
TRANSIENT = ("Connection", "No available agent", "try again later", "Failed to connect")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A head node plus worker nodes started with `ray start`, each with its own temp dir."""

    def __init__(self):
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.temps: list[str] = []
        self.seen: dict[int, float] = {}  # pid -> create_time of every process of the cluster
        self.port, self.dash = free_port(), free_port()
        self.gcs = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dash}"

    def _temp(self) -> str:
        t = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix sockets live under it
        self.temps.append(t)
        return t

    def _ray_start(self, args: list[str]) -> None:
        # the job agent's HTTP port is fixed (52365) unless given: any other Ray on this
        # machine holding it leaves the cluster with "No available agent to submit job"
        agent = f"--dashboard-agent-listen-port={free_port()}"
        r = subprocess.run(
            [str(BIN / "ray"), "start", "--disable-usage-stats", agent, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        self.processes()  # remember them now: a killed node's children are orphaned later
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]

    def start_head(self, num_cpus: int) -> None:
        self._ray_start(
            [
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                f"--num-cpus={num_cpus}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dash}",
                f"--temp-dir={self._temp()}",
            ]
        )

    def add_worker(self, num_cpus: int, resources: dict | None = None) -> str:
        """Start a worker node (a second raylet on this host); returns its temp dir."""
        temp = self._temp()
        self._ray_start(
            [
                f"--address={self.gcs}",
                "--node-ip-address=127.0.0.1",
                f"--num-cpus={num_cpus}",
                f"--node-manager-port={free_port()}",
                f"--resources={json.dumps(resources or {})}",
                f"--temp-dir={temp}",
            ]
        )
        return temp

    def processes(self, temp: str | None = None) -> list[psutil.Process]:
        """Processes of the cluster (of one node's temp dir): those naming it, and descendants."""
        temps = [temp] if temp else self.temps
        out: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(t in " ".join(p.info["cmdline"] or []) for t in temps):
                    for q in [p, *p.children(recursive=True)]:
                        out[q.pid] = q
            except psutil.Error:
                continue
        if temp is None:
            for q in out.values():
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(q.pid, q.create_time())
        return list(out.values())

    def raylet(self, temp: str) -> psutil.Process:
        (p,) = [p for p in self.processes(temp) if p.name() == "raylet"]
        return p

    def teardown(self) -> None:
        self.processes()
        procs = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:  # still ours, not a reused pid
                    procs.append(p)
            except psutil.Error:
                continue
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
        for t in self.temps:
            shutil.rmtree(t, ignore_errors=True)

    # ------------------------------------------------------------------------------ jobs

    def job(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """`ray job ARGS...` against the dashboard, retried while the job server comes up."""
        cmd = [str(BIN / "ray"), "job", args[0], "--address", self.dashboard, *args[1:]]
        deadline = time.time() + 180
        while True:
            r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
            out = r.stdout + r.stderr
            if r.returncode == 0 or time.time() > deadline or not any(t in out for t in TRANSIENT):
                return r
            time.sleep(3)

    def client(self):
        from ray.job_submission import JobSubmissionClient

        deadline = time.time() + 180
        while True:  # the job server comes up a little after `ray start` returns
            try:
                return JobSubmissionClient(self.dashboard)
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(3)

    def submit(self, client, **kw) -> str:
        """client.submit_job(**kw), retried while the job agent comes up ("No available
        agent to submit job, please try again later")."""
        deadline = time.time() + 300
        while True:
            try:
                return client.submit_job(**kw)
            except RuntimeError as e:
                if time.time() > deadline or not any(t in str(e) for t in TRANSIENT):
                    raise
                time.sleep(3)

    def wait_job(self, job_id: str, timeout: float) -> str:
        client, deadline = self.client(), time.time() + timeout
        while time.time() < deadline:
            status = str(client.get_job_status(job_id)).split(".")[-1]
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            time.sleep(2)
        return "TIMEOUT"


@pytest.fixture
def ray_cluster():
    """A one-node cluster: `ray start --head`."""
    c = Cluster()
    try:
        c.start_head(num_cpus=2)
        yield c
    finally:
        c.teardown()


@pytest.fixture
def two_node_cluster():
    """A head node (1 CPU; the job driver runs there) and one worker node (2 CPUs): a second
    raylet on this host with its own temp dir and node-manager port."""
    c = Cluster()
    try:
        c.start_head(num_cpus=1)
        c.worker_temp = c.add_worker(num_cpus=2, resources={"preinfer_worker_node": 1})
        yield c
    finally:
        c.teardown()


def build_entry(cfg_dir, block: int, *extra: str) -> list[str]:
    sets = []
    for s in [*TINY, f"run.dir={cfg_dir}", *extra]:
        sets += ["--set", s]
    return [
        str(BIN / "preinfer"),
        "cache",
        "build",
        "--block",
        str(block),
        "--config",
        str(REPO / "configs/demo.yaml"),
        *sets,
    ]


def test_job_submit_builds_a_cache_that_verifies(ray_cluster, tiny_run):
    cfg = tiny_run()
    r = ray_cluster.job("submit", "--", *build_entry(cfg.run.dir, 2))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "cache build: boundary 2" in r.stdout
    for p in plan_block(cfg, 2).caches:
        assert p.complete, p.split
        assert open_cache(cfg.cache.root, p.fingerprint).verify() == []


def _done_markers(root: Path) -> int:
    return len(list(root.glob("*/done/*.json")))


def _actors_on(cluster: Cluster, temp: str) -> set[int]:
    """Pids of the pre-inference actor processes under that node's raylet."""
    try:
        procs = cluster.raylet(temp).children(recursive=True)
    except (ValueError, psutil.Error):
        return set()
    out = set()
    for p in procs:
        try:
            name = p.name() + " " + " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "MapWorker" in name or "PrefixWorker" in name:
            out.add(p.pid)
    return out


def _actor_on(cluster: Cluster, temp: str) -> bool:
    """True when a pre-inference actor process runs under that node's raylet."""
    return bool(_actors_on(cluster, temp))


def test_worker_node_dies_mid_preinference_and_the_job_still_completes(two_node_cluster, tiny_run):
    """kill -9 every process of the worker node (its raylet and its actor: the node is gone)
    while its actor works on a shard: Ray restarts the actor on the head node
    (preinfer.max_restarts) and retries its shard there (preinfer.max_task_retries); the
    shard write is idempotent, so the cache verifies and holds a clean (in-process) build's
    bytes. The shard log (core.faults.SHARD_LOG) shows the retry: a shard the worker node's
    actor had started was started again by another process. (Killing the raylet alone is
    not a node loss: its orphaned actor can finish the shard and reply to the driver itself,
    and then nothing is retried.)"""
    c = two_node_cluster
    shards = "cache.shard_mb=0.05"  # 25 rows per shard: 11 train + 1 val shards
    cfg = tiny_run(shards)
    root = Path(cfg.cache.root)
    log = Path(cfg.run.dir) / "shards.log"
    client = c.client()
    job_id = c.submit(
        client,
        entrypoint=shlex.join(build_entry(cfg.run.dir, 2, shards)),
        # every shard task sleeps 2 s first, and says which process ran it
        runtime_env={"env_vars": {SHARD_DELAY_S: "2", SHARD_LOG: str(log)}},
    )
    # pre-inference has started (a shard is committed) and an actor runs on the worker node
    deadline = time.time() + 420
    while time.time() < deadline and not (_done_markers(root) and _actor_on(c, c.worker_temp)):
        status = str(client.get_job_status(job_id)).split(".")[-1]
        assert status in ("PENDING", "RUNNING"), client.get_job_logs(job_id)[-6000:]
        time.sleep(1)
    done_at_kill = _done_markers(root)
    assert done_at_kill and _actor_on(c, c.worker_temp), (
        f"no actor on the worker node ({done_at_kill} shards done)"
    )
    on_worker = _actors_on(c, c.worker_temp)
    c.processes()  # remember the worker node's processes: they are orphaned by the kill
    node = c.processes(c.worker_temp)
    for p in node:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    killed_at = time.time()
    psutil.wait_procs(node, timeout=30)

    status = c.wait_job(job_id, timeout=600)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-6000:]
    assert "cache build: boundary 2" in logs
    plans = plan_block(cfg, 2).caches
    total = sum(open_cache(root, p.fingerprint).num_shards for p in plans)
    assert done_at_kill < total, f"the build had finished ({total} shards) before the kill"
    again = retried(shard_log(log))
    lost = {k: pids for k, pids in again.items() if set(pids[:-1]) & on_worker}
    starts = shard_log(log)
    why = (
        on_worker,
        again,
        [(pid, fp[:6], sh, round(t - killed_at, 1)) for pid, fp, sh, t in starts],
    )
    assert lost and all(pids[-1] not in on_worker for pids in lost.values()), why
    clean = tiny_run(shards, f"cache.root={Path(cfg.run.dir) / 'clean'}")
    build_cache(clean, 2, log=quiet)  # in this process: no Ray
    for p in plans:
        assert_same_cache(clean.cache.root, root, p.fingerprint)
    for p in plans:
        assert p.complete, p.split
        r = subprocess.run(
            [str(BIN / "preinfer"), "cache", "verify", p.fingerprint, "--root", str(root)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
