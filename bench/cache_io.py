"""Activation cache I/O benchmark: throughput vs plain files, bytes/value per codec, lossy error.

    python -m bench.cache_io [--states minilm gpt2] [--seq 128] [--repeats 5]
                             [--skip-io] [--skip-codecs] [--out results.json]
    python -m bench.cache_io --skip-io --states gpt2 --samples 8 --docs 20 --seq 16

I/O (bf16, codec none, 512 x S x 384 values, 16 and 4 MiB shards): write_shard for every shard
+ finalize against plain files of the same bytes, one a shard, both with fsync as a build
writes; open_cache + read_rows against np.fromfile. Both sides every repeat, alternating;
ratios of the medians and of the best times, and of CPU seconds. Codecs: real hidden states
(the pretrained MiniLM-L6 of configs/minilm.yaml and the random-init GPT-2 of
configs/demo.yaml, entering their middle block, computed once under --states-dir) through each
dtype x codec: bytes per value, write/read speed, and the error vs the float32 states.
--tiny: bench.writer's synthetic stand-in, and its table says so. Notes: docs/cache_io.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.arms import prepare
from bench.harness import ROOT, headline_table, load_average, write_results
from bench.writer import fill, new_cache, synthetic, timed
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks
from storage.atomic import write_file, write_json
from storage.config import CacheConfig
from storage.reader import open_cache
from storage.stats import combine_stats, shard_stats

DEFAULT = (lambda d: (d.dtype, d.codec, d.shuffle, d.level))(CacheConfig())
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
STATES = {"minilm": ("configs/minilm.yaml", "MiniLM-L6 (pretrained)"),  # its own WordPiece
          "gpt2": ("configs/demo.yaml", "GPT-2 demo (random init)")}  # fmt: skip


def entropy(symbols: np.ndarray) -> float:
    """Order-0 entropy of the symbols (uint8 or uint16), bytes per symbol."""
    p = np.bincount(symbols.reshape(-1)) / symbols.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum()) / 8


def _plain_write(d: Path, arrays: list[np.ndarray]) -> None:
    d.mkdir(parents=True)
    for i, a in enumerate(arrays):
        with open(d / f"{i:05d}.bin", "wb") as f:
            f.write(memoryview(a).cast("B"))
            f.flush()
            os.fsync(f.fileno())


def io_bench(n, seq, hidden, shard_mb, repeats, tmp: Path) -> dict:
    """Cache vs plain files, bf16 codec none, medians of `repeats` interleaved runs."""
    g = torch.Generator().manual_seed(0)
    xb = (torch.randn(n, seq, hidden, generator=g) * 3).to(torch.bfloat16)
    bits = xb.view(torch.int16).numpy().view(np.uint16)
    secs: dict[str, list] = {}  # (wall, CPU) seconds of each call, per op
    cfg = {"dtype": "bf16", "codec": "none", "shuffle": "none", "shard_mb": shard_mb}

    def measure(key, f):
        out, *seconds = timed(f)
        secs.setdefault(key, []).append(seconds)
        return out

    def one_round(r: int) -> int:
        d = tmp / f"io{r}"
        w = measure("create", lambda: new_cache(d / "cache", "fp", xb.shape, **cfg))
        shards = w.num_shards
        arrays = [bits[slice(*w.shard_range(i))] for i in range(shards)]
        writes = {"cache_write": lambda: fill(w, xb),
                  "plain_write": lambda: _plain_write(d / "p", arrays)}  # fmt: skip
        reads = {"cache_read": lambda: open_cache(d / "cache", "fp").read_rows(0, n, None)[0],
                 "plain_read": lambda: np.concatenate([np.fromfile(d / "p" / f"{i:05d}.bin",
                                       np.uint16) for i in range(shards)]).reshape(bits.shape)}  # fmt: skip
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

    shards = [one_round(r) for r in range(repeats)][0]
    t = {k: [wall for wall, _ in v] for k, v in secs.items()}
    med = {k: statistics.median(v) for k, v in t.items()}
    cpu_med = {k: statistics.median(c for _, c in v) for k, v in secs.items()}
    mb = xb.numel() * 2 / 2**20
    return {
        "cpu_seconds_median": cpu_med, "fsync": True, "shard_mb": shard_mb, "MiB": mb,
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
    return None if y.dtype == x.dtype else combine_stats([shard_stats(y, x)])[1]


def codec_bench(name: str, x: np.ndarray, shard_mb: float, tmp: Path) -> dict:
    """Every GRID setting on hidden states x (float32 [N, S, H]). Lossless dtypes are written
    from values already in that dtype (the prefix computes in the cache dtype), their error is
    the rounding of the float32 states; lossy ones from float32, their error the manifest's."""
    n, s, h = x.shape
    xt = torch.from_numpy(x)
    b = xt.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)  # bytes
    bf16_mb = xt.numel() * 2 / 2**20
    rows = []
    for dtype, codec, shuffle, level in GRID:
        cfg = {"dtype": dtype, "codec": codec, "shuffle": shuffle, "level": level}
        src = xt.to(LOGICAL[dtype]) if dtype in LOGICAL else xt
        root = tmp / f"c_{dtype}_{codec}_{shuffle}_{level}"
        w = new_cache(root, "fp", src.shape, shard_mb=shard_mb, **cfg)
        m, dt_w, _ = timed(lambda w=w, src=src: fill(w, src))
        c = open_cache(root, "fp")
        reads = [timed(lambda c=c: c.read_rows(0, n, None)[0]) for _ in range(3)]
        if dtype in LOGICAL:
            assert torch.equal(reads[-1][0], src)
        rows.append({**cfg, "bytes_per_value": m["bytes_per_value"],
                     "ratio_vs_bf16": m["ratio_vs_bf16"], "write_MBps": bf16_mb / dt_w,
                     "read_MBps": bf16_mb / statistics.median(r[1] for r in reads),
                     "error": rounding_error(xt, src) if dtype in LOGICAL else m["error"]})  # fmt: skip
        shutil.rmtree(root)
    return {"name": name, "shape": [n, s, h], "std": float(x.std()),
            "absmax": float(np.abs(x).max()), "bf16_byte_entropy": entropy(b[..., 0]) + entropy(b[..., 1]),
            "bf16_value_entropy": entropy(b.view(np.uint16)), "codecs": rows}  # fmt: skip


