"""Tokens, checkpoints and activation caches on an object store (s3:// via s3fs), against a
real S3-compatible server: moto in server mode, started on a free 127.0.0.1 port per module.

Same rules as on a local disk: every object appears whole (one PUT of its final key, never a
temp key), shard objects before their done marker, markers before the manifest; a prefix
without a manifest / checkpoint.json is incomplete and refused.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import ConfigError
from pipelines.cli import main as cli
from preinfer.checkpoint.format import CheckpointError
from preinfer.checkpoint.store import Checkpoint
from storage import cache_tools as tools
from storage import fs
from storage.cache import CacheWriter
from storage.config import CacheConfig, StorageConfig
from storage.layout import MANIFEST, CacheError, CacheIncomplete, is_complete
from storage.reader import open_cache
from storage.tokens import TokenStore
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg

BUCKET = "preinfer-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with one bucket; yields the --set options to reach it.

    The server runs in its own process: as a thread of the test process it shares that
    process's interpreter lock, forks and exit handlers, and once stopped answering for a
    whole test on a loaded CI machine (a HEAD read timeout)."""
    import boto3

    log = tmp_path_factory.mktemp("moto") / "server.log"
    port = _free_port()
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(server, port, log)
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)
        opts = [
            f"storage.endpoint_url={endpoint}",
            "storage.key=testing",
            "storage.secret=testing",
            "storage.region=us-east-1",
        ]
        yield {"endpoint": endpoint, "sets": opts}
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        fs.configure(None)


@contextlib.contextmanager
def _silent_server():
    """A port on 127.0.0.1 that accepts connections and never sends a byte."""
    held = []
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        srv.settimeout(0.2)
        stop = threading.Event()

        def accept():
            while not stop.is_set():
                with contextlib.suppress(OSError):  # the 0.2 s accept timeout
                    held.append(srv.accept()[0])

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        try:
            yield srv.getsockname()[1]
        finally:
            stop.set()
            t.join()
            for c in held:
                c.close()


def _wait_until_serving(server: subprocess.Popen, port: int, log: Path, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"moto server exited ({server.returncode}): {log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server not serving on port {port} after {timeout_s} s")


@pytest.fixture
def s3_run(s3, tmp_path, request):
    """Config factory of a tiny run whose tokens, checkpoint and cache live under a fresh
    s3://BUCKET/<test>-<time>/ prefix (run.dir, for metrics, stays local)."""
    prefix = f"s3://{BUCKET}/{request.node.name}-{time.time_ns()}"

    def make(*extra):
        return tiny_cfg(
            tmp_path / "run",
            f"data.out_dir={prefix}/tokens",
            f"run.checkpoint={prefix}/checkpoint",
            f"cache.root={prefix}/cache",
            *s3["sets"],
            *extra,
        )

    make.prefix = prefix
    return make


def keys(url: str) -> list[str]:
    """Every object key under a URL prefix, relative to it."""
    rp = fs.path(url)
    return sorted(k[len(rp.key) + 1 :] for k in rp.find())


# ------------------------------------------------------------------------------ config


def test_urls_stay_urls_and_options_are_checked(s3_run):
    cfg = s3_run()
    assert cfg.cache.root.startswith("s3://") and cfg.run.checkpoint.startswith("s3://")
    assert cfg.data.out_dir == f"{s3_run.prefix}/tokens"
    with pytest.raises(ConfigError, match="storage.endpoint_url must look like http"):
        StorageConfig(endpoint_url="127.0.0.1:9000")
    with pytest.raises(ConfigError, match="storage.key and storage.secret go together"):
        StorageConfig(key="k")
    with pytest.raises(ConfigError, match="storage.anon=true"):
        StorageConfig(anon=True, key="k", secret="s")
    with pytest.raises(ConfigError, match="storage.retries must be >= 1"):
        StorageConfig(retries=0)
    with pytest.raises(ConfigError, match="storage.read_timeout_s must be > 0"):
        StorageConfig(read_timeout_s=0)
    assert fs.s3_options(StorageConfig(read_timeout_s=7.0))["config_kwargs"]["read_timeout"] == 7.0


