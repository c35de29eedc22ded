"""Activation cache I/O benchmark: throughput vs plain files, bytes/value per codec, lossy error.

    python -m bench.cache_io [--hidden a.npy [b.npy ...] | --synthetic]
                             [--n 512 --seq 128 --hidden-size 384] [--shard-mb 16 4]
                             [--repeats 5] [--skip-io] [--skip-codecs] [--out results.json]

I/O (bf16, codec none, random values): the cache (CacheWriter.write_shard for every shard +
finalize: stats, checksums, markers, renames, manifest; create timed apart) against plain
files of the same bytes, one a shard, with the same fsync; reads: open_cache + read_rows(0, N)
against np.fromfile + concatenate. Both sides every repeat, in alternating order; ratios of
the medians of --repeats (>= 5) and of the best times, and of CPU seconds (all threads: the
extra work, which other jobs on a shared machine disturb far less than wall time). With fsync
(what a build does) and without (os.fsync a no-op for both sides: page-cache speed).

Codecs: real hidden states (bench/hidden_states.py's MiniLM and random-init GPT-2 states, kept
under /tmp/preinfer_hidden) through each dtype x codec: bytes per value, ratio vs raw bf16,
write/read speed, and the error of lossy (and rounding) formats vs the float32 states.
--synthetic uses a smooth stand-in, and every table says so. Notes: docs/cache_io.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import headline_table, quiet, write_results
from bench.writer import new_cache
from storage.config import CacheConfig
from storage.reader import open_cache

DEFAULT = ("bf16", "blosc-zstd", "byte", 3)  # storage/config.py's default
GRID = [  # (dtype, codec, shuffle, level)
    *[("bf16", c, "none", 3) for c in ("none", "zstd", "blosc-zstd")],
    *[("bf16", "blosc-zstd", "byte", lv) for lv in (1, 3, 5, 7, 9)],
    *[("bf16", "blosc-zstd", "bit", lv) for lv in (1, 2, 3, 5, 9)],
    ("fp16", "blosc-zstd", "byte", 3), ("fp16", "blosc-zstd", "bit", 3),
    ("fp32", "blosc-zstd", "byte", 3), ("int8", "none", "none", 3),
    ("int8", "blosc-zstd", "bit", 3), ("fp8_e4m3", "none", "none", 3),
    ("fp8_e4m3", "blosc-zstd", "bit", 3),
]  # fmt: skip
LOGICAL = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def synthetic_hidden(n: int, s: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth stand-in for LM hidden states [n, s, h] float32 (NOT real activations)."""
    g = np.random.default_rng(seed)
    rank = 16
    z = g.standard_normal((n, s, rank)).astype(np.float32)
    for t in range(1, s):  # AR(1) along the sequence: neighbouring tokens are similar
        z[:, t] = 0.9 * z[:, t - 1] + 0.44 * z[:, t]
    x = z @ g.standard_normal((rank, h)).astype(np.float32) / 4
    x += 0.3 * g.standard_normal((n, s, h)).astype(np.float32)
    x *= np.exp(0.5 * g.standard_normal(h)).astype(np.float32)  # per-channel scale
    x[:, :, g.choice(h, 2, replace=False)] *= 20  # outlier channels, as in real LMs
    return x


def _entropy(symbols: np.ndarray, n: int) -> float:
    """Order-0 entropy of the symbols (of n values), bytes per symbol."""
    p = np.bincount(symbols, minlength=n) / len(symbols)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum()) / 8


def byte_entropy(x_bf16: torch.Tensor) -> float:
    """Order-0 entropy of the bf16 bytes (high and low byte separately), bytes per value."""
    b = x_bf16.view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
    return _entropy(b[:, 0], 256) + _entropy(b[:, 1], 256)


def value_entropy(x_bf16: torch.Tensor) -> float:
    """Order-0 entropy of the 16-bit bf16 values themselves, bytes per value."""
    return _entropy(x_bf16.view(torch.int16).numpy().view(np.uint16).reshape(-1), 65536)


def _create(root, x, dtype, codec, shuffle, level, shard_mb):
    cfg = CacheConfig(dtype=dtype, codec=codec, shuffle=shuffle, level=level, shard_mb=shard_mb)
    return new_cache(root, "fp", *x.shape, cfg)


def _fill(w, x):
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    return w.finalize()


@contextlib.contextmanager
def _no_fsync(active: bool):
    """os.fsync as a no-op (for the cache and the plain files alike) while active."""
    real = os.fsync
    if active:
        os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = real


def _plain_write(d: Path, arrays: list[np.ndarray]) -> None:
    d.mkdir(parents=True)
    for i, a in enumerate(arrays):
        with open(d / f"{i:05d}.bin", "wb") as f:
            f.write(memoryview(a).cast("B"))
            f.flush()
            os.fsync(f.fileno())


