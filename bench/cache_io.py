"""Activation cache I/O benchmark: throughput vs plain files, bytes/value per codec, lossy error.

    python bench/cache_io.py [--hidden states.npy] [--n 128 --seq 128 --hidden-size 384]
                             [--repeats 3] [--out results.json]

--hidden: a .npy of real hidden states [N, S, H] (fp32/fp16). Without it a smooth synthetic
stand-in is generated (low-rank, correlated along the sequence, per-channel scales, a few
outlier channels) and every table SAYS so: its codec figures are not real-model figures.
Throughput compares the cache (bf16, codec none: checksums, marker, decode included) with
writing/reading the same bytes as plain files of the same shard size, fsync'd the same way,
in the same run; medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage.cache import CacheWriter  # noqa: E402
from storage.config import CacheConfig  # noqa: E402
from storage.reader import open_cache  # noqa: E402

CODECS = [("none", "none"), ("zstd", "none"), ("blosc-zstd", "byte"), ("blosc-zstd", "bit")]
GRID = [("bf16", c, s) for c, s in CODECS] + [
    ("fp16", "blosc-zstd", "bit"),
    ("fp32", "blosc-zstd", "bit"),
    ("int8", "none", "none"),
    ("int8", "blosc-zstd", "byte"),
    ("fp8_e4m3", "none", "none"),
    ("fp8_e4m3", "blosc-zstd", "byte"),
]


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


def byte_entropy(x_bf16: torch.Tensor) -> float:
    """Order-0 entropy of the bf16 bytes (high and low byte separately), bytes per value."""
    b = x_bf16.view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
    total = 0.0
    for col in (0, 1):
        p = np.bincount(b[:, col], minlength=256) / len(b)
        p = p[p > 0]
        total += float(-(p * np.log2(p)).sum()) / 8
    return total


def _cfg(dtype, codec, shuffle, shard_mb):
    return CacheConfig(dtype=dtype, codec=codec, shuffle=shuffle, shard_mb=shard_mb)


def _write_cache(root, fp, x, cfg, samples):
    n, s, h = x.shape
    w = CacheWriter.create(
        root, fp, samples=samples, seq_len=s, hidden_size=h, cache_cfg=cfg, meta={"bench": True}
    )
    for i in range(w.num_shards):
        a, b = w.shard_range(i)
        w.write_shard(i, x[a:b])
    return w.finalize()


def _plain_write(d: Path, blobs: list[bytes]):
    d.mkdir(parents=True)
    for i, blob in enumerate(blobs):
        with open(d / f"{i:05d}.bin", "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())


def _plain_read(d: Path, shape, n_files):
    parts = [np.fromfile(d / f"{i:05d}.bin", dtype=np.uint16) for i in range(n_files)]
    return torch.from_numpy(np.concatenate(parts).reshape(shape)).view(torch.bfloat16)


def run(hidden=None, n=128, seq=128, hidden_size=384, repeats=3, shard_mb=4.0, workdir=None):
    """Run the benchmark; returns a dict (see main() for the printed tables)."""
    if hidden is not None:
        x = np.load(hidden).astype(np.float32)
        source = f"real hidden states from {hidden}"
    else:
        x = synthetic_hidden(n, seq, hidden_size)
        source = "SYNTHETIC smooth stand-in (not real model activations)"
    n, seq, hidden_size = x.shape
    xt = torch.from_numpy(x)
    xb = xt.to(torch.bfloat16)
    ids = np.zeros((n, seq), np.int32)
    samples = (np.arange(n), ids, ids)
    tmp = Path(tempfile.mkdtemp(prefix="cache_io_", dir=workdir))
    try:
        mb = n * seq * hidden_size * 2 / 2**20
        t = {
            k: []
            for k in (
                "cache_write",
                "plain_write",
                "cache_read",
                "cache_read_nocheck",
                "plain_read",
            )
        }
        cfg = _cfg("bf16", "none", "none", shard_mb)
        for r in range(repeats):
            t0 = time.perf_counter()
            _write_cache(tmp / f"w{r}", "fp", xb, cfg, samples)
            t["cache_write"].append(time.perf_counter() - t0)
            c = open_cache(tmp / f"w{r}", "fp")
            blobs = [
                (c.dir / rel).read_bytes() for sh in c.manifest["shards"] for rel in sh["files"]
            ]
            t0 = time.perf_counter()
            _plain_write(
                tmp / f"p{r}",
                [
                    xb[a:b].view(torch.int16).numpy().tobytes()
                    for a, b in map(c.shard_range, range(c.num_shards))
                ],
            )
            t["plain_write"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = open_cache(tmp / f"w{r}", "fp").read_rows(0, n, dtype=None)[0]
            t["cache_read"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            open_cache(tmp / f"w{r}", "fp", check_reads=False).read_rows(0, n, dtype=None)
            t["cache_read_nocheck"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plain = _plain_read(tmp / f"p{r}", (n, seq, hidden_size), c.num_shards)
            t["plain_read"].append(time.perf_counter() - t0)
            assert torch.equal(got.view(torch.int16), plain.view(torch.int16))
            assert sum(map(len, blobs)) >= mb * 2**20
        med = {k: statistics.median(v) for k, v in t.items()}
        through = {k: mb / v for k, v in med.items()}
        codecs_out = []
        for dtype, codec, shuffle in GRID:
            root = tmp / f"c_{dtype}_{codec}_{shuffle}"
            t0 = time.perf_counter()
            m = _write_cache(root, "fp", xt, _cfg(dtype, codec, shuffle, shard_mb), samples)
            dt = time.perf_counter() - t0
            codecs_out.append(
                {
                    "dtype": dtype,
                    "codec": codec,
                    "shuffle": shuffle,
                    "bytes_per_value": m["bytes_per_value"],
                    "ratio_vs_bf16": m["ratio_vs_bf16"],
                    "write_MBps": n * seq * hidden_size * 4 / 2**20 / dt,
                    "error": m["error"],
                }
            )
            shutil.rmtree(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "source": source,
        "shape": [n, seq, hidden_size],
        "repeats": repeats,
        "throughput_MBps": through,
        "seconds_median": med,
        "write_ratio_cache_vs_plain": med["plain_write"] / med["cache_write"],
        "read_ratio_cache_vs_plain": med["plain_read"] / med["cache_read"],
        "bf16_byte_entropy_bytes_per_value": byte_entropy(xb),
        "codecs": codecs_out,
    }


def markdown(res: dict) -> str:
    n, s, h = res["shape"]
    tp, med = res["throughput_MBps"], res["seconds_median"]
    lines = [
        f"Data: {res['source']}; shape N={n} S={s} H={h}; medians of {res['repeats']} runs.",
        "",
        "| I/O (bf16, codec none) | cache MB/s | plain file MB/s | cache / plain |",
        "|---|---|---|---|",
        f"| write | {tp['cache_write']:.0f} | {tp['plain_write']:.0f} | "
        f"{res['write_ratio_cache_vs_plain']:.2f} |",
        f"| read | {tp['cache_read']:.0f} | {tp['plain_read']:.0f} | "
        f"{res['read_ratio_cache_vs_plain']:.2f} |",
        f"| read, check_reads=False | {tp['cache_read_nocheck']:.0f} | {tp['plain_read']:.0f} | "
        f"{med['plain_read'] / med['cache_read_nocheck']:.2f} |",
        "",
        f"Codecs ({'SYNTHETIC data' if 'SYNTHETIC' in res['source'] else 'real data'}; bf16 "
        f"order-0 byte entropy = {res['bf16_byte_entropy_bytes_per_value']:.3f} bytes/value):",
        "",
        "| dtype | codec | shuffle | bytes/value | vs raw bf16 | write MB/s (fp32 in) "
        "| max abs err | mean abs err | rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["codecs"]:
        e = c["error"] or {}
        errs = [
            f"{e[k]:.3g}" if k in e else "-" for k in ("max_abs_err", "mean_abs_err", "rel_err")
        ]
        lines.append(
            f"| {c['dtype']} | {c['codec']} | {c['shuffle']} | {c['bytes_per_value']:.3f} | "
            f"{c['ratio_vs_bf16']:.2f}x | {c['write_MBps']:.0f} | " + " | ".join(errs) + " |"
        )
    lines.append("")
    lines.append("(fp16/bf16 errors are the rounding of fp32 input; int8/fp8 are lossy.)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", help=".npy of real hidden states [N, S, H]")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden-size", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=float, default=4.0)
    ap.add_argument("--workdir", help="where to write temp caches (default: system temp)")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.repeats < 3:
        ap.error("--repeats must be >= 3 (medians)")
    res = run(a.hidden, a.n, a.seq, a.hidden_size, a.repeats, a.shard_mb, a.workdir)
    print(markdown(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
