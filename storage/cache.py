"""The activation cache writer (the format and its contract: docs/cache_format.md).

    <root>/<fingerprint>/
      hidden.zarr/        Zarr v3 [N, S, H]; chunk (1, S, H); shard (R, S, H), R from shard_mb
      scale.zarr/         [N, S] float32 per-token scales (lossy dtypes only)
      samples.parquet     sample_id int64, input_ids list<int32> [S], labels list<int32> [S];
                          one row group per shard (R rows), so a shard's labels are one read
      build.json          header + the caller's meta (+ identity) at creation (what
                          `CacheWriter.open` and `cache ls` of an unfinished cache read)
      done/<i:05d>.json   marker of committed shard i: rows, xxh3_128 + bytes of its files, stats
      manifest.json       written LAST, after every marker: its presence means complete;
                          `identity` (storage/identity.py): what a reuser must match
      leases/             while a reader has the cache open: its lease (storage/lease.py)

A writer task owns whole shards. A shard is encoded in memory with exactly the array's Zarr
metadata (so its bytes are what Zarr itself would store, and Zarr never reads an old shard
first), written aside as `<key>.<host>.<pid>.<tok>.partial`, fsync'd and os.replace'd onto its
key; then its marker. Encoding is deterministic, so a retried task writes identical bytes.

Markers are written atomically but not fsync'd (FSYNC_MARKERS): a marker is a claim that is
re-checked against the shard's bytes (size + checksum) before anything relies on it (resume,
finalize), and its shard was fsync'd before it was written; so a marker lost or torn by a crash
only means that shard is written again. The manifest, which readers trust, is fsync'd.

`root` may be an object-store URL (s3://bucket/prefix, storage/fs.py): there each file is ONE
PUT of its final key (atomic: never visible half-written), in the same order (shard objects,
then their marker, then the manifest last), and "directories" are key prefixes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core import faults
from core.fingerprint import CACHE_FORMAT_VERSION
from storage import atomic, codecs, fs
from storage.atomic import checksum_entry, checksum_file, dir_bytes, entry_matches, human
from storage.config import CacheConfig
from storage.identity import identity_diff, identity_record
from storage.layout import (
    BUILD,
    DONE,
    HIDDEN,
    MANIFEST,
    SAMPLES,
    SCALE,
    CacheCorrupt,
    CacheError,
    CacheIncomplete,
    check_marker,
    committed_shards,
    estimate_cache_bytes,
    free_disk_bytes,
    read_json,
    rows_per_shard,
)
from storage.samples import read_samples, samples_arrays, samples_table
from storage.shard_codec import encode_shard_parts, shard_codec, shard_key
from storage.stats import (
    combine_stats,
    count_nonfinite,
    sampling_record,
    shard_stats,
    shard_stats_sampled,
)
from storage.values import (
    LOGICAL_TORCH,
    CodecError,
    _as_float_tensor,
    decode,
    encode,
    is_lossy,
    stored_dtype,
)

FSYNC_MARKERS = False  # see the module docstring
# ------------------------------------------------------------------------------ the writer


class CacheWriter:
    """Writes (or resumes) one cache. Make it with `CacheWriter.create(...)`."""

    def __init__(
        self,
        cache_dir: Path,
        header: dict,
        meta: dict,
        jsons: dict[str, bytes],
        identity: dict | None = None,
    ):
        self.dir = cache_dir
        self.header = header  # shape, dtype, codec, rows per shard (also in hidden.zarr attrs)
        self.meta = meta
        self.identity = identity  # the manifest's identity record (None: a boundary cache)
        self._json = jsons  # array name -> zarr.json bytes
        self._good: dict[int, dict] = {}  # shards known committed by this writer -> marker

    @classmethod
    def create(
        cls,
        root: str | Path,
        fingerprint: str,
        *,
        samples: Any,
        seq_len: int,
        hidden_size: int,
        cache_cfg: CacheConfig,
        meta: dict,
        free_bytes: int | None = None,
        identity: dict | None = None,
    ) -> CacheWriter:
        """Create `<root>/<fingerprint>/`, or open it for resume when its header matches.

        identity: what the cache is made from, as a reuser must match it (storage/identity.py:
        model, tokenizer, layer, ...); the writer adds the storage facts (dtype, codec, seq_len,
        hidden_size, format_version) and records it in build.json and the manifest.

        Raises CacheError when an existing cache has another header (shape/dtype/codec/shard
        rows), other samples or another identity, or when the estimated size exceeds free disk
        (`free_bytes` overrides the measured figure; tests use it).
        """
        if not fingerprint or "/" in fingerprint or fingerprint.startswith("."):
            raise CacheError(f"bad cache fingerprint {fingerprint!r}: need a plain directory name")
        for name, v in (("seq_len", seq_len), ("hidden_size", hidden_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise CacheError(f"{name} must be a positive int, got {v!r}")
        try:
            meta_blob = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as e:
            raise CacheError(f"cache meta must be JSON-serializable: {e}") from None
        try:
            sid, ids, labels = samples_arrays(samples, seq_len)
        except CodecError as e:
            raise CacheError(str(e)) from None
        n, dtype = len(sid), cache_cfg.dtype
        rows = min(n, rows_per_shard(seq_len, hidden_size, dtype, cache_cfg.shard_mb))
        header = {
            "format_version": CACHE_FORMAT_VERSION,
            "fingerprint": fingerprint,
            "num_samples": n,
            "seq_len": seq_len,
            "hidden_size": hidden_size,
            "rows_per_shard": rows,
            "num_shards": -(-n // rows),
            "dtype": dtype,
            "stored_dtype": stored_dtype(dtype).name,
            "codec": cache_cfg.codec,
            "shuffle": cache_cfg.shuffle,
            "level": cache_cfg.level,
        }
        ident = None if identity is None else identity_record(identity, header)
        try:
            jsons = {
                HIDDEN: codecs.array_json(
                    (n, seq_len, hidden_size),
                    rows,
                    stored_dtype(dtype),
                    cache_cfg,
                    {"preinfer": header},
                )
            }
            if is_lossy(dtype):
                jsons[SCALE] = codecs.array_json(
                    (n, seq_len),
                    rows,
                    np.dtype("float32"),
                    cache_cfg,
                    {"preinfer": {"scale_of": HIDDEN}},
                )
        except CodecError as e:
            raise CacheError(str(e)) from None
        fs.check(root, "cache root")
        cache_dir = fs.path(root) / fingerprint
        meta_blob = fs.redact(meta_blob)
        for name, blob in jsons.items():
            p = cache_dir / name / "zarr.json"
            if p.exists() and p.read_bytes() != blob:
                old = json.loads(p.read_bytes()).get("attributes", {}).get("preinfer", {})
                diff = {k: (old.get(k), header.get(k)) for k in header if old.get(k) != header[k]}
                raise CacheError(
                    f"cache {cache_dir} exists with another layout ({name}); differing "
                    f"(existing, requested): {diff or 'codec metadata'}. Same fingerprint must "
                    "mean same layout: delete the directory or fix the fingerprint inputs"
                )
        if not (cache_dir / MANIFEST).exists():
            need = max(
                0, estimate_cache_bytes(n, seq_len, hidden_size, dtype) - dir_bytes(cache_dir)
            )
            free = free_disk_bytes(cache_dir) if free_bytes is None else int(free_bytes)
            # every shard committed (a build stopped before its manifest, by a full disk say):
            # only the manifest is left, and a disk too full for it says so itself
            marked = committed_shards(cache_dir) if need > free else 0
            if need > free and marked < header["num_shards"]:
                raise CacheError(
                    f"cache {fingerprint} needs up to {need} bytes ({human(need)}) but only "
                    f"{free} bytes ({human(free)}) are free at {cache_dir}; free space "
                    "(`preinfer cache gc`), move cache.root, or pick a smaller cache.dtype"
                )
        for name, blob in jsons.items():
            if not (cache_dir / name / "zarr.json").exists():
                atomic.write_bytes(cache_dir / name / "zarr.json", blob)
        sp = cache_dir / SAMPLES
        if sp.exists():
            try:
                old = samples_arrays(pq.read_table(fs.parquet_source(sp)), seq_len)
            except (OSError, pa.ArrowException, CodecError) as e:
                raise CacheCorrupt(f"{sp} is unreadable ({e}); delete it and rerun") from None
            if not all(np.array_equal(a, b) for a, b in zip(old, (sid, ids, labels), strict=True)):
                raise CacheError(
                    f"{sp} holds other samples than this build (sample ids, input ids or labels "
                    "differ) under the same fingerprint; the token fingerprint is wrong or the "
                    "directory is stale: delete it and rebuild"
                )
        else:
            buf = pa.BufferOutputStream()
            pq.write_table(samples_table(sid, ids, labels), buf, row_group_size=rows)
            atomic.write_bytes(sp, buf.getvalue().to_pybytes())
        if not (cache_dir / BUILD).exists():
            build = {"header": header, "meta": meta_blob}
            atomic.write_json(
                cache_dir / BUILD, build if ident is None else {**build, "identity": ident}
            )
        elif (
            ident is not None
            and (old := read_json(cache_dir / BUILD, "build").get("identity")) != ident
        ):
            raise CacheError(
                f"cache {cache_dir} exists with another identity ({identity_diff(old, ident)}); "
                "same fingerprint must mean same inputs: delete the directory or fix the "
                "fingerprint inputs"
            )
        (cache_dir / DONE).mkdir(exist_ok=True)
        atomic.clean_partials(cache_dir)
        return cls(cache_dir, header, meta_blob, jsons, ident)

    @classmethod
    def open(cls, root: str | Path, fingerprint: str) -> CacheWriter:
        """Open a cache that `create` made (e.g. in a worker that has no samples at hand)."""
        fs.check(root, "cache root")
        d = fs.path(root) / fingerprint
        try:
            build = read_json(d / BUILD, "build file")
            jsons = {n: (d / n / "zarr.json").read_bytes() for n in (HIDDEN, SCALE)
                     if (d / n / "zarr.json").exists()}  # fmt: skip
        except FileNotFoundError:
            raise CacheError(
                f"no cache {fingerprint} under {root} to write into; CacheWriter.create it first"
            ) from None
        attrs = json.loads(jsons.get(HIDDEN, b"{}") or b"{}").get("attributes", {})
        if attrs.get("preinfer") != build["header"]:
            raise CacheCorrupt(f"{d}: {BUILD} and {HIDDEN}/zarr.json disagree; delete and rebuild")
        atomic.clean_partials(d)
        return cls(d, build["header"], build.get("meta") or {}, jsons, build.get("identity"))

    def read_input_ids(self, start: int, stop: int) -> np.ndarray:
        """input_ids [stop-start, S] int32 of rows [start, stop) from samples.parquet."""
        src = pq.ParquetFile(fs.parquet_source(self.dir / SAMPLES))
        return read_samples(src, start, stop, "input_ids")

    # ----------------------------------------------------------------------- shards

    @property
    def num_shards(self) -> int:
        return self.header["num_shards"]

    def shard_range(self, i: int) -> tuple[int, int]:
        """Rows [start, stop) of shard i."""
        if not isinstance(i, int | np.integer) or not 0 <= i < self.num_shards:
            raise CacheError(f"shard index {i!r} out of range 0..{self.num_shards - 1}")
        r = self.header["rows_per_shard"]
        return int(i) * r, min((int(i) + 1) * r, self.header["num_samples"])

    def marker_path(self, i: int) -> Path:
        return self.dir / DONE / f"{i:05d}.json"

    def _marker(self, i: int, *, verify: bool) -> dict | None:
        """Marker of shard i if the shard is committed (files match it), else None."""
        if i in self._good:
            return self._good[i]
        try:
            marker = read_json(self.marker_path(i), "done marker")
        except (FileNotFoundError, CacheCorrupt):
            return None  # a bad marker = shard not done; rewriting it repairs both
        if check_marker(self.dir, marker, verify=verify) is not None:
            return None
        self._good[i] = marker
        return marker

    def missing_shards(self, *, verify: bool = True) -> list[int]:
        """Shards without a marker whose files match (checksum too unless verify=False)."""
        return [i for i in range(self.num_shards) if self._marker(i, verify=verify) is None]

    def encode_rows(self, rows: Any) -> tuple[list, np.ndarray] | None:
        """The compressed chunks of hidden rows (n, S, H), ahead of write_shard: a worker
        compresses each micro-batch while the next computes, then hands write_shard the pieces
        of a shard in row order (its bytes are the same as from the whole shard at once). None
        where the cache does not take pieces (a lossy dtype: its scales are encoded per shard)."""
        if is_lossy(self.header["dtype"]):
            return None
        codec = shard_codec(self._json[HIDDEN])
        if not codec.fast:
            return None
        try:
            stored, _ = encode(_as_float_tensor(rows), self.header["dtype"], check_finite=False)
            return codec.encode_chunks(stored)
        except CodecError as e:
            raise CacheError(f"hidden rows {tuple(getattr(rows, 'shape', ()))}: {e}") from None

    def write_shard(self, i: int, hidden: Any, encoded: list | None = None) -> dict:
        """Encode and commit shard i from hidden [stop-start, S, H] fp32/fp16/bf16 values.

        encoded: encode_rows of consecutive row blocks of `hidden`, in order (the compression
        done already); None = compress here. Returns the shard's marker. Rewriting a shard with
        the same values writes the same bytes. On a complete cache, only an identical rewrite
        is accepted (then a no-op).
        """
        start, stop = self.shard_range(i)
        h = self.header
        want = (stop - start, h["seq_len"], h["hidden_size"])
        if tuple(getattr(hidden, "shape", ())) != want:
            raise CacheError(
                f"shard {i} covers rows [{start}, {stop}) and needs hidden of shape {want} "
                f"(rows, seq_len, hidden_size), got {tuple(getattr(hidden, 'shape', ()))}"
            )
        dtype = h["dtype"]
        try:
            given = _as_float_tensor(hidden)
            stored, scale = encode(given, dtype, check_finite=False)
        except CodecError as e:
            raise CacheError(f"shard {i} (rows {start}..{stop}): {e}") from None
        if encoded is not None and is_lossy(h["dtype"]):
            raise CacheError(f"shard {i}: a {h['dtype']} cache takes whole shards, not pieces")
        if encoded is not None and sum(len(z) for _, z in encoded) != stop - start:
            raise CacheError(
                f"shard {i}: the encoded pieces hold {sum(len(z) for _, z in encoded)} rows, "
                f"the shard {stop - start}; hand write_shard every piece of the shard, in order"
            )
        parts = {
            f"{HIDDEN}/{shard_key(i, 3)}": encode_shard_parts(self._json[HIDDEN], i, start, stored)
            if encoded is None
            else shard_codec(self._json[HIDDEN]).assemble(i, start, encoded)
        }
        if scale is not None:
            parts[f"{SCALE}/{shard_key(i, 2)}"] = encode_shard_parts(
                self._json[SCALE], i, start, scale
            )
        manifest = self.dir / MANIFEST
        complete = manifest.exists()
        files = {rel: checksum_entry(p) for rel, p in parts.items()} if complete else {}
        if complete:
            done = read_json(manifest, "manifest").get("shards", [])
            old = done[i]["files"] if i < len(done) else {}
            if set(old) != set(parts) or not all(entry_matches(old[r], parts[r]) for r in parts):
                raise CacheError(
                    f"cache {self.dir} is complete and shard {i} would get other bytes than it "
                    "holds; a complete cache is immutable (delete it to rebuild)"
                )  # an identical rewrite goes on: it repairs a damaged shard file
        # the shard files are written (and fsync'd) aside on the I/O thread, which checksums
        # each chunk just before writing it, while this thread computes the stats; they are
        # renamed into place only if all went well
        digests = {rel: atomic.hasher() for rel in parts}
        pending = [
            (rel, atomic.background(atomic.write_aside, self.dir / rel, p, digest=digests[rel]))
            for rel, p in parts.items()
        ]
        error: BaseException | None = None
        try:
            stats = self._stats(i, start, stop, given, stored, scale)
        except BaseException as e:
            error = e
        tmps = []
        for rel, fut in pending:  # wait for every write, even after an error
            try:
                tmps.append((rel, fut.result()))
            except BaseException as e:
                error = error or e
        if error is not None:
            for _, tmp in tmps:
                atomic.discard(tmp)
            raise error
        files = files or {
            rel: atomic.digest_entry(digests[rel], sum(memoryview(b).nbytes for b in p))
            for rel, p in parts.items()
        }
        faults.kill_point("cache.shard_tmp")
        for rel, tmp in tmps:
            atomic.commit(tmp, self.dir / rel)
            faults.kill_point("cache.shard_file")
        marker = {"shard": i, "start": start, "stop": stop, "files": files, "stats": stats}
        atomic.write_json(self.marker_path(i), marker, fsync=FSYNC_MARKERS)
        self._good[i] = marker
        return marker

    def _stats(self, i, start, stop, given, stored, scale) -> dict:
        """The shard's value stats; CacheError if a value is NaN/inf (or overflowed)."""
        dtype = self.header["dtype"]
        exact = not is_lossy(dtype) and given.dtype == LOGICAL_TORCH[dtype]
        try:  # the NaN/inf check over every value, and the shard's stats
            if exact:  # stored == given bit for bit: exact absmax, sums of a row sample
                return shard_stats_sampled(given)
            return shard_stats(decode(stored, scale, dtype), given)  # all values
        except CodecError:
            bad = count_nonfinite(given)
            why = (
                f"{bad} of {given.numel()} hidden values are NaN/inf; the prefix model diverged "
                "or overflowed; fix the model (or its dtype) before caching"
                if bad
                else f"hidden values up to {float(given.abs().max()):.4g} overflow {dtype}; "
                "use cache.dtype=fp32"
            )
            raise CacheError(f"shard {i} (rows {start}..{stop}): {why}") from None

    # ----------------------------------------------------------------------- finalize

    def finalize(self, *, verify: bool = True) -> dict:
        """Check every shard's marker (and checksum), then write manifest.json; returns it.

        Idempotent; concurrent finalizers each write a complete manifest via their own temp
        file and os.replace, so one valid manifest remains.
        """
        mp = self.dir / MANIFEST
        if mp.exists():
            return read_json(mp, "manifest")
        missing = self.missing_shards(verify=verify)
        if missing:
            raise CacheIncomplete(
                f"cannot finalize {self.dir}: {len(missing)} of {self.num_shards} shards are "
                f"not written or do not match their marker: {missing[:20]}"
                f"{' ...' if len(missing) > 20 else ''}; write them (rerun the build) first"
            )
        markers = [self._good[i] for i in range(self.num_shards)]
        manifest = build_manifest(self.dir, self.header, self.meta, markers, self.identity)
        atomic.write_json(mp, manifest)
        return manifest


