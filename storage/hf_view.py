"""A complete cache as a Hugging Face `datasets.Dataset` (bit-exact stored values)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from storage.values import decode, is_lossy, stored_dtype

if TYPE_CHECKING:
    from storage.reader import Cache


def to_hf_dataset(cache: Cache):
    """The cache as an in-memory `datasets.Dataset`, bit-exact: stored values, not decoded.

    Columns: sample_id int64; labels [S] int32; hidden Array2D (S, H) of the stored dtype
    (float32 | float16 | uint16 = bf16 bits | int8 | uint8 = fp8_e4m3 bits); scale [S]
    float32 for lossy dtypes. HF's numpy/torch formatters widen uint16 to int64; get the
    values back with `hf_to_torch(row_or_batch["hidden"], cache.dtype, scale)`, e.g. for bf16
    `torch.as_tensor(np.asarray(x, np.uint16)).view(torch.bfloat16)` (what it does).
    Holds the whole cache in memory: meant for inspection and small caches.
    """
    import datasets
    from datasets.features.features import Array2DExtensionType

    s, hs, sd = cache.seq_len, cache.hidden_size, stored_dtype(cache.dtype)
    feats = {
        "sample_id": datasets.Value("int64"),
        "labels": datasets.List(datasets.Value("int32"), length=s),
        "hidden": datasets.Array2D(shape=(s, hs), dtype=sd.name),
    }
    if is_lossy(cache.dtype):
        feats["scale"] = datasets.List(datasets.Value("float32"), length=s)
    batches = []
    for i in range(cache.num_shards):
        a, b = cache.shard_range(i)
        stored, scale = cache.read_stored(a, b)
        labels, sids = cache.read_labels(a, b)
        n = b - a
        inner = pa.ListArray.from_arrays(
            pa.array(np.arange(0, n * s * hs + 1, hs, np.int32)), pa.array(stored.reshape(-1))
        )
        outer = pa.ListArray.from_arrays(pa.array(np.arange(0, n * s + 1, s, np.int32)), inner)
        cols = {
            "sample_id": pa.array(sids.numpy()),
            "labels": pa.FixedSizeListArray.from_arrays(
                pa.array(labels.numpy().astype(np.int32).reshape(-1)), s
            ),
            "hidden": pa.ExtensionArray.from_storage(Array2DExtensionType((s, hs), sd.name), outer),
        }
        if scale is not None:
            cols["scale"] = pa.FixedSizeListArray.from_arrays(pa.array(scale.reshape(-1)), s)
        batches.append(pa.table(cols))
    features = datasets.Features(feats)
    table = pa.concat_tables(batches).cast(features.arrow_schema)
    info = datasets.DatasetInfo(
        description=f"preinfer cache {cache.manifest['fingerprint']}: hidden holds "
        f"{cache.dtype} values stored as {sd.name}",
        features=features,
    )
    return datasets.Dataset(datasets.table.InMemoryTable(table), info=info)


def hf_to_torch(hidden, cache_dtype: str, scale=None, out_dtype=None) -> torch.Tensor:
    """HF view values (list / numpy / torch, possibly widened to int64) -> decoded tensor."""
    if isinstance(hidden, torch.Tensor):
        hidden = hidden.numpy()
    stored = np.asarray(hidden).astype(stored_dtype(cache_dtype), copy=False)
    sc = None if scale is None else np.asarray(scale, np.float32)
    return decode(stored, sc, cache_dtype, out_dtype)
