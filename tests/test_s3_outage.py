"""An object store lost mid-command (#53): `preinfer cache build` whose S3 endpoint goes away
at its first cache PUT says so in one line (exit 2), as the start-up probe does, and the
rerun against the store back up resumes. The server is a moto S3 server of this module's own
(tests/test_object_storage.py's fixture is shared by its tests; this one is stopped)."""

from __future__ import annotations

import subprocess
import sys

import boto3
import pytest

import tests.test_object_storage as object_storage
from pipelines.cli import main as cli
from storage import fs
from tests.pipeline_fixtures import TINY

BUCKET = "preinfer-outage"


class Moto:
    """A moto S3 server on a fixed 127.0.0.1 port, (re)started and stopped by the test."""

    def __init__(self, log):
        self.port, self.log, self.proc = object_storage._free_port(), log, None
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        object_storage._wait_until_serving(self.proc, self.port, self.log)
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def moto(tmp_path):
    server = Moto(tmp_path / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
        fs.configure(None)


def test_losing_the_store_at_the_first_cache_put_is_one_line(tiny_run, moto, monkeypatch, capsys):
    cfg = tiny_run()  # tokens and checkpoint local; the caches go to the object store
    sets = [*TINY, f"run.dir={cfg.run.dir}", f"cache.root=s3://{BUCKET}/caches",
            f"storage.endpoint_url={moto.endpoint}", "storage.key=testing",
            "storage.secret=testing", "storage.region=us-east-1", "storage.retries=1",
            "storage.connect_timeout_s=2", "preinfer.executor=local"]  # fmt: skip
    args = ["cache", "build", "--block", "1", "--config", "configs/demo.yaml"]
    args += [a for s in sets for a in ("--set", s)]
    real_put, puts = fs.put, []

    def put_after_the_store_went(p, data):  # the endpoint goes away as the first PUT starts
        puts.append(str(p))
        moto.stop()
        real_put(p, data)

    monkeypatch.setattr(fs, "put", put_after_the_store_went)
    capsys.readouterr()
    assert cli(args) == 2  # was: a traceback ending in botocore's EndpointConnectionError
    err = capsys.readouterr().err.strip()
    assert puts and puts[0].startswith(f"s3://{BUCKET}/caches/")
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("preinfer cache: error: cannot reach the object store at ")
    assert moto.endpoint in err and "rerun the same command" in err
    # the store back: the same command builds the cache
    monkeypatch.setattr(fs, "put", real_put)
    moto.start()
    assert cli(args) == 0
    assert '"action": "built"' in capsys.readouterr().out


def test_a_store_down_before_the_build_writes_is_one_line_too(tiny_run, moto, capsys):
    """The store down from the start (its first request: the cache's manifest read)."""
    moto.stop()
    cfg = tiny_run()
    sets = [*TINY, f"run.dir={cfg.run.dir}", f"cache.root=s3://{BUCKET}/caches",
            f"storage.endpoint_url={moto.endpoint}", "storage.key=testing",
            "storage.secret=testing", "storage.retries=1"]  # fmt: skip
    args = ["cache", "build", "--block", "1", "--config", "configs/demo.yaml"]
    assert cli(args + [a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "cannot reach the object store" in err and moto.endpoint in err
