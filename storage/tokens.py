"""The token store: packed samples of S+1 token ids as Parquet shards, plus a manifest.

    <dir>/manifest.json            written last; fingerprint, counts, shard checksums, config
    <dir>/tokenizer.json           the tokenizer that produced the ids
    <dir>/<split>-<i:05d>.parquet  sample_id int64, input_ids list<int32> (S+1 each),
                                   and in a store with labels: labels list<int32> (S each)

Labels: labels[t] is the target of input position t (inputs are ids[:S]). A plain store's
labels are the ids shifted by one (`ids[:, 1:]`, next token); a store written with labels=True
stores them, IGNORE (-100) where a position does not count: prompt/response data (shifted, the
prompt masked) or masked-LM data (manifest "objective": "mlm"; NOT shifted: the original id at
a masked input position).

Every shard is checked against the manifest's size and checksum when it is read (xxh3_128 in
format 2; format 1 stores, which recorded sha256 only, still open and are checked in sha256), so
a changed byte is an error naming the shard, never silently different training data.

A store is written into a sibling temp directory (`<dir>.<host>.<pid>.<id>.partial`) and
renamed into place, so a directory holding a manifest is always complete. A temp store whose
writer is gone (a killed tokenize: its pid dead on this host) is removed by the next tokenize
(`clean_stale_partials`); one of a live writer never is.

On an object store (`dir` an s3://... URL, storage/fs.py) there is no rename: the store is
written into a local temp directory, then each file is PUT (atomic per object) under the
prefix, manifest.json LAST, so a prefix holding a manifest is complete there too. Replacing a
store (--force) deletes the old manifest first (the prefix is then incomplete, never mixed),
and removes the old files the new manifest does not list after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage import fs
from storage.atomic import (
    PARTIAL_SUFFIX,
    STALE_AFTER_S,
    checksum,
    checksum_entry,
    entry_algo,
    partial_is_stale,
    partial_path,
    replace_dir,
)

# 2: shard entries {"bytes", "checksum": {"algo", "value"}} (1: {"sha256"}); optional labels
TOKENS_FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
SPLITS = ("train", "val")
IGNORE = -100  # a label that does not count (what the loss ignores)
RETOKENIZE = "rerun `preinfer tokenize` (it rewrites a store whose shards fail their checksum)"


class TokenStoreError(Exception):
    """The token store is missing, incomplete or different from what was asked for."""


def _fixed(rows: np.ndarray) -> pa.FixedSizeListArray:
    flat = pa.array(rows.reshape(-1).astype(np.int32), type=pa.int32())
    return pa.FixedSizeListArray.from_arrays(flat, rows.shape[1])


def _table(sample_ids: np.ndarray, rows: np.ndarray, labels: np.ndarray | None) -> pa.Table:
    cols = {"sample_id": pa.array(sample_ids, type=pa.int64()), "input_ids": _fixed(rows)}
    if labels is not None:
        cols["labels"] = _fixed(labels)
    return pa.table(cols)


_UNREAD = object()


def manifest_bytes(path: str | Path) -> bytes | None:
    """The bytes of the store's manifest.json at `path` (None: no store there): what tells one
    written store from another (each records its creation time)."""
    mpath = fs.path(path) / "manifest.json"
    return mpath.read_bytes() if mpath.is_file() else None


def clean_stale_partials(out_dir: str | Path) -> list[Path]:
    """Remove the temp stores beside the local store `out_dir` whose writer is gone; returns
    them. Ours (`<name>.<host>.<pid>.<id>.partial`): when that pid is dead on this host, or
    untouched for STALE_AFTER_S (another host's); one named `<name>.partial-<id>` (before the
    pid was in the name): untouched for STALE_AFTER_S. A live writer's is never removed."""
    out = fs.path(out_dir)
    if fs.is_url(out) or not out.parent.is_dir():
        return []  # an object store's temp store is local (tempfile), and goes with its process
    name, gone = re.escape(out.name), []
    ours = re.compile(rf"{name}\.[^.]+\.\d+\.[0-9a-f]{{8}}{re.escape(PARTIAL_SUFFIX)}")
    legacy = re.compile(rf"{name}\.partial-[0-9a-f]{{8}}")
    for p in out.parent.iterdir():
        if not p.is_dir() or p.is_symlink():
            continue
        if ours.fullmatch(p.name):
            stale = partial_is_stale(p)
        elif legacy.fullmatch(p.name):
            try:
                newest = max(f.stat().st_mtime for f in (p, *p.iterdir()))
            except OSError:  # changing under us: being written, or removed
                continue
            stale = time.time() - newest > STALE_AFTER_S
        else:
            continue
        if stale:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


