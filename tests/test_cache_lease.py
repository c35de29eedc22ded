"""Leases (storage/lease.py): `cache gc` and the rotation's drop never delete a cache a live
process reads; an expired lease, or one whose holder died on this host, is reclaimed. The
trainer test runs a real `preinfer train` process and a real `preinfer cache gc` beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tests.test_object_storage as object_storage
from core.config import ConfigError
from core.faults import READ_GATE
from pipelines.cache_build import build_cache
from storage import fs, lease
from storage.cache_tools import gc_caches
from storage.config import CacheConfig
from storage.layout import CacheCorrupt, CacheIncomplete, is_complete, remove_cache
from storage.reader import open_cache
from tests.pipeline_fixtures import TINY, quiet, write_small_cache

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
N, S, H = 24, 8, 16
s3, s3_run = object_storage.s3, object_storage.s3_run  # the moto server fixtures


def build(root, fp: str = "ab12cd34") -> str:
    """A complete 3-shard cache <root>/<fp>."""
    write_small_cache(root, fp, N, S, H)
    return fp


def lease_files(cdir) -> list:
    return sorted(fs.path(cdir).glob(f"{lease.LEASES}/*.json"))


def forge(cdir, *, host="other_host", pid=4242, expires_in=-10.0, lease_s=1.0, kind="read"):
    """A lease file as another holder would have written it."""
    rec = {"kind": kind, "host": host, "pidns": lease._PIDNS, "pid": pid, "start": None,
           "lease_s": lease_s, "acquired": time.time(), "expires": time.time() + expires_in}  # fmt: skip
    p = fs.path(cdir) / lease.LEASES / f"{kind}.{host}.{pid}.forged00.json"
    if not fs.is_url(p):
        p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(rec))
    return p


# long enough that a renewal thread starved by a busy machine still renews before expiry (it
# renews every LEASE_S / 3); the tests wait for a renewal, never for a fixed time
LEASE_S = 6.0


def wait_renewed(p, first: dict, timeout: float = 120.0) -> dict:
    """The lease record at `p` once its holder has renewed it past `first`."""
    deadline = time.monotonic() + timeout
    while (rec := json.loads(p.read_text()))["expires"] <= first["expires"]:
        assert time.monotonic() < deadline, f"lease {p} not renewed in {timeout:.0f} s"
        time.sleep(0.05)
    return rec


def wait_outlived(p, lengths: float, still=lambda: True, timeout: float = 300.0) -> dict:
    """The lease record at `p` once its holder has renewed it more than `lengths` lease
    lengths after it was acquired: it is live now only because it was renewed (a renewal at
    t writes expires = t + lease_s), however slowly this machine ran meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        rec = json.loads(p.read_text())
        if rec["expires"] - rec["acquired"] > (lengths + 1) * rec["lease_s"]:
            return rec
        assert still(), f"the holder of {p} ended before renewing it"
        assert time.monotonic() < deadline, f"lease {p} not renewed for {timeout:.0f} s: {rec}"
        time.sleep(0.05)


def test_an_open_cache_is_leased_renewed_and_spared_by_gc_until_closed(tmp_path):
    fp = build(tmp_path)
    said: list[str] = []
    cache = open_cache(tmp_path, fp, lease_s=LEASE_S)
    (p,) = lease_files(tmp_path / fp)
    first = json.loads(p.read_text())
    assert (first["kind"], first["pid"]) == ("read", os.getpid())
    renewed = wait_renewed(p, first)
    assert renewed["expires"] > time.time()
    assert gc_caches(tmp_path, keep=set(), dry_run=False, grace_s=0, log=said.append) == []
    assert (
        is_complete(tmp_path, fp)
        and f"kept {fp}: in use" in said[0]
        and str(os.getpid()) in said[0]
    )
    assert cache.read_rows(0, N)[0].shape == (N, S, H)  # still whole
    cache.close()
    assert not (tmp_path / fp / lease.LEASES).exists()  # the cache as it was built
    assert [r[0] for r in gc_caches(tmp_path, keep=set(), dry_run=False, grace_s=0)] == [fp]
    assert not (tmp_path / fp).exists()
    # a Cache dropped without close() releases its lease too (and a pickled copy holds none)
    fp2 = build(tmp_path, "cd34ef56")
    c2 = open_cache(tmp_path, fp2)
    assert lease_files(tmp_path / fp2) and c2.__getstate__()["_lease"] is None
    del c2
    assert not lease_files(tmp_path / fp2)
    with pytest.raises(ConfigError, match="cache.lease_s must be >= 1"):
        CacheConfig(lease_s=0.5)