def _plain_read(d: Path, n_files: int, shape) -> np.ndarray:
    parts = [np.fromfile(d / f"{i:05d}.bin", dtype=np.uint16) for i in range(n_files)]
    return np.concatenate(parts).reshape(shape)


def io_bench(n, seq, hidden, shard_mb, repeats, fsync, tmp: Path) -> dict:
    """Cache vs plain files, bf16 codec none, medians of `repeats` interleaved runs."""
    g = torch.Generator().manual_seed(0)
    xb = (torch.randn(n, seq, hidden, generator=g) * 3).to(torch.bfloat16)
    bits = xb.view(torch.int16).numpy().view(np.uint16)
    keys = ("create", "cache_write", "plain_write", "cache_read", "cache_read_values",
            "cache_read_nocheck", "plain_read")  # fmt: skip
    t: dict[str, list[float]] = {k: [] for k in keys}  # wall seconds
    cpu: dict[str, list[float]] = {k: [] for k in keys}  # CPU seconds of the same calls

    def measure(key, f):
        c0, t0 = time.process_time(), time.perf_counter()
        out = f()
        t[key].append(time.perf_counter() - t0)
        cpu[key].append(time.process_time() - c0)
        return out

    def one_round(r: int) -> int:
        d = tmp / f"io{r}"
        w = measure("create", lambda: _create(d / "cache", xb, "bf16", "none", "none", 3, shard_mb))
        shards = w.num_shards
        arrays = [bits[slice(*w.shard_range(i))] for i in range(shards)]
        writes = {"cache_write": lambda: _fill(w, xb),
                  "plain_write": lambda: _plain_write(d / "p", arrays)}  # fmt: skip
        reads = {"cache_read": lambda: open_cache(d / "cache", "fp").read_rows(0, n, None)[0],
                 "plain_read": lambda: _plain_read(d / "p", shards, bits.shape)}  # fmt: skip
        for ops in (writes, reads):  # cache first in even rounds, plain first in odd ones
            for key in list(ops) if r % 2 == 0 else list(ops)[::-1]:
                ops[key] = measure(key, ops[key])
        assert torch.equal(reads["cache_read"].view(torch.int16), xb.view(torch.int16))
        assert np.array_equal(reads["plain_read"], bits)
        measure("cache_read_values", lambda: open_cache(d / "cache", "fp").read_stored(0, n))
        nocheck = open_cache(d / "cache", "fp", check_reads=False)
        measure("cache_read_nocheck", lambda: nocheck.read_rows(0, n, None))
        shutil.rmtree(d)
        return shards

    with _no_fsync(not fsync):
        shards = [one_round(r) for r in range(repeats)][0]
    med = {k: statistics.median(v) for k, v in t.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    mb = xb.numel() * 2 / 2**20
    return {
        "cpu_seconds_median": cpu_med, "fsync": fsync, "shard_mb": shard_mb, "MiB": mb,
        "cpu_write_ratio": cpu_med["cache_write"] / cpu_med["plain_write"],
        "cpu_read_ratio": cpu_med["cache_read"] / cpu_med["plain_read"], "num_shards": shards,
        "seconds_median": med, "MBps": {k: mb / v for k, v in med.items() if k != "create"},
        "write_ratio": med["plain_write"] / med["cache_write"],
        "write_ratio_incl_create": med["plain_write"] / (med["cache_write"] + med["create"]),
        "read_ratio": med["plain_read"] / med["cache_read"],
        "read_values_ratio": med["plain_read"] / med["cache_read_values"],
        "read_nocheck_ratio": med["plain_read"] / med["cache_read_nocheck"],
        "best_write_ratio": min(t["plain_write"]) / min(t["cache_write"]),
        "best_read_ratio": min(t["plain_read"]) / min(t["cache_read"]),
    }  # fmt: skip


def rounding_error(x: torch.Tensor, y: torch.Tensor) -> dict | None:
    """Error of y (x rounded to a 16-bit float) vs x, in the manifest's terms."""
    if y.dtype == x.dtype:
        return None
    e = (y.double() - x.double()).abs()
    return {"max_abs_err": float(e.max()), "mean_abs_err": float(e.mean()),
            "rel_err": float(e.norm() / x.double().norm())}  # fmt: skip


def codec_bench(name: str, x: np.ndarray, shard_mb: float, tmp: Path) -> dict:
    """Every GRID setting on hidden states x (float32 [N, S, H]). Lossless dtypes are written
    from values already in that dtype (the prefix computes in the cache dtype), their error is
    the rounding of the float32 states; lossy ones from float32, their error the manifest's."""
    n, s, h = x.shape
    xt = torch.from_numpy(x)
    xb = xt.to(torch.bfloat16)
    bf16_mb = xt.numel() * 2 / 2**20
    rows = []
    for dtype, codec, shuffle, level in GRID:
        src = xt.to(LOGICAL[dtype]) if dtype in LOGICAL else xt
        root = tmp / f"c_{dtype}_{codec}_{shuffle}_{level}"
        w = _create(root, src, dtype, codec, shuffle, level, shard_mb)
        t0 = time.perf_counter()
        m = _fill(w, src)
        dt_w = time.perf_counter() - t0
        c = open_cache(root, "fp")
        reads = []
        for _ in range(3):
            t0 = time.perf_counter()
            got = c.read_rows(0, n, None)[0]
            reads.append(time.perf_counter() - t0)
        if dtype in LOGICAL:
            assert torch.equal(got, src)
        rows.append({"dtype": dtype, "codec": codec, "shuffle": shuffle, "level": level,
                     "bytes_per_value": m["bytes_per_value"], "ratio_vs_bf16": m["ratio_vs_bf16"],
                     "write_MBps": bf16_mb / dt_w, "read_MBps": bf16_mb / statistics.median(reads),
                     "error": rounding_error(xt, src) if dtype in LOGICAL else m["error"]})  # fmt: skip
        shutil.rmtree(root)
    return {"name": name, "shape": [n, s, h], "std": float(x.std()),
            "absmax": float(np.abs(x).max()), "bf16_byte_entropy": byte_entropy(xb),
            "bf16_value_entropy": value_entropy(xb), "codecs": rows}  # fmt: skip


def default_sources(samples: int) -> list[tuple[str, Path]]:
    """(name, .npy) of the MiniLM and random-init GPT-2 states (generated once, under /tmp)."""
    from bench import hidden_states

    names = {"minilm": "MiniLM-L6 (pretrained)", "gpt2": "GPT-2 demo (random init)"}
    return [(names[m], hidden_states.generate(m, samples=samples, log=quiet)) for m in names]


def run(hidden=None, synthetic=False, n=512, seq=128, hidden_size=384, shard_mbs=(16.0, 4.0),
        repeats=5, workdir=None, io=True, codec_table=True, samples=256) -> dict:  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="cache_io_", dir=workdir))
    res: dict = {"io": [], "sources": [], "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    try:
        res["io"] = [io_bench(n, seq, hidden_size, mb, repeats, fsync, tmp)
                     for mb in (shard_mbs if io else []) for fsync in (True, False)]  # fmt: skip
        srcs = ([("SYNTHETIC smooth stand-in (not real activations)", None)] if synthetic
                else [(Path(p).stem, Path(p)) for p in hidden] if hidden
                else default_sources(samples)) if codec_table else []  # fmt: skip
        for name, path in srcs:
            x = synthetic_hidden(256, seq, hidden_size) if path is None else np.load(path)
            res["sources"].append({**codec_bench(name, x.astype(np.float32), 16.0, tmp),
                                   "path": str(path)})  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["repeats"], res["load_after"] = repeats, os.getloadavg()
    head = {}
    for r in res["io"]:
        tag = f"{r['shard_mb']:g} MiB shards{'' if r['fsync'] else ', no fsync'}"
        head[f"read ratio ({tag})"] = r["read_ratio"]
        head[f"write ratio ({tag}, target >= 0.7)"] = r["write_ratio"]
    d = CacheConfig()  # the lossless default
    for src in res["sources"]:
        for r in src["codecs"]:
            if (r["dtype"], r["codec"], r["shuffle"], r["level"]) == (
                "bf16",
                d.codec,
                d.shuffle,
                d.level,
            ):
                head[f"default codec vs raw bf16, {src['name']} (target >= 1.3)"] = r[
                    "ratio_vs_bf16"
                ]
    res["headline"] = head
    return res


def _f(v, fmt=".3g"):
    return "-" if v is None else format(v, fmt)


def markdown(res: dict) -> str:
    load = lambda k: "/".join(f"{v:.1f}" for v in res[k])  # noqa: E731
    lines = [f"Machine: {res['cpus']} CPUs; load average (1/5/15 min) {load('load_before')} "
             f"before, {load('load_after')} after (other work on the machine skews wall-clock "
             "figures).", ""]  # fmt: skip
    if res["io"]:
        rows = [("shard MiB (shards)", "fsync", "op", "cache MB/s", "plain MB/s", "ratio (median)",
                 "ratio (best)", "CPU cache/plain")]  # fmt: skip
        for r, op in ((r, op) for r in res["io"] for op in ("write", "read")):
            rows.append((f"{r['shard_mb']:g} ({r['num_shards']})", "yes" if r["fsync"] else "no", op,
                         f"{r['MBps'][f'cache_{op}']:.0f}", f"{r['MBps'][f'plain_{op}']:.0f}",
                         f"**{r[f'{op}_ratio']:.2f}**", f"{r[f'best_{op}_ratio']:.2f}",
                         f"{r[f'cpu_{op}_ratio']:.2f}"))  # fmt: skip
        ratios = lambda k: ", ".join(f"{r[k]:.2f}" for r in res["io"])  # noqa: E731
        lines += [
            f"I/O: bf16, codec none, {res['io'][0]['MiB']:.0f} MiB of values, {res['repeats']} "
            "interleaved runs. Ratio = cache throughput / plain-file throughput (target >= 0.7), "
            "of the median and of the best times; CPU = process CPU seconds of the cache / of "
            "the plain files.", "", headline_table(rows), "",
            "write = write_shard for every shard + finalize vs one plain file per shard with the "
            "same fsync; with create (once per cache) the median write ratios are "
            f"{ratios('write_ratio_incl_create')}. read = open_cache + read_rows(0, N) vs "
            f"np.fromfile; values only (read_stored): {ratios('read_values_ratio')}; "
            f"check_reads=False: {ratios('read_nocheck_ratio')} (in the table's row order).", "",
        ]  # fmt: skip
    for src in res["sources"]:
        n, s, h = src["shape"]
        rows = [("dtype", "codec", "shuffle", "level", "bytes/value", "vs raw bf16", "write MB/s",
                 "read MB/s", "max abs err", "mean abs err", "rel err")]  # fmt: skip
        for c in src["codecs"]:
            e, key = c["error"] or {}, (c["dtype"], c["codec"], c["shuffle"], c["level"])
            rows.append((*key[:3], f"{c['level'] if c['codec'] != 'none' else '-'}"
                         f"{' (default)' * (key == DEFAULT)}", f"{c['bytes_per_value']:.3f}",
                         f"{c['ratio_vs_bf16']:.2f}x", f"{c['write_MBps']:.0f}",
                         f"{c['read_MBps']:.0f}", *(_f(e.get(k)) for k in
                         ("max_abs_err", "mean_abs_err", "rel_err"))))  # fmt: skip
        lossless = [c for c in src["codecs"] if c["dtype"] == "bf16"]
        best = min(lossless, key=lambda c: c["bytes_per_value"])
        dflt = next(
            c for c in lossless if (c["dtype"], c["codec"], c["shuffle"], c["level"]) == DEFAULT
        )
        lines += [
            f"Codecs on {src['name']}: N={n} S={s} H={h}, std {src['std']:.3g}, absmax "
            f"{src['absmax']:.3g}; order-0 entropy of bf16: {src['bf16_value_entropy']:.3f} "
            f"bytes/value (16-bit symbols), {src['bf16_byte_entropy']:.3f} (bytes apart).", "",
            headline_table(rows), "",
            f"Lossless default (bf16 blosc-zstd byte 3): {dflt['ratio_vs_bf16']:.2f}x smaller "
            f"than raw bf16 (requirement >= 1.3x: {'met' if dflt['ratio_vs_bf16'] >= 1.3 else 'NOT met'}); "
            f"smallest lossless here: {best['codec']} {best['shuffle']} level "
            f"{best['level']} at {best['ratio_vs_bf16']:.2f}x; 16-bit entropy bound "
            f"{2 / src['bf16_value_entropy']:.2f}x.", "",
        ]  # fmt: skip
    if res["sources"]:
        lines.append(
            "MB/s in the codec tables = raw bf16 bytes of the values per second (read: median of "
            "3 read_rows of all rows). Errors are vs the float32 states (bf16/fp16: rounding; "
            "int8/fp8: lossy, per-token scale). Speeds on a shared machine: indicative only.")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", nargs="+", help=".npy files of hidden states [N, S, H]")
    ap.add_argument("--synthetic", action="store_true", help="codec table on a stand-in")
    ap.add_argument("--samples", type=int, default=256, help="states per model (default data)")
    ap.add_argument("--n", type=int, default=512, help="I/O rows")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden-size", type=int, default=384)
    ap.add_argument("--shard-mb", type=float, nargs="+", default=[16.0, 4.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-io", action="store_true")
    ap.add_argument("--skip-codecs", action="store_true")
    ap.add_argument("--workdir", help="where to write temp caches (default: system temp)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--tiny", action="store_true", help="synthetic, 16 x 8 x 32 values (tests)")
    a = ap.parse_args(argv)
    if a.repeats < 5:
        ap.error("--repeats must be >= 5 (medians)")
    if a.tiny:
        a.synthetic, a.n, a.seq, a.hidden_size, a.shard_mb = True, 16, 8, 32, [0.01]
    res = run(a.hidden, a.synthetic, a.n, a.seq, a.hidden_size, a.shard_mb, a.repeats, a.workdir,
              io=not a.skip_io, codec_table=not a.skip_codecs, samples=a.samples)  # fmt: skip
    print(markdown(res))
    if a.out:
        write_results(Path(a.out), res)
    return res


if __name__ == "__main__":
    main()
