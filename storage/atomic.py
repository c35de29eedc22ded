"""File helpers. Atomic writes: write to `<name>.<host>.<pid>.<token>.partial`, fsync, os.replace.

A reader never sees a half-written file under its real name: either the old bytes, the new
bytes, or (before the first write) nothing. Temp names are unique per process, so several
writers of the same file (identical content by construction) never clobber each other's
temp file; the last os.replace wins. Leftover temp files of dead writers are removed by
`clean_partials`.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"
# A temp file whose writer we cannot see (another host) is stale after this long.
STALE_AFTER_S = 3600.0
_HOST = socket.gethostname().replace(".", "_") or "host"


def partial_path(path: str | Path) -> Path:
    """A temp path next to `path`, unique to this process and call."""
    p = Path(path)
    return p.with_name(f"{p.name}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")


def is_partial(path: str | Path) -> bool:
    return str(path).endswith(PARTIAL_SUFFIX)


def write_bytes(path: str | Path, data: bytes | memoryview, *, fsync: bool = True) -> None:
    """Write `data` to `path` atomically (temp file + os.replace)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(p)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def json_bytes(obj: Any) -> bytes:
    """Canonical JSON (sorted keys, 1-space indent): equal objects give equal bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def write_json(path: str | Path, obj: Any) -> None:
    write_bytes(path, json_bytes(obj))


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


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
