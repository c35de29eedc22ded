"""One run per run.dir: an advisory lock on `<run.dir>/.lock` that names its holder.

    with run_lock(cfg.run.dir, "bcd", log=log):   # RunDirLocked (a ConfigError) if held
        ...

Two rotations on one run.dir would roll back each other's state.json and delete the caches the
other reads. The lock is `fcntl.flock` on `<run.dir>/.lock` (the kernel drops it when its holder
exits, SIGKILL included) plus a JSON record in that file, {pid, host, command, started, ...}:
the record is what a refusal names, and what decides where flock cannot:

- held by a live process (flock busy): refused, naming its pid, host and command;
- a record from another host: never taken over (this host cannot see that process, and flock
  does not reach across hosts on every shared filesystem); the message says how to clear it;
- a record from this host whose process is gone (dead pid, a zombie, a pid reused since, or an
  earlier boot): stale, taken over, and said so;
- a filesystem without flock (ENOLCK / EOPNOTSUPP): the record alone decides (best effort).

Taken again in the process that holds it (the demo, then the bcd it runs) it is held once and
released by the outermost exit. A release empties the record; the file itself stays (deleting a
lock file races with a process that has just opened it), except with tidy=True where the block
failed and the lock made run.dir: then the lock file and the directories it made go, while the
flock is still held (a stage that leaves nothing behind when it fails: tokenize).

`live_holder(run_dir)` reads the record only (it creates, locks and writes nothing): the check a
stage makes of another run.dir it may affect (tokenize of a token store that run reads).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from core.config import ConfigError
from storage import fs

LOCK_NAME = ".lock"

_held: dict[str, list] = {}  # resolved lock path -> [fd, depth] for the locks this process holds
_mutex = threading.Lock()


class RunDirLocked(ConfigError):
    """Another run holds this run.dir (or a record of another host's run is there)."""


def check_writable(
    path: str | Path, key: str, *, replaced: bool = False, access: bool = True
) -> None:
    """Refuse (ConfigError), before anything is written, a local directory `path` (the config
    key `key` names it) that cannot be made or written to: it, or a directory above it, is a
    file; or the directory it is in (itself, when it exists) is not writable by this process
    (permissions, a read-only mount, an immutable attribute). replaced: it is written beside
    and renamed into place (a token store), so the directory holding it must be writable too.
    access=False: only a file in the way is refused (for a command that may find nothing to
    write). Object-store URLs pass."""
    if fs.is_url(path):
        return
    p = Path(path).absolute()
    # the nearest of it and the directories above it that exists (lexists: never raises)
    have = next(q for q in (p, *p.parents) if os.path.lexists(q))
    is_dir = os.path.isdir(have)
    elsewhere = f"set {key} to a directory you can write"
    if not is_dir and have == p:
        raise ConfigError(
            f"{key} {p} is a file, not a directory; remove or rename the file, or {elsewhere}"
        )
    if not is_dir:
        raise ConfigError(
            f"{key} {p} cannot be made: {have} is a file, not a directory; remove or rename "
            f"that file, or {elsewhere}"
        )
    if replaced and have == p:
        have = p.parent
    if access and not os.access(have, os.W_OK | os.X_OK):
        what = "" if have == p else f": {have}, where it is made,"
        raise ConfigError(
            f"{key} {p}{what} is not writable by this user (its permissions, a read-only mount "
            f"or an immutable attribute); make it writable, or {elsewhere}"
        )


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, from /proc; None
    where there is no /proc (the pid alone then decides)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3, start 22
    return fields[0], int(fields[19])


def _record(command: str) -> dict:
    pid = os.getpid()
    stat = _proc_stat(pid)
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "command": command,
        "argv": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pid_start": stat and stat[1],
        "boot_id": _boot_id(),
    }


def _alive(rec: dict) -> bool:
    """Whether the process a record of this host names still runs (and is that process)."""
    pid = rec.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if rec.get("boot_id") and _boot_id() and rec["boot_id"] != _boot_id():
        return False  # recorded before this machine last booted
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    stat = _proc_stat(pid)
    if stat is None:
        return True
    if stat[0] in "ZX":  # killed, not yet reaped: holds nothing
        return False
    return rec.get("pid_start") is None or stat[1] == rec["pid_start"]


def describe_holder(rec: dict) -> str:
    """`pid N on host H (`command`, since T)`: a holder as refusals name it."""
    if not rec:
        return "another process (its record is not written yet)"
    return (
        f"pid {rec.get('pid')} on host {rec.get('host')} (`{rec.get('command')}`, "
        f"since {rec.get('started')})"
    )


