"""Value types and compression of the activation cache: the one import for the rest of the code.

What lives where (all re-exported here):
    storage/values.py       logical dtype -> stored dtype, value encode / decode, CodecError
    storage/shard_codec.py  shard files (Zarr v3 sharding_indexed) <-> rows, with numcodecs
    storage/stats.py        per-shard value statistics (and the NaN/inf check)
    storage/samples.py      samples.parquet (sample ids, input ids, labels)
This module builds the arrays' Zarr metadata (zarr.json) from the cache config.

Compression (per sample chunk, inside each shard): none | zstd | blosc-zstd with byte/bit
shuffle.
"""

from __future__ import annotations

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.storage import MemoryStore

from storage.config import CacheConfig
from storage.samples import read_samples, samples_arrays, samples_table
from storage.shard_codec import (
    CODEC_THREADS,
    MAX_U64,
    ShardCodec,
    _zarr_decode_shard,
    _zarr_encode_shard,
    decode_shard,
    encode_shard,
    encode_shard_parts,
    shard_codec,
    shard_key,
)
from storage.stats import (
    STATS_BLOCK,
    combine_stats,
    count_nonfinite,
    sampling_record,
    shard_stats,
    shard_stats_sampled,
)
from storage.values import (
    FP8_MAX,
    INT8_MAX,
    LOGICAL_TORCH,
    STORED_NP,
    CodecError,
    _as_float_tensor,
    decode,
    encode,
    is_lossy,
    stored_dtype,
)

__all__ = [
    "CODEC_THREADS", "FP8_MAX", "INT8_MAX", "LOGICAL_TORCH", "MAX_U64", "STATS_BLOCK",
    "STORED_NP", "CodecError", "ShardCodec", "_as_float_tensor", "_zarr_decode_shard",
    "_zarr_encode_shard", "array_json", "combine_stats", "compressors", "count_nonfinite",
    "decode", "decode_shard", "encode", "encode_shard", "encode_shard_parts", "is_lossy",
    "read_samples", "samples_arrays", "samples_table", "shard_codec", "shard_key",
    "sampling_record", "shard_stats", "shard_stats_sampled", "stored_dtype",
]  # fmt: skip

_SHUFFLE = {"none": "noshuffle", "byte": "shuffle", "bit": "bitshuffle"}


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
