"""Activation cache readers: refusals, corruption, HF view, DDP/worker splits."""

import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from storage.cache import CacheWriter
from storage.cache_tools import verify_cache
from storage.config import CacheConfig
from storage.dataset import CacheDataset, rank_pieces
from storage.hf_view import hf_to_torch, to_hf_dataset
from storage.layout import CacheCorrupt, CacheError, CacheIncomplete, FingerprintMismatch
from storage.reader import open_cache
from storage.values import stored_dtype

N, S, H, R = 40, 8, 16, 8  # 5 shards of 8 rows


def build(root, fp="fp", dtype="bf16", n=N, rows=R, finalize=True, meta=None, s=S, h=H):
    item = stored_dtype(dtype).itemsize
    c = CacheConfig(dtype=dtype, codec="zstd", shuffle="none", shard_mb=rows * s * h * item / 2**20)
    labels = np.tile(np.arange(n)[:, None], (1, s))  # label = row id: tests can track rows
    w = CacheWriter.create(
        root,
        fp,
        samples=(np.arange(n) + 1000, labels, labels),
        seq_len=s,
        hidden_size=h,
        cache_cfg=c,
        meta=meta or {"boundary": 1, "split": "train"},
    )
    x = torch.randn(n, s, h, generator=torch.Generator().manual_seed(0)) * 4
    x = x.to(torch.bfloat16) if dtype == "bf16" else x
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    if finalize:
        w.finalize()
    return x


def test_flipped_byte_is_named_and_refused(tmp_path):
    build(tmp_path)
    shard = tmp_path / "fp/hidden.zarr/c/3/0/0"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = verify_cache(tmp_path, "fp")
    assert [i for i, _ in bad] == [3] and "checksum" in bad[0][1]
    with pytest.raises(CacheCorrupt, match="shard 3"):
        open_cache(tmp_path, "fp", verify=True)
    c = open_cache(tmp_path, "fp")  # cheap open; the read itself refuses
    c.read_shard(2)
    with pytest.raises(CacheCorrupt, match="shard 3"):
        c.read_shard(3)
    with pytest.raises(CacheCorrupt, match="shard 3"):
        c.read_rows(20, 26)  # a slice reaching into shard 3
    (tmp_path / "fp/samples.parquet").write_bytes(b"x" * 10)
    with pytest.raises(CacheCorrupt, match="samples.parquet"):
        open_cache(tmp_path, "fp")


def test_missing_manifest_is_refused_with_progress(tmp_path):
    with pytest.raises(CacheIncomplete, match="no cache at"):
        open_cache(tmp_path, "nope")
    build(tmp_path, finalize=False)
    (tmp_path / "fp/done/00004.json").unlink()
    with pytest.raises(CacheIncomplete, match=r"4 of 5 shards done.*rerun"):
        open_cache(tmp_path, "fp")


def test_fingerprint_mismatch_is_refused_with_differences(tmp_path):
    build(tmp_path, "fpA", meta={"boundary": 1, "split": "train", "model": {"layers": 4}})
    build(tmp_path, "fpB", meta={"boundary": 2, "split": "train", "model": {"layers": 4}})
    with pytest.raises(
        FingerprintMismatch,
        match=r"expected 'fpB', found 'fpA'.*boundary: "
        r"expected 2, found 1",
    ):
        open_cache(tmp_path, "fpA", expected_fingerprint="fpB")
    with pytest.raises(FingerprintMismatch, match=r"model.layers: expected 6, found 4"):
        open_cache(
            tmp_path,
            "fpA",
            expected_fingerprint="fpC",
            expected_meta={"boundary": 1, "split": "train", "model": {"layers": 6}},
        )
    (tmp_path / "fpA").rename(tmp_path / "renamed")  # manifest no longer matches its directory
    with pytest.raises(FingerprintMismatch, match="manifest 'fpA'"):
        open_cache(tmp_path, "renamed")
    assert open_cache(tmp_path, "fpB", expected_fingerprint="fpB").num_samples == N


