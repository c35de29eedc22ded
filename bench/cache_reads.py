"""Cache read benchmark: rows/s through the cache readers against a numpy memmap of the same bytes.

    python -m bench.cache_reads [--rows 2048] [--seq 128] [--hidden 256] [--repeats 3]
                                [--codec none] [--buffer-mb 64] [--warm] [--targets local s3]
                                [--out r.json]
    python -m bench.cache_reads --quick

One bf16 cache of seeded values (labels = the row's index, so every value read can be traced
to its row) and the same stored bytes as one plain file, on each target: the local disk (a
.npy read through a numpy memmap) and S3 (a moto server in its own process; the plain arm is
one object read by ranged GETs of exactly the rows each batch needs, `RangedRows`). Three kinds
of read, each through the cache and through the plain file, alternating, `--repeats` times:

- sequential: `CacheDataset(shuffle=False)` over one epoch / memmap slices batch by batch;
- shuffled: `CacheDataset(shuffle=True, seed, buffer_mb)` / the same plan on the memmap (the
  row ranges `CacheDataset.plan()` lists, into a buffer of as many rows, permuted with the
  same generator), so both yield the same rows in the same batches;
- block-sampled: `--blocks` random blocks of `--block-rows` consecutive rows (seeded) through
  `Cache.read_rows` / memmap slices; `block` with the per-read checksum (a whole shard is read
  to check it), `block_unchecked` with check_reads=False (codec none: just the rows' bytes).

Every arm decodes to float32 tensors (B, S, H) with labels (B, S), as a trainer gets them.
Unless --warm, each local repeat first drops the files from the page cache (posix_fadvise
DONTNEED on the cache's files and the .npy), so reads come from the disk; every S3 read is a
GET to the server (moto holds the objects in memory: no disk below it). Before timing,
each kind is checked once: every batch equals the written rows it names. The shuffle is
recorded: the seed, and a hash of the order of the sample ids one epoch yields (the same in
two passes, so a reader can reproduce it). Notes: docs/cache_io.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import headline_table, load_average, publish
from bench.writer import moto_root
from storage import fs
from storage.cache import CacheWriter
from storage.config import CacheConfig
from storage.dataset import CacheDataset
from storage.reader import open_cache

KINDS = ("sequential", "shuffled", "block", "block_unchecked")
TARGETS = ("local", "s3")
FP = "feed" * 4


def make_values(n: int, s: int, h: int, seed: int) -> torch.Tensor:
    """(N, S, H) bf16 seeded values."""
    return torch.randn(n, s, h, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def write_cache(root, x: torch.Tensor, codec: str, shard_mb: float) -> None:
    """x as a complete cache FP under root (a local directory or an s3:// prefix)."""
    n, s, h = x.shape
    ids = np.repeat(np.arange(n, dtype=np.int64)[:, None], s, 1)  # labels = the row
    cfg = CacheConfig(dtype="bf16", codec=codec, shuffle="none", shard_mb=shard_mb)
    w = CacheWriter.create(root, FP, samples=(np.arange(n), ids, ids), seq_len=s,
                           hidden_size=h, cache_cfg=cfg, meta={"bench": "cache_reads"})  # fmt: skip
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    w.finalize()


def stored_u16(x: torch.Tensor) -> np.ndarray:
    """The stored bytes of bf16 values, as uint16 (N, S, H)."""
    return x.view(torch.int16).numpy().view(np.uint16)


class RangedRows:
    """The plain S3 arm: rows of one object of (N, S, H) uint16 values, each slice one ranged
    read of exactly its rows' bytes (what a reader with no format of its own does).
    read(start, stop): the object's bytes [start, stop), e.g. s3fs's cat_file."""

    def __init__(self, read, shape: tuple[int, ...]):
        self.read, self.shape, self.dtype = read, shape, np.dtype(np.uint16)
        self.row_bytes = int(np.prod(shape[1:])) * 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        a, b, _ = rows.indices(self.shape[0])
        data = self.read(a * self.row_bytes, b * self.row_bytes) if b > a else b""
        return np.frombuffer(data, np.uint16).reshape(max(b - a, 0), *self.shape[1:])


def s3_rows(url: str, shape: tuple[int, ...]) -> RangedRows:
    """RangedRows of an S3 object, each slice one ranged GET."""
    s3 = fs.filesystem("s3")
    return RangedRows(lambda a, b: s3.cat_file(url, start=a, end=b), shape)


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (reads then come from the disk)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _decode(u16: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(u16.view(np.int16)).view(torch.bfloat16).float()


def plain_batches(mm, labels: np.ndarray, kind: str, ds: CacheDataset, blocks: list):
    """The plain arm of each kind (mm: a memmap or RangedRows, sliced by rows): the same rows,
    in the same batches, as the cache arm."""
    b = ds.batch_size
    if kind == "sequential":
        for a in range(0, len(mm), b):
            yield _decode(np.array(mm[a : a + b])), torch.from_numpy(labels[a : a + b])
    elif kind.startswith("block"):
        for a, z in blocks:
            yield _decode(np.array(mm[a:z])), torch.from_numpy(labels[a:z])
    else:  # CacheDataset's plan and buffer, on the memmap
        seed = np.random.SeedSequence([ds.seed, ds.epoch, ds.rank, 0]).generate_state(1)
        rng = torch.Generator().manual_seed(int(seed[0]))
        plan = ds.plan()
        cap = min(ds.buffer_size, sum(z - a for a, z in plan))
        buf = np.empty((cap, *mm.shape[1:]), mm.dtype)
        lab = np.empty((cap, mm.shape[1]), labels.dtype)
        held = 0
        for a, z in plan:
            while a < z:
                e = min(z, a + cap - held)
                buf[held : held + e - a], lab[held : held + e - a] = mm[a:e], labels[a:e]
                held, a = held + e - a, e
                if held == cap:
                    held = yield from _flush(buf, lab, held, rng, b, final=False)
        if held:
            yield from _flush(buf, lab, held, rng, b, final=True)


def _flush(buf, lab, held, rng, b, *, final):
    order = torch.randperm(held, generator=rng)
    full = held if final else held // b * b
    for s in range(0, full, b):
        ix = order[s : s + b].numpy()
        yield _decode(buf[ix]), torch.from_numpy(lab[ix])
    rest = order[full:held].numpy()
    buf[: len(rest)], lab[: len(rest)] = buf[rest], lab[rest]
    return len(rest)


def cache_batches(cache, kind: str, ds: CacheDataset, blocks: list):
    if kind.startswith("block"):
        for a, z in blocks:
            yield cache.read_rows(a, z)[:2]
    else:
        yield from ds


def datasets(cache, args) -> dict[str, CacheDataset]:
    kw = {"batch_size": args.batch_size, "seed": args.seed, "buffer_mb": args.buffer_mb}
    return {"sequential": CacheDataset(cache, shuffle=False, **kw),
            "shuffled": CacheDataset(cache, shuffle=True, **kw)}  # fmt: skip


def check(kind: str, batches, x: torch.Tensor) -> tuple[int, str]:
    """(rows, sha256 of the sample-id order) of one pass; AssertionError on a wrong value."""
    rows, h = 0, hashlib.sha256()
    for hidden, labels in batches:
        rid = labels[:, 0].long()
        assert torch.equal(hidden, x[rid].float()), f"{kind}: values differ from the rows written"
        h.update(rid.numpy().astype(np.int64).tobytes())
        rows += len(rid)
    return rows, h.hexdigest()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--codec", choices=("none", "zstd", "blosc-zstd"), default="none")
    ap.add_argument("--shard-mb", type=float, default=16.0)
    ap.add_argument("--buffer-mb", type=float, default=64.0, help="CacheDataset shuffle buffer")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-rows", type=int, default=64, help="rows of a sampled block")
    ap.add_argument("--blocks", type=int, default=24, help="blocks sampled a pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="values, shuffle and block seed")
    ap.add_argument("--warm", action="store_true", help="keep the page cache (no DONTNEED)")
    ap.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS),
                    help="where the cache and the plain file lie (s3: a moto server)")  # fmt: skip
    ap.add_argument("--work", type=Path, default=None, help="directory for the data (temp)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="256 x 32 x 64 values, 1 repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.seq, args.hidden, args.repeats, args.shard_mb = 256, 32, 64, 1, 0.25
        args.buffer_mb, args.block_rows, args.blocks = 0.5, 16, 8
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = Path(tempfile.mkdtemp(prefix="cache_reads-", dir=args.work))
    try:
        x = make_values(args.rows, args.seq, args.hidden, args.seed)
        res = {"bench": "cache_reads",
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "row_mib": args.seq * args.hidden * 2 / 2**20, "targets": {}}  # fmt: skip
        for target in args.targets:
            with target_files(target, work, x, args) as (root, plain, files, about):
                res["targets"][target] = {**about, **_run(args, x, root, plain, files)}
        res["results"] = [{"target": t, **r} for t, v in res["targets"].items()
                          for r in v.pop("results")]  # fmt: skip
        res["load_average"], res["cpus"] = load_average(), os.cpu_count()
        text = headline_table(
            [("target", "read", "rows", "cache rows/s", "plain rows/s", "cache / plain")]
            + [(r["target"], r["kind"], r["rows"], f"{r['cache_rows_s']:,.0f}",
                f"{r['plain_rows_s']:,.0f}", f"{r['ratio']:.2f}") for r in res["results"]]
        )  # fmt: skip
        publish(res, text, args.out, "cache_reads")
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def target_files(target: str, work: Path, x: torch.Tensor, args):
    """(cache root, a function giving a fresh plain arm, local files to drop from the page
    cache, what the target's record says of its plain arm and page cache) of one target,
    written there and removed after."""
    if target == "local":
        write_cache(work / "cache", x, args.codec, args.shard_mb)
        npy = work / "plain.npy"
        np.save(npy, stored_u16(x))  # the same stored bytes
        files = [p for p in (work / "cache" / FP).rglob("*") if p.is_file()] + [npy]
        about = {"plain": "numpy memmap of one .npy",
                 "page_cache": "warm" if args.warm else "dropped before each pass (posix_fadvise)"}  # fmt: skip
        # mapped afresh each pass: pages a live mapping holds are not dropped
        yield work / "cache", lambda: np.load(npy, mmap_mode="r"), [] if args.warm else files, about
        return
    with moto_root() as root:  # the server's objects go with it
        write_cache(root, x, args.codec, args.shard_mb)
        fs.put(f"{root}/plain.bin", stored_u16(x).tobytes())
        about = {"plain": "ranged GETs of one object", "page_cache": "none: every read a GET"}
        yield root, lambda: s3_rows(f"{root}/plain.bin", tuple(x.shape)), [], about


def _run(args, x: torch.Tensor, root, plain, files: list[Path]) -> dict:
    """One target's record: every kind checked, then timed through the cache and the plain arm."""
    cache = open_cache(root, FP)
    fast = open_cache(root, FP, check_reads=False)  # block_unchecked
    labels = np.repeat(np.arange(args.rows, dtype=np.int64)[:, None], args.seq, 1)
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, args.rows - args.block_rows + 1, size=args.blocks)
    blocks = [(int(a), int(a) + args.block_rows) for a in starts]
    ds = datasets(cache, args)

    record = {}
    for kind in KINDS:  # correctness first (untimed): both arms, the values written
        d = ds.get(kind, ds["sequential"])
        c = fast if kind == "block_unchecked" else cache
        got = [check(kind, cache_batches(c, kind, d, blocks), x),
               check(kind, plain_batches(plain(), labels, kind, d, blocks), x),
               check(kind, cache_batches(c, kind, d, blocks), x)]  # fmt: skip
        assert got[0] == got[2], f"{kind}: two passes read other orders"
        assert got[0] == got[1], f"{kind}: the plain arm reads other rows"
        record[kind] = {"rows": got[0][0], "order_sha256": got[0][1]}

    times = {k: {"cache": [], "plain": []} for k in KINDS}
    for r in range(args.repeats):
        for kind in KINDS:
            d = ds.get(kind, ds["sequential"])
            for name in ("cache", "plain") if r % 2 == 0 else ("plain", "cache"):
                if files:
                    drop_page_cache(files)
                t0 = time.perf_counter()
                if name == "cache":
                    c = fast if kind == "block_unchecked" else cache
                    batches = cache_batches(c, kind, d, blocks)
                else:
                    batches = plain_batches(plain(), labels, kind, d, blocks)
                for _hidden, _labels in batches:
                    pass
                del batches
                times[kind][name].append(time.perf_counter() - t0)
    rows = []
    for kind in KINDS:
        n = record[kind]["rows"]
        cs, ps = (n / statistics.median(times[kind][a]) for a in ("cache", "plain"))
        rows.append({"kind": kind, "rows": n, "cache_rows_s": cs, "plain_rows_s": ps,
                     "ratio": cs / ps, "seconds": times[kind]})  # fmt: skip
    cache.close()
    fast.close()
    return {
        "shuffle": {
            "seed": args.seed,
            "epoch": 0,
            "buffer_rows": ds["shuffled"].buffer_size,
            "order_sha256": record["shuffled"]["order_sha256"],
        },  # fmt: skip
        "checked": record,
        "results": rows,
    }


if __name__ == "__main__":
    main()
