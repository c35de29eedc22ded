"""Value statistics of cache shards (the done markers' `stats`, the manifest's `stats`/`error`).

`shard_stats`: exact count / sum / sum of squares / absmax of every value of a shard, one
blocked fp32 pass that also catches NaN/inf.

`shard_stats_sampled` (what the writer uses for lossless shards stored bit for bit): the
NaN/inf check and absmax stay exact, from one integer pass over the raw bits of every value
(two SIMD max reductions, no float conversion); sum and sum of squares (the manifest's mean
and std, informational) come from a fixed, deterministic row subsample: rows 0, k, 2k, ... of
the shard with k = ceil(values / STATS_SAMPLE_VALUES). A shard of at most STATS_SAMPLE_VALUES
values is summed whole (k = 1: exact, as shard_stats). The marker records k ("row_stride") and
the shard's value count ("values"); the manifest says how its stats were taken
("stats_sampling", see sampling_record).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from storage.values import CodecError, _count_nonfinite

STATS_BLOCK = 1 << 18  # values per block: 1 MiB of fp32, stays in L2; few Python calls
_ONES = np.ones(STATS_BLOCK, np.float32)


def _f32_blocks(t: torch.Tensor):
    """float32 numpy blocks of a float tensor's values, in a fixed order (deterministic)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.float32:
        a = flat.numpy()
        for o in range(0, len(a), STATS_BLOCK):
            yield a[o : o + STATS_BLOCK]
        return
    if t.dtype == torch.bfloat16:
        bits = flat.view(torch.int16).numpy().view(np.uint16)
        buf = np.empty(min(STATS_BLOCK, len(bits)), np.uint32)
        for o in range(0, len(bits), STATS_BLOCK):
            u = buf[: len(bits[o : o + STATS_BLOCK])]
            np.copyto(u, bits[o : o + STATS_BLOCK])
            np.left_shift(u, 16, out=u)  # bf16 bits are the top half of fp32's: exact
            yield u.view(np.float32)
        return
    a = flat.numpy() if t.dtype == torch.float16 else flat.float().numpy()
    buf = np.empty(min(STATS_BLOCK, len(a)), np.float32)
    for o in range(0, len(a), STATS_BLOCK):
        f = buf[: len(a[o : o + STATS_BLOCK])]
        np.copyto(f, a[o : o + STATS_BLOCK])
        yield f


def _sums(t: torch.Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, absmax) of all values in one blocked pass: each block of
    STATS_BLOCK values as float32 (exact for bf16/fp16), summed and squared-summed by BLAS dots
    (fp32 within a block), blocks combined in float64; absmax = max(|min|, |max|). A NaN/inf
    value (or an fp32 overflow of a block's sums) makes the sums non-finite."""
    if t.dtype == torch.bfloat16:
        return _sums_bf16(t.detach().cpu().contiguous().reshape(-1).view(torch.int16).numpy())
    s = ss = hi = lo = 0.0
    for f in _f32_blocks(t):  # numpy/BLAS only: torch's OpenMP reductions spin on busy CPUs
        s += float(np.dot(f, _ONES[: len(f)]))
        ss += float(np.dot(f, f))
        hi, lo = max(hi, float(f.max())), min(lo, float(f.min()))
    return s, ss, max(hi, -lo)


def _bf16_float(bits: int) -> float:
    return float(np.array([(bits & 0xFFFF) << 16], np.uint32).view(np.float32)[0])


def _sums_bf16(bits: np.ndarray) -> tuple[float, float, float]:
    """_sums of bf16 values given as their int16 bits, without widening them one by one.

    Read as uint32 words, a pair of bf16 values is (odd << 16 | even): `word & 0xFFFF0000` is
    the odd value's fp32 bits and `word << 16` the even one's (both exact), two cheap bit ops
    per block instead of a widening copy. absmax from the bits: magnitude bits order like
    magnitudes, so it is max(largest int16 (positives), largest uint16 & 0x7FFF (negatives)).
    The summation order depends only on the values (unaligned input is copied first), so
    equal shards give equal stats.
    """
    top = max(int(bits.max(initial=0)), int(bits.view(np.uint16).max(initial=0)) & 0x7FFF)
    last = None
    if len(bits) % 2:
        last = _bf16_float(int(bits[-1]))
        bits = bits[:-1]
    if bits.ctypes.data % 4:
        bits = bits.copy()
    words = bits.view(np.uint32)
    block = STATS_BLOCK // 2
    buf = np.empty(min(block, len(words)), np.uint32)
    s = ss = 0.0
    for o in range(0, len(words), block):
        w = words[o : o + block]
        u, one = buf[: len(w)], _ONES[: len(w)]
        f = u.view(np.float32)
        np.bitwise_and(w, np.uint32(0xFFFF0000), out=u)  # odd values
        s, ss = s + float(np.dot(f, one)), ss + float(np.dot(f, f))
        np.left_shift(w, np.uint32(16), out=u)  # even values
        s, ss = s + float(np.dot(f, one)), ss + float(np.dot(f, f))
    if last is not None:
        s, ss = s + last, ss + last * last
    return s, ss, _bf16_float(top)


def _sums_f64(t: torch.Tensor) -> tuple[float, float, float]:
    """As _sums but in float64 throughout (fallback when fp32 block sums overflow)."""
    s = ss = 0.0
    m = 0.0
    for f in _f32_blocks(t):
        d = f.astype(np.float64)
        s, ss, m = s + float(d.sum()), ss + float(np.dot(d, d)), max(m, float(np.abs(d).max()))
    return s, ss, m


def count_nonfinite(t: torch.Tensor) -> int:
    """Number of NaN/inf values of a float tensor."""
    return _count_nonfinite(t.detach().cpu().contiguous())


# raw-bit masks: magnitude bits (sign cleared) at or above the all-ones exponent = inf/NaN
_BITS = {  # torch float dtype -> (signed int view, unsigned numpy view, exponent mask)
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80),
    torch.float16: (torch.int16, np.uint16, 0x7C00),
    torch.float32: (torch.int32, np.uint32, 0x7F800000),
}
STATS_SAMPLE_VALUES = 1 << 18  # values a shard's sums come from (about): 512 KiB of bf16


