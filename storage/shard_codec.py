"""Shard files of the cache's Zarr v3 arrays (sharding_indexed), encoded and decoded with numpy
+ numcodecs: `encode_shard` / `decode_shard` turn a shard's rows into the exact bytes Zarr would
store under the shard's key (and back). zarr itself is the fallback and the test reference.
Codec none decodes to a zero-copy view of the shard's bytes.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import numpy as np
import zarr
from numcodecs import Blosc, Zstd
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from storage.values import CodecError

_WRITE_CFG = {"write_empty_chunks": True}  # all-fill chunks too: -0.0 == 0.0 must not drop


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
# threads (de)compressing a shard's chunks in parallel (numcodecs releases the GIL); 1 = none;
# set from cache.codec_threads by set_codec_threads (the root config does, in every process)
DEFAULT_CODEC_THREADS = min(
    4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
)
CODEC_THREADS = DEFAULT_CODEC_THREADS
_pool: tuple[int, ThreadPoolExecutor] | None = None


def set_codec_threads(n: int | None) -> None:
    """Threads per process for chunk (de)compression; None = min(4, this process's CPUs)."""
    global CODEC_THREADS, _pool
    want = DEFAULT_CODEC_THREADS if n is None else int(n)
    if want != CODEC_THREADS:
        CODEC_THREADS, _pool = want, None  # the next shard gets a pool of the new size


def _thread_pool() -> ThreadPoolExecutor | None:
    """A per-process pool for chunk (de)compression (recreated after fork), None if 1 thread."""
    global _pool
    if CODEC_THREADS <= 1:
        return None
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="codec"))
    return _pool[1]


def _map(fn, items) -> list:
    """[fn(x) for x in items], split into CODEC_THREADS contiguous runs: one run in this thread,
    the others on the pool (a few tasks per shard, not one per chunk: per-task overhead, under
    the GIL, cost more than a chunk's work on a busy machine)."""
    n = len(items)
    pool = _thread_pool() if n >= 4 else None
    if pool is None:
        return [fn(x) for x in items]
    k = min(CODEC_THREADS, n)
    cut = [n * j // k for j in range(k + 1)]
    futs = [
        pool.submit(lambda a, b: [fn(x) for x in items[a:b]], cut[j], cut[j + 1])
        for j in range(1, k)
    ]
    out = [fn(x) for x in items[: cut[1]]]
    for f in futs:
        out += f.result()
    return out


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
        return self.assemble(shard, start, [self.encode_chunks(rows)])

    def encode_chunks(self, rows: np.ndarray) -> tuple[list, np.ndarray]:
        """(buffers, uint64 sizes per row) of rows (n, *inner): each row is a chunk of its own,
        compressed alone, so the chunks of consecutive row blocks, in order, are the chunks of
        the whole (a worker compresses each micro-batch while the next computes)."""
        if not self.fast:
            raise CodecError(f"no chunk-wise encoding for this array ({self.why_slow})")
        n = len(rows)
        if rows.shape[1:] != self.inner:
            raise CodecError(f"rows {rows.shape} do not match the array's rows {self.inner}")
        rows = np.ascontiguousarray(rows, dtype=self.dtype)  # no copy when already LE + C
        flat = rows.reshape(n, self.chunk_items).view(np.uint8)  # (n, chunk_nbytes)
        if self.compressor is None:
            return [flat.reshape(-1)], np.full(n, self.chunk_nbytes, np.uint64)
        chunks = _map(self.compressor.encode, flat)
        return chunks, np.fromiter(map(len, chunks), np.uint64, n)

    def assemble(self, shard: int, start: int, pieces: list[tuple[list, np.ndarray]]) -> list:
        """Buffers of shard `shard`'s bytes from encode_chunks of its rows [start, start+n), in
        row order: the chunks back to back, and the index."""
        sizes = np.concatenate([z for _, z in pieces]) if pieces else np.zeros(0, np.uint64)
        chunks = [c for cs, _ in pieces for c in cs]
        n, a = len(sizes), start - shard * self.rows
        if not 0 <= a < a + n <= self.rows:
            raise CodecError(f"rows {start}..{start + n} do not fit shard {shard}")
        if start + n > self.shape[0]:
            raise CodecError(f"rows up to {start + n} exceed the array's {self.shape[0]}")
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

            def one(job):
                try:
                    dec(job[0], out=job[1])
                except Exception as e:  # numcodecs raises RuntimeError/ValueError on bad data
                    raise CodecError(f"a chunk does not decompress: {e}") from None

            _map(one, todo)
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