UNREACHABLE = "cannot reach the object store at http://127"
SILENT = "did not answer within storage.read_timeout_s"


def _refused(port: int, match: str, retries: int = 1, **timeouts) -> list:
    """A store at 127.0.0.1:port: StorageError `match`; the HTTP attempts it made (counted,
    not timed: a count holds on a busy machine, a time bound does not)."""
    fs.configure(StorageConfig(endpoint_url=f"http://127.0.0.1:{port}", key="testing",
                               secret="testing", retries=retries, **timeouts))  # fmt: skip
    attempts = []
    try:
        client = fs.filesystem("s3").s3  # every call of this configuration goes through it
        client.meta.events.register("before-send.s3", lambda **kw: attempts.append(kw["request"]))
        with pytest.raises(fs.StorageError, match=match):
            TokenStore.exists(f"s3://{BUCKET}/tokens")
    finally:
        fs.configure(None)  # the next test must not reach this dead endpoint
    return [(r.method, r.url) for r in attempts]


def test_bad_inputs_are_clear_errors(s3, tmp_path):
    """Unknown scheme, URL without a bucket, missing bucket, unreachable endpoint: one
    StorageError (a ConfigError: the CLI prints it as one line) naming what to fix."""
    fs.configure(StorageConfig(endpoint_url=s3["endpoint"], key="testing", secret="testing"))
    with pytest.raises(fs.StorageError, match="unknown storage URL scheme 'nosuch'"):
        open_cache("nosuch://bucket/cache", "ab" * 8)
    with pytest.raises(fs.StorageError, match="names no bucket"):
        TokenStore("s3://")
    with pytest.raises(fs.StorageError, match="bucket 'no-such-bucket' does not exist"):
        Checkpoint.open("s3://no-such-bucket/ckpt")
    assert _refused(_free_port(), UNREACHABLE, connect_timeout_s=1.0)
    with _silent_server() as port:  # takes connections, never answers
        assert _refused(port, SILENT, read_timeout_s=0.5)
    # the CLI: one line, exit 2
    code = cli(["cache", "ls", "nosuch://x/y"])
    assert code == 2
    fs.configure(None)


@pytest.mark.parametrize("retries", [1, 2])
@pytest.mark.parametrize("server", ["refused", "silent"])
def test_storage_retries_is_the_number_of_attempts(server, retries):
    """storage.retries is the attempts per request (storage/config.py): retries=1 fails after
    one HTTP request, not after a second one and a back-off: what bounds how long an
    unreachable or silent store holds a command up (attempts x timeouts + back-offs)."""
    if server == "refused":
        attempts = _refused(_free_port(), UNREACHABLE, retries, connect_timeout_s=1.0)
    else:
        with _silent_server() as port:
            attempts = _refused(port, SILENT, retries, read_timeout_s=0.5)
    assert len(attempts) == retries, attempts


# ------------------------------------------------------------------ tokens + checkpoint


