"""The compression of the activation cache's arrays and their Zarr metadata (zarr.json), from
the cache config: `compressors` (per sample chunk, inside each shard: none | zstd | blosc-zstd
with byte/bit shuffle) and `array_json`.

The cache's other value code lives beside it (import from there):
    storage/values.py       logical dtype -> stored dtype, value encode / decode, CodecError
    storage/shard_codec.py  shard files (Zarr v3 sharding_indexed) <-> rows, with numcodecs
    storage/stats.py        per-shard value statistics (and the NaN/inf check)
    storage/samples.py      samples.parquet (sample ids, input ids, labels)
"""

from __future__ import annotations

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.storage import MemoryStore

from storage.config import CacheConfig
from storage.values import CodecError

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
