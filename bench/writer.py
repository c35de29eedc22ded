"""The cache writer alone: can it keep up with a GPU's forward? (docs/writer.md, section 1)

    .venv/bin/python -m bench.writer                  # local disk + S3 (moto), every codec, 1-2 threads
    .venv/bin/python -m bench.writer --quick --targets local

Synthetic bf16 hidden states (N, S, H; N(0, 1) per channel times a log-normal channel scale, as
in LM residual streams) through the real writer path (the worker's torch.cat of its micro-batch
outputs, write_shard, finalize), per codec x encoder threads x target (a local directory; S3 =
a moto server in its own process, so this process's CPU time is the writer's alone). Per arm,
medians of --repeats interleaved runs [min, max]: MB/s (wall), MB per core-second (this
process's user + system seconds), and the cores a GPU's output needs at that rate (7B, H=4096
bf16: 8,192 bytes per token; 10k-50k tokens/s = 82-410 MB/s).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

from bench.harness import headline_table, interleaved, load_average, publish, show, spread
from preinfer.plan.costmodel import writer_key
from storage import fs
from storage.cache import CacheWriter
from storage.config import CacheConfig, StorageConfig
from storage.layout import remove_cache
from storage.shard_codec import set_codec_threads

GPU_BYTES_PER_TOKEN = 4096 * 2  # 7B model, H=4096, bf16
GPU_TOKENS_PER_S = (10_000, 50_000)
CODECS = {  # writer_key (preinfer.plan.costmodel's names) -> CacheConfig fields
    writer_key(codec, level, shuffle): {"codec": codec, "shuffle": shuffle, "level": level}
    for codec, shuffle, level in (
        ("none", "none", 3),
        ("zstd", "none", 1),
        ("blosc-zstd", "byte", 1),
        ("blosc-zstd", "byte", 3),  # the default
        ("zstd", "none", 3),
    )
}


def synthetic(rows: int, seq: int, hidden: int, dtype=torch.bfloat16) -> torch.Tensor:
    """(rows, S, H): N(0, 1) x a log-normal scale per channel."""
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(hidden, generator=g) * 1.0)
    return (torch.randn(rows, seq, hidden, generator=g) * scale).to(dtype)


def timed(fn):
    """(fn(), its wall seconds, this process's CPU seconds: user + system of every thread)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def new_cache(root, fp: str, shape, free_bytes: int | None = None, **cfg) -> CacheWriter:
    """A new cache of `shape` (n, seq, hidden) values, CacheConfig(**cfg), token ids all 0."""
    n, seq, hidden = shape
    ids = np.zeros((n, seq), np.int32)
    return CacheWriter.create(root, fp, seq_len=seq, hidden_size=hidden, free_bytes=free_bytes,
                              samples={"sample_id": np.arange(n), "input_ids": ids, "labels": ids},
                              cache_cfg=CacheConfig(**cfg), meta={"bench": True})  # fmt: skip


def fill(w: CacheWriter, x: torch.Tensor, micro_batch: int | None = None) -> dict:
    """write_shard of each shard of x, then finalize (the manifest). micro_batch: each shard's
    rows cut into micro-batches and cat'd, the copy a worker makes of its outputs."""
    for i in range(w.num_shards):
        a, b = w.shard_range(i)
        w.write_shard(i, torch.cat(x[a:b].split(micro_batch)) if micro_batch else x[a:b])
    return w.finalize()


@contextlib.contextmanager
def moto_server():
    """The URL of a moto S3 server with bucket `bench`, in its own process on a free port."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=url, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
    try:
        for _ in range(100):
            with contextlib.suppress(Exception):  # not listening yet
                client.create_bucket(Bucket="bench")
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("moto server did not start")
        yield url
    finally:
        proc.kill()


@contextlib.contextmanager
def moto_root():
    """An s3:// prefix of its own on a fresh moto server (moto_server), with this process's
    storage configured to reach it; the configuration is reset and the server stopped after."""
    with moto_server() as url:
        fs.configure(StorageConfig(endpoint_url=url, key="testing", secret="testing",
                                   region="us-east-1"))  # fmt: skip
        try:
            yield f"s3://bench/{uuid.uuid4().hex[:8]}"
        finally:
            fs.configure(None)


def run(args) -> dict:
    logging.getLogger("botocore").setLevel(logging.ERROR)
    rows = max(1, int(args.mb * 1e6 // (args.seq * args.hidden * 2)))
    hidden = synthetic(rows, args.seq, args.hidden)
    res: dict = {"bench": "writer", "seq": args.seq, "hidden": args.hidden, "rows": rows,
                 "bytes": hidden.numel() * 2, "shard_mb": args.shard_mb,
                 "micro_batch": args.micro_batch, "repeats": args.repeats,
                 "cpus": len(os.sched_getaffinity(0)), "load_before": load_average(),
                 "gpu": {"bytes_per_token": GPU_BYTES_PER_TOKEN,
                         "tokens_per_s": list(GPU_TOKENS_PER_S)}, "arms": {}}  # fmt: skip

    cfg = {"dtype": "bf16", "shard_mb": args.shard_mb}

    def write(root: str, c: str, n: int) -> dict:
        """One cache of `hidden` through the writer path, codec c on n encoder threads."""
        set_codec_threads(n)
        fp = f"bench-{uuid.uuid4().hex[:12]}"
        w = new_cache(root, fp, hidden.shape, 1 << 50, **cfg, **CODECS[c])
        manifest, wall, cpu = timed(lambda: fill(w, hidden, args.micro_batch))
        remove_cache(root, fp)
        return {"wall_s": wall, "cpu_s": cpu, "ratio": manifest["compression_ratio"]}

    with contextlib.ExitStack() as stack:
        roots = {}
        if "local" in args.targets:
            tmp = tempfile.TemporaryDirectory(prefix="writer-", dir=args.dir)
            roots["local"] = stack.enter_context(tmp)
        if "s3" in args.targets:
            roots["s3"] = stack.enter_context(moto_root())
        arms = {(t, c, n): lambda r=r, c=c, n=n: write(r, c, n)
                for t, r in roots.items() for c in args.codecs for n in args.threads}  # fmt: skip
        raw = interleaved(arms, args.repeats)  # after a warm-up: imports, pools, connections
    mb = res["bytes"] / 1e6
    for (t, c, n), outs in raw.items():
        core = [mb / max(o["cpu_s"], 1e-9) for o in outs]
        res["arms"][f"{t} | {c} | {n}"] = {
            "target": t, "codec": c, "threads": n,
            "mb_s": spread([mb / o["wall_s"] for o in outs]), "mb_per_core_s": spread(core),
            "cpu_per_wall": statistics.median(o["cpu_s"] / o["wall_s"] for o in outs),
            "ratio": outs[0]["ratio"],
            "cores_per_gpu": [GPU_BYTES_PER_TOKEN * k / 1e6 / statistics.median(core)
                              for k in GPU_TOKENS_PER_S],
        }  # fmt: skip
    res["load_after"] = load_average()
    return res


def table(res: dict) -> str:
    lo, hi = (GPU_BYTES_PER_TOKEN * k / 1e6 for k in GPU_TOKENS_PER_S)
    rows = [("target", "codec", "encoder threads", "MB/s (wall)", "MB per core-second", "CPU/wall",
             "ratio", f"cores per GPU at {lo:.0f} MB/s", f"at {hi:.0f} MB/s")]  # fmt: skip
    rows += [(a["target"], a["codec"], a["threads"], show(a["mb_s"], "{:.0f}"),
              show(a["mb_per_core_s"], "{:.0f}"), f"{a['cpu_per_wall']:.2f}", f"{a['ratio']:.2f}",
              f"{a['cores_per_gpu'][0]:.1f}", f"{a['cores_per_gpu'][1]:.1f}")
             for a in res["arms"].values()]  # fmt: skip
    return (f"{res['bytes'] / 1e6:.0f} MB of bf16 hidden (N={res['rows']}, S={res['seq']}, "
            f"H={res['hidden']}), shards of {res['shard_mb']} MiB, medians of {res['repeats']} "
            f"[min, max]; {res['cpus']} CPUs; load average before {res['load_before']}, after "
            f"{res['load_after']}\n\n" + headline_table(rows))  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mb", type=float, default=128, help="megabytes of bf16 hidden per run")
    ap.add_argument("--shard-mb", type=float, default=32.0)
    ap.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch (the copy)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--targets", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    ap.add_argument("--dir", default=None, help="parent of the local cache dir (default: tmp)")
    ap.add_argument("--out", default=None, help="JSON path; default bench/results/writer-<time>")
    ap.add_argument("--quick", action="store_true", help="64 MB, 2 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.repeats = min(args.mb, 64), min(args.repeats, 2)
    res = run(args)
    publish(res, table(res), args.out, "writer")
    return res


if __name__ == "__main__":
    main()