def test_tokens_and_checkpoint_on_s3(s3_run, tiny_base):
    from pipelines.init import run_init
    from pipelines.tokenize import run_tokenize

    cfg = s3_run()
    store = run_tokenize(cfg, log=quiet)
    assert isinstance(store.path, fs.RemotePath)
    names = keys(cfg.data.out_dir)
    assert "manifest.json" in names and "tokenizer.json" in names
    assert not [n for n in names if "partial" in n]
    # the same inputs as the local tiny run: the same fingerprint and the same rows
    local = TokenStore(tiny_base / "tokens")
    assert store.fingerprint == local.fingerprint
    for split in ("train", "val"):
        n = local.num_samples(split)
        np.testing.assert_array_equal(store.read(split, 0, n), local.read(split, 0, n))
    assert store.verify() == []
    manifest = json.loads(fs.path(f"{cfg.data.out_dir}/manifest.json").read_text())
    assert manifest["config"]["storage"]["secret"] == "***"  # never persisted
    assert run_tokenize(cfg, log=quiet).fingerprint == store.fingerprint  # current: reused

    ckpt = run_init(cfg, log=quiet)
    assert isinstance(ckpt.path, fs.RemotePath)
    local_ckpt = Checkpoint.open(tiny_base / "checkpoint")
    assert [ckpt.block_hash(b) for b in range(3)] == [local_ckpt.block_hash(b) for b in range(3)]
    ckpt.verify()
    # load only the last block (its tied head is read from block 0's object by name)
    model, adapter = ckpt.load([2])
    assert all(not t.is_meta for t in ckpt.block_state(model, adapter, 2).values())
    # commit a block: new object, then checkpoint.json, then the old object is deleted
    before = keys(cfg.run.checkpoint)
    old_file = ckpt.index["blocks"][1]["file"]
    model, adapter = ckpt.load([1])
    state = ckpt.block_state(model, adapter, 1)
    new_state = {n: t + 0.5 for n, t in state.items()}
    digest = ckpt.commit_block(1, new_state)
    after = keys(cfg.run.checkpoint)
    assert old_file in before and old_file not in after
    assert ckpt.index["blocks"][1]["file"] in after and len(after) == len(before)
    again = Checkpoint.open(cfg.run.checkpoint)
    assert again.block_hash(1) == digest and again.index["generation"] == 1
    m2, a2 = again.load([1])
    got = again.block_state(m2, a2, 1)
    assert all(torch.equal(got[n], new_state[n]) for n in new_state)
    # a prefix without checkpoint.json is refused with what to do
    fs.path(f"{cfg.run.checkpoint}/checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete or not a checkpoint"):
        Checkpoint.open(cfg.run.checkpoint)


# ------------------------------------------------------------------------- the cache


def _writer(root, fp="ab12cd34ef56", n=10, s=4, h=8):
    ids = np.arange(n * s, dtype=np.int32).reshape(n, s)
    return CacheWriter.create(
        root,
        fp,
        samples={"sample_id": np.arange(n), "input_ids": ids, "labels": ids + 1},
        seq_len=s,
        hidden_size=h,
        cache_cfg=CacheConfig(
            dtype="fp32", codec="zstd", shuffle="none", shard_mb=3 * s * h * 4 / 2**20
        ),
        meta={"boundary": 1, "config": {"storage": {"key": "k", "secret": "s"}}},
    )


def test_cache_writes_are_ordered_whole_puts(s3, s3_run, monkeypatch):
    """Every write is one PUT of a final key; each shard's objects come before its marker,
    all markers before the manifest; a failed shard PUTs nothing; resume skips done shards."""
    cfg = s3_run()  # configures the storage options
    root = cfg.cache.root
    puts: list[str] = []
    real_put = fs.put

    def record(p, data):
        puts.append(str(p)[len(root) + 1 :])
        real_put(p, data)

    monkeypatch.setattr(fs, "put", record)
    w = _writer(root)
    assert w.num_shards == 4
    rng = np.random.default_rng(0)
    bad = np.full((3, 4, 8), np.nan, np.float32)
    with pytest.raises(CacheError, match="NaN/inf"):
        w.write_shard(0, bad)
    assert not [k for k in puts if "/c/0/" in k or k.startswith("done/00000")]  # nothing PUT
    for i in range(3):  # shard 3 left missing: an interrupted build
        a, b = w.shard_range(i)
        w.write_shard(i, rng.standard_normal((b - a, 4, 8)).astype(np.float32))
    with pytest.raises(CacheIncomplete, match="1 of 4 shards"):
        w.finalize()
    with pytest.raises(CacheIncomplete, match="no manifest.json"):
        open_cache(root, w.header["fingerprint"])
    w2 = CacheWriter.open(root, w.header["fingerprint"])  # resume (e.g. another worker)
    assert w2.missing_shards() == [3]
    w2.write_shard(3, rng.standard_normal((1, 4, 8)).astype(np.float32))
    w2.finalize()
    assert not [k for k in puts if "partial" in k]
    assert puts[-1].endswith(MANIFEST)
    pos = {k: i for i, k in enumerate(puts)}
    for i in range(4):
        marker = f"{w.header['fingerprint']}/done/{i:05d}.json"
        shard_keys = [
            k for k in puts if k.startswith(f"{w.header['fingerprint']}/hidden.zarr/c/{i}/")
        ]
        assert shard_keys and all(pos[k] < pos[marker] for k in shard_keys)
        assert pos[marker] < pos[f"{w.header['fingerprint']}/{MANIFEST}"]
    cache = open_cache(root, w.header["fingerprint"], verify=True)
    assert cache.read_rows(0, 10)[0].shape == (10, 4, 8)
    cache.close()  # an open Cache holds a lease, which gc respects (storage/lease.py)
    build = json.loads(fs.path(f"{root}/{w.header['fingerprint']}/build.json").read_text())
    assert build["meta"]["config"]["storage"]["secret"] == "***"
    # cache tools on the prefix: ls, inspect, gc (deletes every object of the cache)
    fp = w.header["fingerprint"]
    (row,) = tools.list_caches(root)
    assert row["fingerprint"] == fp and row["complete"] and row["done_shards"] == 4
    assert tools.inspect_cache(root, fp)["status"] == "complete"
    assert tools.gc_caches(root, keep={fp}, dry_run=False) == []
    removed = tools.gc_caches(root, keep=set(), dry_run=False, grace_s=0)
    assert [r[0] for r in removed] == [fp] and keys(root) == []


