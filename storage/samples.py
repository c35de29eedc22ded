"""samples.parquet (what the loss needs): sample_id int64, input_ids / labels list<int32> [S],
one row group per shard; `samples_arrays` validates the caller's samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from storage.values import CodecError


def _to_numpy(a: Any) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def samples_arrays(samples: Any, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pyarrow.Table | dict | (sample_id, input_ids, labels) -> int64 [N], int32 [N,S] x 2."""
    if isinstance(samples, pa.Table):
        missing = {"sample_id", "input_ids", "labels"} - set(samples.column_names)
        if missing:
            raise CodecError(f"samples table lacks column(s) {sorted(missing)}")
        cols = []
        for name in ("input_ids", "labels"):
            col = samples.column(name).combine_chunks()
            lens = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            if len(lens) and (lens.min() != seq_len or lens.max() != seq_len):
                raise CodecError(f"samples.{name}: every row must hold seq_len={seq_len} ids")
            cols.append(pc.list_flatten(col).to_numpy().reshape(-1, seq_len))
        sid, ids, labels = samples.column("sample_id").to_numpy(), *cols
    elif isinstance(samples, dict):
        sid, ids, labels = (_to_numpy(samples[k]) for k in ("sample_id", "input_ids", "labels"))
    elif isinstance(samples, tuple | list) and len(samples) == 3:
        sid, ids, labels = (_to_numpy(a) for a in samples)
    else:
        raise CodecError(
            "samples must be a pyarrow.Table, a dict or a (sample_id, input_ids, labels) tuple, "
            f"got {type(samples).__name__}"
        )
    n = len(sid)
    for name, a in (("input_ids", ids), ("labels", labels)):
        if a.shape != (n, seq_len) or not np.issubdtype(a.dtype, np.integer):
            raise CodecError(
                f"samples.{name} must be integers of shape ({n}, {seq_len}) (one row per "
                f"sample_id, seq_len ids each), got {a.dtype} {a.shape}"
            )
        if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
            raise CodecError(f"samples.{name} has values outside int32")
    if n == 0 or sid.ndim != 1 or not np.issubdtype(sid.dtype, np.integer):
        raise CodecError(
            f"samples.sample_id must be a non-empty 1-D integer array, got {sid!r:.80}"
        )
    if len(np.unique(sid)) != n:
        raise CodecError("samples.sample_id has duplicates; each sample must appear once")
    return sid.astype(np.int64), ids.astype(np.int32), labels.astype(np.int32)


def samples_table(sid: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> pa.Table:
    n, s = ids.shape
    offsets = pa.array(np.arange(0, n * s + 1, s, dtype=np.int32))

    def lists(a):
        return pa.ListArray.from_arrays(offsets, pa.array(a.reshape(-1), type=pa.int32()))

    return pa.table(
        {"sample_id": pa.array(sid, pa.int64()), "input_ids": lists(ids), "labels": lists(labels)}
    )


def read_samples(f: pq.ParquetFile, start: int, stop: int, column: str) -> np.ndarray:
    """Column `column` of rows [start, stop): [n] for sample_id, [n, S] int32 for id lists.

    samples.parquet has one row group per shard, so this reads 1-2 row groups.
    """
    r = f.metadata.row_group(0).num_rows
    g0, g1 = start // r, (stop - 1) // r
    col = f.read_row_groups(list(range(g0, g1 + 1)), columns=[column]).column(0)
    col = col.slice(start - g0 * r, stop - start).combine_chunks()
    if column == "sample_id":
        return col.to_numpy()
    return pc.list_flatten(col).to_numpy().reshape(stop - start, -1)
