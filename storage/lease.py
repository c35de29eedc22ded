"""Leases: a reader's claim that a cache is in use, which `cache gc` (and the rotation's drop of
old caches) respects, so a cache is never deleted under a live process reading it.

    <cache>/leases/<kind>.<host>.<pid>.<token>.json   {"kind", "host", "pidns", "pid",
                                                       "start", "lease_s", "expires", ...}

A reader (`open_cache`) writes a `read` lease BEFORE it reads the manifest; a thread of its
process rewrites it every lease_s/3 with a later `expires` while the Cache is alive, and it is
deleted when the Cache is closed or collected (or the process exits). A remover writes a `gc`
claim, THEN lists the read leases, and deletes only if none is live; a reader that finds a
live claim after writing its lease waits for it to go. Whichever wrote second sees the other:
the reader either is seen (the remover backs off) or finds the cache gone (a clear
CacheIncomplete), never a cache deleted while it reads.

A lease is live until max(expires, mtime + lease_s): the holder's clock, or the file system's
(the object store's for s3://) when the holder's clock lags. One held on this host (same host
name and pid namespace) whose process is gone (or whose pid now names a younger process) is
dead at once: a killed trainer's lease does not block gc for lease_s. On an object store a
lease is one object, PUT again to renew; the protocol needs only read-after-write and
list-after-write consistency (S3 has both), no rename and no conditional write.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

from storage import atomic, fs
from storage.config import CacheConfig
from storage.layout import MANIFEST, CacheError, CacheIncomplete, remove_cache

LEASES = "leases"
READ, GC = "read", "gc"
DEFAULT_LEASE_S = CacheConfig.lease_s
GC_CLAIM_S = 120.0  # a remover's claim: it only has to outlive the decision to delete
GC_WAIT_S = 60.0  # how long a reader waits for a live gc claim to go before giving up
_POLL_S = 0.1
_HOST = socket.gethostname().replace(".", "_") or "host"


def _pidns() -> str:
    """This process's pid namespace: pids compare only within one (containers share hosts)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_PIDNS = _pidns()


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc); None: no such process,
    or a zombie (killed, not yet reaped); "" without /proc for one that exists."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else fields[19]  # state, starttime: proc(5) 3, 22
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # exists, owned by someone else
        return ""


class Lease:
    """One lease file; `release` deletes it (in the process that took it only)."""

    def __init__(self, path, record: dict):
        self.path, self.record = path, record
        self.owner = os.getpid()  # a forked child holds a copy: it must not delete the file
        self._lock = threading.Lock()  # a renewal never re-creates a released lease
        self.released = False

    @property
    def lease_s(self) -> float:
        return float(self.record["lease_s"])

    def renew(self) -> bool:
        """Push `expires` on; False when the lease file is gone (the cache was deleted)."""
        with self._lock:
            if self.released or os.getpid() != self.owner or not self.path.exists():
                return False
            self.record["expires"] = time.time() + self.lease_s
            _write(self.path, self.record)
            return True

    def release(self) -> None:
        """Delete the lease file; idempotent, never raises (it runs from finalizers)."""
        if os.getpid() != self.owner or self.released:
            return
        _renewer.discard(self)
        with self._lock:
            self.released = True
            try:
                self.path.unlink(missing_ok=True)
                if not fs.is_url(self.path):
                    self.path.parent.rmdir()  # the last one out: the cache as it was built
            except Exception:  # noqa: BLE001
                pass  # others' leases are left, the cache went, the store is unreachable: it
                # expires (or its holder is seen dead) and gc reclaims it

    def __repr__(self) -> str:
        return f"Lease({self.path})"


def _write(path, record: dict) -> None:
    """The lease file, whole (rename locally, not fsync'd: a lease lost in a crash went with
    its holder; one PUT on an object store); never creates the cache directory:
    FileNotFoundError if the cache is gone."""
    data = json.dumps(record, sort_keys=True).encode()
    atomic.write_file(path, lambda f: f.write(data), fsync=False)


