"""Cache management for `preinfer cache ls/inspect/verify/gc`: plain functions returning data.

A directory under the root counts as a cache when it holds hidden.zarr/, done/ or
manifest.json; anything else under the root is never touched. The root may be an
object-store URL (s3://bucket/prefix): caches are then key prefixes under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from storage import atomic, fs, lease
from storage.atomic import dir_bytes
from storage.layout import (
    BUILD,
    DONE,
    HIDDEN,
    MANIFEST,
    CacheError,
    CacheIncomplete,
    committed_shards,
    read_json,
)
from storage.manifest import validate_manifest
from storage.reader import open_cache

# An incomplete cache touched more recently than this may still be being built: gc keeps it.
GC_GRACE_S = 3600.0


def _cache_dirs(root: str | Path) -> list[Path]:
    fs.check(root, "cache root")
    r = fs.path(root)
    if not r.is_dir():
        raise CacheError(f"cache root {r} does not exist (nothing built there yet?)")
    return sorted(
        d
        for d in r.iterdir()
        if d.is_dir() and any((d / x).exists() for x in (HIDDEN, DONE, MANIFEST))
    )


def _meta_fields(meta: dict) -> dict:
    """boundary / layer / model / tokens / split from a cache's meta dict, whatever its nesting."""
    model = meta.get("model")
    if isinstance(model, dict):
        model = model.get("name") or model.get("model_type") or model.get("arch")
    tokens = meta.get("tokens", meta.get("token_fingerprint"))
    return {
        "boundary": meta.get("boundary"),
        "layer": meta.get("layer"),  # an extracted layer cache (pipelines/extract.py)
        "model": model,
        "tokens": tokens[:12] if isinstance(tokens, str) else tokens,
        "split": meta.get("split"),
    }


def _damaged(d: Path, m: dict) -> list[str]:
    """Files a (valid) manifest lists that are missing or not of the size it records: a stat
    each, no checksum (`cache verify` reads them). An object-store cache is not checked (a
    request per file)."""
    if fs.is_url(d):
        return []
    entries = [f for sh in m["shards"] for f in sh["files"].items()] + list(m["files"].items())
    bad = []
    for rel, want in entries:
        try:
            size = (d / rel).stat().st_size
        except OSError:
            size = None
        if size != want["bytes"]:
            bad.append(rel)
    return bad


def _summary(d: Path) -> dict:
    row = {"fingerprint": d.name, "complete": (d / MANIFEST).exists(), "size_bytes": dir_bytes(d)}
    damaged: list[str] = []
    try:
        if row["complete"]:
            m = read_json(d / MANIFEST, "manifest")
            validate_manifest(m, d)  # damaged: listed without its fields
            header, meta = m["header"], m.get("meta") or {}
            row.update(compression_ratio=m.get("compression_ratio"), created=m.get("created"))
            damaged = _damaged(d, m)
        else:
            b = read_json(d / BUILD, "build file")
            header, meta = b["header"], b.get("meta") or {}
            row.update(compression_ratio=None, created=None)
    except (FileNotFoundError, CacheError, KeyError):
        header, meta = {}, {}
        row.update(compression_ratio=None, created=None)
    done = committed_shards(d)
    row.update(
        _meta_fields(meta),
        N=header.get("num_samples"),
        dtype=header.get("dtype"),
        done_shards=done,
        total_shards=header.get("num_shards"),
        damaged=damaged,
    )
    if damaged:  # a manifest whose files are not all there is no complete cache
        row["complete"] = False
    return row


def damage_note(row: dict) -> str | None:
    """What `cache ls` says under its table of a cache whose files are not all there."""
    bad = row.get("damaged")
    if not bad:
        return None
    k = row.get("boundary") if row.get("boundary") is not None else "K"
    shown = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
    return (
        f"{row['fingerprint']}: damaged: {len(bad)} file(s) its manifest lists are missing or "
        f"of the wrong size ({shown}); `preinfer cache verify {row['fingerprint']}` checks every "
        f"shard, `preinfer cache build --block {k} --verify` rewrites the bad ones"
    )


