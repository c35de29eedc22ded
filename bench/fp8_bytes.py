"""How small fp8 can get: a cache's values coded as fp8_e4m3 (a scale per token row) under each
lossless coder, against the entropy bounds of those codes and the cache's own bytes (issue #56's
<= 0.55x of bf16 lossless).

    .venv/bin/python -m bench.fp8_bytes --cache-root R --fingerprint FP [--rows N]

FP: a complete cache of real hidden states (e.g. the bf16 boundary cache bench/fp8_visit.py
builds under --work). Its rows (the first --rows; default all) are decoded and coded as the fp8 codec codes them
(storage.values.encode), then compressed as one sample chunk each (the cache's chunking) by
zstd and blosc-zstd with byte and bit shuffle. Reported in bytes per value, each with the
per-token fp32 scale (4 / H bytes) added: the cache's stored values' bytes (hidden.zarr, its own codec, e.g. bf16
blosc-zstd byte 3), each coder's fp8 bytes, and two bounds no coder of these codes beats:
the order-0 entropy of the 8-bit codes, and their entropy given the channel (a coder with one
table per hidden channel). Also the entropy of the codes' parts (sign, exponent, mantissa).
"""

from __future__ import annotations

import argparse

import numcodecs
import numpy as np

from bench.harness import headline_table, publish
from storage.atomic import dir_bytes
from storage.reader import open_cache
from storage.values import encode

CODERS = {
    "zstd 3": lambda: numcodecs.Zstd(level=3),
    "zstd 19": lambda: numcodecs.Zstd(level=19),
    "blosc-zstd byte 3 (the default)": lambda: numcodecs.Blosc("zstd", 3, numcodecs.Blosc.SHUFFLE),
    "blosc-zstd bit 3": lambda: numcodecs.Blosc("zstd", 3, numcodecs.Blosc.BITSHUFFLE),
}


def entropy_bits(symbols: np.ndarray, k: int) -> float:
    """Order-0 entropy in bits per symbol of integer symbols in 0..k-1."""
    p = np.bincount(symbols.reshape(-1).astype(np.int64), minlength=k) / symbols.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def channel_entropy_bits(codes: np.ndarray) -> float:
    """Entropy in bits per code given its hidden channel: codes (..., H) uint8."""
    flat = codes.reshape(-1, codes.shape[-1])
    return float(np.mean([entropy_bits(flat[:, h], 256) for h in range(flat.shape[1])]))


def measure(root: str, fp: str, rows: int | None = None) -> dict:
    with open_cache(root, fp) as c:
        n = c.num_samples if rows is None else min(rows, c.num_samples)
        hidden = c.read_rows(0, n)[0]  # (n, S, H) fp32
        total = c.num_samples * c.seq_len * c.hidden_size
        # the stored values' bytes (hidden.zarr: the shards and their metadata), not the
        # token ids and labels beside them, which an fp8 cache holds alike
        stored = {"dtype": c.dtype, "codec": c.manifest.get("codec"),
                  "bytes_per_value": dir_bytes(c.dir / "hidden.zarr") / total}  # fmt: skip
    codes, _ = encode(hidden, "fp8_e4m3")  # (n, S, H) uint8, scale (n, S) fp32
    H = codes.shape[-1]
    scale = 4 / H  # the fp32 scale per token row, per value
    coders = {}
    for name, make in CODERS.items():
        coder = make()
        nbytes = sum(len(coder.encode(codes[i].tobytes())) for i in range(n))
        coders[name] = nbytes / codes.size + scale
    bounds = {"order-0 entropy of the codes": entropy_bits(codes, 256) / 8 + scale,
              "entropy given the channel": channel_entropy_bits(codes) / 8 + scale}  # fmt: skip
    parts = {"sign": entropy_bits(codes >> 7, 2), "exponent": entropy_bits((codes >> 3) & 15, 16),
             "mantissa": entropy_bits(codes & 7, 8)}  # fmt: skip
    base = stored["bytes_per_value"]
    return {"bench": "fp8_bytes", "cache": fp, "rows": n, "hidden_size": H, "stored": stored,
            "fp8_bytes_per_value": coders, "bounds_bytes_per_value": bounds,
            "part_entropy_bits": parts,
            "ratio_to_stored": {k: v / base for k, v in {**coders, **bounds}.items()}}  # fmt: skip


def table(res: dict) -> str:
    s = res["stored"]
    rows = [("fp8_e4m3 + fp32 scale per token", "bytes / value", "/ the cache's own")]
    for k, v in {**res["fp8_bytes_per_value"], **res["bounds_bytes_per_value"]}.items():
        rows.append((k, f"{v:.4f}", f"{res['ratio_to_stored'][k]:.3f}"))
    p = res["part_entropy_bits"]
    return (f"{res['rows']} rows of cache {res['cache'][:12]} (H={res['hidden_size']}); its own "
            f"bytes: {s['dtype']} {s['codec']} {s['bytes_per_value']:.4f} per value\n\n"
            + headline_table(rows) + f"\n\nentropy of the codes' parts, bits: sign "
            f"{p['sign']:.3f}, exponent {p['exponent']:.3f}, mantissa {p['mantissa']:.3f}")  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-root", required=True)
    ap.add_argument("--fingerprint", required=True)
    ap.add_argument("--rows", type=int, default=None, help="the first rows only (default all)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    args = ap.parse_args(argv)
    res = measure(args.cache_root, args.fingerprint, args.rows)
    publish(res, table(res), args.out, "fp8_bytes")
    return res


if __name__ == "__main__":
    main()