def test_bad_row_ranges(tmp_path):
    build(tmp_path)
    c = open_cache(tmp_path / "fp", None)  # a cache directory directly
    for a, b in ((5, 5), (-1, 3), (30, 41)):
        with pytest.raises(Exception, match="contiguous slice"):
            c.read_rows(a, b)


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8", "fp8_e4m3"])
def test_hf_view_is_bit_exact(tmp_path, dtype):
    build(tmp_path, dtype=dtype)
    c = open_cache(tmp_path, "fp")
    ds = to_hf_dataset(c, cache_dir=tmp_path / "hf")
    assert len(ds) == N
    stored_type = ds.data.schema.field("hidden").type.storage_type
    assert stored_type.value_type.value_type == pa.from_numpy_dtype(stored_dtype(dtype))
    hidden, labels, sids = c.read_rows(0, N, dtype=None)
    stored, _ = c.read_stored(0, N)
    arrow_hidden = np.asarray(ds.data.column("hidden").to_pylist(), dtype=stored.dtype)
    assert np.array_equal(arrow_hidden.view(np.uint8), stored.view(np.uint8))
    batch = ds.with_format("numpy")[:]  # HF widens ints to int64 here
    got = hf_to_torch(batch["hidden"], dtype, batch.get("scale"))
    assert got.dtype == hidden.dtype
    if dtype == "bf16":
        assert torch.equal(got.view(torch.int16), hidden.view(torch.int16))
        row = ds.with_format("torch")[7]["hidden"]  # the documented recipe, one row
        assert torch.equal(row.to(torch.int16).view(torch.bfloat16), hidden[7])
    assert torch.equal(got, hidden)
    assert np.array_equal(batch["labels"], labels.numpy())
    assert np.array_equal(batch["sample_id"], sids.numpy())


def _files(d):
    return sorted((str(p.relative_to(d)), p.stat().st_size) for p in d.rglob("*"))


def test_hf_view_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    """Over a 10-shard cache the view reads each whole shard once, in order, and the memory it
    holds (numpy and other Python allocations by tracemalloc, plus Arrow's pool) grows by less
    than one shard between its first and its last read; the in-memory view it replaced grew by
    ~9 shards (every shard read so far). The Arrow files go to cache_dir, not into the cache,
    and a second call reuses them without reading the cache."""
    import datasets  # noqa: F401  (imported before measuring: the import allocates a lot)

    n, s, h, r = 160, 32, 256, 16  # bf16: 256 KiB a shard, 10 shards
    build(tmp_path, n=n, rows=r, s=s, h=h)
    c = open_cache(tmp_path, "fp")
    assert c.num_shards == 10 and c.rows_per_shard == r
    before = _files(tmp_path / "fp")
    real, reads, held = c.read_stored, [], []

    def read_stored(a, b):
        held.append(tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes())
        reads.append((a, b))
        return real(a, b)

    monkeypatch.setattr(c, "read_stored", read_stored)
    tracemalloc.start()
    try:
        ds = to_hf_dataset(c, cache_dir=tmp_path / "hf")
    finally:
        tracemalloc.stop()
    assert reads == [c.shard_range(i) for i in range(c.num_shards)]
    shard_bytes = r * s * h * 2
    assert max(held) - held[0] < shard_bytes, [round((x - held[0]) / shard_bytes, 2) for x in held]
    assert len(ds) == n and ds[n - 1]["sample_id"] == 1000 + n - 1
    assert ds.cache_files and all(
        Path(f["filename"]).is_relative_to(tmp_path / "hf") for f in ds.cache_files
    )
    assert _files(tmp_path / "fp") == before  # nothing written into the cache
    again = to_hf_dataset(c, cache_dir=tmp_path / "hf")
    assert len(reads) == c.num_shards and again.cache_files == ds.cache_files