def hidden_states(model: str, out: Path, *, samples: int, docs: int, seq_len: int) -> Path:
    """The .npy of `model`'s float32 hidden states (N, S, H) entering block ceil(M / 2),
    computed once under `out` by the project's own tokenize and init stages on the built-in
    corpus (N below `samples` when the corpus is short); a .json beside it."""
    path = Path(out) / f"{model}_d{docs}_s{seq_len}_n{samples}_kmid.npy"
    if path.exists():
        return path
    run = Path(out) / f"run_{model}_d{docs}_s{seq_len}"
    over = [f"run.dir={run}", f"data.max_documents={docs}", f"data.seq_len={seq_len}"]
    cfg, store = prepare(ROOT / STATES[model][0], over, run / "checkpoint")
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    m = ckpt.num_blocks
    k = (m + 1) // 2
    n = min(samples, store.num_samples("train"))
    net, adapter = ckpt.load(range(k))
    ids = torch.from_numpy(store.read("train", 0, n)[:, :seq_len].astype(np.int64))
    with torch.inference_mode():
        x = torch.cat([forward_blocks(adapter, ckpt.partition, ids[i : i + 16], 0, k).float()
                       for i in range(0, n, 16)]).numpy()  # fmt: skip
    write_file(path, lambda f: np.save(f, x))
    write_json(path.with_suffix(".json"), {
        "model": model, "config": STATES[model][0], "arch": cfg.model.arch, "boundary": k,
        "pretrained": cfg.model.checkpoint is not None, "num_blocks": m, "shape": list(x.shape),
        "dtype": "float32", "docs": docs, "seq_len": seq_len})  # fmt: skip
    return path


def run(a) -> dict:
    n, hidden = (16, 32) if a.tiny else (512, 384)  # I/O rows, hidden size
    tmp = Path(tempfile.mkdtemp(prefix="cache_io_"))
    res: dict = {"io": [], "sources": [], "cpus": os.cpu_count(), "load_before": load_average()}
    try:
        if not a.skip_io:
            res["io"] = [io_bench(n, a.seq, hidden, mb, a.repeats, tmp) for mb in a.shard_mb]
        if a.skip_codecs:
            srcs = []
        elif a.tiny:
            srcs = [("SYNTHETIC stand-in (not real activations)", None)]
        else:
            srcs = [(STATES[m][1], hidden_states(m, a.states_dir, samples=a.samples, docs=a.docs,
                                                 seq_len=a.seq))
                    for m in a.states]  # fmt: skip
        for name, path in srcs:
            x = np.load(path) if path else synthetic(256, a.seq, hidden, torch.float32).numpy()
            res["sources"].append({**codec_bench(name, x.astype(np.float32), 16.0, tmp),
                                   "path": str(path)})  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["repeats"], res["load_after"] = a.repeats, load_average()
    head = {}
    for r in res["io"]:
        head[f"read ratio ({r['shard_mb']:g} MiB shards)"] = r["read_ratio"]
        head[f"write ratio ({r['shard_mb']:g} MiB shards, target >= 0.7)"] = r["write_ratio"]
    for src in res["sources"]:
        dflt = next(r["ratio_vs_bf16"] for r in src["codecs"] if _key(r) == DEFAULT)
        head[f"default codec vs raw bf16, {src['name']} (target >= 1.3)"] = dflt
    res["headline"] = head
    return res