@contextlib.contextmanager
def _dir_lock(path: Path):
    """An exclusive flock on directory `path` (no lock file is left behind)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


class TokenStoreWriter:
    """Writes one token store aside (`<dir>.<host>.<pid>.<id>.partial`), then `commit()` renames
    it.

    Rows arrive in blocks per split (`add`, splits interleaved as they come); a split's rows
    are cut into shards of `shard_rows` in arrival order, so what is held in memory is at most
    one shard per split.

    `over`: the manifest bytes (`manifest_bytes`) of the store the caller saw at `dir` when it
    began (None: none), read here when not given. A local commit refuses when `dir` holds
    another store by then: a second concurrent writer never replaces the first one's store
    unseen, with or without replace."""

    def __init__(self, out_dir: str | Path, *, seq_len: int, shard_rows: int, labels: bool = False,
                 over: bytes | None | object = _UNREAD):  # fmt: skip
        self.out_dir = fs.path(out_dir)
        self.over = manifest_bytes(self.out_dir) if over is _UNREAD else over
        if fs.is_url(self.out_dir):  # staged locally, PUT object by object at commit
            fs.check(self.out_dir, "token store")
            self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.out_dir.name}.partial-"))
        else:
            self.tmp = partial_path(self.out_dir)  # the pid in its name: clean_stale_partials
            self.tmp.mkdir(parents=True)
        self.seq_len = seq_len
        self.shard_rows = shard_rows
        self.labels = labels
        self.shards: dict[str, list[dict]] = {s: [] for s in SPLITS}
        self.counts = dict.fromkeys(SPLITS, 0)
        # per split: pending (ids (k, S+1), labels (k, S) or None) blocks, < shard_rows rows
        self._pending: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = {
            s: [] for s in SPLITS
        }
        self._held = dict.fromkeys(SPLITS, 0)

    def rows(self, split: str) -> int:
        """Rows added to `split` so far (written or pending)."""
        return self.counts[split] + self._held[split]

    def add(self, split: str, ids: np.ndarray, labels: np.ndarray | None = None) -> None:
        """Append rows: ids (k, S+1) int32, labels (k, S) int32 (only, and always, in a store
        with labels)."""
        if ids.ndim != 2 or ids.shape[1] != self.seq_len + 1:
            raise ValueError(f"rows must be (k, {self.seq_len + 1}), got {ids.shape}")
        if (labels is not None) != self.labels or (
            labels is not None and labels.shape != (len(ids), self.seq_len)
        ):
            raise ValueError(
                f"labels must be {'(k, S)' if self.labels else 'None'} in this store, got "
                f"{None if labels is None else labels.shape}"
            )
        if not len(ids):
            return
        self._pending[split].append((ids, labels))
        self._held[split] += len(ids)
        while self._held[split] >= self.shard_rows:
            self._flush(split, self.shard_rows)

    def write_split(self, split: str, rows: Iterable[np.ndarray]) -> int:
        """Write a split from an iterator of (S+1,) int32 rows; returns the number of samples."""
        for row in rows:
            self.add(split, np.asarray(row, dtype=np.int32)[None])
        self._flush(split, self._held[split])
        return self.counts[split]

    def _take(self, split: str, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first n pending rows of a split, removed from the pending blocks."""
        ids, labels, got = [], [], 0
        pending = self._pending[split]
        while got < n:
            a, b = pending[0]
            k = min(n - got, len(a))
            ids.append(a[:k])
            labels.append(None if b is None else b[:k])
            if k == len(a):
                pending.pop(0)
            else:
                pending[0] = (a[k:], None if b is None else b[k:])
            got += k
        self._held[split] -= n
        lab = np.concatenate(labels) if self.labels else None
        return np.concatenate(ids), lab

    def _flush(self, split: str, n: int) -> None:
        if n == 0:
            return
        rows, labels = self._take(split, n)  # (n, S+1) int32, (n, S) int32 | None
        start = self.counts[split]
        name = f"{split}-{len(self.shards[split]):05d}.parquet"
        table = _table(np.arange(start, start + len(rows)), rows, labels)
        pq.write_table(table, self.tmp / name)
        entry = checksum_entry((self.tmp / name).read_bytes())
        self.shards[split].append({"file": name, "rows": [start, start + len(rows)], **entry})
        self.counts[split] += len(rows)

    def add_file(self, src: str | Path, name: str) -> None:
        shutil.copyfile(src, self.tmp / name)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, manifest: dict, *, replace: bool = False) -> TokenStore:
        """Write the last shards and the manifest, then move the store into place (atomically
        per directory)."""
        for split in SPLITS:
            self._flush(split, self._held[split])
        manifest = {
            **manifest,
            "format_version": TOKENS_FORMAT_VERSION,
            "seq_len": self.seq_len,
            "labels": self.labels,
            "counts": self.counts,
            "shards": self.shards,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        manifest = fs.redact(manifest)  # no storage credentials in a persisted config
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if fs.is_url(self.out_dir):
            return self._commit_remote(replace)
        with _dir_lock(self.out_dir.parent):  # one commit at a time beside this store
            now = manifest_bytes(self.out_dir)
            if now != self.over:
                self.abort()
                what = "no token store" if now is None else f"store {_fingerprint(now)}"
                raise TokenStoreError(
                    f"{self.out_dir} changed while this tokenize ran (it now holds {what}: "
                    "another tokenize wrote there meanwhile); this one wrote nothing: rerun it to "
                    "replace that store (with --force if their inputs differ)"
                )
            if self.out_dir.exists() and not replace:
                self.abort()
                raise TokenStoreError(
                    f"{self.out_dir} exists ({'a token store' if now else 'no token store in it'}"
                    "); this tokenize wrote nothing: pass --force to replace it, or set "
                    "data.out_dir elsewhere"
                )
            replace_dir(self.tmp, self.out_dir)  # the old store is put back if this fails
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


def _fingerprint(manifest: bytes) -> str:
    try:
        return str(json.loads(manifest)["fingerprint"])[:12]
    except (ValueError, KeyError, TypeError):
        return "(unreadable manifest)"


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
        if self.manifest.get("format_version") not in READABLE_FORMATS:
            raise TokenStoreError(
                f"{self.path}: token store format {self.manifest.get('format_version')} is not "
                f"one this code reads ({', '.join(map(str, READABLE_FORMATS))}); rerun "
                "`preinfer tokenize --force`"
            )
        # the last shard read: (split, i, ids (n, S+1) int32, labels (n, S) int32)
        self._cache: tuple[str, int, np.ndarray, np.ndarray] | None = None

    @staticmethod
    def exists(path: str | Path) -> bool:
        fs.check(path, "token store")
        return (fs.path(path) / "manifest.json").is_file()

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def seq_len(self) -> int:
        """S: a sample holds S+1 ids (inputs are [:S], labels [1:] unless stored)."""
        return self.manifest["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def objective(self) -> str:
        """'causal' (labels: the next token) or 'mlm' (labels: masked positions' own ids)."""
        return self.manifest.get("objective", "causal")  # stores from before mlm: causal

    @property
    def has_labels(self) -> bool:
        """True if the shards store labels (IGNORE where masked), not just the shifted ids."""
        return bool(self.manifest.get("labels", False))

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.json"

    def num_samples(self, split: str) -> int:
        self._check_split(split)
        return self.manifest["counts"][split]

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise TokenStoreError(f"split {split!r} is not one of {', '.join(SPLITS)}")

    def _checked_bytes(self, info: dict) -> bytes | str:
        """The shard file's bytes if they match the manifest's size and checksum, else why not."""
        try:
            data = (self.path / info["file"]).read_bytes()
        except FileNotFoundError:
            return "is missing"
        algo, want = entry_algo(info)
        if ("bytes" in info and len(data) != info["bytes"]) or checksum(data, algo) != want:
            return f"does not match its {algo} checksum in manifest.json (bytes changed on disk)"
        return data

    def _shard(self, split: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cache is not None and self._cache[:2] == (split, i):
            return self._cache[2:]
        info = self.manifest["shards"][split][i]
        data = self._checked_bytes(info)
        if isinstance(data, str):
            raise TokenStoreError(
                f"token store {self.path}: shard {info['file']} ({split} rows "
                f"{info['rows'][0]}..{info['rows'][1] - 1}) {data}; {RETOKENIZE}"
            )
        cols = ["input_ids", "labels"] if self.has_labels else ["input_ids"]
        table = pq.read_table(pa.BufferReader(data), columns=cols)
        out = []
        for name in cols:
            col = table.column(name).combine_chunks()
            out.append(col.values.to_numpy(zero_copy_only=False).reshape(len(col), -1))
        rows = out[0]
        labels = out[1] if self.has_labels else rows[:, 1:]
        self._cache = (split, i, rows, labels)
        return rows, labels

    def _gather(self, split: str, pick, n: int, labels: bool):
        """ids (n, S+1) [and labels (n, S)] int32 of the rows `pick(a, b)` selects in each
        shard [a, b): (dest rows, shard rows) index arrays or slices, None to skip the shard."""
        ids = np.zeros((n, self.seq_len + 1), dtype=np.int32)
        lab = np.zeros((n, self.seq_len), dtype=np.int32) if labels else None
        for i, info in enumerate(self.manifest["shards"][split]):
            sel = pick(*info["rows"])
            if sel is None:
                continue
            rows, shard_labels = self._shard(split, i)
            ids[sel[0]] = rows[sel[1]]
            if lab is not None:
                lab[sel[0]] = shard_labels[sel[1]]
        return (ids, lab) if labels else ids

    def _range(self, split: str, start: int, stop: int, labels: bool):
        n = self.num_samples(split)
        if not 0 <= start <= stop <= n:
            raise TokenStoreError(f"rows [{start}, {stop}) out of range for {split} ({n} samples)")

        def pick(a, b):
            if b <= start or a >= stop:
                return None
            lo, hi = max(start, a), min(stop, b)
            return slice(lo - start, hi - start), slice(lo - a, hi - a)

        return self._gather(split, pick, stop - start, labels)

    def _indices(self, split: str, indices: np.ndarray, labels: bool):
        self._check_split(split)
        indices = np.asarray(indices)

        def pick(a, b):
            sel = (indices >= a) & (indices < b)
            return (sel, indices[sel] - a) if sel.any() else None

        return self._gather(split, pick, len(indices), labels)

    def read(self, split: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a split as an (n, S+1) int32 array (shard-contiguous reads)."""
        return self._range(split, start, stop, False)

    def read_with_labels(self, split: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of a split: ids (n, S+1) int32 and labels (n, S) int32."""
        return self._range(split, start, stop, True)

    def read_indices(self, split: str, indices: np.ndarray) -> np.ndarray:
        """Rows at sorted `indices` (used by sampled caches), read shard by shard."""
        return self._indices(split, indices, False)

    def read_indices_with_labels(
        self, split: str, indices: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """ids (n, S+1) and labels (n, S) int32 at sorted `indices`, read shard by shard."""
        return self._indices(split, indices, True)

    def verify(self) -> list[str]:
        """Files whose size or checksum differs from the manifest (or that are missing)."""
        return [
            info["file"]
            for split in SPLITS
            for info in self.manifest["shards"][split]
            if isinstance(self._checked_bytes(info), str)
        ]