def acquire(cache_dir, lease_s: float, kind: str = READ) -> Lease:
    """Write a `kind` lease on `cache_dir` (renewed until released when kind is READ).
    Raises FileNotFoundError when the cache directory is gone, OSError when it is not writable."""
    d = fs.path(cache_dir)
    now = time.time()
    record = {
        "kind": kind,
        "host": _HOST,
        "pidns": _PIDNS,
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "lease_s": float(lease_s),
        "acquired": now,
        "expires": now + lease_s,
    }
    name = f"{kind}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.json"
    lease = Lease(d / LEASES / name, record)
    for attempt in range(5):
        try:
            if not fs.is_url(d):
                (d / LEASES).mkdir(exist_ok=True)  # not parents: never re-creates a deleted cache
            _write(lease.path, record)
            break
        except FileNotFoundError:  # leases/ emptied and removed by a release meanwhile
            if attempt == 4 or not d.is_dir():
                raise
    if kind == READ:
        _renewer.add(lease)
    return lease


def _listing(cache_dir) -> list[tuple[object, float]]:
    """(path, mtime) of every lease file of a cache."""
    d = fs.path(cache_dir) / LEASES
    if fs.is_url(d):
        out = []
        for key, info in d.find().items():
            if key.endswith(".json"):
                t = info.get("LastModified")
                out.append((fs.RemotePath(f"{d.scheme}://{key}"), t.timestamp() if t else 0.0))
        return out
    try:
        entries = list(os.scandir(d))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        if e.name.endswith(".json"):
            try:
                out.append((Path(e.path), e.stat().st_mtime))
            except FileNotFoundError:
                continue
    return out


def stale_reason(record: dict, mtime: float, now: float | None = None) -> str | None:
    """None while the lease is live; else why it is not (expired, holder dead)."""
    now = time.time() if now is None else now
    try:
        pid, lease_s = int(record["pid"]), float(record["lease_s"])
        until = max(float(record["expires"]), mtime + lease_s)
    except (KeyError, TypeError, ValueError):
        return "unreadable lease record"
    if record.get("host") == _HOST and record.get("pidns") == _PIDNS and pid != os.getpid():
        started = _start_time(pid)
        if started is None:
            return f"holder pid {pid} on this host is dead"
        if record.get("start") and started and started != record["start"]:
            return f"holder pid {pid} on this host is dead (pid reused)"
    if now >= until:
        return f"expired {now - until:.0f}s ago"
    return None


def holders(cache_dir, now: float | None = None) -> tuple[list[dict], list[tuple[object, str]]]:
    """(live lease records, [(path, why)] of stale leases) of a cache."""
    live, stale = [], []
    for p, mtime in _listing(cache_dir):
        try:
            record = json.loads(p.read_text())
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, ValueError):
            record = {}
        why = stale_reason(record, mtime, now) if isinstance(record, dict) else "not a record"
        if why is None:
            live.append({**record, "path": str(p)})
        else:
            stale.append((p, why))
    return live, stale


def describe(records: list[dict]) -> str:
    """'pid 123 on host-a (until 12:00:05), ...' of lease records."""
    return ", ".join(
        f"{r.get('kind')} lease of pid {r.get('pid')} on {r.get('host')} (until "
        f"{time.strftime('%H:%M:%S', time.localtime(float(r.get('expires', 0))))})"
        for r in records
    )


def reclaim(stale: list[tuple[object, str]], dry_run: bool = False) -> int:
    """Delete stale lease files; how many (found, if dry_run)."""
    n = 0
    for p, _ in stale:
        if not dry_run:
            try:
                p.unlink(missing_ok=True)
                if not fs.is_url(p):
                    p.parent.rmdir()
            except OSError:
                pass  # other leases are left (rmdir), or it went meanwhile
        n += 1
    return n