def test_removing_a_cache_deletes_its_manifest_first(s3, s3_run, monkeypatch):
    """On an object store too: the manifest is DELETEd alone before any other object (a batch
    delete has no order), so a delete that fails midway leaves an incomplete cache."""
    root = s3_run().cache.root
    store = fs.path(root).fs
    real_rm, real_rm_file = store.rm, store.rm_file

    def complete_cache() -> str:
        w = _writer(root)
        rng = np.random.default_rng(0)
        for i in range(w.num_shards):
            a, b = w.shard_range(i)
            w.write_shard(i, rng.standard_normal((b - a, 4, 8)).astype(np.float32))
        w.finalize()
        assert is_complete(root, w.header["fingerprint"])
        return w.header["fingerprint"]

    fp = complete_cache()
    calls: list[list[str]] = []

    def rm(path, *a, **kw):
        calls.append(sorted(path) if isinstance(path, list) else [path])
        return real_rm(path, *a, **kw)

    def rm_file(path, *a, **kw):
        calls.append([path])
        return real_rm_file(path, *a, **kw)

    monkeypatch.setattr(store, "rm", rm)
    monkeypatch.setattr(store, "rm_file", rm_file)
    tools.gc_caches(root, keep=set(), dry_run=False, grace_s=0)
    manifest_key = f"{fs.path(root).key}/{fp}/{MANIFEST}"
    assert calls[0] == [manifest_key]  # first, and alone
    assert all(manifest_key not in c for c in calls[1:]) and keys(root) == []

    # the second phase fails (network gone): the cache is incomplete, never complete
    fp = complete_cache()

    def gone(path, *a, **kw):
        raise ConnectionError("network gone mid-delete")

    monkeypatch.setattr(store, "rm", gone)
    with pytest.raises(ConnectionError):
        tools.gc_caches(root, keep=set(), dry_run=False, grace_s=0)
    assert any("/c/" in k for k in keys(root))  # shards are left...
    assert not is_complete(root, fp)  # ...in a cache nothing reads as complete
    with pytest.raises(CacheIncomplete, match="no manifest.json"):
        open_cache(root, fp)
    monkeypatch.setattr(store, "rm", real_rm)
    tools.gc_caches(root, keep=set(), dry_run=False, grace_s=0)  # a later gc removes the rest
    assert keys(root) == []