def _read(fd: int) -> dict:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        rec = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}  # a torn or foreign write: no holder can be named from it
    return rec if isinstance(rec, dict) else {}


def _write(fd: int, rec: dict) -> None:
    data = json.dumps(rec, indent=2).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _acquire(path: Path, run_dir: Path, command: str, log: Callable[[str], None]) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            kernel = True
        except BlockingIOError:
            rec = _read(fd)
            gone = (
                "; that process is gone, but one it started still holds the lock: end it"
                if rec and rec.get("host") == socket.gethostname() and not _alive(rec)
                else ""
            )
            raise RunDirLocked(
                f"run.dir {run_dir} is in use by {describe_holder(rec)}{gone}; one run per "
                "run.dir: wait for it to finish (or stop it), or give this run another run.dir"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            kernel = False  # this filesystem has no flock: the record alone decides
        rec = _read(fd)
        if rec and rec.get("host") != socket.gethostname():
            raise RunDirLocked(
                f"run.dir {run_dir} is locked by {describe_holder(rec)}, another machine; this "
                f"host cannot tell whether it still runs, so it is never taken over. If no run "
                f"is active there, delete {path} and rerun; else wait, or give this run another "
                "run.dir"
            )
        if rec and rec.get("pid") != os.getpid() and _alive(rec):
            how = "" if kernel else " (no flock on this filesystem: the record decides)"
            raise RunDirLocked(
                f"run.dir {run_dir} is in use by {describe_holder(rec)}{how}; one run per "
                f"run.dir: wait for it to finish (or stop it), or give this run another run.dir. "
                f"If that process is no preinfer run, delete {path} and rerun"
            )
        if rec and rec.get("pid") != os.getpid():
            who = describe_holder(rec)
            log(f"  run.dir {run_dir}: took over the stale lock of {who}, which is gone")
        _write(fd, _record(command))
        return fd
    except BaseException:
        os.close(fd)  # closing drops a flock this call took
        raise


def live_holder(run_dir: str | Path) -> dict | None:
    """The record of the run holding `<run_dir>/.lock` now, read without taking the lock (nothing
    is created or written): a live process of this host other than this one, or any record of
    another host (never judged from here, as `run_lock` does not); None when none holds it."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None  # no lock file (no run ever held it), or not readable: nothing to name
    try:
        rec = _read(fd)
    finally:
        os.close(fd)
    if not rec or (rec.get("pid") == os.getpid() and rec.get("host") == socket.gethostname()):
        return None
    return rec if rec.get("host") != socket.gethostname() or _alive(rec) else None


@contextlib.contextmanager
def run_lock(
    run_dir: str | Path, command: str, *, log: Callable[[str], None] = print, tidy: bool = False
) -> Iterator[Path]:
    """Hold `<run_dir>/.lock` for the block (created with run_dir if missing); yields its path.
    Raises RunDirLocked, naming the holder, when another run has it. tidy: if the block raises
    and this call made run_dir (and is the outermost), the lock file and the directories made
    for it are removed again (those left empty)."""
    run_dir = Path(run_dir)
    check_writable(run_dir, "run.dir")  # a file there, or no write access: one clear line
    made = [d for d in (run_dir, *run_dir.parents) if not os.path.lexists(d)]  # deepest first
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / LOCK_NAME).resolve()
    key = str(path)
    with _mutex:
        if key in _held:
            _held[key][1] += 1
            made = []  # held already: its dirs are the outer holder's
        else:
            try:
                _held[key] = [_acquire(path, run_dir, command, log), 1]
            except BaseException:
                _remove_made(None, made if tidy else [])
                raise
    failed = False
    try:
        yield path
    except BaseException:
        failed = True
        raise
    finally:
        with _mutex:
            _held[key][1] -= 1
            if _held[key][1] == 0:
                fd = _held.pop(key)[0]
                try:
                    os.ftruncate(fd, 0)  # a clean exit leaves no record to judge
                    if failed and tidy and made:
                        _remove_made(path, made)  # under the flock: no one holds it meanwhile
                finally:
                    os.close(fd)  # and drops the flock


def _remove_made(lock_file: Path | None, made: list[Path]) -> None:
    """Remove `lock_file` and then the directories `made` (deepest first) left empty."""
    with contextlib.suppress(OSError):
        if lock_file is not None:
            lock_file.unlink()
        for d in made:
            d.rmdir()
