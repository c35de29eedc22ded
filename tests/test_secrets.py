"""Storage credentials are never printed, stored or sent inside a payload.

`storage.key` / `storage.secret` read "***" in `preinfer config`, in every file a run writes
(config.json, manifests, metrics, report) and in the config payload of Ray workers; a worker
gets them in its environment (PREINFER_STORAGE_KEY / _SECRET: inherited by the private Ray
instance's processes, else Ray runtime_env env_vars) and rebuilds its storage options.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from core.config import MASK, ConfigError
from pipelines import cache_build
from pipelines.cli import main
from pipelines.ray_env import credentials_env, worker_config, worker_payload
from pipelines.train import worker_args
from preinfer.run.config import load_config
from preinfer.run.visit import VisitSpec
from storage import fs
from storage.config import CREDENTIAL_ENV, StorageConfig
from tests import test_object_storage
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg
from tests.test_object_storage import BUCKET, keys

KEY, SECRET = "AKIDPREINFERTEST", "s3cr3t-PREINFER-test-value"
CREDS = [f"storage.key={KEY}", f"storage.secret={SECRET}"]
moto_server = test_object_storage.s3  # the module's moto S3 server, as a fixture here
RAY_INLINE_MAX = 100 * 1024  # Ray passes a smaller argument by value, a larger one by reference


def _leaks(blob: bytes | str) -> list[str]:
    data = blob.encode() if isinstance(blob, str) else blob
    return [s for s in (KEY, SECRET) if s.encode() in data]


def _files_with_credentials(*roots: Path) -> list[str]:
    return [
        f"{p}: {_leaks(p.read_bytes())}"
        for root in roots
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and _leaks(p.read_bytes())
    ]


@pytest.fixture(autouse=True)
def _fresh_storage_options():
    yield
    fs.configure(None)  # a test's credentials stay out of the next test's s3 access


@pytest.fixture
def no_aws_chain(monkeypatch):
    """No credentials but the ones preinfer passes: the AWS chain finds nothing."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    for k in CREDENTIAL_ENV.values():
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# ----------------------------------------------------------------------- printed configs


def test_config_command_and_reprs_show_no_credential(capsys, tmp_path):
    assert main(["config", "--set", f"run.dir={tmp_path}", *_sets(CREDS)]) == 0
    out = capsys.readouterr().out
    assert not _leaks(out)
    storage = json.loads(out)["storage"]
    assert storage["key"] == storage["secret"] == MASK  # set, and masked
    cfg = load_config(None, [f"run.dir={tmp_path}", *CREDS])
    assert cfg.storage.secret == SECRET  # the config object itself holds it
    assert not _leaks(repr(cfg)) and not _leaks(repr(cfg.storage)) and not _leaks(cfg.to_json())
    unset = json.loads(load_config(None, [f"run.dir={tmp_path}"]).to_json())["storage"]
    assert unset["key"] is None and unset["secret"] is None  # unset stays visibly unset


def test_a_masked_or_url_credential_is_refused_with_what_to_do(tmp_path):
    saved = tmp_path / "config.json"  # a printed config, credentials masked, loaded back
    saved.write_text(load_config(None, [f"run.dir={tmp_path}", *CREDS]).to_json())
    with pytest.raises(ConfigError, match=r"storage.key is '\*\*\*', the mask .*set the real"):
        load_config(saved)
    assert load_config(saved, CREDS).storage.secret == SECRET  # real values: loads
    with pytest.raises(ConfigError, match="must not hold credentials.*storage.key"):
        StorageConfig(endpoint_url=f"http://{KEY}:{SECRET}@minio:9000")


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


# ------------------------------------------------------------- every file of a tiny run


def test_no_file_of_a_tiny_run_holds_a_credential(tmp_path, capsys):
    """tokenize, init, bcd (build, refresh, train, metrics, state, config.json), eval and
    report, with credentials in the config: no file under run.dir holds either of them."""
    from pipelines.bcd import run_bcd
    from pipelines.eval import run_eval
    from pipelines.init import run_init
    from pipelines.report import run_report
    from pipelines.tokenize import run_tokenize

    run = tmp_path / "run"
    over = [*CREDS, "train.max_steps=2", "train.eval_every=1", "preinfer.executor=local"]
    cfg = tiny_cfg(run, *over)
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    run_bcd(cfg, log=quiet)
    run_eval(cfg, max_batches=1, log=quiet)
    run_report(cfg, log=quiet)
    assert main(["cache", "ls", "--set", f"run.dir={run}", *_sets([*TINY, *over])]) == 0
    assert not _leaks(capsys.readouterr().out)
    written = [p for p in run.rglob("*") if p.is_file()]
    names = {p.name for p in written}
    assert {"config.json", "state.json", "metrics.jsonl", "manifest.json"} <= names
    assert any(p.suffix == ".md" for p in written)  # the report
    assert _files_with_credentials(run) == []
    saved = json.loads((run / "config.json").read_text())["storage"]
    assert saved["key"] == saved["secret"] == MASK


# ------------------------------------------------------------------ what workers are sent


