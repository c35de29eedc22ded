"""Readers of a complete activation cache: `open_cache` -> `Cache`. The dataset views of a
Cache are functions of it in the modules above this one, which import it (a method here
would make an import cycle): `CacheDataset(cache, batch_size)` (storage/dataset.py) and
`to_hf_dataset(cache)` (storage/hf_view.py), both exported by `storage`.

Every shard read checks the checksum (xxh3_128: tens of GB/s, a small fraction of the read) of
the bytes it decodes against the manifest, so a flipped bit is a CacheCorrupt naming the shard,
never a silently wrong activation. A shard file is read once, straight into a fresh buffer;
with codec none the returned values are a view of that buffer (no decode copy).
Leftover `*.partial` temp files are never opened (readers address files by their key).

An open Cache holds a lease on its directory (storage/lease.py), renewed while it is alive and
released by `close()` (or when it is collected, or the process exits): `cache gc` and the
rotation's drop of old caches never delete a cache a live process reads.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from core.fingerprint import CACHE_FORMAT_VERSION
from storage import fs, lease
from storage.atomic import entry_algo, file_matches, hasher, read_array, read_into
from storage.identity import ExtractSpec, cache_identity, check_identity
from storage.layout import (
    HIDDEN,
    MANIFEST,
    SAMPLES,
    SCALE,
    CacheCorrupt,
    CacheError,
    CacheIncomplete,
    FingerprintMismatch,
    committed_shards,
    read_json,
)
from storage.manifest import validate_manifest
from storage.shard_codec import decode_shard, shard_codec
from storage.values import CodecError, decode, stored_dtype


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
    expect: ExtractSpec | dict | None = None,
    verify: bool = False,
    check_reads: bool = True,
    lease_s: float | None = lease.DEFAULT_LEASE_S,
) -> Cache:
    """Open `<root>/<fingerprint>` (or `root` itself when fingerprint is None) for reading.

    Raises CacheIncomplete (no manifest), FingerprintMismatch (manifest or directory is not
    `expected_fingerprint`; names differing meta fields when `expected_meta` is given or the
    expected cache's manifest exists under root), CacheCorrupt (checksums; all shards are
    hashed when verify=True, otherwise each shard when read; check_reads=False skips the
    per-read checksum (size checks only) once a cache has been verified), IdentityMismatch
    (a FingerprintMismatch: the cache's identity differs from `expect` in a field, e.g.
    expect={"layer": 6, "model": model_hash}; storage/identity.py).

    lease_s (cache.lease_s): the Cache holds a lease of that length on the cache, renewed
    while it is open, which gc respects; None: no lease. A cache that cannot be written (a
    read-only directory, a public bucket) is read without one, with a warning.
    """
    fs.check(root, "cache root")  # a URL: clear error for a bad endpoint / bucket
    cdir = fs.path(root) if fingerprint is None else fs.path(root) / fingerprint
    if not cdir.is_dir():
        raise CacheIncomplete(f"no cache at {cdir}; build it first (preinfer cache build)")
    held = lease.read_lease(cdir, lease_s)  # before the manifest is read: storage/lease.py
    try:
        cache = _open(cdir, expected_fingerprint, expected_meta, verify, check_reads)
        check_identity(cache.manifest, expect, str(cdir))
    except BaseException:
        if held is not None:
            held.release()
        raise
    cache._hold(held)
    return cache


def _open(cdir, expected_fingerprint, expected_meta, verify: bool, check_reads: bool) -> Cache:
    fp = cdir.name
    mp = cdir / MANIFEST
    if not mp.exists():
        done = committed_shards(cdir)
        total = "?"
        with contextlib.suppress(FileNotFoundError, CacheError, KeyError):
            total = read_json(cdir / "build.json", "build file")["header"]["num_shards"]
        raise CacheIncomplete(
            f"cache {cdir} is incomplete: no {MANIFEST} ({done} of {total} shards done); rerun "
            "the cache build to write the missing shards and finalize it"
        )
    manifest = read_json(mp, "manifest")

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
    """A complete cache. Rows are samples; hidden [N, S, H]; labels [N, S].

    As a dataset: `from storage import CacheDataset, to_hf_dataset`, then
    `CacheDataset(cache, batch_size)` (a DataLoader-ready torch IterableDataset) or
    `to_hf_dataset(cache)` (a `datasets.Dataset`); examples/probe.py trains on one.
    """

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
        self._lease: lease.Lease | None = None  # storage/lease.py; None: not held here
        self._last: tuple[int, dict[str, np.ndarray]] | None = None  # last partly read shard
        self._last_samples: tuple[int, np.ndarray, np.ndarray] | None = None  # (group, ids, lab)
        self._pq: pq.ParquetFile | None = None

    @property
    def identity(self) -> dict:
        """What the cache was made from (model, tokenizer, layer, dtype...; storage/identity.py)."""
        return cache_identity(self.manifest)

    def __getstate__(self):  # picklable for DataLoader workers: no open handles / buffers
        # the lease stays with the process that opened the cache (it renews it)
        return {**self.__dict__, "_last": None, "_last_samples": None, "_pq": None, "_lease": None}

    def _hold(self, held: lease.Lease | None) -> None:
        self._lease = held
        lease.hold(self, held)

    def close(self) -> None:
        """Release this Cache's lease (gc may delete the cache from then on); idempotent."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
            return decode_shard(self._json[name], i, blobs[name], a, b)
        except CodecError as e:
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
        hc = shard_codec(self._json[HIDDEN])
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
        except CodecError as e:
            raise CacheCorrupt(
                f"shard {i}: {HIDDEN} cannot be decoded ({e}); rebuild the cache"
            ) from None

    def _read_span(self, i: int, a: int, b: int) -> np.ndarray | None:
        """Rows [a, b) of shard i read alone (a ranged read: the shard's index, then just
        those rows' bytes), where a whole-shard read is only needed for its checksum: with
        check_reads=False, on local disk, for a dense uncompressed shard (codec none, no scale
        file). None otherwise, or where the index does not say the rows lie densely."""
        files = self.manifest["shards"][i]["files"]
        hc = shard_codec(self._json[HIDDEN])
        s0, s1 = self.shard_range(i)
        span = hc.dense_payload(s1 - s0)
        if self.check_reads or fs.is_url(self.dir) or len(files) != 1 or span is None:
            return None
        ((rel, want),) = files.items()
        out = np.empty((b - a, *hc.shape[1:]), stored_dtype(self.dtype))
        index = np.empty(hc.index_nbytes, np.uint8)
        try:
            with open(self.dir / rel, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != want["bytes"] or size != span[1] + hc.index_nbytes:
                    return None  # not the layout (or not the file) the manifest records
                f.seek(0 if hc.index_at_start else size - hc.index_nbytes)
                got = read_into(f, [index])
                f.seek(span[0] + (a - s0) * hc.chunk_nbytes)
                got += read_into(f, [memoryview(out).cast("B")])
        except FileNotFoundError:
            raise CacheCorrupt(f"shard {i}: {rel} is missing; rebuild the cache") from None
        try:
            dense = got == index.nbytes + out.nbytes and hc.is_dense(hc.parse_index(index), s1 - s0)
        except CodecError as e:
            raise CacheCorrupt(
                f"shard {i}: {HIDDEN} cannot be decoded ({e}); rebuild the cache"
            ) from None
        return out if dense else None

    def read_stored(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Raw stored values [n, S, H] (+ scale [n, S] for lossy) of rows [start, stop).

        The arrays are the caller's own (never shared with another call's result). A read of
        several shards goes straight into one output array (codec none: file -> result, one
        copy); a single whole shard is read into a fresh buffer and viewed (codec none) or
        decoded; part of a shard is cut from the shard's bytes, kept for the next read (with
        check_reads=False, a dense uncompressed shard's rows are read alone: `_read_span`).
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
            if not whole and (v := self._read_span(i, a, b)) is not None:
                return v, None
            blobs, kept = self._shard_bytes(i, keep=not whole)
            v = self._decode(HIDDEN, i, blobs, a, b)
            sc = self._decode(SCALE, i, blobs, a, b) if SCALE in blobs else None
            if kept:  # a view of kept bytes would be shared with later reads: copy it
                v = v.copy() if v.base is not None else v
                sc = sc.copy() if sc is not None and sc.base is not None else sc
            return v, sc
        hc = shard_codec(self._json[HIDDEN])
        out = np.empty((stop - start, *hc.shape[1:]), stored_dtype(self.dtype))
        scales = []
        for i, a, b, whole in pieces:
            dest = out[a - start : b - start]
            if whole and self._read_into(i, dest):
                continue
            if not whole and (v := self._read_span(i, a, b)) is not None:
                dest[...] = v
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
        return (decode(stored, scale, self.dtype, dtype), *self.read_labels(start, stop))

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
