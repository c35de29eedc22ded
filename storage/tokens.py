"""The token store: packed samples of S+1 token ids as Parquet shards, plus a manifest.

    <dir>/manifest.json            written last; fingerprint, counts, shard checksums, config
    <dir>/tokenizer.json           the tokenizer that produced the ids
    <dir>/<split>-<i:05d>.parquet  sample_id int64, input_ids list<int32> (S+1 each)

A store is written into a sibling temp directory and renamed into place, so a directory
holding a manifest is always complete.

On an object store (`dir` an s3://... URL, storage/fs.py) there is no rename: the store is
written into a local temp directory, then each file is PUT (atomic per object) under the
prefix, manifest.json LAST, so a prefix holding a manifest is complete there too. Replacing a
store (--force) deletes the old manifest first (the prefix is then incomplete, never mixed),
and removes the old files the new manifest does not list after it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.fingerprint import file_hash
from storage import fs
from storage.atomic import checksum_file

TOKENS_FORMAT_VERSION = 1
SPLITS = ("train", "val")


class TokenStoreError(Exception):
    """The token store is missing, incomplete or different from what was asked for."""


def _table(sample_ids: np.ndarray, rows: np.ndarray) -> pa.Table:
    flat = pa.array(rows.reshape(-1).astype(np.int32), type=pa.int32())
    ids = pa.FixedSizeListArray.from_arrays(flat, rows.shape[1])
    return pa.table({"sample_id": pa.array(sample_ids, type=pa.int64()), "input_ids": ids})


class TokenStoreWriter:
    """Writes one token store aside (`<dir>.partial-<uuid>`), then `commit()` renames it."""

    def __init__(self, out_dir: str | Path, *, seq_len: int, shard_rows: int):
        self.out_dir = fs.path(out_dir)
        if fs.is_url(self.out_dir):  # staged locally, PUT object by object at commit
            fs.check(self.out_dir, "token store")
            self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.out_dir.name}.partial-"))
        else:
            self.tmp = self.out_dir.with_name(f"{self.out_dir.name}.partial-{uuid.uuid4().hex[:8]}")
            self.tmp.mkdir(parents=True)
        self.seq_len = seq_len
        self.shard_rows = shard_rows
        self.shards: dict[str, list[dict]] = {s: [] for s in SPLITS}
        self.counts = dict.fromkeys(SPLITS, 0)

    def write_split(self, split: str, rows: Iterable[np.ndarray]) -> int:
        """Write a split from an iterator of (S+1,) int32 rows; returns the number of samples."""
        buf: list[np.ndarray] = []
        for row in rows:
            buf.append(row)
            if len(buf) == self.shard_rows:
                self._flush(split, buf)
                buf = []
        if buf:
            self._flush(split, buf)
        return self.counts[split]

    def _flush(self, split: str, buf: list[np.ndarray]) -> None:
        rows = np.stack(buf)  # (n, S+1) int32
        start = self.counts[split]
        name = f"{split}-{len(self.shards[split]):05d}.parquet"
        pq.write_table(_table(np.arange(start, start + len(rows)), rows), self.tmp / name)
        self.shards[split].append(
            {"file": name, "rows": [start, start + len(rows)], "sha256": file_hash(self.tmp / name)}
        )
        self.counts[split] += len(rows)

    def add_file(self, src: str | Path, name: str) -> None:
        shutil.copyfile(src, self.tmp / name)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, manifest: dict, *, replace: bool = False) -> TokenStore:
        """Write the manifest last, then move the store into place (atomically per directory)."""
        manifest = {
            **manifest,
            "format_version": TOKENS_FORMAT_VERSION,
            "seq_len": self.seq_len,
            "counts": self.counts,
            "shards": self.shards,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        manifest = fs.redact(manifest)  # no storage credentials in a persisted config
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if fs.is_url(self.out_dir):
            return self._commit_remote(replace)
        old = None
        if self.out_dir.exists():
            if not replace:
                self.abort()
                raise TokenStoreError(f"{self.out_dir} appeared while tokenizing; rerun")
            old = self.out_dir.with_name(f"{self.out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(self.out_dir, old)
        os.replace(self.tmp, self.out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return TokenStore(self.out_dir)

    def _commit_remote(self, replace: bool) -> TokenStore:
        out = self.out_dir
        try:
            old = {p.name for p in out.iterdir()}
            if old:
                if not replace:
                    raise TokenStoreError(
                        f"{out} is not empty (another tokenize wrote there meanwhile, or it "
                        "holds something else); rerun with --force to replace it"
                    )
                (out / "manifest.json").unlink(missing_ok=True)  # incomplete from now on
            names = sorted(p.name for p in self.tmp.iterdir() if p.name != "manifest.json")
            for name in [*names, "manifest.json"]:  # the manifest last: the commit point
                fs.put(out / name, (self.tmp / name).read_bytes())
            for name in old - {*names, "manifest.json"}:
                (out / name).unlink(missing_ok=True)
        finally:
            self.abort()
        return TokenStore(out)


class TokenStore:
    """Read access to a complete token store."""

    def __init__(self, path: str | Path):
        fs.check(path, "token store")
        self.path = fs.path(path)  # a Path, or a RemotePath (s3://...)
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            raise TokenStoreError(
                f"no token store at {self.path} (manifest.json missing); run `preinfer tokenize` first"
            )
        self.manifest = json.loads(mpath.read_text())
        if self.manifest.get("format_version") != TOKENS_FORMAT_VERSION:
            raise TokenStoreError(
                f"{self.path}: token store format {self.manifest.get('format_version')} is not "
                f"{TOKENS_FORMAT_VERSION}; rerun `preinfer tokenize --force`"
            )
        self._cache: tuple[str, int, np.ndarray] | None = None

    @staticmethod
    def exists(path: str | Path) -> bool:
        fs.check(path, "token store")
        return (fs.path(path) / "manifest.json").is_file()

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def seq_len(self) -> int:
        """S: a sample holds S+1 ids (inputs are [:S], labels [1:])."""
        return self.manifest["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.json"

    def num_samples(self, split: str) -> int:
        self._check_split(split)
        return self.manifest["counts"][split]

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise TokenStoreError(f"split {split!r} is not one of {', '.join(SPLITS)}")

    def _shard(self, split: str, i: int) -> np.ndarray:
        if self._cache is not None and self._cache[:2] == (split, i):
            return self._cache[2]
        info = self.manifest["shards"][split][i]
        table = pq.read_table(fs.parquet_source(self.path / info["file"]), columns=["input_ids"])
        col = table.column("input_ids").combine_chunks()
        rows = col.values.to_numpy(zero_copy_only=False).reshape(len(col), -1)
        self._cache = (split, i, rows)
        return rows

    def read(self, split: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a split as an (n, S+1) int32 array (shard-contiguous reads)."""
        n = self.num_samples(split)
        if not 0 <= start <= stop <= n:
            raise TokenStoreError(f"rows [{start}, {stop}) out of range for {split} ({n} samples)")
        out = []
        for i, info in enumerate(self.manifest["shards"][split]):
            a, b = info["rows"]
            if b <= start or a >= stop:
                continue
            rows = self._shard(split, i)
            out.append(rows[max(start, a) - a : min(stop, b) - a])
        if not out:
            return np.zeros((0, self.seq_len + 1), dtype=np.int32)
        return np.concatenate(out)

    def read_indices(self, split: str, indices: np.ndarray) -> np.ndarray:
        """Rows at sorted `indices` (used by sampled caches), read shard by shard."""
        indices = np.asarray(indices)
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int32)
        for i, info in enumerate(self.manifest["shards"][split]):
            a, b = info["rows"]
            sel = (indices >= a) & (indices < b)
            if sel.any():
                out[sel] = self._shard(split, i)[indices[sel] - a]
        return out

    def verify(self) -> list[str]:
        """Files whose checksum differs from the manifest."""
        bad = []
        for split in SPLITS:
            for info in self.manifest["shards"][split]:
                p = self.path / info["file"]
                if not p.is_file() or checksum_file(p, "sha256")[0] != info["sha256"]:
                    bad.append(info["file"])
        return bad
