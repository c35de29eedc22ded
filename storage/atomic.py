"""File helpers: the one atomic write of the project, checksums, and reads into buffers.

Atomic writes: a temp file beside the target (by default `<name>.<host>.<pid>.<token>.partial`,
`partial_path`), fsync'd, then os.replace'd onto the target. The file writes of the cache,
the checkpoint, the visit state, state.json and the leases all go through here:
    write_bytes / write_json   bytes or canonical JSON (the cache's shards, markers, manifest,
                               state.json, ...)
    write_aside + commit       the same in two steps, for a multi-file write that renames its
                               temps only once all are written (a cache shard)
    write_file                 a writer callback on the open temp file (torch.save, a lease, a
                               checkpoint's JSON index; safetensors' save_file writes to its
                               `.name`), with the caller's temp name, a hook just before the
                               rename (a test's kill point) and an fsync of the directory after
    write_dir                  a whole directory, filled aside and renamed onto a missing or
                               empty target (a new checkpoint)
If any step fails the temp is removed and the error raised; the target keeps its old bytes.

Checksums: xxh3_128 (fast: ~tens of GB/s, so every read can be verified); entries written as
{"bytes": n, "checksum": {"algo": "xxh3_128", "value": hex}}; legacy {"sha256": hex} entries
still verify.

A reader never sees a half-written file under its real name: either the old bytes, the new
bytes, or (before the first write) nothing. Temp names are unique per process, so several
writers of the same file (identical content by construction) never clobber each other's
temp file; the last os.replace wins. Leftover temp files of dead writers are removed by
`clean_partials`.

Object-store URLs (s3://..., see storage/fs.py) take the same calls: an object PUT is atomic,
so `write_aside` only prepares the bytes, `commit` PUTs them to the final key (never a temp
key, so no half object and no leftover is ever visible), `write_file` PUTs what its writer
wrote into memory, and `clean_partials` has nothing to do.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash

from storage import fs

PARTIAL_SUFFIX = ".partial"
# A temp file whose writer we cannot see (another host) is stale after this long.
STALE_AFTER_S = 3600.0
_HOST = socket.gethostname().replace(".", "_") or "host"


def as_os_error(e: BaseException, path: str | Path) -> OSError | None:
    """The OSError inside an I/O error from a Rust library (safetensors, tokenizers), which
    raise plain exceptions ending in `(os error N)`: a full disk stays an ENOSPC for callers."""
    m = re.search(r"os error (\d+)", str(e))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), str(path))


def partial_path(path: str | Path) -> Path:
    """A temp path next to `path`, unique to this process and call."""
    p = Path(path)
    return p.with_name(f"{p.name}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")


def is_partial(path: str | Path) -> bool:
    return str(path).endswith(PARTIAL_SUFFIX)


Buffer = Any  # bytes, bytearray, memoryview or a C-contiguous numpy array


def _parts(data: Buffer | list[Buffer] | tuple[Buffer, ...]) -> list[Buffer]:
    return list(data) if isinstance(data, list | tuple) else [data]


class PendingPut:
    """The bytes of an object-store write, PUT to their key by `commit` (a URL's "temp file")."""

    def __init__(self, data: bytes):
        self.data = data


HASH_CHUNK = 1 << 20  # bytes hashed then written at a time: the kernel copies them from cache


def fsync_path(path: str | Path) -> None:
    """fsync a file, or a directory (so the renames in it survive a crash), by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(tmp: Path, write: Callable[[BinaryIO], object], fsync: bool) -> Path:
    """`write(f)` on `tmp` opened "wb", then (fsync) flush and fsync through the same handle;
    if either fails, the temp is removed and the error raised as it came."""
    try:
        with open(tmp, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _write_parts(f: BinaryIO, data: Buffer | list[Buffer], digest) -> None:
    for part in _parts(data):
        if digest is None:
            f.write(part)
            continue
        view = memoryview(part).cast("B")
        for o in range(0, len(view), HASH_CHUNK):
            digest.update(view[o : o + HASH_CHUNK])
            f.write(view[o : o + HASH_CHUNK])


def write_aside(
    path: str | Path, data: Buffer | list[Buffer], *, fsync: bool = True, digest=None
) -> Path | PendingPut:
    """Write `data` (one buffer, or a list written back to back) to a fresh temp file next to
    `path` (fsync'd unless fsync=False; `path`'s directory is created if missing); returns the
    temp path for `commit` (or `discard`). An OSError that names no file (a full disk on write
    or fsync) is raised naming `path`. For a URL nothing is written yet: the joined bytes wait
    for `commit`'s single PUT.

    digest: a hasher (`hasher()`) updated with every byte written, HASH_CHUNK bytes at a time
    just before each is written, so the data is read from memory once for both."""
    if fs.is_url(path):
        blob = fs.as_bytes(data)
        if digest is not None:
            digest.update(blob)
        return PendingPut(blob)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _write_temp(partial_path(p), lambda f: _write_parts(f, data, digest), fsync)
    except OSError as e:
        if e.filename is None:  # a full disk on write / fsync: say which file it was
            raise OSError(e.errno, e.strerror, str(p)) from e
        raise


def commit(
    tmp: Path | PendingPut,
    path: str | Path,
    *,
    before: Callable[[], object] | None = None,
    fsync_dir: bool = False,
) -> None:
    """Rename a temp file onto `path`, or PUT a `PendingPut`'s bytes to the URL (atomic).
    before: called just before the rename (inside it: if it raises, the temp is removed);
    fsync_dir: fsync `path`'s directory after the rename, so the rename itself is durable."""
    if isinstance(tmp, PendingPut):
        fs.put(path, tmp.data)
        return
    try:
        if before is not None:
            before()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync_dir:
        fsync_path(Path(path).parent)


def discard(tmp: Path | PendingPut) -> None:
    if not isinstance(tmp, PendingPut):
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: Buffer | list[Buffer], *, fsync: bool = True) -> None:
    """Write `data` (one buffer, or a list written back to back) to `path` atomically
    (temp file, fsync unless fsync=False, os.replace)."""
    commit(write_aside(path, data, fsync=fsync), path)


