"""Value types and compression of the activation cache.

Logical dtype (CacheConfig.dtype) -> what Zarr stores:
    fp32      float32   exact
    fp16      float16   exact for fp16 input; fp32 input is rounded (|x| > 65504 is an error)
    bf16      uint16    the raw bf16 bits (Zarr v3 has no bfloat16); exact for bf16 input
    int8      int8      lossy: q = round(x / s), s = absmax(token) / 127, one s per (sample, pos)
    fp8_e4m3  uint8     lossy: bits of fp8_e4m3fn(clamp(x / s, ±448)), s = absmax(token) / 448
Lossy types store the scale s as float32 [N, S] in scale.zarr; decode is q * s. A token whose
values are all zero gets s = 0 and decodes to exact zeros (no 0/0).

Compression (per sample chunk, inside each shard): none | zstd | blosc-zstd with byte/bit
shuffle. `encode_shard` / `decode_shard` turn a shard's rows into the exact bytes Zarr would
store under the shard's key (and back) using an in-memory store with the same metadata.

samples.parquet (what the loss needs): sample_id int64, input_ids / labels list<int32> [S],
one row group per shard; `samples_arrays` validates the caller's samples.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from storage.config import LOSSY_DTYPES, CacheConfig

STORED_NP = {
    "fp32": np.dtype("float32"),
    "fp16": np.dtype("float16"),
    "bf16": np.dtype("uint16"),
    "int8": np.dtype("int8"),
    "fp8_e4m3": np.dtype("uint8"),
}
# torch dtype of the decoded logical values before the caller's cast (lossy -> float32).
LOGICAL_TORCH = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.float32,
    "fp8_e4m3": torch.float32,
}
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SHUFFLE = {"none": "noshuffle", "byte": "shuffle", "bit": "bitshuffle"}
_WRITE_CFG = {"write_empty_chunks": True}  # all-fill chunks too: -0.0 == 0.0 must not drop


class CodecError(ValueError):
    """Values cannot be stored in the requested format (message says why and what to do)."""


def is_lossy(dtype: str) -> bool:
    return dtype in LOSSY_DTYPES


def stored_dtype(dtype: str) -> np.dtype:
    if dtype not in STORED_NP:
        raise CodecError(f"unknown cache dtype {dtype!r}; choose one of {', '.join(STORED_NP)}")
    return STORED_NP[dtype]


def compressors(cfg: CacheConfig) -> list | None:
    """Zarr v3 bytes->bytes codecs for one sample chunk, from the cache config."""
    if cfg.codec == "none":
        return None
    if cfg.codec == "zstd":
        return [ZstdCodec(level=cfg.level)]
    if cfg.codec == "blosc-zstd":
        if cfg.level > 9:
            raise CodecError(
                f"cache.level={cfg.level} is too high for blosc-zstd (1..9); lower it or use "
                "cache.codec=zstd (1..22)"
            )
        return [BloscCodec(cname="zstd", clevel=cfg.level, shuffle=_SHUFFLE[cfg.shuffle])]
    raise CodecError(f"unknown cache codec {cfg.codec!r}; choose none, zstd or blosc-zstd")


def array_json(
    shape: tuple[int, ...], rows_per_shard: int, np_dtype: np.dtype, cfg: CacheConfig, attrs: dict
) -> bytes:
    """The zarr.json bytes of an [N, ...] array: chunk = 1 row, shard = `rows_per_shard` rows."""
    store: dict = {}
    zarr.create_array(
        MemoryStore(store),
        shape=shape,
        dtype=np_dtype,
        chunks=(1, *shape[1:]),
        shards=(rows_per_shard, *shape[1:]),
        filters=None,
        compressors=compressors(cfg),
        fill_value=0,
        attributes=attrs,
        dimension_names=("sample", "position", "hidden")[: len(shape)],
    )
    return store["zarr.json"].to_bytes()


def shard_key(shard: int, ndim: int) -> str:
    """Store key of shard `shard` along axis 0 (default key encoding, '/' separator)."""
    return "c/" + "/".join([str(shard)] + ["0"] * (ndim - 1))


def _mem_array(meta_json: bytes, store: dict, *, read_only: bool):
    proto = default_buffer_prototype()
    store["zarr.json"] = proto.buffer.from_bytes(meta_json)
    # open_array ignores a `config=` kwarg (zarr 3.1.6): set it with with_config
    arr = zarr.open_array(MemoryStore(store, read_only=read_only))
    return arr if read_only else arr.with_config(_WRITE_CFG)


def encode_shard(meta_json: bytes, shard: int, start: int, rows: np.ndarray) -> bytes:
    """Bytes Zarr stores under shard `shard`'s key for rows [start, start + len(rows))."""
    store: dict = {}
    arr = _mem_array(meta_json, store, read_only=False)
    arr[start : start + len(rows)] = rows
    return store[shard_key(shard, rows.ndim)].to_bytes()