def _top_bits(bits: np.ndarray, uv) -> int:
    """Largest sign-cleared bit pattern of the int view `bits` (bits_absmax's docstring)."""
    sign = 1 << (8 * bits.itemsize - 1)
    return max(int(bits.max()), int(bits.view(uv).max()) & (sign - 1))


def bits_absmax(t: torch.Tensor) -> tuple[float, bool]:
    """(absmax, any NaN/inf) of a bf16/fp16/fp32 tensor from its raw bits, every value.

    Magnitude bits order like magnitudes, so the largest |x| has the largest `bits & ~sign`:
    that is max(largest signed view (the positives), largest unsigned view & ~sign (the
    negatives' magnitudes; the positives' when there are none)). A value is inf/NaN iff its
    magnitude bits reach the exponent mask. Two max reductions, no float conversion.
    """
    iv, uv, exp = _BITS[t.dtype]
    bits = t.detach().cpu().contiguous().reshape(-1).view(iv).numpy()
    top = _top_bits(bits, uv) if bits.size else 0
    return (math.inf, True) if top >= exp else (_magnitude(top, t.dtype), False)


def _magnitude(top: int, dtype: torch.dtype) -> float:
    """The float whose (sign-cleared) bits are `top`."""
    if dtype == torch.bfloat16:
        return _bf16_float(top)
    np_dt = (np.float16, np.uint16) if dtype == torch.float16 else (np.float32, np.uint32)
    return float(np.array([top], np_dt[1]).view(np_dt[0])[0])


def _checked_sums(decoded: torch.Tensor) -> tuple[float, float, float]:
    """_sums, with the NaN/inf check (CodecError) and the float64 fallback on fp32 overflow."""
    n = decoded.numel()
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite sums are checked below
        s, ss, m = _sums(decoded) if n else (0.0, 0.0, 0.0)
        if not (math.isfinite(s) and math.isfinite(ss) and math.isfinite(m)):
            bad = count_nonfinite(decoded)
            if bad:
                raise CodecError(f"{bad} of {n} values are NaN/inf")
            s, ss, m = _sums_f64(decoded)  # finite values whose fp32 sums overflowed
    return s, ss, m