def wait_for_removers(
    cache_dir, still_there: Callable[[], bool], timeout_s: float = GC_WAIT_S
) -> list[dict]:
    """Wait while a live gc claim is on the cache and `still_there()` (its manifest, say);
    the claims still live after timeout_s (none once the cache is no longer there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        claims = [r for r in holders(cache_dir)[0] if r.get("kind") == GC]
        if not claims or not still_there():
            return []
        if time.monotonic() >= deadline:
            return claims
        time.sleep(_POLL_S)


def read_lease(cache_dir, lease_s: float | None) -> Lease | None:
    """A reader's lease on `cache_dir` (None: lease_s is None, or the cache is not writable:
    a warning), once no remover is deleting it; a cache gone meanwhile is CacheIncomplete."""
    if lease_s is None:
        return None
    try:
        held = acquire(cache_dir, lease_s)
    except FileNotFoundError:
        raise CacheIncomplete(
            f"no cache at {cache_dir} (deleted meanwhile); build it first (preinfer cache build)"
        ) from None
    except OSError as e:
        warnings.warn(
            f"cannot write a lease on cache {cache_dir} ({e}); reading it without one: a "
            "`cache gc` elsewhere could delete it while it is read",
            stacklevel=3,
        )
        return None
    claims = wait_for_removers(cache_dir, (fs.path(cache_dir) / MANIFEST).exists)
    if claims:
        held.release()
        raise CacheError(
            f"cache {cache_dir} is being deleted ({describe(claims)}); wait for that gc to "
            "finish, then rebuild the cache if it is gone (preinfer cache build)"
        )
    return held


def remove_unless_used(root, name: str, *, mine_ok: bool = False) -> list[dict]:
    """Delete cache `<root>/<name>` (layout.remove_cache) unless a live read lease is on it;
    returns those leases (empty: deleted). mine_ok: this process's own leases do not count
    (a rotation dropping a cache its finished visit still holds)."""
    d = fs.path(root) / name

    def readers() -> list[dict]:
        return [r for r in holders(d)[0] if r.get("kind") == READ and not (mine_ok and _mine(r))]

    if not fs.is_url(d) and d.is_symlink():
        # remove_cache drops the link alone; a claim would be written where it points,
        # outside the root
        live = readers()
        if not live:
            remove_cache(root, name)
        return live
    claim = acquire(d, GC_CLAIM_S, kind=GC)
    try:
        live = readers()
    except BaseException:
        claim.release()
        raise
    if live:
        claim.release()
        return live
    try:
        remove_cache(root, name)  # the claim and every lease go with it
    except BaseException:
        claim.release()  # the manifest is gone already: readers find an incomplete cache
        raise
    return []


def _mine(record: dict) -> bool:
    return (record.get("host"), record.get("pidns"), record.get("pid")) == (
        _HOST,
        _PIDNS,
        os.getpid(),
    )


class _Renewer:
    """One daemon thread per process renewing its read leases every third of their length."""

    def __init__(self):
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._wake = threading.Event()
        self._thread: tuple[int, threading.Thread] | None = None

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases[id(lease)] = lease
            if self._thread is None or self._thread[0] != os.getpid():  # none, or forked
                t = threading.Thread(target=self._run, name="cache-lease", daemon=True)
                self._thread = (os.getpid(), t)
                t.start()
        self._wake.set()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)

    def _run(self) -> None:
        me = os.getpid()
        due: dict[int, float] = {}
        while True:
            with self._lock:
                leases = [v for v in self._leases.values() if v.owner == me]
            now = time.monotonic()
            for lease in leases:
                due.setdefault(id(lease), now + lease.lease_s / 3)
                if now < due[id(lease)]:
                    continue
                try:
                    kept = lease.renew()
                except Exception:  # noqa: BLE001 - the thread must outlive a store hiccup
                    kept = True  # try again at the next tick
                due[id(lease)] = now + lease.lease_s / 3
                if not kept:
                    self.discard(lease)
            alive = {id(v) for v in leases}
            due = {k: t for k, t in due.items() if k in alive}
            wait = min(due.values(), default=now + 60.0) - time.monotonic()
            self._wake.wait(max(0.05, wait))
            self._wake.clear()


_renewer = _Renewer()


def hold(owner, lease: Lease | None) -> None:
    """Release `lease` when `owner` is garbage-collected (or at exit)."""
    if lease is not None:
        weakref.finalize(owner, lease.release)