def write_file(
    path: str | Path,
    write: Callable[[BinaryIO], object],
    *,
    tmp_name: Callable[[Path], Path] = partial_path,
    fsync: bool = True,
    before_replace: Callable[[], object] | None = None,
    fsync_dir: bool = False,
) -> None:
    """Write `path` atomically with `write(f)`, `f` its temp file opened "wb" (a writer that
    wants a path, like safetensors' save_file, writes to `f.name`, the same file).

    tmp_name: the temp's path from `path` (default `partial_path`; a caller whose sweep knows
    its own temps names them); fsync: the temp's bytes, through `f`, before the rename;
    before_replace: called just before the rename; fsync_dir: `path`'s directory after it.
    Never creates `path`'s directory (FileNotFoundError if it is gone). Any failure removes
    the temp and is raised as it came; `path` keeps its old bytes.

    A URL: `write` fills an in-memory buffer, PUT to `path` whole (one PUT: atomic); tmp_name,
    fsync, before_replace and fsync_dir do not apply."""
    if fs.is_url(path):
        buf = io.BytesIO()
        write(buf)
        fs.put(path, buf.getvalue())
        return
    p = Path(path)
    tmp = _write_temp(tmp_name(p), write, fsync)
    commit(tmp, p, before=before_replace, fsync_dir=fsync_dir)


def write_dir(
    path: str | Path,
    fill: Callable[[Path], object],
    *,
    tmp_name: Callable[[Path], Path] = partial_path,
    fsync_dir: bool = True,
) -> None:
    """Create directory `path` atomically: `fill(tmp)` writes its files into a fresh temp
    directory beside it (tmp_name(path)), renamed onto `path`, which must be missing or empty
    (atomic on POSIX); then `path`'s parent is fsync'd (unless fsync_dir=False). `fill` makes
    its own files durable (write_file, and an fsync of the temp directory after its last one).
    Any failure removes the temp directory and is raised as it came. Local paths only."""
    p = Path(path)
    tmp = tmp_name(p)
    tmp.mkdir()
    try:
        fill(tmp)
        os.replace(tmp, p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fsync_dir:
        fsync_path(p.parent)


def replace_dir(tmp: str | Path, out: str | Path) -> None:
    """Rename the finished directory `tmp` onto `out`. An existing `out` is moved aside first
    (`.<name>.old-<id>` beside it) and deleted once the rename is done; if the rename fails it
    is put back, so `out` is either the old directory or the new one, never neither. The
    caller decides whether an existing `out` may be replaced. Local paths only."""
    tmp, out = Path(tmp), Path(out)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_io_pool: tuple[int, ThreadPoolExecutor] | None = None


def background(fn, *args, **kwargs) -> Future:
    """Run fn(*args, **kwargs) on this process's I/O thread (recreated after a fork).

    Writes and fsyncs release the GIL, so the caller's numpy work overlaps with them.
    """
    global _io_pool
    if _io_pool is None or _io_pool[0] != os.getpid():
        _io_pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="cache-io"))
    return _io_pool[1].submit(fn, *args, **kwargs)


