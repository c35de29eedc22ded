"""Activation cache writers: resume after a crash, concurrent writers, leftover temp files."""

import contextlib
import errno
import multiprocessing as mp
import os
import resource
import signal

import numpy as np
import pytest
import torch

from storage import atomic
from storage.cache import CacheWriter
from storage.config import CacheConfig
from storage.layout import CacheError, CacheIncomplete, is_complete
from storage.reader import open_cache
from storage.shard_codec import encode_shard_parts
from storage.values import stored_dtype

N, S, H, R = 40, 8, 16, 8  # 5 shards


def cfg(dtype="bf16"):
    item = stored_dtype(dtype).itemsize
    return CacheConfig(
        dtype=dtype, codec="blosc-zstd", shuffle="byte", shard_mb=R * S * H * item / 2**20
    )


def samples():
    rng = np.random.default_rng(0)
    return np.arange(N), rng.integers(0, 1000, (N, S)), rng.integers(0, 1000, (N, S))


def hidden():
    return torch.randn(N, S, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)


def writer(root, fp="fp", dtype="bf16"):
    return CacheWriter.create(
        root,
        fp,
        samples=samples(),
        seq_len=S,
        hidden_size=H,
        cache_cfg=cfg(dtype),
        meta={"boundary": 2},
    )


def shard_bytes(cache_dir):
    return {
        str(p.relative_to(cache_dir)): p.read_bytes()
        for p in sorted(cache_dir.rglob("*"))
        if p.is_file() and "/c/" in str(p)
    }


class Crash(Exception):
    pass


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_resume_after_crash_writes_only_missing_shards(tmp_path, monkeypatch, dtype):
    x = hidden()
    w = writer(tmp_path, dtype=dtype)
    for i in (0, 1):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    # shard 2: its files land, then the process dies before the done marker
    real = atomic.write_json

    def die_on_marker(path, obj, **kw):
        if "done" in str(path):
            raise Crash
        real(path, obj, **kw)

    monkeypatch.setattr(atomic, "write_json", die_on_marker)
    with pytest.raises(Crash):
        w.write_shard(2, x[16:24])
    monkeypatch.setattr(atomic, "write_json", real)
    # shard 3: a torn temp file of a dead writer next to its key
    dead = tmp_path / "fp/hidden.zarr/c/3/0/0.otherhost.123.abcdef12.partial"
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b"torn")
    os.utime(dead, (0, 0))  # old: stale even though its host is unknown
    # shard 1: bytes damaged after its marker was written -> not done any more
    p1 = tmp_path / "fp/hidden.zarr/c/1/0/0"
    p1.write_bytes(p1.read_bytes()[:-1] + b"\0")
    with pytest.raises(CacheIncomplete, match="3 of 5 shards"):
        w.finalize()
    with pytest.raises(CacheIncomplete, match=r"2 of 5 shards done"):
        open_cache(tmp_path, "fp")

    w2 = writer(tmp_path, dtype=dtype)  # "resume": same header opens the same cache
    assert not dead.exists()  # stale temp file cleaned on open
    missing = w2.missing_shards()
    assert missing == [1, 2, 3, 4]
    assert w2.missing_shards(verify=False) == [2, 3, 4]  # size-only check misses the flip
    calls = []
    real_encode = encode_shard_parts
    monkeypatch.setattr(
        "storage.cache.encode_shard_parts", lambda *a: calls.append(a[1]) or real_encode(*a)
    )
    for i in missing:
        w2.write_shard(i, x[slice(*w2.shard_range(i))])
    per_shard = 2 if dtype == "int8" else 1  # hidden (+ scale) per shard
    assert calls == [i for i in missing for _ in range(per_shard)]
    assert w2.missing_shards() == []
    w2.finalize()
    c = open_cache(tmp_path, "fp", verify=True)
    got = c.read_rows(0, N, dtype=None)[0]
    if dtype == "bf16":
        assert torch.equal(got, x)
    # same bytes as one uninterrupted writer
    ref = writer(tmp_path / "ref", dtype=dtype)
    for i in range(ref.num_shards):
        ref.write_shard(i, x[slice(*ref.shard_range(i))])
    assert shard_bytes(tmp_path / "fp") == shard_bytes(tmp_path / "ref/fp")


def _worker(root, shards, barrier):
    # a separate (spawned) process: builds its own inputs deterministically
    w = writer(root)
    x = hidden()
    barrier.wait()  # all writers start writing together
    for i in shards:
        w.write_shard(i, x[slice(*w.shard_range(i))])
    barrier.wait()  # finalize only after every shard is written
    w.finalize()


