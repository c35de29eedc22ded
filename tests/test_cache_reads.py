"""Reads for reuse: bench/cache_reads.py (every kind of read equals the rows written; its shuffle
is seeded and recorded), and the ranged read of part of a shard (storage/reader.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import cache_reads
from storage.cache import CacheWriter
from storage.config import CacheConfig
from storage.layout import CacheCorrupt
from storage.reader import Cache, open_cache


def test_cache_reads_quick_checks_every_read_and_records_its_shuffle(tmp_path):
    a = cache_reads.main(["--quick", "--work", str(tmp_path), "--out", str(tmp_path / "a.json")])
    assert [(r["target"], r["kind"]) for r in a["results"]] == [
        (t, k) for t in cache_reads.TARGETS for k in cache_reads.KINDS
    ]
    assert all(r["cache_rows_s"] > 0 and r["plain_rows_s"] > 0 for r in a["results"])
    local, s3 = a["targets"]["local"], a["targets"]["s3"]
    for t in (local, s3):  # every read of each target was checked against the rows written
        assert t["checked"]["sequential"]["rows"] == t["checked"]["shuffled"]["rows"] == 256
        assert t["checked"]["block"]["rows"] == 8 * 16
    assert s3["plain"] == "ranged GETs of one object" and local["plain"].startswith("numpy")
    # the shuffle is the same rows in the same order from the disk and from S3
    assert s3["shuffle"] == local["shuffle"]
    assert (tmp_path / "a.json").is_file() and not list(tmp_path.glob("cache_reads-*"))
    again = cache_reads.main(["--quick", "--warm", "--targets", "local", "--work", str(tmp_path),
                              "--out", str(tmp_path / "b.json")])  # fmt: skip
    assert list(again["targets"]) == ["local"]
    assert again["targets"]["local"]["shuffle"]["order_sha256"] == local["shuffle"]["order_sha256"]
    other = cache_reads.main(["--quick", "--warm", "--targets", "local", "--seed", "1",
                              "--work", str(tmp_path), "--out", str(tmp_path / "c.json")])  # fmt: skip
    assert other["targets"]["local"]["shuffle"]["order_sha256"] != local["shuffle"]["order_sha256"]
    seq = local["checked"]["sequential"]["order_sha256"]
    assert seq != local["shuffle"]["order_sha256"]  # shuffled is not the sequential order


def test_ranged_rows_reads_exactly_the_rows_it_is_asked_for(tmp_path):
    """The plain S3 arm's slices are the rows of the object, as a memmap's are."""
    x = cache_reads.make_values(10, 3, 4, seed=0)
    mm = np.load(_npy(tmp_path, x), mmap_mode="r")
    blob, reads = cache_reads.stored_u16(x).tobytes(), []
    rr = cache_reads.RangedRows(lambda a, b: reads.append((a, b)) or blob[a:b], tuple(x.shape))
    for sl in (slice(0, 10), slice(3, 7), slice(9, 10), slice(4, 4)):
        assert np.array_equal(rr[sl], mm[sl])
    assert reads == [(0, 240), (72, 168), (216, 240)]  # one read a slice, just its rows' bytes


def _npy(tmp_path, x):
    np.save(tmp_path / "x.npy", cache_reads.stored_u16(x))
    return tmp_path / "x.npy"


def _cache(root, codec: str):
    """A complete 3-shard bf16 cache (8 rows a shard, labels = the row) and its values."""
    c = CacheConfig(dtype="bf16", codec=codec, shuffle="none", shard_mb=8 * 4 * 16 * 2 / 2**20)
    ids = np.repeat(np.arange(24)[:, None], 4, 1)
    w = CacheWriter.create(root, "ab" * 8, samples=(np.arange(24), ids, ids), seq_len=4,
                           hidden_size=16, cache_cfg=c, meta={})  # fmt: skip
    x = torch.randn(24, 4, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    w.finalize()
    return x


def test_rows_of_a_shard_are_read_alone_only_without_read_checksums(tmp_path, monkeypatch):
    x = _cache(tmp_path, "none")
    fast = open_cache(tmp_path, "ab" * 8, check_reads=False)
    whole = []
    real = Cache._shard_bytes
    monkeypatch.setattr(
        Cache, "_shard_bytes", lambda self, *a, **k: whole.append(a) or real(self, *a, **k)
    )
    for a, b in ((3, 6), (6, 11), (0, 24)):  # in one shard, across two, every shard
        assert torch.equal(fast.read_rows(a, b)[0], x[a:b].float())
    assert whole == []  # no whole-shard read: only the rows' bytes (and the index)
    checked = open_cache(tmp_path, "ab" * 8)
    assert torch.equal(checked.read_rows(3, 6)[0], x[3:6].float()) and whole == [(0,)]
    # a flipped byte elsewhere in the shard: the checked read refuses it, the fast one (which
    # never reads that row) returns its own rows right
    p = tmp_path / ("ab" * 8) / "hidden.zarr" / "c" / "0" / "0" / "0"
    raw = bytearray(p.read_bytes())
    raw[0] ^= 0xFF  # row 0
    p.write_bytes(bytes(raw))
    with pytest.raises(CacheCorrupt, match="shard 0"):
        open_cache(tmp_path, "ab" * 8).read_rows(3, 6)
    assert torch.equal(open_cache(tmp_path, "ab" * 8, check_reads=False).read_rows(3, 6)[0],
                       x[3:6].float())  # fmt: skip

    # a compressed shard has no rows to read alone: it is still read whole
    whole.clear()
    y = _cache(tmp_path / "zstd", "zstd")
    assert torch.equal(open_cache(tmp_path / "zstd", "ab" * 8, check_reads=False).read_rows(3, 6)[0],
                       y[3:6].float())  # fmt: skip
    assert whole == [(0,)]