def shard_stats_sampled(x: torch.Tensor, budget: int | None = None) -> dict:
    """Stats of shard rows x [n, ...] (bf16/fp16/fp32, the values exactly as stored): exact
    absmax and NaN/inf check (CodecError) over every value; sums over every k-th row (module
    docstring). Deterministic: a rewritten shard gets the same marker."""
    budget = budget or STATS_SAMPLE_VALUES
    total = x.numel()
    rows = x.shape[0] if x.dim() else 1
    k = min(rows, max(1, -(-total // budget))) if total else 1
    if k == 1:
        return shard_stats(x)
    # One pass over the shard in groups of rows that fit in L2: both max reductions of
    # bits_absmax, and the copy of the sample rows (0, k, 2k, ...) among them while they are
    # cached. numpy on the raw bits: a strided torch copy is ~10x slower.
    iv, uv, exp = _BITS[x.dtype]
    flat = x.detach().cpu().contiguous().view(iv).numpy().reshape(rows, -1)  # [n, S*H]
    sample = np.empty((-(-rows // k), flat.shape[1]), flat.dtype)  # [ceil(n / k), S*H]
    g = max(1, STATS_BLOCK // flat.shape[1])  # rows per group
    top = 0
    for r0 in range(0, rows, g):
        top = max(top, _top_bits(flat[r0 : r0 + g], uv))
        for r in range(-(-r0 // k) * k, min(r0 + g, rows), k):
            sample[r // k] = flat[r]
    if top >= exp:
        raise CodecError(f"{count_nonfinite(x)} of {total} values are NaN/inf")
    absmax = _magnitude(top, x.dtype)
    sub = torch.from_numpy(sample).view(x.dtype)
    s, ss, _ = _checked_sums(sub)
    return {"count": int(sub.numel()), "sum": s, "sumsq": ss, "absmax": absmax, "err": None,
            "values": int(total), "row_stride": int(k)}  # fmt: skip


def sampling_record(shards: list[dict]) -> dict | None:
    """The manifest's "stats_sampling" from the shards' stats: None when every value was summed."""
    if not any(m.get("row_stride", 1) > 1 for m in shards):
        return None
    return {
        "rule": "sum/sumsq (mean, std) of rows 0, k, 2k, ... of each shard, k = ceil(shard "
        f"values / {STATS_SAMPLE_VALUES}); absmax and the NaN/inf check cover every value",
        "values_summed": sum(m["count"] for m in shards),
        "values": sum(m.get("values", m["count"]) for m in shards),
        "shards_sampled": sum(m.get("row_stride", 1) > 1 for m in shards),
    }


def shard_stats(decoded: torch.Tensor, given: torch.Tensor | None = None) -> dict:
    """Sums of one shard's decoded values (+ error vs the given values when not exact).

    Every value counts (exact absmax; sum and sum of squares accumulated in fp32 within blocks
    of STATS_BLOCK values and float64 across blocks), deterministic, so a rewritten shard gets
    the same marker. Raises CodecError if a decoded value is NaN/inf (this pass doubles as the
    writer's finiteness check).
    """
    s, ss, m = _checked_sums(decoded)
    out = {"count": int(decoded.numel()), "sum": s, "sumsq": ss, "absmax": m, "err": None}
    if given is not None:
        out["err"] = _error_sums(decoded, given)
    return out


def _error_sums(decoded: torch.Tensor, given: torch.Tensor) -> dict:
    """max |e|, sum |e|, sum e^2 of e = decoded - given, and sum given^2: blocked, fp32 within a
    block (BLAS dots), float64 across blocks."""
    mx = sa = sq = ref = 0.0
    e = np.empty(min(STATS_BLOCK, decoded.numel()), np.float32)
    for d, g in zip(_f32_blocks(decoded), _f32_blocks(given), strict=True):
        k = len(d)
        ek, one = e[:k], _ONES[:k]
        np.subtract(d, g, out=ek)
        sq += float(np.dot(ek, ek))
        ref += float(np.dot(g, g))
        np.abs(ek, out=ek)
        mx = max(mx, float(ek.max()))
        sa += float(np.dot(ek, one))
    return {"max_abs": mx, "sum_abs": sa, "sum_sq": sq, "ref_sum_sq": ref}


def combine_stats(shards: list[dict]) -> tuple[dict, dict | None]:
    """Per-shard stats -> ({mean, std, absmax}, error summary or None when all were exact).

    mean/std weigh each shard by the values it summed (all of them, or its row sample)."""
    count = sum(m["count"] for m in shards)
    mean = sum(m["sum"] for m in shards) / count
    var = max(0.0, sum(m["sumsq"] for m in shards) / count - mean * mean)
    stats = {"mean": mean, "std": var**0.5, "absmax": max(m["absmax"] for m in shards)}
    errs = [m["err"] for m in shards if m["err"] is not None]
    if not errs:
        return stats, None
    ref = sum(e["ref_sum_sq"] for e in errs)
    return stats, {
        "max_abs_err": max(e["max_abs"] for e in errs),
        "mean_abs_err": sum(e["sum_abs"] for e in errs)
        / sum(m.get("values", m["count"]) for m in shards),
        "rel_err": (sum(e["sum_sq"] for e in errs) / ref) ** 0.5 if ref else 0.0,
        "shards_measured": len(errs),
    }
