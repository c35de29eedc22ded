"""Bad-input fuzz over cache manifests: any damage ends in one clear CacheError.

One tiny cache is built per module; every example rewrites its manifest.json (truncated, not
JSON, wrong types anywhere, missing keys, another format version, file names escaping the
cache, negative or huge sizes, wrong shard counts). Then `open_cache`, the cache tools and the
`preinfer cache verify/inspect/ls` commands must either work (a harmless edit) or end in a
CacheError-family error (CLI: one line, non-zero exit, no traceback), and nothing may be
opened, written or removed outside the cache directory (checked with an audit hook).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.cli import main
from storage import cache_tools as tools
from storage.cache import CacheWriter
from storage.config import CacheConfig
from storage.layout import CacheCorrupt, CacheError, FingerprintMismatch
from storage.manifest import validate_manifest
from storage.reader import open_cache

FP = "abcdef0123456789"
N, S, H, R = 12, 4, 8, 4  # 3 shards of 4 rows
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the sandbox

_WATCH: dict = {"on": False, "sandbox": "", "cache": "", "hits": []}


def _audit(event: str, args: tuple) -> None:
    if not _WATCH["on"] or event not in ("open", "os.remove", "os.rename", "shutil.rmtree"):
        return
    p = args[0]
    if isinstance(p, int) or p is None:
        return  # an already open descriptor
    p = os.path.abspath(os.fsdecode(p))
    if p.startswith(_WATCH["sandbox"]) and not p.startswith(_WATCH["cache"]):
        _WATCH["hits"].append((event, p))
    write = event != "open" or (
        any(c in args[1] for c in "wax+")
        if isinstance(args[1], str)
        else bool(args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
    )
    # a reader's own lease (storage/lease.py) is the one write it may make, in <cache>/leases/
    lease = p.startswith(os.path.join(_WATCH["cache"], "leases") + os.sep)
    if write and p.startswith(_WATCH["cache"]) and not lease:
        _WATCH["hits"].append((f"{event} (write)", p))


sys.addaudithook(_audit)  # process-wide and permanent; a no-op unless a test turns it on


class Sandbox:
    """A built cache under <base>/root/<FP>, decoys outside it, and the pristine manifest."""

    def __init__(self, base: Path):
        self.base, self.root = base, base / "root"
        self.dir = self.root / FP
        cfg = CacheConfig(
            dtype="bf16", codec="none", shuffle="none", shard_mb=R * S * H * 2 / 2**20
        )
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 100, (N, S))
        w = CacheWriter.create(
            self.root,
            FP,
            samples={"sample_id": np.arange(N), "input_ids": ids, "labels": ids},
            seq_len=S,
            hidden_size=H,
            cache_cfg=cfg,
            meta={"boundary": 1, "split": "train", "model": {"arch": "gpt2"}},
        )
        x = torch.randn(N, S, H, generator=torch.Generator().manual_seed(0))
        for i in w.missing_shards():
            a, b = w.shard_range(i)
            w.write_shard(i, x[a:b])
        w.finalize()
        self.mp = self.dir / "manifest.json"
        self.raw = self.mp.read_bytes()
        self.good = json.loads(self.raw)
        assert self.good["header"]["num_shards"] == 3
        # decoys: same bytes as a real shard, outside the cache (a manifest may point at them)
        shard = self.dir / "hidden.zarr/c/0/0/0"
        (base / "outside").mkdir()
        for p in (base / "x", base / "outside/secret", base / "root/x"):
            p.write_bytes(shard.read_bytes())
        self.snapshot = self._files()

    def _files(self) -> dict[str, bytes]:
        return {
            str(p): p.read_bytes()
            for p in self.base.rglob("*")
            if p.is_file() and p != self.mp and "__pycache__" not in p.parts
            and "leases" not in p.relative_to(self.base).parts  # readers' own leases
        }  # fmt: skip

    def write(self, data: bytes | object) -> None:
        if not isinstance(data, bytes):
            data = json.dumps(data, allow_nan=True).encode()
        self.mp.write_bytes(data)

    def restore(self) -> None:
        self.mp.write_bytes(self.raw)


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    from pipelines import cli

    with pytest.MonkeyPatch.context() as mp:  # one parser for the module: ~50 ms per command
        mp.setattr(cli, "build_parser", functools.cache(cli.build_parser))
        yield Sandbox(tmp_path_factory.mktemp("fuzzmanifest"))


def check_everything(box: Sandbox, *, cli: bool) -> str | None:
    """Open, read, verify, inspect, list (and the CLI): a clear error or a working cache.

    Returns the CacheError of open_cache (None when it opened)."""
    _WATCH.update(on=True, sandbox=str(box.base), cache=str(box.dir) + os.sep, hits=[])
    err = None
    try:
        try:
            c = open_cache(box.root, FP, expected_fingerprint=FP)
        except CacheError as e:
            err = e
        else:  # a harmless edit, or one that the first read / verify finds
            with contextlib.suppress(CacheError):
                assert c.read_rows(0, N)[0].shape == (N, S, H)
            assert isinstance(c.verify(), list)
        for call in (
            lambda: tools.verify_cache(box.root, FP),
            lambda: tools.inspect_cache(box.root, FP),
        ):
            with contextlib.suppress(CacheError):
                call()
        rows = tools.list_caches(box.root)  # a listing shows a damaged cache; never dies of it
        assert [r["fingerprint"] for r in rows] == [FP]
        tools.format_table(rows)
        if cli:
            run_cli(box, err)
    finally:
        _WATCH["on"] = False
    assert _WATCH["hits"] == [], f"touched outside the cache or wrote: {_WATCH['hits']}"
    assert box._files() == box.snapshot, "a file changed"
    return err


def run_cli(box: Sandbox, err: CacheError | None) -> None:
    """`preinfer cache verify/inspect/ls` in-process: anything but a user error propagates."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    base = ["--root", str(box.root)]
    for argv in (["verify", FP, *base], ["inspect", FP, *base], ["ls", base[1]]):
        out, errs = StringIO(), StringIO()
        with redirect_stdout(out), redirect_stderr(errs):
            code = main(["cache", *argv])
        if argv[0] == "ls" or (argv[0] == "inspect" and isinstance(err, FingerprintMismatch)):
            assert code == 0, errs.getvalue()  # a listing, or a manifest shown as it is
            continue
        assert code in (0, 1, 2) and (code == 2 or err is None), (argv, code, errs.getvalue())
        if code == 2:
            lines = errs.getvalue().strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("preinfer cache: error: "), lines


