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
store under the shard's key (and back): `ShardCodec` implements the sharding_indexed layout
with numpy + numcodecs (zarr itself only writes zarr.json, and is the fallback and the test
reference). Codec none decodes to a zero-copy view of the shard's bytes.

Stats (`shard_stats`): exact count / sum / sum of squares / absmax of every shard, one
blocked fp32 pass that is also the writer's NaN/inf check.

samples.parquet (what the loss needs): sample_id int64, input_ids / labels list<int32> [S],
one row group per shard; `samples_arrays` validates the caller's samples.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import google_crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import zarr
from numcodecs import Blosc, Zstd
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


# ------------------------------------------------- shard bytes (Zarr v3 sharding_indexed)
#
# A shard file, as zarr 3.1.6 writes it for our metadata (chunk = 1 row, shard = R rows):
#   the inner chunks of the rows written, in the shard's Morton order (for a (R, 1, ...) chunk
#   grid that is row order 0..R-1), each = the row's little-endian bytes then the compressor
#   (numcodecs Zstd / Blosc with the parameters zarr.json records), back to back; chunks of
#   rows not written (past the array's end) are absent;
#   the index: uint64 (offset, nbytes) per chunk, shape (R, 1, ..., 2), C order, little-endian,
#   (MAX_U64, MAX_U64) for an absent chunk, then its crc32c (uint32 LE), at the end or start
#   (index_location; offsets count from the file's start).
# ShardCodec does exactly that with numpy/numcodecs (no zarr call per chunk); tests compare its
# bytes with zarr's own for every dtype x codec. Metadata it does not recognise falls back to
# zarr itself (same bytes, slower).

MAX_U64 = 2**64 - 1
# threads (de)compressing a shard's chunks in parallel (numcodecs releases the GIL); 1 = none
CODEC_THREADS = int(
    os.environ.get("PREINFER_CODEC_THREADS")
    or min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
)
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _thread_pool() -> ThreadPoolExecutor | None:
    """A per-process pool for chunk (de)compression (recreated after fork), None if 1 thread."""
    global _pool
    if CODEC_THREADS <= 1:
        return None
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="codec"))
    return _pool[1]


def _compressor(spec: dict):
    """numcodecs codec built exactly as zarr's ZstdCodec / BloscCodec build theirs."""
    name, conf = spec["name"], spec.get("configuration") or {}
    if name == "zstd":
        return Zstd.from_config({"level": conf["level"], "checksum": conf["checksum"]})
    if name == "blosc":
        shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[conf["shuffle"]]
        return Blosc.from_config(
            {
                "cname": conf["cname"],
                "clevel": conf["clevel"],
                "shuffle": shuffle,
                "blocksize": conf["blocksize"],
                "typesize": conf["typesize"],
            }
        )
    raise NotImplementedError(f"codec {name}")


