"""`preinfer cache ...` subcommands: build/refresh (Ray jobs) and the storage tools."""

from __future__ import annotations

import json
import re
from pathlib import Path

from core.config import ConfigError
from preinfer.config import Config

FP_RE = re.compile(r"[0-9a-f]{8,64}")


def _referenced(run_dirs: list[str]) -> set[str]:
    """Fingerprints that the runs' state files say are in use."""
    keep: set[str] = set()
    for d in run_dirs:
        p = Path(d) / "state.json"
        if p.is_file():
            keep |= set(json.loads(p.read_text()).get("caches_in_use", []))
    return keep


def check_fingerprint(fp: str) -> str:
    """A cache name is a hex fingerprint: nothing that could walk out of the cache root."""
    if not FP_RE.fullmatch(fp):
        raise ConfigError(
            f"{fp!r} is not a cache fingerprint (8-64 lowercase hex characters); "
            "`preinfer cache ls` lists them"
        )
    return fp


def main(args, cfg: Config) -> int:
    from storage import tools

    cmd = args.cache_cmd
    if getattr(args, "fingerprint", None) is not None:
        check_fingerprint(args.fingerprint)
    if cmd in ("build", "refresh"):
        from pipelines.cache_build import build_cache, refresh_cache

        if cmd == "build":
            res = build_cache(cfg, args.block, args.round, verify=args.verify)
        else:
            res = refresh_cache(cfg, args.block, args.round)
        print(json.dumps(res))
        return 0
    root = getattr(args, "root", None) or cfg.cache.root
    if cmd == "ls":
        print(tools.format_table(tools.list_caches(root)))
        return 0
    if cmd == "inspect":
        print(json.dumps(tools.inspect_cache(root, args.fingerprint), indent=2, default=str))
        return 0
    if cmd == "verify":
        bad = tools.verify_cache(root, args.fingerprint)
        for shard, reason in bad:
            print(f"shard {shard}: {reason}")
        if bad:
            print(
                f"verify: {args.fingerprint}: {len(bad)} bad shard(s); repair with "
                "`preinfer cache build --block K --verify` (rewrites only the bad shards)"
            )
            return 1
        print(f"verify: {args.fingerprint}: ok")
        return 0
    if cmd == "gc":
        keep = _referenced(args.run or [cfg.run.dir])
        removed = tools.gc_caches(root, keep, dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for fp, reason, nbytes in removed:
            print(f"{verb} {fp} ({reason}, {nbytes / 2**20:.1f} MiB)")
        print(
            f"gc: {len(removed)} cache(s) {'would be removed' if args.dry_run else 'removed'}; kept {len(keep)} in use"
        )
        return 0
    raise AssertionError(cmd)