# ------------------------------------------------------------------------ explicit damage


def _set(m, path, value):
    top = m
    for k in path[:-1]:
        m = m[k]
    m[path[-1]] = value
    return top


def _del(m, path):
    for k in path[:-1]:
        m = m[k]
    del m[path[-1]]


SHARD0 = ("shards", 0, "files", "hidden.zarr/c/0/0/0")


def _rename_file(m, new, shard=0):
    files = m["shards"][shard]["files"]
    old = next(iter(files))
    files[new] = files.pop(old)


def edits(box_base: Path):
    """(name, function(manifest) -> manifest or bytes, message fragment)."""

    def e(fn):
        def go(m):
            out = fn(m)
            return m if out is None else out

        return go

    outside = str(box_base / "outside/secret")
    yield "empty file", e(lambda m: b""), "unreadable"
    yield "truncated", e(lambda m: json.dumps(m).encode()[:200]), "unreadable"
    yield "not json", e(lambda m: b"{not json"), "unreadable"
    yield "binary", e(lambda m: bytes(range(256))), "unreadable"
    yield "a list", e(lambda m: [m]), "is an array"
    yield "null", e(lambda m: b"null"), "is null"
    yield "a string", e(lambda m: "manifest"), "is a string"
    for v in (0, 2, 99, -1):
        yield f"format {v}", e(lambda m, v=v: _set(m, ["format_version"], v)), f"version {v}"
    for v in ("1", 1.0, True, None, [1]):
        yield f"format {v!r}", e(lambda m, v=v: _set(m, ["format_version"], v)), "format_version"
    for k in ("format_version", "fingerprint", "header", "shards", "files", "meta"):
        yield f"no {k}", e(lambda m, k=k: _del(m, [k])), f"{k} is missing"
    for k in ("num_samples", "seq_len", "hidden_size", "num_shards", "rows_per_shard", "dtype"):
        yield f"no header.{k}", e(lambda m, k=k: _del(m, ["header", k])), f"header.{k}"
        yield f"header.{k} str", e(lambda m, k=k: _set(m, ["header", k], "12")), f"header.{k}"
    yield "header.dtype", e(lambda m: _set(m, ["header", "dtype"], "fp64")), "header.dtype"
    yield "fingerprint int", e(lambda m: _set(m, ["fingerprint"], 7)), "fingerprint"
    yield (
        "other fingerprint",
        e(lambda m: _set(_set(m, ["fingerprint"], "0" * 16), ["header", "fingerprint"], "0" * 16)),
        "mismatch",
    )
    yield "header.fp", e(lambda m: _set(m, ["header", "fingerprint"], "0" * 16)), "differs"
    for name, rel in [
        ("../x", "../x"),
        ("../../x", "../../x"),
        ("hidden.zarr/../../x", "hidden.zarr/../../x"),
        ("absolute", outside),
        ("absolute /etc/passwd", "/etc/passwd"),
        ("dot", "hidden.zarr/c/./0/0/0"),
        ("backslash", "hidden.zarr\\c\\0\\0\\0"),
        ("empty", ""),
        ("other file", "samples.parquet"),
        ("done marker", "done/00000.json"),
        ("nul", "hidden.zarr/c/0/0/0\0"),
    ]:
        yield f"shard path {name}", e(lambda m, rel=rel: _rename_file(m, rel)), "shards[0]"
        if rel == "samples.parquet":
            continue
        yield (
            f"files path {name}",
            e(lambda m, rel=rel: m["files"].__setitem__(rel, m["files"].pop("samples.parquet"))),
            "files",
        )
    yield "same shard file twice", e(lambda m: _rename_file(m, "hidden.zarr/c/0/0/0", 1)), "two"
    for v in (-1, 2**63, 10**30, 1.5, "5444", None):
        yield f"size {v!r}", e(lambda m, v=v: _set(m, [*SHARD0, "bytes"], v)), "bytes"
        yield (
            f"files size {v!r}",
            e(lambda m, v=v: _set(m, ["files", "samples.parquet", "bytes"], v)),
            "bytes",
        )
    yield "checksum algo", e(lambda m: _set(m, [*SHARD0, "checksum", "algo"], "md5")), "algorithm"
    yield "checksum value", e(lambda m: _set(m, [*SHARD0, "checksum", "value"], "zz")), "digest"
    yield "checksum null", e(lambda m: _set(m, [*SHARD0, "checksum"], None)), "checksum"
    yield "no checksum", e(lambda m: _del(m, [*SHARD0, "checksum"])), "checksum"
    yield "a shard too few", e(lambda m: _del(m, ["shards", 2])), "lists 2 shards"
    yield "a shard too many", e(lambda m: m["shards"].append(m["shards"][-1])), "lists 4 shards"
    yield "no shards", e(lambda m: _set(m, ["shards"], [])), "lists 0 shards"
    yield "num_shards 4", e(lambda m: _set(m, ["header", "num_shards"], 4)), "num_shards"
    yield "num_shards 0", e(lambda m: _set(m, ["header", "num_shards"], 0)), "num_shards"
    yield "num_shards -3", e(lambda m: _set(m, ["header", "num_shards"], -3)), "num_shards"
    yield "num_samples huge", e(lambda m: _set(m, ["header", "num_samples"], 2**62)), "num_sam"
    yield "num_samples 11", e(lambda m: _set(m, ["header", "num_samples"], 11)), "num_samples"
    yield "hidden_size 4", e(lambda m: _set(m, ["header", "hidden_size"], 4)), "hidden_size"
    yield (
        "both hidden_size 4",
        e(lambda m: _set(_set(m, ["header", "hidden_size"], 4), ["hidden_size"], 4)),
        "zarr.json",
    )
    yield "rows_per_shard 6", e(lambda m: _set(m, ["header", "rows_per_shard"], 6)), "num_shards"
    yield "shards swapped", e(lambda m: m["shards"].reverse()), "shards[0]"
    yield "shard stop", e(lambda m: _set(m, ["shards", 2, "stop"], 13)), "shards[2].stop"
    yield "shard files empty", e(lambda m: _set(m, ["shards", 1, "files"], {})), "shards[1]"
    yield "no samples entry", e(lambda m: _del(m, ["files", "samples.parquet"])), "samples"
    yield "meta list", e(lambda m: _set(m, ["meta"], [1])), "meta"
    yield "stats str", e(lambda m: _set(m, ["stats", "mean"], "x")), "stats.mean"
    yield "created int", e(lambda m: _set(m, ["created"], 3)), "created"


