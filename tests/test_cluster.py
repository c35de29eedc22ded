"""A real local Ray cluster: `ray start --head` + `ray job submit` of a cache build.

Marked `cluster` (run by `make test-slow`). The cluster is stopped even when the test fails.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.preinfer import plan_caches
from storage.reader import open_cache
from tests.pipeline_fixtures import TINY

pytestmark = pytest.mark.cluster
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_cluster():
    import shutil
    import tempfile

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix sockets live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    port, dash = free_port(), free_port()
    start = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, text=True, timeout=180)
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}", "env": env}
    finally:
        subprocess.run(
            [str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120
        )
        shutil.rmtree(temp, ignore_errors=True)


def test_job_submit_builds_a_cache_that_verifies(ray_cluster, tiny_run):
    cfg = tiny_run()
    sets = []
    for s in [*TINY, f"run.dir={cfg.run.dir}"]:
        sets += ["--set", s]
    entry = [
        str(BIN / "preinfer"),
        "cache",
        "build",
        "--block",
        "2",
        "--config",
        str(REPO / "configs/demo.yaml"),
        *sets,
    ]
    submit = [
        str(BIN / "ray"),
        "job",
        "submit",
        "--address",
        ray_cluster["dashboard"],
        "--",
        *entry,
    ]
    deadline = time.time() + 60
    while True:  # the job server comes up a little after `ray start` returns
        r = subprocess.run(
            submit, env=ray_cluster["env"], capture_output=True, text=True, timeout=600
        )
        if r.returncode == 0 or time.time() > deadline or "Connection" not in r.stderr + r.stdout:
            break
        time.sleep(3)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "cache build: boundary 2" in r.stdout
    for p in plan_caches(cfg, 2, create=False):
        assert p.complete, p.split
        assert open_cache(cfg.cache.root, p.fingerprint).verify() == []