def test_expired_and_dead_leases_are_reclaimed_live_ones_kept(tmp_path):
    a, b, c, d = (build(tmp_path, fp) for fp in ("aaaa0001", "aaaa0002", "aaaa0003", "aaaa0004"))
    forge(tmp_path / a, expires_in=-30)  # another host's, expired: reclaimed
    old = time.time() - 60
    os.utime(lease_files(tmp_path / a)[0], (old, old))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    forge(tmp_path / b, host=lease._HOST, pid=int(dead.stdout), expires_in=3600)  # dead holder
    forge(tmp_path / c, expires_in=3600)  # another host's, live: spared
    forge(tmp_path / d, kind="read", expires_in=-30)  # stale, on a kept cache: file removed
    os.utime(lease_files(tmp_path / d)[0], (old, old))
    said: list[str] = []
    out = {fp: why for fp, why, _ in gc_caches(tmp_path, {d}, False, grace_s=0, log=said.append)}
    assert "stale lease(s) reclaimed: expired" in out[a]
    assert f"pid {int(dead.stdout)} on this host is dead" in out[b]
    assert c not in out and f"kept {c}: in use (read lease of pid 4242 on other_host" in said[0]
    assert (
        "1 stale lease(s)" in out[d] and not lease_files(tmp_path / d) and is_complete(tmp_path, d)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([c, d])


def test_a_reader_and_a_remover_never_both_win(tmp_path):
    """The two orders of the protocol: a reader that comes while a remover's claim is on the
    cache waits for it; a remover that finds a reader's lease after its claim backs off."""
    fp = build(tmp_path)
    cdir = tmp_path / fp
    with open_cache(tmp_path, fp, lease_s=5) as cache:  # a reader first: the remover backs off
        (held,) = lease.remove_unless_used(tmp_path, fp)
        assert held["pid"] == os.getpid() and is_complete(tmp_path, fp)
        assert lease.remove_unless_used(tmp_path, fp, mine_ok=True) == []  # the rotation's own
        assert not cdir.exists()
        with pytest.raises(CacheCorrupt, match="missing"):
            cache.read_rows(0, N)
    # a remover's claim first: the reader waits; the claim goes (the remover backed off)
    fp = build(tmp_path)
    claim = lease.acquire(cdir, lease.GC_CLAIM_S, kind=lease.GC)
    t0 = time.monotonic()
    threading.Timer(0.5, claim.release).start()
    with open_cache(tmp_path, fp) as cache:
        assert time.monotonic() - t0 >= 0.4 and cache.num_samples == N
    # ...or the remover deleted it meanwhile: a clear CacheIncomplete, nothing re-created
    claim = lease.acquire(cdir, lease.GC_CLAIM_S, kind=lease.GC)
    remover = threading.Timer(0.5, remove_cache, (tmp_path, fp))  # its decision was made
    remover.start()
    with pytest.raises(CacheIncomplete):
        open_cache(tmp_path, fp)
    remover.join()
    assert not cdir.exists()


def test_a_killed_readers_lease_is_reclaimed_at_once_on_its_host(tmp_path):
    """SIGKILL a process holding a (long) lease: it never releases it, yet gc on this host sees
    its holder is gone and collects the cache without waiting lease_s."""
    fp = build(tmp_path)
    code = (
        "import sys, time\nfrom storage.reader import open_cache\n"
        f"c = open_cache({str(tmp_path)!r}, {fp!r}, lease_s=3600)\nprint('open', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "open"
        assert gc_caches(tmp_path, keep=set(), dry_run=False, grace_s=0) == []  # alive: spared
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        p.kill()
    assert lease_files(tmp_path / fp)  # never released
    (row,) = gc_caches(tmp_path, keep=set(), dry_run=False, grace_s=0)
    assert row[0] == fp and "is dead" in row[1] and not (tmp_path / fp).exists()


def test_leases_on_an_object_store(s3, s3_run):
    """s3://: a lease is one object, PUT again to renew; gc spares a leased cache, reclaims an
    expired lease, and collects the cache once its reader closes it."""
    root = s3_run().cache.root
    fp = build(root)
    said: list[str] = []
    with open_cache(root, fp, lease_s=LEASE_S) as cache:
        (p,) = lease_files(f"{root}/{fp}")
        wait_renewed(p, json.loads(p.read_text()))  # renewed by a PUT
        assert gc_caches(root, keep=set(), dry_run=False, grace_s=0, log=said.append) == []
        assert is_complete(root, fp) and "in use" in said[0]
        assert cache.read_rows(0, N)[0].shape == (N, S, H)
    assert not lease_files(f"{root}/{fp}")
    forge(f"{root}/{fp}", expires_in=-30, lease_s=0.01)  # expired (store clock + lease_s too)
    (row,) = gc_caches(root, keep=set(), dry_run=False, grace_s=0)
    assert row[0] == fp and "reclaimed: expired" in row[1]
    assert object_storage.keys(root) == []


def _cli(*args: str, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "preinfer"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)  # fmt: skip


@pytest.mark.slow  # two CLI processes start (~1 min on 2 busy CPUs)
@pytest.mark.functional
def test_cache_gc_beside_a_training_process_spares_its_caches(tiny_run, tmp_path):
    """A real `preinfer train --block 1` process reads its caches (held at its 3rd batch, past
    two lease lengths, by the READ_GATE switch) while a real `preinfer cache gc` runs: the gc
    keeps both caches, the visit finishes; once it has ended, the next gc collects them."""
    # LEASE_S, not 1 s: the trainer's renewals must go on while gc's interpreter starts, and
    # a 1 s lease expires at the first stall of a busy machine's renewal thread
    extra = [f"cache.lease_s={LEASE_S:g}", "train.shuffle_buffer_mb=0.001"]  # a shard at a time
    cfg = tiny_run(*extra)
    sets = [*TINY, f"run.dir={cfg.run.dir}", *extra]
    fps = build_cache(cfg, 1, log=quiet)["fingerprints"]
    root = Path(cfg.cache.root)
    gate = tmp_path / "go"
    args = [a for s in sets for a in ("--set", s)]
    env = {**os.environ, READ_GATE: f"{gate}@3"}
    trainer = _cli("train", "--block", "1", "--config", "configs/demo.yaml", *args, env=env)
    try:
        deadline = time.time() + 300
        while not all(lease_files(root / fp) for fp in fps.values()):
            assert trainer.poll() is None and time.time() < deadline, trainer.stdout.read()
            time.sleep(0.2)
        for fp in fps.values():  # each lease outlived 2 of its lengths only by renewals
            (f,) = lease_files(root / fp)
            wait_outlived(f, lengths=2, still=lambda: trainer.poll() is None)
        gc = subprocess.run(
            [str(BIN / "preinfer"), "cache", "gc", "--config", "configs/demo.yaml", *args],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert gc.returncode == 0, gc.stdout + gc.stderr
        for fp in fps.values():
            assert f"kept {fp}: in use (read lease of pid {trainer.pid}" in gc.stdout, gc.stdout
            assert is_complete(root, fp)
        gate.touch()  # the visit goes on reading (shards, val evaluations) and commits
        out, _ = trainer.communicate(timeout=300)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, out[-3000:]
    summary = [line for line in out.splitlines() if line.startswith("{")][-1]
    assert json.loads(summary)["steps"] == cfg.train.max_steps
    said: list[str] = []
    removed = gc_caches(root, keep=set(), dry_run=False, log=said.append)
    assert sorted(fp for fp, _, _ in removed) == sorted(fps.values()) and not said
