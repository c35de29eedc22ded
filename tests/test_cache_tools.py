"""Cache tools: ls / inspect / verify / gc."""

import numpy as np
import pytest
import torch

from storage.cache import CacheWriter
from storage.cache_tools import format_table, gc_caches, inspect_cache, list_caches, verify_cache
from storage.config import CacheConfig
from storage.layout import CacheError

N, S, H = 24, 8, 16


def build(root, fp, boundary, finalize=True):
    c = CacheConfig(dtype="bf16", codec="zstd", shuffle="none", shard_mb=8 * S * H * 2 / 2**20)
    ids = np.zeros((N, S), int)
    meta = {"boundary": boundary, "split": "val", "tokens": "t" * 40, "model": {"name": "gpt2"}}
    w = CacheWriter.create(
        root, fp, samples=(np.arange(N), ids, ids), seq_len=S, hidden_size=H, cache_cfg=c, meta=meta
    )
    x = torch.randn(N, S, H).to(torch.bfloat16)
    for i in range(w.num_shards - (0 if finalize else 1)):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    if finalize:
        w.finalize()


def test_ls_inspect_verify(tmp_path):
    build(tmp_path, "aaa", 1)
    build(tmp_path, "bbb", 2, finalize=False)
    (tmp_path / "not_a_cache").mkdir()
    rows = {r["fingerprint"]: r for r in list_caches(tmp_path)}
    assert set(rows) == {"aaa", "bbb"}
    a, b = rows["aaa"], rows["bbb"]
    assert a["complete"] and (a["done_shards"], a["total_shards"]) == (3, 3)
    assert not b["complete"] and (b["done_shards"], b["total_shards"]) == (2, 3)
    assert (a["boundary"], a["model"], a["split"], a["N"]) == (1, "gpt2", "val", N)
    assert b["boundary"] == 2 and a["size_bytes"] > 0 and a["compression_ratio"] > 0
    assert a["created"] and b["created"] is None
    table = format_table(list_caches(tmp_path))
    assert "aaa" in table and "size_MiB" in table and len(table.splitlines()) == 4
    info = inspect_cache(tmp_path, "aaa")
    assert info["status"] == "complete" and info["num_shards"] == 3 and "shards" not in info
    assert info["stats"]["absmax"] > 0 and info["meta"]["boundary"] == 1
    assert inspect_cache(tmp_path, "bbb")["status"].startswith("incomplete")
    assert verify_cache(tmp_path, "aaa") == []
    with pytest.raises(CacheError):
        list_caches(tmp_path / "missing")


def test_gc_dry_run_then_real_never_removes_kept(tmp_path):
    for fp, k in (("keep1", 1), ("old", 2)):
        build(tmp_path, fp, k)
    build(tmp_path, "broken", 3, finalize=False)
    build(tmp_path, "keep2", 3, finalize=False)  # incomplete but kept: still never removed
    stale = tmp_path / "keep1/hidden.zarr/c/0/0/0.partial"
    stale.write_bytes(b"x")
    before = sorted(p.name for p in tmp_path.iterdir())
    plan = gc_caches(tmp_path, {"keep1", "keep2"}, dry_run=True, grace_s=0)
    assert sorted(before) == sorted(p.name for p in tmp_path.iterdir()) and stale.exists()
    reasons = {fp: why for fp, why, _ in plan}
    assert reasons["old"] == "not in keep set" and reasons["broken"].startswith("incomplete")
    assert "partial" in reasons["keep1"] and "keep2" not in reasons
    assert all(size > 0 for _, _, size in plan)
    # an incomplete cache still being written (recent files) survives a default gc
    recent = gc_caches(tmp_path, {"keep1", "keep2"}, dry_run=True)
    assert "broken" not in {fp for fp, _, _ in recent}
    done = gc_caches(tmp_path, {"keep1", "keep2"}, dry_run=False, grace_s=0)
    assert {fp for fp, _, _ in done} == {"old", "broken", "keep1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep1", "keep2"]
    assert not stale.exists() and verify_cache(tmp_path, "keep1") == []