def _rows(batches):
    return [b[1][:, 0].tolist() for b in batches]  # label[:, 0] = row id


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ddp_split_equal_steps_disjoint_rows(tmp_path, world, drop_last):
    x = build(tmp_path, n=37, rows=6)  # 7 shards, last one short
    c = open_cache(tmp_path, "fp")
    per_rank, steps = [], []
    for r in range(world):
        ds = CacheDataset(
            c,
            4,
            shuffle=True,
            seed=1,
            rank=r,
            world_size=world,
            buffer_size=5,
            dtype=torch.bfloat16,
            drop_last=drop_last,
        )
        ds.set_epoch(3)
        batches = list(ds)
        steps.append(len(batches))
        assert len(batches) == len(ds)
        for h, lab in batches:
            assert h.dtype == torch.bfloat16 and lab.dtype == torch.long
            assert torch.equal(h, x[lab[:, 0]])  # hidden and labels stay paired
        per_rank.append([i for b in _rows(batches) for i in b])
    assert len(set(steps)) == 1  # every rank takes the same number of steps
    lens = [len(r) for r in per_rank]
    assert len(set(lens)) == 1  # same rows (hence same steps) on every rank
    flat = [i for r in per_rank for i in r]
    if drop_last:
        assert len(flat) == len(set(flat))  # disjoint
        assert len(flat) >= 37 - world * 4  # at most one batch per rank dropped
    else:
        assert set(flat) == set(range(37))  # covers everything
        assert len(flat) - 37 == (-37) % world  # only the wrap-around pad repeats


def test_shuffle_per_epoch_and_worker_split(tmp_path):
    build(tmp_path)
    c = open_cache(tmp_path, "fp")
    ds = CacheDataset(c, 4, shuffle=True, seed=7, rank=1, world_size=2)
    ds.set_epoch(0)
    e0, e0b = _rows(ds), _rows(ds)
    ds.set_epoch(1)
    e1 = _rows(ds)
    assert e0 == e0b and e0 != e1
    assert len(sum(e0, [])) == len(sum(e1, [])) == 20  # the rank's share: other rows
    ordered = CacheDataset(c, 4, shuffle=False, rank=0, world_size=2)
    assert sum(_rows(ordered), []) == list(range(20))
    # DataLoader workers split the rank's batches; together they yield the same rows
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    ds.set_epoch(1)
    got = _rows(dl)
    assert len(got) == len(ds) == 5
    assert sorted(sum(got, [])) == sorted(sum(e1, []))


def test_rank_pieces_wraps():
    order = [(10, 15), (0, 5), (5, 10)]
    assert rank_pieces(15, order, 3, 12) == [(13, 15), (0, 5), (5, 7)]
    assert rank_pieces(15, order, 13, 17) == [(8, 10), (10, 12)]


def test_reads_are_the_callers_own_arrays(tmp_path):
    build(tmp_path, dtype="bf16")
    c = open_cache(tmp_path, "fp")
    want = c.read_rows(0, N, dtype=None)[0].clone()
    for a, b in ((8, 16), (10, 13), (8, 16), (10, 13), (3, 21)):  # whole, partial (kept), ...
        h = c.read_rows(a, b, dtype=None)[0]
        assert torch.equal(h, want[a:b])
        h.fill_(7)  # the caller may scribble on what it got ...
        stored, _ = c.read_stored(a, b)
        stored[...] = 1
    assert torch.equal(c.read_rows(0, N, dtype=None)[0], want)  # ... never on the cache's


def test_flipped_index_byte_and_legacy_sha256_manifest(tmp_path):
    import json

    from storage import atomic

    build(tmp_path)
    d = tmp_path / "fp"
    # a cache written when checksums were sha256 still opens, verifies and reads
    m = json.loads((d / "manifest.json").read_text())
    for entry in [f for sh in m["shards"] for f in sh["files"].values()] + list(
        m["files"].values()
    ):
        path = next(p for p in d.rglob("*") if p.is_file() and entry["checksum"]["value"]
                    == atomic.checksum_file(p)[0])  # fmt: skip
        entry.pop("checksum")
        entry["sha256"] = atomic.sha256_file(path)[0]
    (d / "manifest.json").write_text(json.dumps(m))
    c = open_cache(tmp_path, "fp", verify=True)
    assert c.read_rows(0, N)[0].shape == (N, S, H) and verify_cache(tmp_path, "fp") == []
    shard = d / "hidden.zarr/c/1/0/0"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x10  # inside the shard index
    shard.write_bytes(bytes(data))
    assert [i for i, _ in verify_cache(tmp_path, "fp")] == [1]
    with pytest.raises(CacheCorrupt, match="shard 1"):
        open_cache(tmp_path, "fp").read_shard(1)
    with pytest.raises(CacheCorrupt, match="shard 1: hidden.zarr cannot be decoded"):
        open_cache(tmp_path, "fp", check_reads=False).read_shard(1)  # crc32c of the index


