"""Names, errors and small helpers of the activation cache layout (storage/cache.py's module
docstring draws the layout; the writer there, the readers and the guards import these from
here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from core.config import ConfigError
from storage import atomic, fs
from storage.values import is_lossy, stored_dtype

FP_RE = re.compile(r"[0-9a-f]{8,64}")  # a cache's directory name: its hex fingerprint


def check_fingerprint(fp: str) -> str:
    """A cache name is a hex fingerprint: nothing that could walk out of the cache root."""
    if not isinstance(fp, str) or not FP_RE.fullmatch(fp):
        raise ConfigError(
            f"{fp!r} is not a cache fingerprint (8-64 lowercase hex characters); "
            "`preinfer cache ls` lists them"
        )
    return fp


HIDDEN, SCALE, SAMPLES, BUILD, DONE, MANIFEST = (
    "hidden.zarr",
    "scale.zarr",
    "samples.parquet",
    "build.json",
    "done",
    "manifest.json",
)


class CacheError(Exception):
    """The activation cache is missing, wrong or cannot be written; the message says what to do."""


class CacheIncomplete(CacheError):
    """No manifest: the build did not finish (some shards missing)."""


class CacheCorrupt(CacheError):
    """Stored bytes do not match their recorded checksum, or a cache file is unreadable."""


class FingerprintMismatch(CacheError):
    """The cache holds other activations than the caller expects."""


# ------------------------------------------------------------------------- small helpers


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise CacheCorrupt(f"{what} {path} is unreadable ({e}); delete it and rebuild") from None


def committed_shards(cache_dir) -> int:
    """Shards of the cache at `cache_dir` (a Path or fs.RemotePath) committed so far (their
    done markers)."""
    d = cache_dir / DONE
    return len(list(d.glob("*.json"))) if d.is_dir() else 0


def rows_per_shard(seq_len: int, hidden_size: int, dtype: str, shard_mb: float) -> int:
    """Rows R per shard so that one shard holds about `shard_mb` MiB of stored values."""
    row = seq_len * hidden_size * stored_dtype(dtype).itemsize
    return max(1, int(shard_mb * 2**20) // row)


def estimate_cache_bytes(n: int, seq_len: int, hidden_size: int, dtype: str) -> int:
    """Upper bound of a cache's size on disk (uncompressed values + scales + samples + index)."""
    values = n * seq_len * hidden_size * stored_dtype(dtype).itemsize
    scale = n * seq_len * 4 if is_lossy(dtype) else 0
    samples = n * (8 + 2 * 4 * seq_len)
    return int(values * 1.01) + scale + samples + n * 32 + (1 << 16)


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem of `path` (or its nearest existing parent); an object
    store (URL) has no limit to check: fs.UNLIMITED_BYTES."""
    if fs.is_url(path):
        return fs.UNLIMITED_BYTES
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def is_complete(root: str | Path, fingerprint: str) -> bool:
    """True if `<root>/<fingerprint>` has its manifest (checksums are the reader's job)."""
    return (fs.path(root) / fingerprint / MANIFEST).is_file()


def remove_cache(root: str | Path, name: str) -> None:
    """Delete the cache `<root>/<name>`, local or on an object store: its manifest.json FIRST
    (and, locally, durably), then the rest, hidden.zarr/ last. A delete interrupted at any point
    therefore leaves an incomplete cache (no manifest: readers refuse it, a build of that
    fingerprint rewrites what is missing) that `cache gc` still recognizes and removes, never a
    complete-looking one with shards gone. The one way a cache directory is deleted."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise CacheError(f"{name!r} is not a cache directory name under {root}; nothing deleted")
    d = fs.path(root) / name
    local = not fs.is_url(d)
    if local and d.is_symlink():
        d.unlink()  # the link only: never what it points at (outside the root, maybe)
        return
    (d / MANIFEST).unlink(missing_ok=True)  # from here on the cache reads as incomplete
    if local:
        if not d.is_dir():
            return
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)  # the manifest's removal reaches the disk before any shard's
        finally:
            os.close(fd)
    # hidden.zarr/ last: until the very end the leftovers still look like a cache to gc
    for p in sorted(d.iterdir(), key=lambda p: p.name == HIDDEN):
        if p.is_dir():
            fs.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    fs.rmtree(d)  # the emptied directory (and anything written meanwhile)


def check_marker(cache_dir: Path, marker: dict, *, verify: bool = True) -> str | None:
    """None if every file of the marker exists with its size (and checksum if verify); else why."""
    for rel, want in marker["files"].items():
        p = cache_dir / rel
        try:
            size = p.stat().st_size  # one request on an object store
        except FileNotFoundError:
            return f"{rel} is missing"
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, marker says {want['bytes']}"
        if verify and not atomic.file_matches(p, want):
            return f"{rel} checksum differs from its done marker (bytes changed on disk)"
    return None
