"""Readers of a complete activation cache: `open_cache` -> `Cache`, `CacheDataset`, HF view.

Every shard read checks the checksum (xxh3_128: tens of GB/s, a small fraction of the read) of
the bytes it decodes against the manifest, so a flipped bit is a CacheCorrupt naming the shard,
never a silently wrong activation. A shard file is read once, straight into a fresh buffer;
with codec none the returned values are a view of that buffer (no decode copy).
Leftover `*.partial` temp files are never opened (readers address files by their key).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from preinfer.fingerprint import CACHE_FORMAT_VERSION
from storage import codecs, fs
from storage.atomic import entry_algo, file_matches, hasher, read_array, read_into
from storage.cache import (
    DONE,
    HIDDEN,
    MANIFEST,
    SAMPLES,
    SCALE,
    CacheCorrupt,
    CacheError,
    CacheIncomplete,
    FingerprintMismatch,
    read_json,
)
from storage.codecs import stored_dtype


def _flat(d, prefix="") -> dict:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def meta_diff(expected: dict, found: dict) -> list[str]:
    """'key: expected X, found Y' for every differing (dotted) key of two meta dicts."""
    e, f = _flat(expected), _flat(found)
    return [
        f"{k}: expected {e.get(k)!r}, found {f.get(k)!r}"
        for k in sorted(set(e) | set(f))
        if e.get(k) != f.get(k)
    ]


def open_cache(
    root: str | Path,
    fingerprint: str | None,
    *,
    expected_fingerprint: str | None = None,
    expected_meta: dict | None = None,
    verify: bool = False,
    check_reads: bool = True,
) -> Cache:
    """Open `<root>/<fingerprint>` (or `root` itself when fingerprint is None) for reading.

    Raises CacheIncomplete (no manifest), FingerprintMismatch (manifest or directory is not
    `expected_fingerprint`; names differing meta fields when `expected_meta` is given or the
    expected cache's manifest exists under root), CacheCorrupt (checksums; all shards are
    hashed when verify=True, otherwise each shard when read; check_reads=False skips the
    per-read checksum (size checks only) once a cache has been verified).
    """
    fs.check(root, "cache root")  # a URL: clear error for a bad endpoint / bucket
    cdir = fs.path(root) if fingerprint is None else fs.path(root) / fingerprint
    fp = cdir.name
    if not cdir.is_dir():
        raise CacheIncomplete(f"no cache at {cdir}; build it first (preinfer cache build)")
    mp = cdir / MANIFEST
    if not mp.exists():
        done = len(list((cdir / DONE).glob("*.json"))) if (cdir / DONE).is_dir() else 0
        total = "?"
        with contextlib.suppress(FileNotFoundError, CacheError, KeyError):
            total = read_json(cdir / "build.json", "build file")["header"]["num_shards"]
        raise CacheIncomplete(
            f"cache {cdir} is incomplete: no {MANIFEST} ({done} of {total} shards done); rerun "
            "the cache build to write the missing shards and finalize it"
        )
    manifest = read_json(mp, "manifest")
    from storage.manifest import validate_manifest  # schema + paths stay inside cdir

    validate_manifest(manifest, cdir)
    if manifest.get("format_version") != CACHE_FORMAT_VERSION:
        raise CacheError(
            f"cache {cdir} has format version {manifest.get('format_version')}, this code reads "
            f"{CACHE_FORMAT_VERSION}; rebuild the cache"
        )
    found = manifest.get("fingerprint")
    want = expected_fingerprint
    if found != fp or (want is not None and want != found):
        why = [f"directory {fp!r}, manifest {found!r}"]
        other = expected_meta
        if other is None and want is not None and (cdir.parent / want / MANIFEST).exists():
            other = read_json(cdir.parent / want / MANIFEST, "manifest").get("meta")
        if other is not None:
            why += meta_diff(other, manifest.get("meta") or {}) or ["(meta identical)"]
        raise FingerprintMismatch(
            f"cache fingerprint mismatch: expected {want or fp!r}, found {found!r}; "
            + "; ".join(why)
            + ". The cache holds other activations: rebuild it for the "
            "current model/tokens (preinfer cache build)"
        )
    cache = Cache(cdir, manifest, check_reads=check_reads)
    for rel, want_f in manifest["files"].items():
        p = cdir / rel
        if not p.is_file() or p.stat().st_size != want_f["bytes"]:
            raise CacheCorrupt(f"{p} is missing or has the wrong size; rebuild the cache")
        if (verify or rel.endswith("zarr.json")) and not file_matches(p, want_f):
            raise CacheCorrupt(f"{p} does not match its manifest checksum; rebuild the cache")
    if verify:
        bad = cache.verify()
        if bad:
            raise CacheCorrupt(
                f"cache {cdir} is corrupt: "
                + "; ".join(f"shard {i}: {why}" if i >= 0 else why for i, why in bad)
                + ". Delete the cache (preinfer cache gc) and rebuild"
            )
    return cache


class Cache:
    """A complete cache. Rows are samples; hidden [N, S, H]; labels [N, S]."""

    def __init__(self, cache_dir: Path, manifest: dict, *, check_reads: bool = True):
        self.dir = fs.path(cache_dir)  # a Path, or a RemotePath (s3://...)
        self.check_reads = check_reads  # checksum of every shard read (False: size only)
        self.manifest = manifest
        h = manifest["header"]
        self.num_samples = h["num_samples"]
        self.seq_len, self.hidden_size = h["seq_len"], h["hidden_size"]
        self.num_shards, self.rows_per_shard = h["num_shards"], h["rows_per_shard"]
        self.dtype = h["dtype"]  # logical cache dtype: fp32 | fp16 | bf16 | int8 | fp8_e4m3
        self._json = {
            n: (self.dir / n / "zarr.json").read_bytes()
            for n in (HIDDEN, SCALE)
            if (self.dir / n / "zarr.json").exists()
        }
        self._last: tuple[int, dict[str, np.ndarray]] | None = None  # last partly read shard
        self._last_samples: tuple[int, np.ndarray, np.ndarray] | None = None  # (group, ids, lab)
        self._pq: pq.ParquetFile | None = None

    def __getstate__(self):  # picklable for DataLoader workers: no open handles / buffers
        return {**self.__dict__, "_last": None, "_last_samples": None, "_pq": None}

    def __repr__(self):
        return (
            f"Cache({self.dir}, N={self.num_samples}, S={self.seq_len}, "
            f"H={self.hidden_size}, {self.dtype}, {self.num_shards} shards)"
        )

    def shard_range(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.num_shards:
            raise CacheError(f"shard {i} out of range 0..{self.num_shards - 1}")
        return i * self.rows_per_shard, min((i + 1) * self.rows_per_shard, self.num_samples)

    def _shard_bytes(self, i: int, *, keep: bool = True) -> tuple[dict[str, np.ndarray], bool]:
        """({array: uint8 buffer} of shard i's files, each checked against the manifest, and
        whether they are kept: keep=True remembers them for the next read of the same shard)."""
        if self._last is not None and self._last[0] == i:
            return self._last[1], True
        out = {}
        for rel, want in self.manifest["shards"][i]["files"].items():
            algo, digest = entry_algo(want)
            h = hasher(algo) if self.check_reads else None  # fed while reading (cache-hot)
            try:
                data = read_array(self.dir / rel, h)
            except FileNotFoundError:
                raise CacheCorrupt(f"shard {i}: {rel} is missing; rebuild the cache") from None
            if len(data) != want["bytes"] or (h is not None and h.hexdigest() != digest):
                raise CacheCorrupt(
                    f"shard {i}: {self.dir / rel} does not match its checksum (bytes changed on "
                    "disk); delete the cache and rebuild it"
                )
            out[rel.split("/", 1)[0]] = data
        self._last = (i, out) if keep else None
        return out, keep

    def _decode(self, name: str, i: int, blobs: dict, a: int, b: int) -> np.ndarray:
        try:
            return codecs.decode_shard(self._json[name], i, blobs[name], a, b)
        except codecs.CodecError as e:
            raise CacheCorrupt(
                f"shard {i}: {name} cannot be decoded ({e}); rebuild the cache"
            ) from None

    def _read_into(self, i: int, dest: np.ndarray) -> bool:
        """Read whole shard i's values straight into `dest` (its rows, C-contiguous), checked
        like _shard_bytes: one copy, no decode. False if the shard is not stored that way
        (compressed, lossy with a scale file, or another layout): use _shard_bytes then."""
        if fs.is_url(self.dir):
            return False  # an object store: one GET per shard (_shard_bytes)
        files = self.manifest["shards"][i]["files"]
        hc = codecs.shard_codec(self._json[HIDDEN])
        span = hc.dense_payload(len(dest))
        if len(files) != 1 or span is None:
            return False
        ((rel, want),) = files.items()
        offset, nbytes = span
        if want["bytes"] != nbytes + hc.index_nbytes:
            return False
        algo, digest = entry_algo(want)
        index = np.empty(hc.index_nbytes, np.uint8)
        parts = (
            [index, memoryview(dest).cast("B")] if offset else [memoryview(dest).cast("B"), index]
        )  # in file order
        h = hasher(algo) if self.check_reads else None  # fed while reading (cache-hot)
        try:
            with open(self.dir / rel, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != want["bytes"]:
                    raise CacheCorrupt(
                        f"shard {i}: {self.dir / rel} does not have the size its manifest "
                        "records (bytes changed on disk); delete the cache and rebuild it"
                    )
                read_into(f, parts, h)
        except FileNotFoundError:
            raise CacheCorrupt(f"shard {i}: {rel} is missing; rebuild the cache") from None
        if h is not None and h.hexdigest() != digest:
            raise CacheCorrupt(
                f"shard {i}: {self.dir / rel} does not match its checksum (bytes changed on "
                "disk); delete the cache and rebuild it"
            )
        try:
            return hc.is_dense(hc.parse_index(index), len(dest))
        except codecs.CodecError as e:
            raise CacheCorrupt(
                f"shard {i}: {HIDDEN} cannot be decoded ({e}); rebuild the cache"
            ) from None

    def read_stored(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Raw stored values [n, S, H] (+ scale [n, S] for lossy) of rows [start, stop).

        The arrays are the caller's own (never shared with another call's result). A read of
        several shards goes straight into one output array (codec none: file -> result, one
        copy); a single whole shard is read into a fresh buffer and viewed (codec none) or
        decoded; part of a shard is cut from the shard's bytes, kept for the next read.
        """
        self._check_range(start, stop)
        first, last = start // self.rows_per_shard, (stop - 1) // self.rows_per_shard
        pieces = []
        for i in range(first, last + 1):
            s0, s1 = self.shard_range(i)
            pieces.append(
                (i, max(s0, start), min(s1, stop), (max(s0, start), min(s1, stop)) == (s0, s1))
            )
        if len(pieces) == 1:
            i, a, b, whole = pieces[0]
            blobs, kept = self._shard_bytes(i, keep=not whole)
            v = self._decode(HIDDEN, i, blobs, a, b)
            sc = self._decode(SCALE, i, blobs, a, b) if SCALE in blobs else None
            if kept:  # a view of kept bytes would be shared with later reads: copy it
                v = v.copy() if v.base is not None else v
                sc = sc.copy() if sc is not None and sc.base is not None else sc
            return v, sc
        hc = codecs.shard_codec(self._json[HIDDEN])
        out = np.empty((stop - start, *hc.shape[1:]), stored_dtype(self.dtype))
        scales = []
        for i, a, b, whole in pieces:
            dest = out[a - start : b - start]
            if whole and self._read_into(i, dest):
                continue
            blobs, _ = self._shard_bytes(i, keep=not whole)
            dest[...] = self._decode(HIDDEN, i, blobs, a, b)
            if SCALE in blobs:
                scales.append(self._decode(SCALE, i, blobs, a, b))
        return out, (np.concatenate(scales) if scales else None)

    def _samples_group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample_id int64 [r], labels int32 [r, S]) of samples.parquet row group g (= shard g)."""
        if self._last_samples is not None and self._last_samples[0] == g:
            return self._last_samples[1:]
        sids, lab = self._samples_groups([g])
        self._last_samples = (g, sids, lab)
        return sids, lab

    def _samples_groups(self, groups: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if self._pq is None:
            self._pq = pq.ParquetFile(fs.parquet_source(self.dir / SAMPLES))
        t = self._pq.read_row_groups(groups, columns=["sample_id", "labels"])
        sids = t.column(0).to_numpy()
        lab = pc.list_flatten(t.column(1)).to_numpy().reshape(len(sids), -1)
        return sids, lab

    def read_labels(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [n, S] long, sample_ids [n] long) of rows [start, stop)."""
        self._check_range(start, stop)
        if self._pq is None:
            self._pq = pq.ParquetFile(fs.parquet_source(self.dir / SAMPLES))
        r = self._pq.metadata.row_group(0).num_rows
        g0, g1 = start // r, (stop - 1) // r
        if g0 == g1:  # one group (a shard): kept for the next read
            ids, lab = self._samples_group(g0)
        else:
            ids, lab = self._samples_groups(list(range(g0, g1 + 1)))
        a, b = start - g0 * r, stop - g0 * r
        return (  # astype copies: fresh arrays, never the kept group
            torch.from_numpy(lab[a:b].astype(np.int64)),
            torch.from_numpy(ids[a:b].astype(np.int64)),
        )

    def read_rows(self, start: int, stop: int, dtype=torch.float32):
        """(hidden [n, S, H] in `dtype` (None: logical), labels [n, S] long, sample_ids [n])."""
        stored, scale = self.read_stored(start, stop)
        return (codecs.decode(stored, scale, self.dtype, dtype), *self.read_labels(start, stop))

    def read_shard(self, i: int, dtype=torch.float32):
        return self.read_rows(*self.shard_range(i), dtype=dtype)

    def _check_range(self, start: int, stop: int) -> None:
        if not (
            isinstance(start, int | np.integer)
            and isinstance(stop, int | np.integer)
            and 0 <= start < stop <= self.num_samples
        ):
            raise CacheError(
                f"row range [{start}, {stop}) is not a non-empty contiguous slice of "
                f"0..{self.num_samples}"
            )

    def verify(self) -> list[tuple[int, str]]:
        """Recompute every shard's checksums: [(shard, reason)] of bad ones (-1: other files)."""
        bad = []
        for i, sh in enumerate(self.manifest["shards"]):
            for rel, want in sh["files"].items():
                p = self.dir / rel
                if not p.is_file():
                    bad.append((i, f"{rel} is missing"))
                elif not file_matches(p, want):
                    bad.append((i, f"{rel} does not match its checksum"))
                    break
        for rel, want in self.manifest["files"].items():
            p = self.dir / rel
            if not p.is_file() or not file_matches(p, want):
                bad.append((-1, f"{rel} is missing or does not match its checksum"))
        return bad