def decode_shard(meta_json: bytes, shard: int, data: bytes, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of shard `shard` from its stored bytes -> stored-dtype array."""
    store: dict = {}
    ndim = len(json.loads(meta_json)["shape"])
    store[shard_key(shard, ndim)] = default_buffer_prototype().buffer.from_bytes(data)
    return _mem_array(meta_json, store, read_only=True)[start:stop]


# ---------------------------------------------------------------- value encode / decode


def _as_float_tensor(values) -> torch.Tensor:
    if isinstance(values, np.ndarray):
        if values.dtype not in (np.float32, np.float16):
            raise CodecError(
                f"hidden states must be float32/float16 (numpy) or a float torch tensor, got "
                f"numpy {values.dtype}; pass a torch bfloat16 tensor for bf16 values"
            )
        values = torch.from_numpy(np.ascontiguousarray(values))
    if not isinstance(values, torch.Tensor):
        raise CodecError(f"hidden states must be a torch tensor or numpy array, got {type(values)}")
    if values.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CodecError(f"hidden states must be fp32/fp16/bf16, got {values.dtype}")
    return values.detach().cpu().contiguous()


_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # exponent bits all set = inf/NaN


def _count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/inf values; on raw bits for 16-bit floats (torch.isfinite on bf16 is slow)."""
    if x.dtype in _EXP_MASK:
        m = _EXP_MASK[x.dtype]
        return int(np.count_nonzero((x.view(torch.int16).numpy() & m) == m))
    a = x.numpy()
    return (
        0 if np.isfinite(a.max(initial=0.0) - a.min(initial=0.0)) else int((~np.isfinite(a)).sum())
    )


def encode(values, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """values [n, S, H] (fp32/fp16/bf16) -> (stored [n, S, H], scale [n, S] float32 | None).

    Raises CodecError on NaN/inf input or on values the format cannot hold (fp16 overflow).
    """
    x = _as_float_tensor(values)
    bad = _count_nonfinite(x)
    if bad:
        raise CodecError(
            f"{bad} of {x.numel()} hidden values are NaN/inf; the prefix model diverged or "
            "overflowed; fix the model (or its dtype) before caching"
        )
    if dtype == "fp32":
        return x.float().numpy(), None
    if dtype in ("fp16", "bf16"):
        y = x.to(LOGICAL_TORCH[dtype])
        if dtype == "fp16" and not bool(torch.isfinite(y).all()):
            raise CodecError(
                f"hidden values up to {float(x.abs().max()):.4g} overflow fp16 (max 65504); "
                "use cache.dtype=bf16 or fp32"
            )
        return (y.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else y.numpy()), None
    if dtype not in LOSSY_DTYPES:
        raise CodecError(f"unknown cache dtype {dtype!r}; choose one of {', '.join(STORED_NP)}")
    x = x.float()
    qmax = INT8_MAX if dtype == "int8" else FP8_MAX
    scale = x.abs().amax(dim=-1) / qmax  # [n, S] float32; 0 for an all-zero token
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    y = (x / safe).clamp_(-qmax, qmax)  # clamp BEFORE the cast: no overflow, no NaN
    if dtype == "int8":
        q = torch.round(y).to(torch.int8).numpy()
    else:
        q = y.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return q, scale.numpy()


def decode(stored: np.ndarray, scale: np.ndarray | None, dtype: str, out_dtype=torch.float32):
    """Stored values (+ scale for lossy) -> torch tensor in `out_dtype` (None: logical dtype)."""
    t = torch.from_numpy(np.ascontiguousarray(stored))
    if dtype == "bf16":
        t = t.view(torch.bfloat16)  # uint16 bits -> bf16, no copy
    elif dtype in LOSSY_DTYPES:
        if scale is None:
            raise CodecError(f"cache dtype {dtype} needs its scale array to decode")
        if dtype == "fp8_e4m3":
            t = t.view(torch.float8_e4m3fn)
        t = t.float() * torch.from_numpy(np.ascontiguousarray(scale)).unsqueeze(-1)
    return t if out_dtype is None else t.to(out_dtype)


# ------------------------------------------------------------------------- value stats


def shard_stats(decoded: torch.Tensor, given: torch.Tensor | None) -> dict:
    """Sums of one shard's decoded values (+ error vs the given values when not exact).

    numpy float64 pairwise sums: deterministic, so a rewritten shard has the same marker.
    """
    d = decoded.numpy()
    out = {
        "count": int(d.size),
        "sum": float(np.sum(d, dtype=np.float64)),
        "sumsq": float(np.sum(np.square(d), dtype=np.float64)),
        "absmax": float(np.max(np.abs(d))) if d.size else 0.0,
        "err": None,
    }
    if given is not None:
        e = d - given.numpy()
        out["err"] = {
            "max_abs": float(np.max(np.abs(e))) if e.size else 0.0,
            "sum_abs": float(np.sum(np.abs(e), dtype=np.float64)),
            "sum_sq": float(np.sum(np.square(e), dtype=np.float64)),
            "ref_sum_sq": float(np.sum(np.square(given.numpy()), dtype=np.float64)),
        }
    return out


def combine_stats(shards: list[dict]) -> tuple[dict, dict | None]:
    """Per-shard stats -> ({mean, std, absmax}, error summary or None when all were exact)."""
    count = sum(m["count"] for m in shards)
    mean = sum(m["sum"] for m in shards) / count
    var = max(0.0, sum(m["sumsq"] for m in shards) / count - mean * mean)
    stats = {"mean": mean, "std": var**0.5, "absmax": max(m["absmax"] for m in shards)}
    errs = [m["err"] for m in shards if m["err"] is not None]
    if not errs:
        return stats, None
    ref = sum(e["ref_sum_sq"] for e in errs)
    return stats, {
        "max_abs_err": max(e["max_abs"] for e in errs),
        "mean_abs_err": sum(e["sum_abs"] for e in errs) / count,
        "rel_err": (sum(e["sum_sq"] for e in errs) / ref) ** 0.5 if ref else 0.0,
        "shards_measured": len(errs),
    }


# ----------------------------------------------------- samples.parquet (ids and labels)


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
