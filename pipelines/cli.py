"""`preinfer` command line: parse, build, run. Each subcommand's work lives in pipelines/ or storage/.

preinfer tokenize --config configs/demo.yaml --set data.seq_len=64
preinfer cache build --block 2 --config configs/demo.yaml
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path

from core.config import ConfigError
from pipelines.bcd import run_bcd
from pipelines.cache_build import build_cache, refresh_cache
from pipelines.demo import run_demo
from pipelines.eval import run_eval
from pipelines.export import run_export
from pipelines.extract import RECORD as EXTRACT_RECORD
from pipelines.extract import ExtractConfig, run_extract
from pipelines.init import run_init
from pipelines.report import run_report
from pipelines.tokenize import run_tokenize
from pipelines.train import run_train_by_hand
from preinfer.checkpoint.format import CheckpointError
from preinfer.run.config import Config, case_note, load_config
from preinfer.run.lock import check_writable, run_lock
from preinfer.run.plan_report import add_plan_arguments, run_plan
from storage import cache_tools, fs
from storage.layout import FP_RE, CacheError, check_fingerprint
from storage.tokens import TokenStoreError

MODES = ("bcd", "full", "bcd-recompute")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="YAML config (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.lr=0.01",
    )


def _block(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block", "-k", type=int, required=True, help="block index K (0-based)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="preinfer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("tokenize", help="corpus -> tokenizer -> packed train/val token store")
    _common(p)
    p.add_argument("--force", action="store_true", help="replace a store built from other inputs")

    p = sub.add_parser(
        "init", help="model (random init or local checkpoint) -> per-block checkpoint"
    )
    _common(p)
    p.add_argument("--force", action="store_true", help="replace a different existing checkpoint")

    p = sub.add_parser("eval", help="val loss and perplexity of the checkpoint")
    _common(p)
    p.add_argument("--batches", type=int, default=0,
                   help="N x train.batch_size val rows spread over the split, by train.seed, "
                   "with the standard error (0 = the whole split)")  # fmt: skip

    p = sub.add_parser(
        "export", help="the checkpoint + tokenizer as a Hugging Face transformers directory"
    )
    _common(p)
    p.add_argument(
        "--out", required=True, help="directory to write (created; empty; outside the run's dirs)"
    )
    p.add_argument("--force", action="store_true", help="replace a previous export at --out")

    p = sub.add_parser(
        "demo", help="the whole pipeline on the built-in corpus, printing what it did"
    )
    _common(p)

    p = sub.add_parser("plan", help="memory, disk and cost estimate before anything runs")
    _common(p)

    add_plan_arguments(p)

    p = sub.add_parser("report", help="plots + markdown summary of a run -> <run.dir>/report/")
    _common(p)

    p = sub.add_parser("config", help="print the resolved config (with field docs)")
    _common(p)

    p = sub.add_parser("train", help="one visit of block K (Ray Train workers or in-process)")
    _common(p)
    _block(p)
    p.add_argument("--round", type=int, default=0, help="rotation round (data order, sampling)")
    p.add_argument("--mode", choices=MODES, default=None, help="default: train.mode")

    p = sub.add_parser("bcd", help="the rotation: rounds x blocks, caches reused/refreshed/built")
    _common(p)
    p.add_argument("--mode", choices=MODES, default=None, help="default: train.mode")

    cache = sub.add_parser("cache", help="build, refresh and manage activation caches")
    csub = cache.add_subparsers(dest="cache_cmd", required=True, metavar="CACHE_COMMAND")
    for name, text in (
        ("build", "hidden states entering block K, from tokens (Ray job)"),
        ("refresh", "boundary K from a current boundary K-1 cache through block K-1"),
    ):
        p = csub.add_parser(name, help=text)
        _common(p)
        _block(p)
        p.add_argument(
            "--round", type=int, default=0, help="rotation round (decides sampled subsets)"
        )
        if name == "build":
            p.add_argument(
                "--verify",
                action="store_true",
                help="check a complete cache's shards and rewrite any that fail",
            )
    p = csub.add_parser(
        "extract", help="hidden states at chosen layers over a token store, one cache per layer"
    )
    _common(p)
    p.add_argument("--layers", required=True, help="layer ids, e.g. 6,12 (docs/cache_format.md)")
    p.add_argument("--split", choices=("train", "val"), default="train", help="token-store split")
    p.add_argument("--max-rows", type=int, default=None, help="at most N rows (the first ones)")
    p = csub.add_parser("ls", help="list caches under a root")
    _common(p)
    p.add_argument("root", nargs="?", default=None, help="cache root (default: the config's)")
    for name, text in (
        ("inspect", "show one cache's manifest"),
        ("verify", "recompute checksums; non-zero exit on any bad shard"),
    ):
        p = csub.add_parser(name, help=text)
        _common(p)
        p.add_argument("fingerprint")
        p.add_argument("--root", default=None, help="cache root (default: the config's)")
    p = csub.add_parser("gc", help="remove incomplete caches and caches no run refers to")
    _common(p)
    p.add_argument("--root", default=None, help="cache root (default: the config's)")
    p.add_argument("--run", action="append", default=[], help="run dir whose caches are kept")
    p.add_argument("--dry-run", action="store_true")
    return ap


# the directories each command writes in (config keys), checked before it runs (tokenize
# checks its own: a store that is current is not written)
WRITES = {
    "init": ("run.dir", "run.checkpoint"),
    "train": ("run.dir", "run.checkpoint"),
    "bcd": ("run.dir", "run.checkpoint", "cache.root"),
    "demo": ("run.dir", "data.out_dir", "run.checkpoint", "cache.root"),
    "eval": ("run.dir",),  # metrics.jsonl
    "report": ("run.dir",),
    "cache build": ("cache.root",),
    "cache refresh": ("cache.root",),
    "cache extract": ("run.dir", "cache.root"),  # extracts.json, the caches
}


def _load(args):
    cfg = load_config(args.config, args.overrides)
    cmd = " ".join(filter(None, (args.cmd, getattr(args, "cache_cmd", None))))
    _check_dirs(cfg, WRITES.get(cmd, ()))
    return cfg


def _check_dirs(cfg: Config, keys: tuple[str, ...]) -> None:
    """A file where a directory the command writes goes, or one it cannot write: one line
    naming the setting, before anything runs. run.dir is named first where the others are
    under it (they are unless set elsewhere)."""
    paths = {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in keys}
    run = Path(cfg.run.dir)
    if "run.dir" not in paths and any(run in Path(v).parents for v in paths.values()):
        paths = {"run.dir": cfg.run.dir, **paths}
    for key, path in paths.items():
        check_writable(path, key, replaced=key == "data.out_dir")


def _cmd_config(args) -> int:
    cfg = _load(args)
    print(cfg.to_json())
    if note := case_note(cfg):  # on stderr: stdout stays the JSON
        print(f"preinfer config: {note}", file=sys.stderr)
    return 0


def _cmd_tokenize(args) -> int:

    run_tokenize(_load(args), force=args.force)
    return 0


def _cmd_init(args) -> int:

    run_init(_load(args), force=args.force)
    return 0


def _cmd_eval(args) -> int:
    res = run_eval(_load(args), max_batches=args.batches)
    print(json.dumps(res))
    return 0


def _cmd_export(args) -> int:
    res = run_export(_load(args), args.out, force=args.force)
    print(json.dumps(res))
    return 0


def _cmd_demo(args) -> int:

    run_demo(_load(args))
    return 0


def _cmd_train(args) -> int:
    cfg = _load(args)
    with run_lock(cfg.run.dir, f"train --block {args.block}"):  # one run per run.dir
        res = run_train_by_hand(cfg, args.block, args.round, mode=args.mode)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}))
    return 0


def _cmd_bcd(args) -> int:

    run_bcd(_load(args), mode=args.mode)
    return 0


def _cmd_plan(args) -> int:

    return run_plan(_load(args), args)


def _cmd_report(args) -> int:

    run_report(_load(args))
    return 0


def _cmd_cache(args) -> int:
    return _cache(args, _load(args))


def _referenced(run_dirs: list[str], named: bool = True) -> set[str]:
    """Fingerprints that the runs' records say are in use: state.json's caches_in_use (bcd) and
    extracts.json's (`cache extract`). Refuses (ConfigError: gc then removes nothing) a run.dir
    that has neither (named: a --run, so a typo, not a run), a record that does not parse, or
    whose caches_in_use is not a list of fingerprints: its caches could not be kept. The
    config's run.dir (named=False) may have none (no caches in use)."""
    keep: set[str] = set()
    for d in run_dirs:
        records = [Path(d) / n for n in ("state.json", EXTRACT_RECORD) if (Path(d) / n).is_file()]
        if not records and named:
            raise ConfigError(
                f"cache gc --run {d}: {Path(d) / 'state.json'} does not exist, so {d} is not a "
                "run (a typo?) and the caches a run uses cannot be told from there; nothing was "
                "removed. Give the run.dir of each run that uses this cache root (where "
                "`preinfer bcd` wrote state.json or `cache extract` wrote extracts.json)"
            )
        for p in records:
            keep |= _in_use(p)
    return keep