class ShardCodec:
    """Encode/decode the shard files of one [N, ...] array from its zarr.json bytes."""

    def __init__(self, meta_json: bytes):
        self.meta_json = meta_json
        m = json.loads(meta_json)
        self.shape = tuple(m["shape"])
        self.fast, self.why_slow = True, ""
        try:
            self._parse(m)
        except (KeyError, TypeError, ValueError, IndexError, NotImplementedError) as e:
            self.fast, self.why_slow = False, f"{type(e).__name__}: {e}"

    def _parse(self, m: dict) -> None:
        if m.get("zarr_format") != 3 or m.get("node_type") != "array":
            raise ValueError("not a Zarr v3 array")
        if m.get("storage_transformers"):
            raise NotImplementedError("storage transformers")
        enc = m["chunk_key_encoding"]
        if enc["name"] != "default" or (enc.get("configuration") or {}).get("separator") != "/":
            raise NotImplementedError(f"chunk key encoding {enc}")
        grid = m["chunk_grid"]
        if grid["name"] != "regular":
            raise NotImplementedError(f"chunk grid {grid['name']}")
        shard_shape = tuple(grid["configuration"]["chunk_shape"])
        (sh,) = m["codecs"]
        if sh["name"] != "sharding_indexed":
            raise NotImplementedError(f"array codec {sh['name']}")
        conf = sh["configuration"]
        inner = self.shape[1:]
        if shard_shape[1:] != inner or tuple(conf["chunk_shape"]) != (1, *inner):
            raise NotImplementedError(f"shard {shard_shape} / chunk {conf['chunk_shape']}")
        self.rows = shard_shape[0]
        self.inner = inner
        dt = np.dtype(m["data_type"])
        if dt.kind not in "fiu" or not isinstance(m["fill_value"], int | float):
            raise NotImplementedError(f"data type {m['data_type']} fill {m['fill_value']!r}")
        codecs_ = list(conf["codecs"])
        b = codecs_.pop(0)
        endian = (b.get("configuration") or {}).get("endian")
        if b["name"] != "bytes" or (
            endian != "little" and not (endian is None and dt.itemsize == 1)
        ):
            raise NotImplementedError(f"inner codec {b}")
        self.dtype = dt.newbyteorder("<")
        self.fill = np.array(m["fill_value"], self.dtype)
        self.compressor = _compressor(codecs_.pop(0)) if codecs_ else None
        if codecs_:
            raise NotImplementedError(f"more than one compressor: {codecs_}")
        idx = [c["name"] for c in conf["index_codecs"]]
        ib = conf["index_codecs"][0].get("configuration") or {}
        if idx not in (["bytes"], ["bytes", "crc32c"]) or ib.get("endian") != "little":
            raise NotImplementedError(f"index codecs {conf['index_codecs']}")
        self.crc = idx == ["bytes", "crc32c"]
        self.index_at_start = conf["index_location"] == "start"
        if conf["index_location"] not in ("start", "end"):
            raise ValueError(f"index_location {conf['index_location']!r}")
        self.chunk_items = int(np.prod(inner, dtype=np.int64))
        self.chunk_nbytes = self.chunk_items * self.dtype.itemsize
        self.index_nbytes = 16 * self.rows + (4 if self.crc else 0)

    # ------------------------------------------------------------------ index

    def _index_bytes(self, index: np.ndarray) -> bytes:
        raw = index.astype("<u8", copy=False).tobytes()
        return raw + struct.pack("<I", google_crc32c.value(raw)) if self.crc else raw

    def read_index(self, buf: np.ndarray) -> np.ndarray:
        """(R, 2) uint64 (offset, nbytes) of a shard's bytes; CodecError if it is damaged."""
        n = self.index_nbytes
        if len(buf) < n:
            raise CodecError(f"shard has {len(buf)} bytes, fewer than its index ({n})")
        return self.parse_index(buf[:n] if self.index_at_start else buf[len(buf) - n :])

    def parse_index(self, raw: np.ndarray) -> np.ndarray:
        """(R, 2) uint64 from the index's own index_nbytes bytes (uint8); checks its crc32c."""
        body = raw[: 16 * self.rows]
        if self.crc and struct.unpack("<I", raw[-4:].tobytes())[0] != google_crc32c.value(body):
            raise CodecError("shard index crc32c mismatch")
        return body.view("<u8").reshape(self.rows, 2)

    def dense_payload(self, n: int) -> tuple[int, int] | None:
        """(offset, nbytes) of the rows of a shard holding rows 0..n-1 uncompressed back to back
        (what we write with codec none), or None for a compressed or unrecognised layout."""
        if not self.fast or self.compressor is not None:
            return None
        return (self.index_nbytes if self.index_at_start else 0), n * self.chunk_nbytes

    def is_dense(self, index: np.ndarray, n: int) -> bool:
        """True if `index` (parse_index) says rows 0..n-1 lie as dense_payload(n) says."""
        o0, _ = self.dense_payload(n) or (None, 0)
        if o0 is None:
            return False
        cb = np.uint64(self.chunk_nbytes)
        want = np.uint64(o0) + np.arange(n, dtype=np.uint64) * cb
        return bool(
            (index[:n, 0] == want).all()
            and (index[:n, 1] == cb).all()
            and (index[n:] == MAX_U64).all()
        )

    # ------------------------------------------------------------------ encode

    def encode_parts(self, shard: int, start: int, rows: np.ndarray) -> list:
        """Buffers whose concatenation is shard `shard`'s bytes with rows [start, start+n)."""
        if not self.fast:
            return [_zarr_encode_shard(self.meta_json, shard, start, rows)]
        s0 = shard * self.rows
        a = start - s0
        n = len(rows)
        if rows.shape[1:] != self.inner or not 0 <= a < a + n <= self.rows:
            raise CodecError(f"rows {start}..{start + n} {rows.shape} do not fit shard {shard}")
        if start + n > self.shape[0]:
            raise CodecError(f"rows up to {start + n} exceed the array's {self.shape[0]}")
        rows = np.ascontiguousarray(rows, dtype=self.dtype)  # no copy when already LE + C
        flat = rows.reshape(n, -1).view(np.uint8)  # (n, chunk_nbytes)
        if self.compressor is None:
            chunks = [flat.reshape(-1)]
            sizes = np.full(n, self.chunk_nbytes, np.uint64)
        else:
            enc = self.compressor.encode
            pool = _thread_pool() if n >= 4 else None
            chunks = list(pool.map(enc, flat)) if pool else [enc(c) for c in flat]
            sizes = np.fromiter(map(len, chunks), np.uint64, n)
        index = np.full((self.rows, 2), MAX_U64, np.uint64)
        offsets = np.zeros(n, np.uint64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        if self.index_at_start:
            offsets += np.uint64(self.index_nbytes)
        index[a : a + n, 0] = offsets
        index[a : a + n, 1] = sizes
        ib = self._index_bytes(index)
        return [ib, *chunks] if self.index_at_start else [*chunks, ib]

    # ------------------------------------------------------------------ decode

    def decode(self, data, shard: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) from shard `shard`'s bytes (bytes or a uint8 array).

        Codec none with the rows stored back to back (what we write): a zero-copy view of
        `data` (writable if `data` is). Otherwise a fresh array, chunk by chunk.
        """
        if not self.fast:
            return _zarr_decode_shard(self.meta_json, shard, bytes(data), start, stop)
        buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        s0 = shard * self.rows
        a, b = start - s0, stop - s0
        if not 0 <= a < b <= self.rows:
            raise CodecError(f"rows {start}..{stop} are not in shard {shard}")
        index = self.read_index(buf)[a:b]
        off, size = index[:, 0], index[:, 1]
        lo = self.index_nbytes if self.index_at_start else 0
        hi = len(buf) - (0 if self.index_at_start else self.index_nbytes)
        present = off != MAX_U64
        if present.any():
            o, z = off[present], size[present]
            if int(o.min()) < lo or int(o.max()) > hi or int(z.max()) > hi or (o + z).max() > hi:
                raise CodecError("shard index points outside the shard")
        n, cb = b - a, self.chunk_nbytes
        if (
            self.compressor is None
            and present.all()
            and (size == cb).all()
            and (off == off[0] + np.arange(n, dtype=np.uint64) * np.uint64(cb)).all()
        ):
            o0 = int(off[0])
            return buf[o0 : o0 + n * cb].view(self.dtype).reshape(n, *self.inner)
        out = np.empty((n, *self.inner), self.dtype)
        flat = out.reshape(n, -1)
        todo = []
        for k in range(n):
            if not present[k]:
                flat[k] = self.fill
                continue
            chunk = buf[int(off[k]) : int(off[k] + size[k])]
            if self.compressor is None:
                if len(chunk) != cb:
                    raise CodecError(f"chunk {a + k} has {len(chunk)} bytes, expected {cb}")
                flat[k] = chunk.view(self.dtype)
            else:
                todo.append((chunk, flat[k]))
        if todo:
            dec = self.compressor.decode
            pool = _thread_pool() if len(todo) >= 4 else None

            def one(job):
                try:
                    dec(job[0], out=job[1])
                except Exception as e:  # numcodecs raises RuntimeError/ValueError on bad data
                    raise CodecError(f"a chunk does not decompress: {e}") from None

            for _ in pool.map(one, todo) if pool else map(one, todo):
                pass
        return out


@functools.lru_cache(maxsize=64)
def shard_codec(meta_json: bytes) -> ShardCodec:
    return ShardCodec(meta_json)


def encode_shard_parts(meta_json: bytes, shard: int, start: int, rows: np.ndarray) -> list:
    """Buffers whose concatenation is `encode_shard(...)` (saves one copy when writing)."""
    return shard_codec(meta_json).encode_parts(shard, start, rows)


def encode_shard(meta_json: bytes, shard: int, start: int, rows: np.ndarray) -> bytes:
    """Bytes Zarr stores under shard `shard`'s key for rows [start, start + len(rows))."""
    return b"".join(encode_shard_parts(meta_json, shard, start, rows))


def decode_shard(meta_json: bytes, shard: int, data, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of shard `shard` from its stored bytes -> stored-dtype array."""
    return shard_codec(meta_json).decode(data, shard, start, stop)


def _mem_array(meta_json: bytes, store: dict, *, read_only: bool):
    proto = default_buffer_prototype()
    store["zarr.json"] = proto.buffer.from_bytes(meta_json)
    # open_array ignores a `config=` kwarg (zarr 3.1.6): set it with with_config
    arr = zarr.open_array(MemoryStore(store, read_only=read_only))
    return arr if read_only else arr.with_config(_WRITE_CFG)


def _zarr_encode_shard(meta_json: bytes, shard: int, start: int, rows: np.ndarray) -> bytes:
    """Reference/fallback: the shard bytes zarr itself writes into an empty in-memory store."""
    store: dict = {}
    arr = _mem_array(meta_json, store, read_only=False)
    arr[start : start + len(rows)] = rows
    return store[shard_key(shard, rows.ndim)].to_bytes()


def _zarr_decode_shard(meta_json: bytes, shard: int, data: bytes, start: int, stop: int):
    """Reference/fallback: rows [start, stop) decoded by zarr from one shard's bytes."""
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


def _refuse_nonfinite(x: torch.Tensor) -> None:
    bad = _count_nonfinite(x)
    if bad:
        raise CodecError(
            f"{bad} of {x.numel()} hidden values are NaN/inf; the prefix model diverged or "
            "overflowed; fix the model (or its dtype) before caching"
        )


def encode(
    values, dtype: str, *, check_finite: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """values [n, S, H] (fp32/fp16/bf16) -> (stored [n, S, H], scale [n, S] float32 | None).

    Raises CodecError on NaN/inf input (check_finite=False skips that pass: the caller checks
    the decoded values, e.g. with shard_stats) or on values the format cannot hold (fp16
    overflow).
    """
    x = _as_float_tensor(values)
    if check_finite:
        _refuse_nonfinite(x)
    if dtype == "fp32":
        return x.float().numpy(), None
    if dtype in ("fp16", "bf16"):
        y = x.to(LOGICAL_TORCH[dtype])
        if dtype == "fp16" and x.dtype != torch.float16 and not bool(torch.isfinite(y).all()):
            _refuse_nonfinite(x)
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


STATS_BLOCK = 1 << 18  # values per block: 1 MiB of fp32, stays in L2; few Python calls
_ONES = np.ones(STATS_BLOCK, np.float32)


def _f32_blocks(t: torch.Tensor):
    """float32 numpy blocks of a float tensor's values, in a fixed order (deterministic)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.float32:
        a = flat.numpy()
        for o in range(0, len(a), STATS_BLOCK):
            yield a[o : o + STATS_BLOCK]
        return
    if t.dtype == torch.bfloat16:
        bits = flat.view(torch.int16).numpy().view(np.uint16)
        buf = np.empty(min(STATS_BLOCK, len(bits)), np.uint32)
        for o in range(0, len(bits), STATS_BLOCK):
            u = buf[: len(bits[o : o + STATS_BLOCK])]
            np.copyto(u, bits[o : o + STATS_BLOCK])
            np.left_shift(u, 16, out=u)  # bf16 bits are the top half of fp32's: exact
            yield u.view(np.float32)
        return
    a = flat.numpy() if t.dtype == torch.float16 else flat.float().numpy()
    buf = np.empty(min(STATS_BLOCK, len(a)), np.float32)
    for o in range(0, len(a), STATS_BLOCK):
        f = buf[: len(a[o : o + STATS_BLOCK])]
        np.copyto(f, a[o : o + STATS_BLOCK])
        yield f


def _sums(t: torch.Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, absmax) of all values in one blocked pass: each block of
    STATS_BLOCK values as float32 (exact for bf16/fp16), summed and squared-summed by BLAS dots
    (fp32 within a block), blocks combined in float64; absmax = max(|min|, |max|). A NaN/inf
    value (or an fp32 overflow of a block's sums) makes the sums non-finite."""
    if t.dtype == torch.bfloat16:
        return _sums_bf16(t.detach().cpu().contiguous().reshape(-1).view(torch.int16).numpy())
    s = ss = hi = lo = 0.0
    for f in _f32_blocks(t):  # numpy/BLAS only: torch's OpenMP reductions spin on busy CPUs
        s += float(np.dot(f, _ONES[: len(f)]))
        ss += float(np.dot(f, f))
        hi, lo = max(hi, float(f.max())), min(lo, float(f.min()))
    return s, ss, max(hi, -lo)


def _bf16_float(bits: int) -> float:
    return float(np.array([(bits & 0xFFFF) << 16], np.uint32).view(np.float32)[0])


def _sums_bf16(bits: np.ndarray) -> tuple[float, float, float]:
    """_sums of bf16 values given as their int16 bits, without widening them one by one.

    Read as uint32 words, a pair of bf16 values is (odd << 16 | even): `word & 0xFFFF0000` is
    the odd value's fp32 bits and `word << 16` the even one's (both exact), two cheap bit ops
    per block instead of a widening copy. absmax from the bits: magnitude bits order like
    magnitudes, so it is max(largest int16 (positives), largest uint16 & 0x7FFF (negatives)).
    The summation order depends only on the values (unaligned input is copied first), so
    equal shards give equal stats.
    """
    top = max(int(bits.max(initial=0)), int(bits.view(np.uint16).max(initial=0)) & 0x7FFF)
    last = None
    if len(bits) % 2:
        last = _bf16_float(int(bits[-1]))
        bits = bits[:-1]
    if bits.ctypes.data % 4:
        bits = bits.copy()
    words = bits.view(np.uint32)
    block = STATS_BLOCK // 2
    buf = np.empty(min(block, len(words)), np.uint32)
    s = ss = 0.0
    for o in range(0, len(words), block):
        w = words[o : o + block]
        u, one = buf[: len(w)], _ONES[: len(w)]
        f = u.view(np.float32)
        np.bitwise_and(w, np.uint32(0xFFFF0000), out=u)  # odd values
        s, ss = s + float(np.dot(f, one)), ss + float(np.dot(f, f))
        np.left_shift(w, np.uint32(16), out=u)  # even values
        s, ss = s + float(np.dot(f, one)), ss + float(np.dot(f, f))
    if last is not None:
        s, ss = s + last, ss + last * last
    return s, ss, _bf16_float(top)


def _sums_f64(t: torch.Tensor) -> tuple[float, float, float]:
    """As _sums but in float64 throughout (fallback when fp32 block sums overflow)."""
    s = ss = 0.0
    m = 0.0
    for f in _f32_blocks(t):
        d = f.astype(np.float64)
        s, ss, m = s + float(d.sum()), ss + float(np.dot(d, d)), max(m, float(np.abs(d).max()))
    return s, ss, m


def count_nonfinite(t: torch.Tensor) -> int:
    """Number of NaN/inf values of a float tensor."""
    return _count_nonfinite(t.detach().cpu().contiguous())


def shard_stats(decoded: torch.Tensor, given: torch.Tensor | None = None) -> dict:
    """Sums of one shard's decoded values (+ error vs the given values when not exact).

    Every value counts (exact absmax; sum and sum of squares accumulated in fp32 within blocks
    of STATS_BLOCK values and float64 across blocks), deterministic, so a rewritten shard gets
    the same marker. Raises CodecError if a decoded value is NaN/inf (this pass doubles as the
    writer's finiteness check).
    """
    n = decoded.numel()
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite sums are checked below
        s, ss, m = _sums(decoded) if n else (0.0, 0.0, 0.0)
        if not (math.isfinite(s) and math.isfinite(ss) and math.isfinite(m)):
            bad = count_nonfinite(decoded)
            if bad:
                raise CodecError(f"{bad} of {n} values are NaN/inf")
            s, ss, m = _sums_f64(decoded)  # finite values whose fp32 sums overflowed
    out = {"count": int(n), "sum": s, "sumsq": ss, "absmax": m, "err": None}
    if given is not None:
        out["err"] = _error_sums(decoded, given)
    return out


def _error_sums(decoded: torch.Tensor, given: torch.Tensor) -> dict:
    """max |e|, sum |e|, sum e^2 of e = decoded - given, and sum given^2: blocked, fp32 within a
    block (BLAS dots), float64 across blocks."""
    mx = sa = sq = ref = 0.0
    e = np.empty(min(STATS_BLOCK, decoded.numel()), np.float32)
    for d, g in zip(_f32_blocks(decoded), _f32_blocks(given), strict=True):
        k = len(d)
        ek, one = e[:k], _ONES[:k]
        np.subtract(d, g, out=ek)
        sq += float(np.dot(ek, ek))
        ref += float(np.dot(g, g))
        np.abs(ek, out=ek)
        mx = max(mx, float(ek.max()))
        sa += float(np.dot(ek, one))
    return {"max_abs": mx, "sum_abs": sa, "sum_sq": sq, "ref_sum_sq": ref}


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
