"""Deleting a cache: the manifest goes first, so an interrupted delete (at any file, or by a
real SIGKILL) leaves an incomplete cache, never a complete-looking one with shards missing; and
the rotation deletes only fingerprints, whatever state.json says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError
from pipelines.bcd import drop_stale_caches
from storage.cache_tools import gc_caches, list_caches
from storage.layout import MANIFEST, CacheIncomplete, is_complete, remove_cache
from storage.reader import open_cache
from tests.pipeline_fixtures import quiet, tiny_cfg, write_small_cache

ROOT = Path(__file__).resolve().parent.parent
FP = "ab12cd34ef56"
N, S, H = 24, 8, 16


def build(root: Path, fp: str = FP) -> Path:
    """A complete 3-shard cache <root>/<fp>."""
    write_small_cache(root, fp, N, S, H)
    assert is_complete(root, fp) and open_cache(root, fp).verify() == []
    return root / fp


def files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


class Interrupted(BaseException):
    """Stands for a kill: not an OSError, so shutil.rmtree(ignore_errors=True) cannot swallow it."""


def _delete_with(how: str, root: Path, run_dir: Path) -> None:
    if how == "gc":
        gc_caches(root, keep=set(), dry_run=False, grace_s=0)
    elif how == "drop_stale":
        cfg = tiny_cfg(run_dir, f"cache.root={root}", "cache.keep=false")
        drop_stale_caches(cfg, {"events": [{"fingerprints": {"train": FP}}]}, keep=set())
    else:
        remove_cache(root, FP)


def _interrupted_delete(how: str, root: Path, run_dir: Path, k: int, monkeypatch) -> int:
    """Run the delete, interrupted before its (k+1)-th file; returns how many files it deleted."""
    real_unlink, done = os.unlink, 0

    def unlink(*args, **kw):
        nonlocal done
        if done == k:
            raise Interrupted(k)
        real_unlink(*args, **kw)
        done += 1

    monkeypatch.setattr(os, "unlink", unlink)
    try:
        _delete_with(how, root, run_dir)
    except Interrupted:
        pass
    finally:
        monkeypatch.setattr(os, "unlink", real_unlink)
    return done


@pytest.mark.parametrize("how", ["gc", "drop_stale", "remove_cache"])
def test_a_delete_interrupted_after_any_file_never_leaves_a_complete_cache(
    tmp_path, monkeypatch, how
):
    """Interrupt the delete after its k-th file, for every k: from the first file on, the cache
    is incomplete (is_complete false, open_cache refuses), and a gc then removes the rest."""
    n = len(files(build(tmp_path / "probe")))
    for k in range(1, n + 1):
        root = tmp_path / f"k{k}"
        d = build(root)
        assert _interrupted_delete(how, root, tmp_path / "run", k, monkeypatch) == k
        assert not (d / MANIFEST).exists(), f"interrupted after {k} of {n} files: manifest kept"
        assert not is_complete(root, FP)
        with pytest.raises(CacheIncomplete, match="no manifest.json|no cache at"):
            open_cache(root, FP)
        gc_caches(root, keep=set(), dry_run=False, grace_s=0)  # the leftovers go
        assert not d.exists()


KILL_AFTER_FIRST_UNLINK = """
import os, signal, sys
from storage.cache_tools import gc_caches
real = os.unlink
def unlink(*a, **kw):
    if getattr(unlink, "done", False):
        os.kill(os.getpid(), signal.SIGKILL)  # a real kill, mid-delete
    real(*a, **kw)
    unlink.done = True
os.unlink = unlink
gc_caches(sys.argv[1], keep=set(), dry_run=False, grace_s=0)
"""


def test_a_gc_killed_mid_delete_leaves_an_incomplete_cache(tmp_path):
    d = build(tmp_path)
    before = files(d)
    p = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_FIRST_UNLINK, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    # the one file it deleted is the manifest: every shard is still there, and nothing
    # reads the cache as complete (the killed gc's claim, storage/lease.py, is left: its
    # holder is dead, so neither a reader nor the next gc waits for it)
    assert [f for f in files(d) if not f.startswith("leases/gc.")] == [
        f for f in before if f != MANIFEST
    ]
    assert not is_complete(tmp_path, FP)
    with pytest.raises(CacheIncomplete, match="no manifest.json"):
        open_cache(tmp_path, FP)
    (row,) = list_caches(tmp_path)
    assert not row["complete"]
    gc_caches(tmp_path, keep=set(), dry_run=False, grace_s=0)
    assert not d.exists()


# ------------------------------------------------------- fingerprints from state.json


@pytest.mark.parametrize("bad", ["..", "../outside", "ABSOLUTE", "../" + FP, "AB12CD34", "", None])
def test_drop_stale_caches_refuses_a_state_entry_that_is_not_a_fingerprint(tmp_path, bad):
    root = tmp_path / "cache"
    good = build(root)
    victim = tmp_path / "outside"  # what "../outside" names, relative to the cache root
    if bad == "ABSOLUTE":
        bad = str(victim)  # an absolute path (never a real system directory in a test)
    victim.mkdir()
    (victim / MANIFEST).write_text("{}")
    (victim / "precious").write_text("keep me")
    cfg = tiny_cfg(tmp_path / "run", f"cache.root={root}", "cache.keep=false")
    # a good entry first: the bad one must stop the call before anything is deleted
    state = {"events": [{"fingerprints": {"train": FP}}, {"fingerprints": {"val": bad}}]}
    with pytest.raises(ConfigError, match="not a cache fingerprint.*nothing was deleted"):
        drop_stale_caches(cfg, state, keep=set(), log=quiet)
    assert (victim / "precious").read_text() == "keep me" and (victim / MANIFEST).exists()
    assert is_complete(root, FP) and good.is_dir()


def test_drop_stale_caches_still_drops_what_it_should(tmp_path):
    root = tmp_path / "cache"
    build(root, FP)
    build(root, "cd34ef56ab12")
    cfg = tiny_cfg(tmp_path / "run", f"cache.root={root}", "cache.keep=false")
    state = {"events": [{"fingerprints": {"train": FP, "val": "cd34ef56ab12"}}]}
    said = []
    drop_stale_caches(cfg, state, keep={"cd34ef56ab12"}, log=said.append)
    assert sorted(p.name for p in root.iterdir()) == ["cd34ef56ab12"]
    assert len(said) == 1 and FP[:12] in said[0]