def test_multi_shard_reads_go_straight_into_the_result_and_are_checked(tmp_path):
    c = CacheConfig(dtype="bf16", codec="none", shuffle="none", shard_mb=R * S * H * 2 / 2**20)
    labels = np.tile(np.arange(N)[:, None], (1, S))
    w = CacheWriter.create(
        tmp_path, "fp", samples=(np.arange(N), labels, labels), seq_len=S, hidden_size=H,
        cache_cfg=c, meta={},
    )  # fmt: skip
    x = torch.randn(N, S, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    w.finalize()
    cache = open_cache(tmp_path, "fp")
    for a, b in ((0, N), (8, 32), (3, 37), (8, 16)):
        h, lab, sid = cache.read_rows(a, b, dtype=None)
        assert torch.equal(h.view(torch.int16), x[a:b].view(torch.int16))
        assert torch.equal(lab[:, 0], torch.arange(a, b)) and torch.equal(sid, torch.arange(a, b))
    shard = tmp_path / "fp/hidden.zarr/c/2/0/0"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x04  # a value byte
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorrupt, match="shard 2"):
        open_cache(tmp_path, "fp").read_rows(0, N)
    assert torch.equal(open_cache(tmp_path, "fp").read_rows(24, 40)[0], x[24:40].float())
    data[100] ^= 0x04
    data[-3] ^= 0x01  # the index's crc32c: caught even without the per-read checksum
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorrupt, match="shard 2: hidden.zarr cannot be decoded"):
        open_cache(tmp_path, "fp", check_reads=False).read_rows(0, N)


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8"])
def test_shuffle_buffer_mixes_shards_and_keeps_pairs(tmp_path, dtype):
    """The default buffer holds the whole (small) split: batches mix rows of many shards, as a
    global shuffle does; a one-shard buffer gives shard-local batches (the old behaviour)."""
    x = build(tmp_path, dtype=dtype, n=64, rows=8)  # 8 shards
    c = open_cache(tmp_path, "fp")
    want = c.read_rows(0, 64, dtype=torch.float32)[0]
    ds = CacheDataset(c, 8, shuffle=True, seed=2)
    assert ds.buffer_size == 64
    batches = list(ds)
    shards_per_batch = [len({i // 8 for i in b[1][:, 0].tolist()}) for b in batches]
    assert np.mean(shards_per_batch) > 4  # 8 rows drawn from 8 shards: ~5.3 distinct expected
    for h, lab in batches:
        assert h.dtype == torch.float32
        torch.testing.assert_close(h, want[lab[:, 0]], rtol=0, atol=0)
    assert sorted(i for b in batches for i in b[1][:, 0].tolist()) == list(range(64))
    local = CacheDataset(c, 8, shuffle=True, seed=2, buffer_size=8)
    assert all(len({i // 8 for i in b[1][:, 0].tolist()}) == 1 for b in local)
    if dtype == "bf16":
        assert torch.equal(x.float(), want)


def test_shuffle_buffer_size_from_megabytes(tmp_path):
    build(tmp_path, n=64, rows=8)  # bf16 rows of 8 x 16 x 2 = 256 bytes
    c = open_cache(tmp_path, "fp")
    assert CacheDataset(c, 4, buffer_mb=16 * 256 / 2**20).buffer_size == 16
    assert CacheDataset(c, 4, buffer_mb=1 / 2**20).buffer_size == 8  # never below one shard
    assert CacheDataset(c, 32, buffer_size=3).buffer_size == 32  # never below one batch
    with pytest.raises(CacheError, match="shuffle buffer"):
        CacheDataset(c, 4, buffer_mb=0)
