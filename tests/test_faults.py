"""The fault suite: each failure gives a clear message, no silently wrong data, and a rerun of
the same command recovers. (Worker killed mid-shard: test_preinfer.py; driver killed mid-build:
test_preinfer.py; trainer killed mid-block: test_bcd.py; tampered checkpoint file:
test_checkpoint.py.)"""

import contextlib
import errno
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.bcd import run_bcd
from pipelines.cache_build import build_cache, plan_block
from preinfer.checkpoint.store import Checkpoint
from storage.cache import CacheWriter
from storage.config import CacheConfig
from storage.reader import open_cache
from tests.pipeline_fixtures import quiet
from tests.test_cache_resume import file_size_limit


@pytest.fixture
def small_fs(tmp_path):
    """(directory, fill): fill() is a context inside which the next shard write fails with a
    real OS error: ENOSPC on a 1 MiB tmpfs filled by someone else's file where this machine can
    mount one (root), else EFBIG from a file-size limit, so the test never skips."""
    mnt = Path(f"/tmp/preinfer-tmpfs-{uuid.uuid4().hex[:8]}")
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        mnt.rmdir()
        yield tmp_path, lambda: file_size_limit(16 << 10)  # a shard is 32 KiB
        return

    @contextlib.contextmanager
    def fill():
        filler = mnt / "filler"
        free = shutil.disk_usage(mnt).free
        filler.write_bytes(b"\0" * (free - 100 * 1024))  # someone else fills the disk
        try:
            yield
        finally:
            filler.unlink()

    try:
        yield mnt, fill
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)


def test_disk_full_mid_write_then_rerun_recovers(small_fs):
    root, fill = small_fs
    N, S, H = 64, 16, 64  # fp32: 256 KiB of values in 8 shards of 32 KiB
    ccfg = CacheConfig(dtype="fp32", codec="none", shuffle="none", shard_mb=32 / 1024)
    rng = np.random.default_rng(0)
    samples = (np.arange(N), rng.integers(0, 100, (N, S)), rng.integers(0, 100, (N, S)))
    hidden = torch.randn(N, S, H, generator=torch.Generator().manual_seed(0))

    def writer():
        return CacheWriter.create(
            root,
            "f" * 16,
            samples=samples,
            seq_len=S,
            hidden_size=H,
            cache_cfg=ccfg,
            meta={"boundary": 1},
        )

    w = writer()
    for i in w.missing_shards()[:2]:  # the build is under way...
        w.write_shard(i, hidden[slice(*w.shard_range(i))])
    with fill(), pytest.raises(OSError) as e:  # ...when the disk fills
        for i in w.missing_shards():
            a, b = w.shard_range(i)
            w.write_shard(i, hidden[a:b])
    assert e.value.errno in (errno.ENOSPC, errno.EFBIG)
    done = set(range(w.num_shards)) - set(w.missing_shards())
    assert 0 < len(done) < w.num_shards  # some shards committed, the rest not claimed
    assert not (root / ("f" * 16) / "manifest.json").exists()
    w = writer()  # the rerun: only the missing shards
    todo = w.missing_shards()
    assert set(todo) == set(range(w.num_shards)) - done
    for i in todo:
        a, b = w.shard_range(i)
        w.write_shard(i, hidden[a:b])
    w.finalize()
    cache = open_cache(root, "f" * 16)
    assert cache.verify() == []
    assert torch.equal(cache.read_rows(0, N)[0], hidden)


def test_corrupted_cache_is_repaired_by_rerunning_bcd(tiny_run):
    cfg = tiny_run("train.max_steps=2", "train.eval_every=0", "cache.keep=true")
    run_bcd(cfg, log=quiet)
    fp = plan_block(cfg, 2).fingerprints["train"]
    shard = sorted(Path(cfg.cache.root, fp, "hidden.zarr").rglob("c/*/0/0"))[0]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x55
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match="shard 0"):
        open_cache(cfg.cache.root, fp).read_shard(0)
    # as if the run had been stopped before block 2: the rerun must not train on bad data
    state = Path(cfg.run.dir, "state.json")
    s = json.loads(state.read_text())
    del s["visits"]["r0-b2"]
    state.write_text(json.dumps(s))
    res = run_bcd(cfg, log=quiet)
    assert res["visits"][2]["cache"] == "repaired"
    assert open_cache(cfg.cache.root, fp).verify() == []


def test_replaced_checkpoint_block_never_reads_the_old_cache(tiny_run):
    cfg = tiny_run()
    old = build_cache(cfg, 2, log=quiet)["fingerprints"]
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load([1])
    state = {k: v + 0.01 for k, v in ckpt.block_state(model, adapter, 1).items()}
    ckpt.commit_block(1, state)  # a different block 1: the boundary-2 cache is stale
    plans = plan_block(cfg, 2).caches
    assert all(not p.complete for p in plans)
    assert {p.split: p.fingerprint for p in plans} != old
    from core.config import ConfigError
    from pipelines.train import run_train

    with pytest.raises(ConfigError, match="not built for the checkpoint as it is now"):
        run_train(cfg, 2, log=quiet)
    new = build_cache(cfg, 2, log=quiet)
    assert new["action"] == "built" and new["fingerprints"] != old


def test_cache_build_refuses_before_writing_when_disk_is_too_small(tiny_run, monkeypatch):
    from preinfer.plan.guards import DiskSpaceError

    cfg = tiny_run()
    for where in ("preinfer.plan.guards", "storage.cache"):  # the guard's and the writer's
        monkeypatch.setattr(f"{where}.free_disk_bytes", lambda path: 1000)
    with pytest.raises(DiskSpaceError, match="only 1000"):
        build_cache(cfg, 1, log=quiet)
    with pytest.raises(DiskSpaceError):
        run_bcd(cfg, log=quiet)
    assert not Path(cfg.cache.root).exists() or not any(Path(cfg.cache.root).iterdir())