EDITS = list(edits(Path("/BASE")))  # names only; the functions are rebuilt with the real base


@pytest.mark.parametrize("name", [n for n, _, _ in EDITS])
def test_damaged_manifest_is_a_clear_cache_error(box, name):
    fn, needle = next((f, nd) for n, f, nd in edits(box.base) if n == name)
    try:
        box.write(fn(copy.deepcopy(box.good)))
        err = check_everything(box, cli=True)
    finally:
        box.restore()
    assert err is not None, f"{name}: the damaged manifest was accepted"
    assert needle in str(err) and "rebuild" in str(err), str(err)


def test_pristine_manifest_opens_and_the_cli_says_ok(box, capsys):
    assert check_everything(box, cli=True) is None
    assert main(["cache", "verify", FP, "--root", str(box.root)]) == 0
    assert "ok" in capsys.readouterr().out


def test_the_advised_repair_works(box):
    """The message says: delete the manifest and rerun the build (its finalize step)."""
    try:
        box.write({**box.good, "shards": []})
        with pytest.raises(CacheCorrupt, match="delete .*manifest.json and rerun"):
            open_cache(box.root, FP)
        box.mp.unlink()
        CacheWriter.open(box.root, FP).finalize()
        assert open_cache(box.root, FP, verify=True).verify() == []
    finally:
        box.restore()


