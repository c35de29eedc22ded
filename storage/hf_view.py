"""A complete cache as a Hugging Face `datasets.Dataset` (bit-exact stored values), written
shard by shard to Arrow files on disk and memory-mapped: never the whole cache in memory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from storage.identity import ExtractSpec, check_identity
from storage.values import decode, is_lossy, stored_dtype

if TYPE_CHECKING:
    from storage.reader import Cache

# Part of every view's fingerprint: bump it when the columns or their encoding change, so a
# view written by older code is never reused.
VIEW_VERSION = 2


def view_fingerprint(cache: Cache) -> str:
    """The view's `datasets` fingerprint: the cache's fingerprint plus a hash of its manifest
    (every shard's checksum), so a rebuilt cache never reuses an older cache's Arrow files."""
    digest = hashlib.sha256(json.dumps(cache.manifest, sort_keys=True).encode()).hexdigest()
    return f"preinfer-{cache.manifest['fingerprint']}-{digest[:16]}-v{VIEW_VERSION}"


def _features(cache: Cache):
    import datasets  # deferred: heavy, and only the HF view needs it

    s, hs, sd = cache.seq_len, cache.hidden_size, stored_dtype(cache.dtype)
    feats = {
        "sample_id": datasets.Value("int64"),
        "labels": datasets.List(datasets.Value("int32"), length=s),
        "hidden": datasets.Array2D(shape=(s, hs), dtype=sd.name),
    }
    if is_lossy(cache.dtype):
        feats["scale"] = datasets.List(datasets.Value("float32"), length=s)
    return datasets.Features(feats)


def _rows(cache: Cache):
    """The cache's rows in order, one shard in memory at a time. Each row is a copy, so the
    rows the Arrow writer still holds never pin a whole shard's buffer."""
    for i in range(cache.num_shards):
        a, b = cache.shard_range(i)
        stored, scale = cache.read_stored(a, b)
        labels, sids = cache.read_labels(a, b)
        labels, sids = labels.numpy().astype(np.int32), sids.numpy()
        for j in range(b - a):
            row = {"sample_id": int(sids[j]), "labels": labels[j], "hidden": stored[j].copy()}
            if scale is not None:
                row["scale"] = scale[j].copy()
            yield row
        del stored, scale, labels, sids  # before the next shard is read


def to_hf_dataset(
    cache: Cache, cache_dir: str | Path | None = None, *, expect: ExtractSpec | dict | None = None
):
    """The cache as a `datasets.Dataset`, bit-exact: stored values, not decoded.

    Columns: sample_id int64; labels [S] int32; hidden Array2D (S, H) of the stored dtype
    (float32 | float16 | uint16 = bf16 bits | int8 | uint8 = fp8_e4m3 bits); scale [S]
    float32 for lossy dtypes. HF's numpy/torch formatters widen uint16 to int64; get the
    values back with `hf_to_torch(row_or_batch["hidden"], cache.dtype, scale)`, e.g. for bf16
    `torch.as_tensor(np.asarray(x, np.uint16)).view(torch.bfloat16)` (what it does).

    Streamed: `Dataset.from_generator` reads one shard at a time and writes it to Arrow files
    under `cache_dir` (None: HF's datasets cache, `HF_DATASETS_CACHE`; never the preinfer
    cache, which may be read-only or remote), which the Dataset memory-maps; memory stays
    about one shard whatever the cache's size. The files are keyed by `view_fingerprint`, so a
    second call on the same cache reuses them. Nothing is downloaded. The view takes as much
    disk as the cache holds uncompressed. expect: the identity the caller expects
    (storage/identity.py); a cache that differs is refused before anything is written.
    """
    import datasets  # deferred: heavy, and only the HF view needs it

    check_identity(cache.manifest, expect, str(cache.dir))

    fp = view_fingerprint(cache)
    ds = datasets.Dataset.from_generator(
        _rows,
        features=_features(cache),
        cache_dir=None if cache_dir is None else str(cache_dir),
        gen_kwargs={"cache": cache},
        fingerprint=fp,
        writer_batch_size=cache.rows_per_shard,  # flushed at each shard's end
    )
    ds.info.description = (
        f"preinfer cache {cache.manifest['fingerprint']}: hidden holds {cache.dtype} values "
        f"stored as {stored_dtype(cache.dtype).name}"
    )
    return ds


def hf_to_torch(hidden, cache_dtype: str, scale=None, out_dtype=None) -> torch.Tensor:
    """HF view values (list / numpy / torch, possibly widened to int64) -> decoded tensor."""
    if isinstance(hidden, torch.Tensor):
        hidden = hidden.numpy()
    stored = np.asarray(hidden).astype(stored_dtype(cache_dtype), copy=False)
    sc = None if scale is None else np.asarray(scale, np.float32)
    return decode(stored, sc, cache_dtype, out_dtype)