def list_caches(root: str | Path) -> list[dict]:
    """One row per cache: fingerprint, boundary, layer, model, tokens, split, N, dtype, size_bytes,
    compression_ratio, complete, done_shards / total_shards, created, damaged (the files its
    manifest lists that are missing or of the wrong size: then complete is False)."""
    return [_summary(d) for d in _cache_dirs(root)]


def inspect_cache(root: str | Path, fingerprint: str) -> dict:
    """Manifest summary of one cache (without the per-shard list); incomplete: what is known."""
    d = fs.path(root) / fingerprint
    if not (d / MANIFEST).exists():
        if not d.is_dir():
            raise CacheIncomplete(f"no cache {fingerprint} under {root}")
        return {**_summary(d), "status": "incomplete (no manifest)"}
    m = read_json(d / MANIFEST, "manifest")
    validate_manifest(m, d)
    out = {k: v for k, v in m.items() if k not in ("shards", "files")}
    out.update(status="complete", num_shards=len(m["shards"]), size_on_disk=dir_bytes(d))
    return out


def verify_cache(root: str | Path, fingerprint: str) -> list[tuple[int, str]]:
    """Recompute all checksums: [(shard, reason)] of bad shards (-1: samples/metadata)."""
    return open_cache(root, fingerprint).verify()


def gc_caches(
    root: str | Path,
    keep: set[str],
    dry_run: bool = True,
    *,
    grace_s: float = GC_GRACE_S,
    log: Callable[[str], None] | None = None,
) -> list[tuple[str, str, int]]:
    """Remove incomplete caches and complete ones not in `keep`; [(fp, reason, bytes)].

    Never removes a fingerprint in `keep`, nor a cache with a live lease (a process reading
    it: storage/lease.py; `log` is told which). An incomplete cache modified within `grace_s`
    seconds is left alone (a build may be writing it). Stale `*.partial` temp files and stale
    leases (expired, or of a dead process on this host) are removed everywhere, kept caches
    included. dry_run=True only reports.
    """
    out = []
    now = time.time()
    say = log or (lambda _msg: None)
    for d in _cache_dirs(root):
        fp = d.name
        complete = (d / MANIFEST).exists()
        live, stale = lease.holders(d)
        readers = [r for r in live if r.get("kind") == lease.READ]
        if readers and fp not in keep:
            say(f"kept {fp}: in use ({lease.describe(readers)})")
        if fp in keep or readers or (not complete and now - _newest_mtime(d) < grace_s):
            parts = atomic.clean_partials(d, dry_run=dry_run)
            if parts:
                out.append((fp, f"{len(parts)} stale .partial file(s)", sum(b for _, b in parts)))
            if stale:
                n = lease.reclaim(stale, dry_run=dry_run)
                out.append((fp, f"{n} stale lease(s): {stale[0][1]}", 0))
            continue
        reason = "not in keep set" if complete else "incomplete (no manifest)"
        if stale:
            reason += f"; {len(stale)} stale lease(s) reclaimed: {stale[0][1]}"
        size = dir_bytes(d)
        if not dry_run:
            # a reader may have come since: the remover's claim settles it (lease.py)
            readers = lease.remove_unless_used(root, fp)
            if readers:
                say(f"kept {fp}: in use ({lease.describe(readers)})")
                continue
        out.append((fp, reason, size))
    return out


def _newest_mtime(d: Path) -> float:
    if fs.is_url(d):
        return fs.newest_mtime(d, default=time.time())  # no objects yet: as if just touched
    return max((p.stat().st_mtime for p in d.rglob("*")), default=d.stat().st_mtime)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return f"{len(v)} files" if v else "-"
    return str(v)


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows as an aligned plain-text table (size_bytes shown in MiB)."""
    if not rows:
        return "(no caches)"
    cols = columns or list(rows[0])
    cells = [
        [
            _fmt(r.get(c) / 2**20 if c == "size_bytes" and r.get(c) is not None else r.get(c))
            for c in cols
        ]
        for r in rows
    ]
    heads = [("size_MiB" if c == "size_bytes" else c) for c in cols]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(r) for r in cells])