def _in_use(p: Path) -> set[str]:
    """The caches_in_use of one run record (state.json or extracts.json)."""
    try:
        fps = json.loads(p.read_text()).get("caches_in_use", [])
    except (ValueError, AttributeError) as e:  # AttributeError: JSON, but not an object
        why = str(e) if isinstance(e, ValueError) else "not a JSON object"
        raise ConfigError(
            f"cache gc: {p} does not parse ({why}), so the caches that run uses cannot "
            "be told; nothing was removed. Restore that file (or leave that run out of "
            "--run if it is gone) and rerun"
        ) from None
    if not isinstance(fps, list) or not all(isinstance(f, str) and FP_RE.fullmatch(f) for f in fps):
        raise ConfigError(
            f"cache gc: {p}: caches_in_use is not a list of cache fingerprints "
            f"({json.dumps(fps)[:80]}), so the caches that run uses cannot be told; "
            "nothing was removed. Restore that file and rerun"
        )
    return set(fps)


def _cache(args, cfg: Config) -> int:
    """`preinfer cache ...`: build/refresh, and the storage tools (storage/cache_tools.py)."""
    cmd = args.cache_cmd
    if getattr(args, "fingerprint", None) is not None:
        check_fingerprint(args.fingerprint)
    if cmd in ("build", "refresh"):
        if cmd == "build":
            res = build_cache(cfg, args.block, args.round, verify=args.verify)
        else:
            res = refresh_cache(cfg, args.block, args.round)
        print(json.dumps(res))
        return 0
    if cmd == "extract":
        layers = ExtractConfig.parse_layers(args.layers)
        ec = ExtractConfig(layers=layers, split=args.split, max_rows=args.max_rows)
        print(json.dumps(run_extract(cfg, ec)))
        return 0
    root = getattr(args, "root", None) or cfg.cache.root
    if cmd == "ls":
        rows = cache_tools.list_caches(root)
        print(cache_tools.format_table(rows))
        for note in filter(None, map(cache_tools.damage_note, rows)):
            print(note)
        return 0
    if cmd == "inspect":
        print(json.dumps(cache_tools.inspect_cache(root, args.fingerprint), indent=2, default=str))
        return 0
    if cmd == "verify":
        bad = cache_tools.verify_cache(root, args.fingerprint)
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
        keep = _referenced(args.run or [cfg.run.dir], named=bool(args.run))
        removed = cache_tools.gc_caches(root, keep, dry_run=args.dry_run, log=print)
        verb = "would remove" if args.dry_run else "removed"
        for fp, reason, nbytes in removed:
            print(f"{verb} {fp} ({reason}, {nbytes / 2**20:.1f} MiB)")
        print(
            f"gc: {len(removed)} cache(s) {'would be removed' if args.dry_run else 'removed'}; kept {len(keep)} in use"
        )
        return 0
    raise AssertionError(cmd)