# --------------------------------------------------------------------------- torch dataset


def rank_pieces(n: int, order: list[tuple[int, int]], begin: int, end: int):
    """Row ranges of stream positions [begin, end); the stream = `order`'s ranges, wrapped."""
    out, bounds, acc = [], [], 0
    for a, b in order:
        bounds.append((acc, a, b))
        acc += b - a
    for lap in range(begin // n, (end - 1) // n + 1 if end > begin else 0):
        for p0, a, b in bounds:
            lo, hi = max(begin, lap * n + p0), min(end, lap * n + p0 + b - a)
            if lo < hi:
                out.append((a + lo - lap * n - p0, a + hi - lap * n - p0))
    return out


DEFAULT_BUFFER_MB = 64.0


class CacheDataset(torch.utils.data.IterableDataset):
    """Batches (hidden [B, S, H] in `dtype`, labels [B, S] long) from a Cache, DDP-aware.

    Each epoch the shard order is permuted with (seed, epoch) — identically on every rank —
    giving a stream of N rows. Rank r takes the contiguous stream slice [r*L, (r+1)*L):
      drop_last=True : L = N // world_size, and only whole batches (the tail is dropped);
      drop_last=False: L = ceil(N / world_size); the stream wraps to its start to pad, so up
                       to world_size-1 rows repeat; the last batch may be short.
    Every rank therefore yields the same number of batches (len(self)). Within a rank, the
    batches are split contiguously between DataLoader workers.

    Shuffling: rows fill a buffer of `buffer_mb` MB of *stored* values (bf16 stays 2 bytes a
    value; only each batch is decoded to `dtype`), at least one shard and one batch, at most
    the rank's rows. When it is full it is permuted with a (seed, epoch, rank, worker) seed
    and emptied batch by batch, so a batch mixes rows of every shard the buffer holds (the
    whole split when it fits: a global shuffle). Pre-inference writes train caches in a
    seeded random row order, so even one shard mixes the whole corpus; a cache in document
    order read through a one-shard buffer gives batches of neighbouring documents, which
    train measurably worse (docs/quality.md, 'Cache batch order'). `buffer_size` (rows)
    overrides `buffer_mb`;
    without shuffle the buffer is one shard (the order does not depend on it).
    Call set_epoch before iterating; DataLoader workers copy the dataset when they start, so
    use persistent_workers=False (the default) or the epoch will not reach them.
    """

    def __init__(
        self,
        cache: Cache,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        buffer_size: int | None = None,
        buffer_mb: float = DEFAULT_BUFFER_MB,
        dtype=torch.float32,
        drop_last: bool = False,
    ):
        if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise CacheError(f"bad batch_size/rank/world_size {batch_size}/{rank}/{world_size}")
        if buffer_size is not None and buffer_size <= 0 or buffer_mb <= 0:
            raise CacheError(f"bad shuffle buffer: {buffer_size} rows / {buffer_mb} MB")
        self.cache, self.batch_size, self.shuffle, self.seed = cache, batch_size, shuffle, seed
        self.rank, self.world_size, self.dtype, self.drop_last = rank, world_size, dtype, drop_last
        self.epoch = 0
        n = cache.num_samples
        self.rows_per_rank = n // world_size if drop_last else math.ceil(n / world_size)
        self.num_batches = (
            self.rows_per_rank // batch_size
            if drop_last
            else math.ceil(self.rows_per_rank / batch_size)
        )
        if self.num_batches == 0:
            raise CacheError(
                f"{n} samples cannot make one batch of {batch_size} on each of {world_size} "
                "ranks with drop_last=True; lower batch_size or set drop_last=False"
            )
        row_bytes = cache.seq_len * cache.hidden_size * stored_dtype(cache.dtype).itemsize
        self.buffer_size = buffer_rows(
            row_bytes, cache.rows_per_shard, batch_size, self.rows_per_rank, buffer_size, buffer_mb
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_batches

    def plan(self, worker: int = 0, num_workers: int = 1) -> list[tuple[int, int]]:
        """Row ranges (in stream order) this rank's `worker` reads this epoch."""
        c, b = self.cache, self.batch_size
        shards = list(range(c.num_shards))
        if self.shuffle:
            shards = np.random.default_rng([self.seed, self.epoch]).permutation(shards).tolist()
        b0 = worker * self.num_batches // num_workers
        b1 = (worker + 1) * self.num_batches // num_workers
        rows = min(b1 * b, self.rows_per_rank) if not self.drop_last else b1 * b
        base = self.rank * self.rows_per_rank
        order = [c.shard_range(i) for i in shards]
        return rank_pieces(c.num_samples, order, base + b0 * b, base + rows)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        seed = np.random.SeedSequence([self.seed, self.epoch, self.rank, wid]).generate_state(1)
        rng = torch.Generator().manual_seed(int(seed[0]))
        plan = self.plan(wid, nw)
        c, rps = self.cache, self.cache.rows_per_shard
        cap = min(self.buffer_size, max(1, sum(b - a for a, b in plan)))  # this worker's rows
        buf: list | None = None  # [values (cap, S, H) stored dtype, scale (cap, S) | None]
        labels = torch.empty((cap, c.seq_len), dtype=torch.long)  # (cap, S) paired with buf
        held = 0
        for a, b in plan:
            s = a
            while s < b:  # pieces within one shard and the buffer's free rows
                e = min(b, (s // rps + 1) * rps, s + cap - held)
                v, sc = c.read_stored(s, e)
                if buf is None:
                    buf = [np.empty((cap, *v.shape[1:]), v.dtype), None]
                    if sc is not None:
                        buf[1] = np.empty((cap, *sc.shape[1:]), sc.dtype)
                buf[0][held : held + e - s] = v
                if sc is not None:
                    buf[1][held : held + e - s] = sc
                labels[held : held + e - s] = c.read_labels(s, e)[0]
                del v, sc
                held, s = held + e - s, e
                if held == cap:
                    held = yield from self._flush(buf, labels, held, rng, final=False)
        if held:
            yield from self._flush(buf, labels, held, rng, final=True)

    def _flush(self, buf, labels, held: int, rng, *, final: bool):
        """Yield batches of the buffer's first `held` rows; move the remainder to the front."""
        order = torch.randperm(held, generator=rng) if self.shuffle else torch.arange(held)
        full = held if final else held // self.batch_size * self.batch_size
        for s in range(0, full, self.batch_size):
            idx = order[s : s + self.batch_size]
            if self.shuffle:  # a gather: fresh arrays
                ix = idx.numpy()
                v, lbl = buf[0][ix], labels[idx]
                sc = buf[1][ix] if buf[1] is not None else None
            else:  # contiguous rows: copies, never views of the buffer (it is refilled)
                rows = slice(s, s + len(idx))
                v, lbl = buf[0][rows].copy(), labels[rows].clone()
                sc = buf[1][rows].copy() if buf[1] is not None else None
            yield codecs.decode(v, sc, self.cache.dtype, self.dtype), lbl
        rest = order[full:held]
        if len(rest):
            ix = rest.numpy()
            buf[0][: len(ix)] = buf[0][ix]
            if buf[1] is not None:
                buf[1][: len(ix)] = buf[1][ix]
            labels[: len(ix)] = labels[rest]
        return len(rest)


def buffer_rows(
    row_bytes: int,
    rows_per_shard: int,
    batch_size: int,
    rows_per_rank: int | None,
    rows: int | None,
    mb: float,
) -> int:
    """Rows of a CacheDataset's shuffle buffer (also the planner's estimate of it): `rows`,
    else `mb` of stored values (`row_bytes` a row) but never below one shard (a shard is read
    whole); never below one batch, never above the rank's rows (None: not known)."""
    if rows is None:
        rows = max(int(mb * 2**20 // row_bytes), rows_per_shard)
    if rows_per_rank is not None:
        rows = min(rows, rows_per_rank)
    return max(batch_size, rows)


# ---------------------------------------------------------------------------- HF datasets


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

    s, hs, sd = cache.seq_len, cache.hidden_size, codecs.stored_dtype(cache.dtype)
    feats = {
        "sample_id": datasets.Value("int64"),
        "labels": datasets.List(datasets.Value("int32"), length=s),
        "hidden": datasets.Array2D(shape=(s, hs), dtype=sd.name),
    }
    if codecs.is_lossy(cache.dtype):
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
    stored = np.asarray(hidden).astype(codecs.stored_dtype(cache_dtype), copy=False)
    sc = None if scale is None else np.asarray(scale, np.float32)
    return codecs.decode(stored, sc, cache_dtype, out_dtype)