def test_cli_on_a_damaged_manifest_in_a_real_process(box):
    """The console script itself: exit 2, one line on stderr, no traceback."""
    try:
        m = copy.deepcopy(box.good)
        m["header"] = ["not", "a", "dict"]
        box.write(m)
        r = subprocess.run(
            [
                str(Path(sys.executable).parent / "preinfer"),
                "cache",
                "verify",
                FP,
                "--root",
                box.root,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert "header must be an object" in r.stderr and "rebuild the cache" in r.stderr
    finally:
        box.restore()


# ------------------------------------------------------------------- random (hypothesis)

WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 1, 2, 2**31, 2**63, -(2**70), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "x", "1", "../x", "/etc/passwd", "hidden.zarr/c/0/0/0", "bf16"]),
    st.just([]),
    st.just({}),
    st.lists(st.integers(-2, 2), min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(["bytes", "a", "files"]), st.integers(-1, 9), max_size=2),
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _mutate(m, path, kind, value):
    if not path:
        return value if kind == "replace" else m
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if kind == "replace":
        parent[key] = value
    elif kind == "delete":
        del parent[key]
    elif kind == "rename" and isinstance(parent, dict):
        parent[f"{key}/../../x" if isinstance(value, bool) else str(value)] = parent.pop(key)
    elif kind == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    return m


@st.composite
def damaged(draw, good):
    m = copy.deepcopy(good)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(m))
        path = draw(st.sampled_from(paths))
        kind = draw(st.sampled_from(["replace", "replace", "delete", "rename", "duplicate"]))
        m = _mutate(m, path, kind, draw(WRONG))
        if not isinstance(m, dict):
            break
    return m


@pytest.fixture(scope="module")
def good_manifest(box):
    return box.good


def test_random_damage_never_escapes_as_a_traceback(box):
    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(damaged(box.good), st.integers(0, 1))
    def run(m, truncate):
        raw = json.dumps(m, allow_nan=True).encode()
        if truncate:
            raw = raw[: len(raw) // 2]
        try:
            box.write(raw)
            check_everything(box, cli=False)
        finally:
            box.restore()

    run()


def test_the_sandbox_sees_reads_outside_and_writes_inside(box):
    _WATCH.update(on=True, sandbox=str(box.base), cache=str(box.dir) + os.sep, hits=[])
    try:
        (box.base / "x").read_bytes()
        os.close(os.open(box.dir / "done/00000.json", os.O_RDWR))
        (box.dir / "done/00001.json").read_bytes()  # a read inside: fine
        (box.dir / "leases").mkdir(exist_ok=True)
        (box.dir / "leases" / "read.x.json").write_text("{}")  # a reader's lease: fine
    finally:
        _WATCH["on"] = False
    assert [e for e, _ in _WATCH["hits"]] == ["open", "open (write)"]


def test_validate_manifest_accepts_the_real_one(box):
    validate_manifest(box.good, box.dir)
    bad = {**box.good, "shards": [{**box.good["shards"][0], "files": {"../../x": {}}}]}
    with pytest.raises(CacheCorrupt, match="rebuild the cache"):
        validate_manifest(bad, box.dir)