def build_manifest(
    cache_dir: Path, header: dict, meta: dict, markers: list[dict], identity: dict | None = None
) -> dict:
    n, s, hs = header["num_samples"], header["seq_len"], header["hidden_size"]
    stats, error = combine_stats([m["stats"] for m in markers])
    sampling = sampling_record([m["stats"] for m in markers])
    value_bytes = sum(f["bytes"] for m in markers for f in m["files"].values())
    others = {
        rel: checksum_file(cache_dir / rel)
        for rel in (SAMPLES, f"{HIDDEN}/zarr.json", f"{SCALE}/zarr.json")
        if (cache_dir / rel).exists()
    }
    raw = n * s * hs * stored_dtype(header["dtype"]).itemsize
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "fingerprint": header["fingerprint"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "meta": meta,
        "header": header,
        "num_samples": n,
        "seq_len": s,
        "hidden_size": hs,
        "dtype": header["dtype"],
        "codec": {k: header[k] for k in ("codec", "shuffle", "level")},
        "shards": [{k: m[k] for k in ("shard", "start", "stop", "files")} for m in markers],
        "files": {
            rel: {"bytes": b, "checksum": {"algo": atomic.CHECKSUM_ALGO, "value": d}}
            for rel, (d, b) in others.items()
        },
        "stats": stats,
        "stats_sampling": sampling,  # None: mean/std over every value
        "error": error,
        "total_bytes": value_bytes + sum(b for _, b in others.values()),
        "value_bytes": value_bytes,
        "bytes_per_value": value_bytes / (n * s * hs),
        "compression_ratio": raw / value_bytes,  # vs the stored dtype uncompressed
        "ratio_vs_bf16": 2 * n * s * hs / value_bytes,
        **({} if identity is None else {"identity": identity}),
    }