def test_cache_build_verify_train_from_s3(s3_run, capsys):
    """tokens + checkpoint + cache all on s3: build boundary 1 (Ray workers write their shards
    themselves), `preinfer cache verify` it, train block 1 from it, detect a flipped byte."""
    from pipelines.cache_build import build_cache
    from pipelines.init import run_init
    from pipelines.tokenize import run_tokenize
    from pipelines.train import run_train

    cfg = s3_run("cache.shard_mb=0.25")  # several shards (each one PUT + one marker PUT)
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    t0 = time.perf_counter()
    res = build_cache(cfg, 1, log=quiet)
    build_s = time.perf_counter() - t0
    assert res["action"] == "built" and res["shards"] >= 4
    fps = res["fingerprints"]
    names = keys(cfg.cache.root)
    assert {f"{fp}/{MANIFEST}" for fp in fps.values()} <= set(names)
    assert not [n for n in names if "partial" in n]

    sets = [a for s in [*TINY, f"run.dir={cfg.run.dir}"] for a in ("--set", s)]
    sets += [a for s in [
        f"data.out_dir={cfg.data.out_dir}", f"run.checkpoint={cfg.run.checkpoint}",
        f"cache.root={cfg.cache.root}", *s3_run_sets(cfg)] for a in ("--set", s)]  # fmt: skip
    capsys.readouterr()
    assert cli(["cache", "verify", fps["train"], *sets]) == 0
    assert f"verify: {fps['train']}: ok" in capsys.readouterr().out
    assert cli(["cache", "ls", *sets]) == 0
    assert fps["train"] in capsys.readouterr().out

    hash1 = Checkpoint.open(cfg.run.checkpoint).block_hash(1)
    t0 = time.perf_counter()
    summary = run_train(cfg, 1, mode="bcd", log=quiet)
    train_s = time.perf_counter() - t0
    assert summary["steps"] == cfg.train.max_steps
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert ckpt.block_hash(1) != hash1  # the trained block was committed to s3
    assert ckpt.block_hash(0) == Checkpoint.open(cfg.run.checkpoint).block_hash(0)

    # a flipped byte in a shard object: verify names the shard and exits 1
    shard = next(n for n in names if n.startswith(f"{fps['val']}/hidden.zarr/c/"))
    obj = fs.path(f"{cfg.cache.root}/{shard}")
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    fs.put(obj, bytes(data))
    capsys.readouterr()
    assert cli(["cache", "verify", fps["val"], *sets]) == 1
    assert "does not match its checksum" in capsys.readouterr().out
    print(f"s3 cache build {build_s:.1f}s, train {train_s:.1f}s")


def s3_run_sets(cfg) -> list[str]:
    st = cfg.storage
    return [
        f"storage.endpoint_url={st.endpoint_url}",
        f"storage.key={st.key}",
        f"storage.secret={st.secret}",
        f"storage.region={st.region}",
    ]


def test_bcd_rotation_on_s3_drops_old_caches_and_masks_credentials(s3_run):
    """`preinfer bcd` with tokens, checkpoint and caches on s3: the rotation builds and
    refreshes there, drops the caches it no longer needs (cache.keep=false), and the run's
    config.json never holds the storage secret."""
    import json

    from pipelines.bcd import run_bcd
    from pipelines.init import run_init
    from pipelines.report import run_report
    from pipelines.tokenize import run_tokenize

    cfg = s3_run("cache.shard_mb=0.5", "train.max_steps=2", "train.eval_every=0")
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    before = [Checkpoint.open(cfg.run.checkpoint).block_hash(b) for b in range(3)]
    said = []
    run_bcd(cfg, log=said.append)
    after = [Checkpoint.open(cfg.run.checkpoint).block_hash(b) for b in range(3)]
    assert all(a != b for a, b in zip(after, before, strict=True))  # every block trained
    state = json.loads((Path(cfg.run.dir) / "state.json").read_text())
    live = set(state["caches_in_use"])
    on_s3 = {n.split("/", 1)[0] for n in keys(cfg.cache.root)}
    assert live and on_s3 == live  # boundary 1 was dropped once boundary 2 existed
    assert any("dropped cache" in m for m in said)
    sizes = [e["bytes"] for e in state["events"] if "bytes" in e]
    assert sizes and all(v > 0 for s in sizes for v in s.values())  # sized on s3
    saved = json.loads((Path(cfg.run.dir) / "config.json").read_text())["storage"]
    assert saved["secret"] == saved["key"] == "***"
    assert saved["endpoint_url"] == cfg.storage.endpoint_url
    report = run_report(cfg, log=quiet)
    sizes = [i for c in report["caches"] for i in c["sizes"].values() if i]
    assert any(i.get("total_bytes") for i in sizes)  # manifests still on s3, read there