def test_concurrent_writers_and_finalizers_give_one_valid_cache(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    plan = [[0, 1, 2, 3], [4, 3, 2]]  # disjoint and overlapping shards
    procs = [ctx.Process(target=_worker, args=(tmp_path / "multi", p, barrier)) for p in plan]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    c = open_cache(tmp_path / "multi", "fp", verify=True)
    assert torch.equal(c.read_rows(0, N, dtype=None)[0], hidden())
    assert not list((tmp_path / "multi").rglob("*.partial"))
    single = writer(tmp_path / "single")
    for i in range(single.num_shards):
        single.write_shard(i, hidden()[slice(*single.shard_range(i))])
    single.finalize()
    assert shard_bytes(tmp_path / "multi/fp") == shard_bytes(tmp_path / "single/fp")
    assert (tmp_path / "multi/fp/samples.parquet").read_bytes() == (
        tmp_path / "single/fp/samples.parquet"
    ).read_bytes()


def test_partial_files_ignored_by_reader_and_cleaned_by_writer(tmp_path):
    w = writer(tmp_path)
    x = hidden()
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    w.finalize()
    d = tmp_path / "fp"
    foreign = d / "hidden.zarr/c/0/0/0.partial"  # not our naming: nobody owns it
    foreign.write_bytes(b"junk")
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=int)
    p.start()
    p.join()
    dead = atomic.partial_path(d / "done/00001.json")
    dead = dead.with_name(dead.name.replace(f".{os.getpid()}.", f".{p.pid}."))
    dead.write_bytes(b"{")  # a dead local writer
    live = atomic.partial_path(d / "hidden.zarr/c/2/0/0")  # this (live) process
    live.write_bytes(b"in flight")
    c = open_cache(tmp_path, "fp", verify=True)  # temp files do not disturb reading
    assert torch.equal(c.read_rows(0, N, dtype=None)[0], x)
    assert c.verify() == []
    writer(tmp_path)  # reopening cleans stale temp files only
    assert not foreign.exists() and not dead.exists() and live.exists()


def test_open_in_worker_reads_ids_and_repairs_complete_cache(tmp_path):
    with pytest.raises(CacheError, match="create it first"):
        CacheWriter.open(tmp_path, "fp")
    writer(tmp_path)
    w = CacheWriter.open(tmp_path, "fp")  # a worker: no samples at hand
    assert w.num_shards == 5 and w.missing_shards() == [0, 1, 2, 3, 4]
    assert np.array_equal(w.read_input_ids(5, 19), samples()[1][5:19])
    x = hidden()
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    assert not is_complete(tmp_path, "fp")
    CacheWriter.open(tmp_path, "fp").finalize()
    assert is_complete(tmp_path, "fp")
    shard = tmp_path / "fp/hidden.zarr/c/2/0/0"
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    w2 = CacheWriter.open(tmp_path, "fp")
    assert w2.missing_shards() == [2]  # found by checksum
    w2.write_shard(2, x[16:24])  # identical bytes: allowed on a complete cache, repairs it
    assert shard.read_bytes() == good and open_cache(tmp_path, "fp", verify=True)


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """A real write failure: while inside, this process cannot write past `nbytes` of any
    file (RLIMIT_FSIZE; the write fails with EFBIG, as a full disk fails with ENOSPC)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a signal that kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_failed_background_write_commits_nothing(tmp_path, dtype):
    """The device fails mid-write (the real write, on the I/O thread): the shard's temp files
    are removed by storage.atomic itself (write_aside's cleanup; for int8 the scale file,
    written fine, discarded too), nothing is renamed into place, no marker; resume redoes it."""
    w = writer(tmp_path, dtype=dtype)
    x = hidden()
    w.write_shard(1, x[8:16])
    # shard 1's files: about the sizes shard 2's will have (int8: hidden 1284 B, scale 516 B)
    sizes = sorted(p.stat().st_size for p in tmp_path.glob("fp/*.zarr/c/1/**/*") if p.is_file())
    limit = (sizes[0] + sizes[-1]) // 2 if len(sizes) > 1 else sizes[0] // 2  # int8: scale fits
    with file_size_limit(limit), pytest.raises(OSError) as e:
        w.write_shard(2, x[16:24])
    assert e.value.errno == errno.EFBIG
    assert not (tmp_path / "fp/hidden.zarr/c/2/0/0").exists()
    assert not (tmp_path / "fp/scale.zarr/c/2/0").exists()
    assert not (tmp_path / "fp/done/00002.json").exists()
    assert not list(tmp_path.rglob("*.partial"))
    assert writer(tmp_path, dtype=dtype).missing_shards() == [0, 2, 3, 4]