COMMANDS = {
    "config": _cmd_config,
    "tokenize": _cmd_tokenize,
    "init": _cmd_init,
    "eval": _cmd_eval,
    "export": _cmd_export,
    "demo": _cmd_demo,
    "cache": _cmd_cache,
    "train": _cmd_train,
    "bcd": _cmd_bcd,
    "report": _cmd_report,
    "plan": _cmd_plan,
}


# no space, a file-size limit, a quota: the same for the user
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input: printed as one clear line, exit code 2."""

    return (ConfigError, TokenStoreError, FileNotFoundError, CheckpointError, CacheError)


# no write access: permissions, an immutable attribute, a read-only mount
DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
WHERE = "run.dir (or data.out_dir, run.checkpoint, cache.root)"


def path_error(e: OSError) -> str | None:
    """The line for an OSError that a path the user chose causes (no write access to it, or
    a file where a directory goes); None for any other."""
    name = e.filename
    if name is None:
        return None
    if e.errno in DENIED:
        return (
            f"no access to {name} ({e.strerror}): its permissions, a read-only mount or an "
            f"immutable attribute keep this user from writing (or reading) it; make it "
            f"writable, or point {WHERE} at a directory you can write"
        )
    if e.errno not in (errno.ENOTDIR, errno.EEXIST):
        return None
    p = Path(name)
    # the file standing where a directory goes: the path itself, or a directory above it
    blocker = next((q for q in (p, *p.parents) if q.exists() and not q.is_dir()), None)
    if blocker is None:
        return None
    return (
        f"{blocker} is a file, not a directory, so {name} cannot be made; remove or rename that "
        f"file, or point {WHERE} elsewhere"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.cmd](args)
    except user_errors() as e:
        print(f"preinfer {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"preinfer {args.cmd}: interrupted; rerun the same command to resume", file=sys.stderr
        )
        return 130
    except Exception as e:  # noqa: BLE001 - an object store lost mid-command, else re-raised
        lost = fs.unreachable(e)  # botocore's errors (some OSErrors without an errno)
        if lost is not None:
            print(f"preinfer {args.cmd}: error: {lost}", file=sys.stderr)
            return 2
        if not isinstance(e, OSError):
            raise
        if e.errno not in DISK_FULL:
            line = path_error(e)
            if line is None:
                raise
            print(f"preinfer {args.cmd}: error: {line}", file=sys.stderr)
            return 2
        # every writer commits by rename: what was written before this file is intact
        print(
            f"preinfer {args.cmd}: error: the disk is full writing {e.filename or 'a file'} "
            f"({e.strerror}); free space there (or point run.dir / cache.root elsewhere) and "
            f"rerun the same command: what is already written is kept",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