def _key(c: dict) -> tuple:
    return c["dtype"], c["codec"], c["shuffle"], c["level"]


def _f(v, fmt=".3g"):
    return "-" if v is None else format(v, fmt)


def markdown(res: dict) -> str:
    lines = [f"Machine: {res['cpus']} CPUs; load average (1/5/15 min) {res['load_before']} "
             f"before, {res['load_after']} after (other work on the machine skews wall-clock "
             "figures).", ""]  # fmt: skip
    if res["io"]:
        rows = [("shard MiB (shards)", "op", "cache MB/s", "plain MB/s", "ratio (median)",
                 "ratio (best)", "CPU cache/plain")]  # fmt: skip
        rows += [(f"{r['shard_mb']:g} ({r['num_shards']})", op, f"{r['MBps'][f'cache_{op}']:.0f}",
                  f"{r['MBps'][f'plain_{op}']:.0f}", f"**{r[f'{op}_ratio']:.2f}**",
                  f"{r[f'best_{op}_ratio']:.2f}", f"{r[f'cpu_{op}_ratio']:.2f}")
                 for r in res["io"] for op in ("write", "read")]  # fmt: skip
        ratios = lambda k: ", ".join(f"{r[k]:.2f}" for r in res["io"])  # noqa: E731
        lines += [
            f"I/O: bf16, codec none, {res['io'][0]['MiB']:.0f} MiB of values, {res['repeats']} "
            "interleaved runs, with fsync. Ratio = cache throughput / plain-file throughput "
            "(target >= 0.7), of the median and of the best times; CPU = process CPU seconds of "
            "the cache / of the plain files.", "", headline_table(rows), "",
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
        rows += [(*_key(c)[:3], f"{c['level'] if c['codec'] != 'none' else '-'}"
                  f"{' (default)' * (_key(c) == DEFAULT)}", f"{c['bytes_per_value']:.3f}",
                  f"{c['ratio_vs_bf16']:.2f}x", f"{c['write_MBps']:.0f}", f"{c['read_MBps']:.0f}",
                  *(_f((c["error"] or {}).get(k)) for k in ("max_abs_err", "mean_abs_err", "rel_err")))
                 for c in src["codecs"]]  # fmt: skip
        lossless = [c for c in src["codecs"] if c["dtype"] == "bf16"]
        best = min(lossless, key=lambda c: c["bytes_per_value"])
        dflt = next(c for c in lossless if _key(c) == DEFAULT)["ratio_vs_bf16"]
        lines += [
            f"Codecs on {src['name']}: N={n} S={s} H={h}, std {src['std']:.3g}, absmax "
            f"{src['absmax']:.3g}; order-0 entropy of bf16: {src['bf16_value_entropy']:.3f} "
            f"bytes/value (16-bit symbols), {src['bf16_byte_entropy']:.3f} (bytes apart).", "",
            headline_table(rows), "",
            f"Lossless default ({' '.join(map(str, DEFAULT))}): {dflt:.2f}x smaller than raw bf16 "
            f"(requirement >= 1.3x: {'met' if dflt >= 1.3 else 'NOT met'}); smallest lossless "
            f"here: {best['codec']} {best['shuffle']} level {best['level']} at "
            f"{best['ratio_vs_bf16']:.2f}x; 16-bit entropy bound "
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
    ap.add_argument("--states", nargs="+", choices=sorted(STATES), default=list(STATES),
                    help="the real states of these models (default both)")  # fmt: skip
    ap.add_argument("--samples", type=int, default=256, help="states per model (default data)")
    ap.add_argument("--docs", type=int, default=40, help="documents the states are computed on")
    ap.add_argument("--states-dir", type=Path, default=Path("/tmp/preinfer_hidden"))
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--shard-mb", type=float, nargs="+", default=[16.0, 4.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-io", action="store_true")
    ap.add_argument("--skip-codecs", action="store_true")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--tiny", action="store_true", help="synthetic, 16 x 8 x 32 values (tests)")
    a = ap.parse_args(argv)
    if a.repeats < 5:
        ap.error("--repeats must be >= 5 (medians)")
    if a.tiny:
        a.seq, a.shard_mb = 8, [0.01]
    res = run(a)
    print(markdown(res))
    if a.out:
        write_results(Path(a.out), res)
    return res


if __name__ == "__main__":
    main()
