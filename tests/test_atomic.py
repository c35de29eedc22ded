"""storage/atomic.py, the one atomic write: a write that fails (or a process killed) at any
step leaves the target's old bytes and no temp file behind (a killed writer's temp: until
`clean_partials`); the callers' options (their temp names, the hook before the rename, the
fsync of the file and of its directory, URLs) do what they say."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage import atomic

ROOT = Path(__file__).resolve().parent.parent


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_write_bytes_and_json_replace_whole(tmp_path):
    p = tmp_path / "sub" / "f.json"  # write_bytes / write_json create the directory
    atomic.write_json(p, {"b": 1, "a": [1, 2]})
    assert (
        p.read_bytes()
        == atomic.json_bytes({"a": [1, 2], "b": 1})
        == b'{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}\n'
    )
    atomic.write_bytes(p, [b"ab", memoryview(b"cd")], fsync=False)
    assert p.read_bytes() == b"abcd" and _names(p.parent) == ["f.json"]


def test_a_write_failing_midway_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"old")
    seen = []

    def half(f):
        f.write(b"new, but only half")
        f.flush()
        seen.append(Path(f.name))
        assert Path(f.name).parent == tmp_path and atomic.is_partial(f.name)
        raise RuntimeError("died midway")

    with pytest.raises(RuntimeError, match="died midway"):
        atomic.write_file(p, half)
    assert p.read_bytes() == b"old" and _names(tmp_path) == ["f"] and not seen[0].exists()


def test_a_failing_hook_before_the_rename_keeps_the_old_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"old")

    def hook():
        raise OSError(errno.EIO, "hook")

    with pytest.raises(OSError, match="hook"):
        atomic.write_file(p, lambda f: f.write(b"new"), before_replace=hook)
    assert p.read_bytes() == b"old" and _names(tmp_path) == ["f"]


def test_write_aside_names_the_file_of_a_full_disk_and_leaves_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_bytes(b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError) as e:
        atomic.write_bytes(p, b"new")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(p)
    assert p.read_bytes() == b"old" and _names(tmp_path) == ["f"]
    # write_file raises what came: an error without a file name stays one
    with pytest.raises(OSError) as e:
        atomic.write_file(p, lambda f: f.write(b"new"))
    assert e.value.errno == errno.ENOSPC and e.value.filename is None
    assert p.read_bytes() == b"old" and _names(tmp_path) == ["f"]


def test_write_file_options(tmp_path, monkeypatch):
    p = tmp_path / "f"
    synced, order = [], []
    real = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(fd) or real(fd))

    def write(f):
        order.append(("write", Path(f.name).name))
        f.write(b"x")

    atomic.write_file(p, write, tmp_name=lambda q: q.with_name(f".{q.name}.tmp"),
                      before_replace=lambda: order.append(("hook", _names(tmp_path))),
                      fsync_dir=True)  # fmt: skip
    assert order == [("write", ".f.tmp"), ("hook", [".f.tmp"])]
    assert p.read_bytes() == b"x" and _names(tmp_path) == ["f"] and len(synced) == 2
    synced.clear()
    atomic.write_file(p, lambda f: f.write(b"y"), fsync=False)  # a lease: no fsync at all
    assert p.read_bytes() == b"y" and synced == []
    # never creates the directory (a lease on a deleted cache)
    with pytest.raises(FileNotFoundError):
        atomic.write_file(tmp_path / "gone" / "f", lambda f: f.write(b"x"))
    assert not (tmp_path / "gone").exists()


def test_write_file_to_a_url_is_one_put_of_what_was_written(monkeypatch):
    puts = []
    monkeypatch.setattr(atomic.fs, "put", lambda path, data: puts.append((path, data)))
    atomic.write_file("s3://bucket/k.json", lambda f: (f.write(b"a"), f.write(b"b")),
                      before_replace=lambda: pytest.fail("no rename on an object store"))  # fmt: skip
    assert puts == [("s3://bucket/k.json", b"ab")]


def test_write_dir_is_whole_or_absent(tmp_path):
    out = tmp_path / "ck"

    def fill(d):
        (d / "a").write_bytes(b"1")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        atomic.write_dir(out, fill)
    assert _names(tmp_path) == []
    atomic.write_dir(out, lambda d: (d / "a").write_bytes(b"1"))
    assert _names(tmp_path) == ["ck"] and (out / "a").read_bytes() == b"1"
    with pytest.raises(OSError):  # onto a non-empty directory: refused, the temp removed
        atomic.write_dir(out, lambda d: (d / "b").write_bytes(b"2"))
    assert _names(tmp_path) == ["ck"] and _names(out) == ["a"]


def test_a_writer_killed_before_the_rename_leaves_the_old_file(tmp_path):
    """A process really killed (os._exit) between its fsync'd temp and the rename: the target
    holds its old bytes; the dead writer's temp is what `clean_partials` removes."""
    p = tmp_path / "f"
    p.write_bytes(b"old")
    child = (
        "import os, sys; from storage import atomic; "
        "atomic.write_file(sys.argv[1], lambda f: f.write(b'new'), "
        "before_replace=lambda: os._exit(137))"
    )
    r = subprocess.run([sys.executable, "-c", child, str(p)], cwd=ROOT, timeout=120)
    assert r.returncode == 137
    assert p.read_bytes() == b"old"
    (tmp,) = [q for q in tmp_path.iterdir() if q != p]
    assert atomic.is_partial(tmp) and tmp.read_bytes() == b"new"
    assert [q for q, _ in atomic.clean_partials(tmp_path)] == [tmp]
    assert _names(tmp_path) == ["f"]


def test_replace_dir_swaps_a_directory_and_puts_the_old_back_when_the_rename_fails(tmp_path):
    out, new = tmp_path / "out", tmp_path / "new"
    out.mkdir()
    (out / "a").write_text("old")
    new.mkdir()
    (new / "a").write_text("new")
    atomic.replace_dir(new, out)
    assert (out / "a").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old one deleted
    with pytest.raises(FileNotFoundError):  # nothing to rename: the old directory stays
        atomic.replace_dir(tmp_path / "missing", out)
    assert (out / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    atomic.replace_dir(empty, out)
    assert list(out.iterdir()) == []  # onto an existing directory: replaced, not merged