def json_bytes(obj: Any) -> bytes:
    """Canonical JSON (sorted keys, 1-space indent): equal objects give equal bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def write_json(path: str | Path, obj: Any, *, fsync: bool = True) -> None:
    write_bytes(path, json_bytes(obj), fsync=fsync)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def partial_is_stale(path: Path, *, stale_after_s: float = STALE_AFTER_S) -> bool:
    """True if nobody is writing temp file `path` any more.

    Ours (`<name>.<host>.<pid>.<token>.partial`): stale when its pid is dead on this host, or
    when it is older than `stale_after_s` (other hosts). Any other `*.partial`: stale.
    """
    parts = path.name[: -len(PARTIAL_SUFFIX)].split(".")
    ours = len(parts) >= 4 and parts[-2].isdigit() and len(parts[-1]) == 8
    if not ours:
        return True
    if parts[-3] == _HOST:
        pid = int(parts[-2])
        return pid != os.getpid() and not _pid_alive(pid)
    try:
        return time.time() - path.stat().st_mtime > stale_after_s
    except FileNotFoundError:
        return False


def clean_partials(
    root: str | Path, *, dry_run: bool = False, stale_after_s: float = STALE_AFTER_S
) -> list[tuple[Path, int]]:
    """Remove stale `*.partial` files under `root`; returns [(path, bytes)] (found if dry_run).

    A temp file of a live writer (this host, pid alive, recent) is left alone, so cleaning
    while another process writes the same cache is safe.
    """
    if fs.is_url(root):
        return []  # object stores get no temp objects (commit PUTs the final key)
    out = []
    for p in Path(root).rglob(f"*{PARTIAL_SUFFIX}"):
        if p.is_file() and partial_is_stale(p, stale_after_s=stale_after_s):
            try:
                size = p.stat().st_size
                if not dry_run:
                    p.unlink()
            except FileNotFoundError:
                continue
            out.append((p, size))
    return out


CHECKSUM_ALGO = "xxh3_128"
_HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def hasher(algo: str = CHECKSUM_ALGO):
    try:
        return _HASHERS[algo]()
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algo!r}") from None


def checksum(parts: Buffer | list[Buffer], algo: str = CHECKSUM_ALGO) -> str:
    """Hex digest of the concatenation of `parts` (buffers: bytes, memoryview, numpy arrays)."""
    h = hasher(algo)
    for part in _parts(parts):
        h.update(part)
    return h.hexdigest()


def checksum_entry(parts: Buffer | list[Buffer], algo: str = CHECKSUM_ALGO) -> dict:
    """{"bytes": n, "checksum": {"algo", "value"}} of the concatenation of `parts`."""
    parts = _parts(parts)
    n = sum(memoryview(p).nbytes for p in parts)
    return {"bytes": n, "checksum": {"algo": algo, "value": checksum(parts, algo)}}


def digest_entry(digest, nbytes: int, algo: str = CHECKSUM_ALGO) -> dict:
    """checksum_entry's dict from a `hasher(algo)` that has seen `nbytes` bytes."""
    return {"bytes": nbytes, "checksum": {"algo": algo, "value": digest.hexdigest()}}


def entry_algo(entry: dict) -> tuple[str, str]:
    """(algo, hex digest) recorded in a file entry (new style, or legacy {"sha256": hex})."""
    c = entry.get("checksum")
    if isinstance(c, dict):
        return c["algo"], c["value"]
    if "sha256" in entry:
        return "sha256", entry["sha256"]
    raise ValueError(f"file entry without a checksum: {entry!r}")


def entry_matches(entry: dict, parts: Buffer | list[Buffer]) -> bool:
    """True if `parts` have the entry's size and checksum (in the entry's own algorithm)."""
    parts = _parts(parts)
    if sum(memoryview(p).nbytes for p in parts) != entry["bytes"]:
        return False
    algo, want = entry_algo(entry)
    return checksum(parts, algo) == want


def checksum_file(
    path: str | Path, algo: str = CHECKSUM_ALGO, chunk: int = 1 << 22
) -> tuple[str, int]:
    """(hex digest, size in bytes) of a file, read in `chunk`-byte pieces into one buffer."""
    h, n = hasher(algo), 0
    if fs.is_url(path):
        with fs.open_read(path) as f:
            while block := f.read(chunk):
                h.update(block)
                n += len(block)
        return h.hexdigest(), n
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(chunk, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while got := f.readinto(buf):
            h.update(view[:got])
            n += got
    return h.hexdigest(), n


def file_matches(path: str | Path, entry: dict) -> bool:
    """True if the file at `path` has the entry's size and checksum."""
    algo, want = entry_algo(entry)
    return checksum_file(path, algo) == (want, entry["bytes"])


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file."""
    return checksum_file(path, "sha256", chunk)


def dir_bytes(path: Path) -> int:
    if fs.is_url(path):
        return fs.du(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def read_into(f, buffers: list, digest=None) -> int:
    """Fill `buffers` (writable, C-contiguous) back to back from the open raw file `f`; returns
    the bytes read (less than their size only at end of file). digest: a hasher updated with
    every byte read, HASH_CHUNK bytes at a time right after each is read (still in cache)."""
    total = 0
    for b in buffers:
        view, got = memoryview(b).cast("B"), 0
        while got < len(view):
            k = f.readinto(view[got : got + HASH_CHUNK] if digest is not None else view[got:])
            if not k:
                return total + got
            if digest is not None:
                digest.update(view[got : got + k])
            got += k
        total += got
    return total


def read_array(path: str | Path, digest=None) -> np.ndarray:
    """The whole file as a fresh, writable uint8 array (one read straight into it); digest: a
    hasher updated with its bytes as they are read (read_into)."""
    if fs.is_url(path):
        data = fs.path(path).read_bytes()
        buf = np.empty(len(data), np.uint8)
        buf[:] = np.frombuffer(data, np.uint8)
        if digest is not None:
            digest.update(buf)
        return buf
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = np.empty(size, np.uint8)
        got = read_into(f, [buf], digest)
    if got != size:
        raise OSError(f"{path} shrank while being read ({got} of {size} bytes)")
    return buf
