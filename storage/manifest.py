"""Schema check of a cache's manifest.json, before anything in it is used.

A manifest is written by `storage.cache.build_manifest`; a damaged or hand-edited one must end
in one clear CacheError (what is wrong, and "rebuild the cache"), never in a KeyError /
TypeError deep inside a reader, and never in a read or write outside the cache directory: every
file name the manifest lists is checked to be a plain relative path of the cache layout that
stays inside `cache_dir` (symlinks resolved).

What is checked: the format version first (another version may have another schema); then the
type of every field the code reads; the header against the shard list (counts, row ranges)
and against hidden.zarr/zarr.json (shape, shard rows, stored type); each file entry (size in
range, checksum algorithm and hex digest); the identity record, where there is one (its field
types, and its storage facts against the header). Informational fields (stats, sizes, ratios) are
type-checked only when present, so an older manifest without one still opens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

from core.fingerprint import CACHE_FORMAT_VERSION
from storage import fs
from storage.identity import check_record
from storage.layout import HIDDEN, MANIFEST, SAMPLES, SCALE, CacheCorrupt, CacheError
from storage.values import STORED_NP, is_lossy

MAX_COUNT = 1 << 40  # samples, shards, rows, positions, hidden size: more is a damaged manifest
MAX_BYTES = 1 << 50  # one file (1 PiB)
DIGEST_HEX = {"xxh3_128": 32, "sha256": 64}  # checksum algorithms storage.atomic knows
HEADER_INTS = ("num_samples", "seq_len", "hidden_size", "num_shards", "rows_per_shard")


class _Bad(Exception):
    pass


def _fail(msg: str) -> NoReturn:
    raise _Bad(msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: dict, key: str, where: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    if key not in d:
        _fail(f"{where}{key} is missing")
    v = d[key]
    if not _is_int(v) or not lo <= v <= hi:
        _fail(f"{where}{key} must be an integer in {lo}..{hi}, found {_short(v)}")
    return v


def _typed(d: dict, key: str, types: type | tuple, where: str = "", *, required: bool = True):
    if key not in d:
        if required:
            _fail(f"{where}{key} is missing")
        return None
    v = d[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
        names = " or ".join(dict.fromkeys(_json_type(t) for t in _tuple(types)))
        _fail(f"{where}{key} must be {names}, found {_short(v)}")
    return v


def _tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _json_type(t: type) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    return names.get(t, "null" if t is type(None) else "a number")


def _number(d: dict, key: str, where: str = "", *, required: bool = False) -> None:
    v = _typed(d, key, (int, float), where, required=required)
    if v is not None and not math.isfinite(v):
        _fail(f"{where}{key} must be a finite number, found {_short(v)}")


def _short(v: Any) -> str:
    s = json.dumps(v) if _jsonable(v) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v, allow_nan=True)
        return True
    except (TypeError, ValueError):
        return False


def _rel_path(rel: Any, cache_dir: Any, root: Path | None, where: str) -> str:
    """`rel` if it is a plain relative path inside the cache directory (symlinks resolved for
    a local cache; an object store has no links, so the lexical check is the whole check)."""
    if not isinstance(rel, str) or not rel:
        _fail(f"{where}: file name {_short(rel)} is not a non-empty string")
    p = PurePosixPath(rel)
    if (
        p.is_absolute()
        or "\\" in rel
        or "\0" in rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        _fail(f"{where}: file name {_short(rel)} is not a plain path inside the cache directory")
    if root is None:
        return rel
    try:
        inside = (cache_dir / rel).resolve().is_relative_to(root)
    except (OSError, ValueError, RuntimeError):
        inside = False
    if not inside:
        _fail(f"{where}: file {_short(rel)} resolves outside the cache directory")
    return rel


def _entry(e: Any, where: str) -> None:
    if not isinstance(e, dict):
        _fail(f"{where} must be an object with bytes and checksum, found {_short(e)}")
    _int(e, "bytes", f"{where}.", 0, MAX_BYTES)
    c = e.get("checksum")
    if c is None and "sha256" in e:  # legacy entry {"bytes", "sha256"}
        algo, value = "sha256", e["sha256"]
    elif isinstance(c, dict):
        algo, value = c.get("algo"), c.get("value")
    else:
        _fail(f"{where}.checksum must be an object with algo and value, found {_short(c)}")
    if not isinstance(algo, str) or algo not in DIGEST_HEX:
        _fail(
            f"{where}: unknown checksum algorithm {_short(algo)} (known: {', '.join(DIGEST_HEX)})"
        )
    if (
        not isinstance(value, str)
        or len(value) != DIGEST_HEX[algo]
        or any(ch not in "0123456789abcdef" for ch in value)
    ):
        _fail(f"{where}: {algo} digest must be {DIGEST_HEX[algo]} lowercase hex characters")


def _zarr_shape(cache_dir: Any) -> tuple[list, Any, Any]:
    """(shape, shard rows, data type) recorded in hidden.zarr/zarr.json."""
    p = cache_dir / HIDDEN / "zarr.json"
    try:
        z = json.loads(p.read_bytes())
        return (
            z["shape"],
            z["chunk_grid"]["configuration"]["chunk_shape"][0],
            z.get("data_type"),
        )
    except FileNotFoundError:
        _fail(f"{HIDDEN}/zarr.json is missing")
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        _fail(f"{HIDDEN}/zarr.json is unreadable ({type(e).__name__}: {e})")


def _check(m: Any, cache_dir: Any) -> None:
    if not isinstance(m, dict):
        _fail(f"the manifest is {_json_type(type(m))} ({_short(m)}), not a JSON object")
    if "format_version" not in m:
        _fail("format_version is missing")
    v = m["format_version"]
    if not _is_int(v):
        _fail(f"format_version must be an integer, found {_short(v)}")
    if v != CACHE_FORMAT_VERSION:
        raise CacheError(
            f"cache {cache_dir} has format version {v}, this code reads "
            f"{CACHE_FORMAT_VERSION}; rebuild the cache"
        )
    fp = _typed(m, "fingerprint", str)
    if not fp:
        _fail("fingerprint is empty")
    _typed(m, "meta", dict)
    h = _typed(m, "header", dict)
    n, s, hs, num_shards, rows = (_int(h, k, "header.", 1) for k in HEADER_INTS)
    dtype = _typed(h, "dtype", str, "header.")
    if dtype not in STORED_NP:
        _fail(f"header.dtype {_short(dtype)} is not one of {', '.join(STORED_NP)}")
    for k, want in (("fingerprint", fp), ("format_version", v)):
        if k in h and (h[k] != want or type(h[k]) is not type(want)):
            _fail(f"header.{k} {_short(h[k])} differs from the manifest's {_short(want)}")
    for k in ("codec", "shuffle"):
        _typed(h, k, str, "header.", required=False)
    if "level" in h:
        _int(h, "level", "header.", -(1 << 20), 1 << 20)
    for k, want in (("num_samples", n), ("seq_len", s), ("hidden_size", hs), ("dtype", dtype)):
        if k in m and (m[k] != want or isinstance(m[k], bool)):
            _fail(f"{k} {_short(m[k])} differs from header.{k} {_short(want)}")
    if num_shards != -(-n // rows):
        _fail(
            f"header.num_shards {num_shards} does not fit {n} samples in shards of {rows} rows "
            f"({-(-n // rows)} shards)"
        )
    shape, zrows, ztype = _zarr_shape(cache_dir)
    if shape != [n, s, hs] or zrows != rows:
        _fail(
            f"the header ([{n}, {s}, {hs}] in shards of {rows} rows) does not match "
            f"{HIDDEN}/zarr.json ({_short(shape)} in shards of {_short(zrows)} rows)"
        )
    if ztype is not None and ztype != STORED_NP[dtype].name:
        _fail(f"header.dtype {dtype} is not stored as {HIDDEN}'s data type {_short(ztype)}")

    root = cache_dir.resolve() if isinstance(cache_dir, Path) else None
    lossy = is_lossy(dtype)
    arrays = {HIDDEN, SCALE} if lossy else {HIDDEN}
    shards = _typed(m, "shards", list)
    if len(shards) != num_shards:
        _fail(f"shards lists {len(shards)} shards, header.num_shards is {num_shards}")
    seen: set[str] = set()
    for i, sh in enumerate(shards):
        where = f"shards[{i}]"
        if not isinstance(sh, dict):
            _fail(f"{where} must be an object, found {_short(sh)}")
        for k, want in (("shard", i), ("start", i * rows), ("stop", min((i + 1) * rows, n))):
            got = _int(sh, k, f"{where}.", 0)
            if got != want:
                _fail(f"{where}.{k} is {got}, expected {want}")
        files = _typed(sh, "files", dict, f"{where}.")
        found = set()
        for rel, e in files.items():
            _rel_path(rel, cache_dir, root, where)
            array = rel.split("/", 1)[0]
            if array not in arrays or not rel.startswith(f"{array}/c/"):
                _fail(
                    f"{where}: {_short(rel)} is not a shard file of {' or '.join(sorted(arrays))}"
                )
            if rel in seen:
                _fail(f"{where}: {_short(rel)} is listed for two shards")
            seen.add(rel)
            found.add(array)
            _entry(e, f"{where}.files[{_short(rel)}]")
        if found != arrays:
            _fail(f"{where} lists no {' / '.join(sorted(arrays - found))} file")
    files = _typed(m, "files", dict)
    need = {SAMPLES, f"{HIDDEN}/zarr.json"} | ({f"{SCALE}/zarr.json"} if lossy else set())
    for rel, e in files.items():
        _rel_path(rel, cache_dir, root, "files")
        if rel not in need:
            _fail(f"files: {_short(rel)} is not one of {', '.join(sorted(need))}")
        _entry(e, f"files[{_short(rel)}]")
    if need - set(files):
        _fail(f"files lists no {', '.join(sorted(need - set(files)))}")

    ident = _typed(m, "identity", dict, required=False)  # extract caches (storage/identity.py)
    if ident is not None:
        if (bad := check_record(ident, "identity")) is not None:
            _fail(bad)
        header = {"dtype": dtype, "codec": h.get("codec"), "seq_len": s, "hidden_size": hs,
                  "format_version": v}  # fmt: skip
        for k, want in header.items():
            if k in ident and ident[k] != want:
                _fail(f"identity.{k} {_short(ident[k])} differs from header.{k} {_short(want)}")

    # informational fields: checked only when present
    _typed(m, "created", str, required=False)
    _typed(m, "codec", dict, required=False)
    for k in ("total_bytes", "value_bytes"):
        if k in m:
            _int(m, k, "", 0, MAX_BYTES * MAX_COUNT)
    for k in ("bytes_per_value", "compression_ratio", "ratio_vs_bf16"):
        _number(m, k)
    sampling = _typed(m, "stats_sampling", (dict, type(None)), required=False)  # newer caches
    if sampling:
        _typed(sampling, "rule", str, "stats_sampling.")
        for k in ("values_summed", "values", "shards_sampled"):
            _int(sampling, k, "stats_sampling.", 0, MAX_BYTES * MAX_COUNT)
    for k, optional in (("stats", False), ("error", True)):
        d = _typed(m, k, (dict, type(None)) if optional else dict, required=False)
        for name, val in (d or {}).items():
            if not _is_int(val) and not isinstance(val, float):  # inf/nan: real, if odd, values
                _fail(f"{k}.{name} must be a number, found {_short(val)}")


def validate_manifest(manifest: Any, cache_dir: Any) -> None:
    """Raise CacheCorrupt (CacheError for another format version) unless `manifest` is a
    well-formed manifest of the cache in `cache_dir` whose files all lie inside it.

    cache_dir: a Path, a storage.fs RemotePath (an object-store cache) or a string of either."""
    if isinstance(cache_dir, str):
        cache_dir = fs.path(cache_dir)  # a Path, or a RemotePath for an s3:// cache
    try:
        _check(manifest, cache_dir)
    except _Bad as e:
        raise CacheCorrupt(
            f"{MANIFEST} of cache {cache_dir} is damaged or hand-edited: {e}; rebuild the cache "
            f"(delete {cache_dir / MANIFEST} and rerun the cache build: shards that still match "
            "their done markers are kept and a new manifest is written)"
        ) from None