def test_actor_arguments_hold_no_credential_yet_the_worker_signs_with_it(
    moto_server, tiny_run, no_aws_chain, monkeypatch
):
    """The PrefixWorker actors of a Ray build (Ray stood in for by a pool that does what it
    does: arguments pickled, runtime_env env_vars as the process environment): their
    arguments hold no credential and are small (passed by value); the worker rebuilds its
    storage options from its environment and writes its shards to s3 with them."""
    seen = {}

    def pool(cls, kwargs, calls, *, actors, method, options):
        blob = pickle.dumps(kwargs)
        seen.update(blob=blob, env=dict((options.get("runtime_env") or {})["env_vars"]))
        with monkeypatch.context() as m:  # the actor's process: the env Ray gives it
            for k, v in seen["env"].items():
                m.setenv(k, v)
            w = cls(**pickle.loads(blob), pin=False)
            seen["storage"] = fs.options()
            try:
                for c in calls:
                    yield getattr(w, method)(c)
            finally:
                w.close()

    monkeypatch.setattr(cache_build, "map_over_actors", pool)
    monkeypatch.setattr(cache_build, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(cache_build, "actor_resources", lambda cfg: {"num_cpus": 1})
    root = f"s3://{BUCKET}/secrets-{time.time_ns()}"
    cfg = tiny_run(f"storage.endpoint_url={moto_server['endpoint']}", "storage.region=us-east-1",
                   *CREDS, f"cache.root={root}", "preinfer.executor=ray")  # fmt: skip
    res = cache_build.build_cache(cfg, 1, log=quiet)
    assert not _leaks(seen["blob"]) and len(seen["blob"]) < RAY_INLINE_MAX
    assert seen["env"][CREDENTIAL_ENV["secret"]] == SECRET  # in the env, not the arguments
    assert (seen["storage"].key, seen["storage"].secret) == (KEY, SECRET)
    assert res["shards"] > 0  # the worker wrote them to s3, signing with those credentials
    assert {f"{fp}/manifest.json" for fp in res["fingerprints"].values()} <= set(keys(root))
    # a worker whose environment lacks them says so, instead of falling back to other ones
    with pytest.raises(ConfigError, match="PREINFER_STORAGE_KEY is not in its environment"):
        worker_config(worker_payload(cfg))


def test_train_workers_get_a_masked_payload_and_credentials_in_their_env(
    moto_server, tmp_path, no_aws_chain, monkeypatch
):
    sets = [f"storage.endpoint_url={moto_server['endpoint']}", "storage.region=us-east-1", *CREDS]
    cfg = load_config(None, [f"run.dir={tmp_path}", *sets])
    url = f"s3://{BUCKET}/train-{time.time_ns()}/obj"
    fs.put(url, b"payload")  # the driver, with the config's credentials
    loop, runtime_env = worker_args(cfg, VisitSpec(block=1))
    assert not _leaks(pickle.dumps(loop)) and len(pickle.dumps(loop)) < RAY_INLINE_MAX
    assert runtime_env["env_vars"] == credentials_env(cfg)
    assert loop["cfg"]["storage"]["secret"] == MASK
    fs.configure(None)
    for k, v in runtime_env["env_vars"].items():
        monkeypatch.setenv(k, v)
    rebuilt = worker_config(loop["cfg"])  # what _worker_loop does
    assert (rebuilt.storage.key, rebuilt.storage.secret) == (KEY, SECRET)
    assert fs.path(url).read_bytes() == b"payload"
    # the same payload from a config without credentials: the worker has none (no chain)
    bare = worker_config(worker_payload(load_config(None, [f"run.dir={tmp_path}", *sets[:2]])))
    assert bare.storage.key is None
    with pytest.raises(Exception, match="(?i)credential"):
        fs.path(url).read_bytes()


# -------------------------------------------------------- a real Ray build, end to end

RAY_BUILD = """
import sys
from pipelines.cache_build import build_cache
from pipelines.train import run_train
from tests.pipeline_fixtures import tiny_cfg, quiet
cfg = tiny_cfg(sys.argv[1], *sys.argv[2:])
res = build_cache(cfg, 1, log=quiet)
print("SHARDS", res["shards"])
res = run_train(cfg, 1, mode="bcd", log=quiet)
print("STEPS", res["steps"])
"""


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.functional
def test_ray_build_on_s3_with_credentials_leaves_them_nowhere(
    moto_server, tiny_run, no_aws_chain, request
):
    """A Ray build (private instance, PrefixWorker actors) writing its cache to s3, then 2
    Ray Train workers training block 1 from it: the workers sign with the config's
    credentials (the AWS chain has none), no file of the run or of Ray's session (logs
    included) holds them, and Ray logs no actor whose constructor arguments sit in the
    object store."""
    run = Path(tiny_run().run.dir)
    ray_tmp = Path(tempfile.mkdtemp(prefix="pi-", dir="/tmp"))  # Ray's socket paths: <108 bytes
    request.addfinalizer(lambda: shutil.rmtree(ray_tmp, ignore_errors=True))
    root = f"s3://{BUCKET}/ray-{time.time_ns()}"
    over = [f"storage.endpoint_url={moto_server['endpoint']}", "storage.region=us-east-1", *CREDS,
            f"cache.root={root}", "preinfer.executor=ray", "run.verbose=true",
            "train.workers=2", "train.max_steps=1", "train.eval_every=0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private instance
    env["RAY_TMPDIR"] = str(ray_tmp)  # its session files (logs) in a directory of this test
    proc = subprocess.run([sys.executable, "-c", RAY_BUILD, str(run), *over], env=env,
                          capture_output=True, text=True, timeout=600, cwd=os.getcwd())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("SHARDS")[1].split()[0]) > 0
    assert int(proc.stdout.split("STEPS")[1].split()[0]) == 1
    logs = [p for p in ray_tmp.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix in (".log", ".err", ".out") for p in logs)
    warned = "constructor arguments in the object store"
    assert warned not in proc.stderr and warned not in proc.stdout
    assert not [p for p in logs if warned.encode() in p.read_bytes()]
    assert not _leaks(proc.stdout) and not _leaks(proc.stderr)
    assert _files_with_credentials(run, ray_tmp) == []
    fs.configure(StorageConfig(endpoint_url=moto_server["endpoint"], key=KEY, secret=SECRET))
    assert any(k.endswith("manifest.json") for k in keys(root))
