"""Does the cache writer keep up with a card's pre-inference? (`preinfer plan`'s writer line)

One card's forward makes tokens/s x H x bytes per stored value of cache to copy, compress,
checksum and write on the host's CPUs; the writer does MB per core-second
(preinfer.plan.costmodel.WRITER_MB_PER_CORE_S, measured by bench/writer.py, or given). The plan
says how many cores per card that takes, whether the card has them and the encoder threads
(cache.codec_threads) use them, and what to change when not.
"""

from __future__ import annotations

import math
import os

from core.config import ConfigError
from preinfer.plan.costmodel import (
    WRITER_MB_PER_CORE_S,
    WRITER_SOURCE,
    Flops,
    writer_cores,
    writer_key,
)
from storage.config import CacheConfig
from storage.values import is_lossy, stored_dtype


def writer_plan(c: CacheConfig, o, sh, part, S: int, infer_peak: float | None) -> dict:
    """Whether the cache writer of cache settings `c` keeps up with one card's pre-inference:
    its output in MB/s (forward tokens/s x H x stored bytes per value), the cores that needs at
    the writer's MB per core-second, against the cores per card and the encoder threads
    (cache.codec_threads); when short, what would do: more encoder threads, or a lighter codec.
    `o`: PlanOptions."""
    M = part.num_blocks
    if o.forward_tokens_s is not None and o.forward_tokens_s <= 0:
        raise ConfigError(f"plan: --forward-tokens-s must be > 0, got {o.forward_tokens_s}")
    if (o.writer_mb_s is not None and o.writer_mb_s <= 0) or (o.host_cores or 1) < 1:
        raise ConfigError("plan: --writer-mb-s must be > 0 and --host-cores >= 1")
    per_value = stored_dtype(c.dtype).itemsize + (4 / sh.hidden if is_lossy(c.dtype) else 0)
    key = writer_key(c.codec, c.level, c.shuffle)
    out = {"codec": key, "bytes_per_value": per_value, "bound": None, "suggest": []}
    if o.forward_tokens_s:
        tok, out["tokens_source"] = o.forward_tokens_s, "given"
    elif infer_peak and M > 1:  # the lightest refresh makes the most bytes per FLOP
        fl = Flops(sh=sh, part=part, seq=S)
        tok = infer_peak * o.mfu / min(fl.preinfer(k) for k in range(1, M))
        out["tokens_source"] = f"FLOPs / (card bf16 peak x MFU {o.mfu}), lightest refresh"
    else:
        out["tokens_source"] = "unknown: pass --forward-tokens-s (measured)"
        return out
    rate = o.writer_mb_s or WRITER_MB_PER_CORE_S.get(key)
    out["rate_source"] = "given" if o.writer_mb_s else (WRITER_SOURCE if rate else None)
    if not rate:
        out["rate_source"] = f"unknown for {key}: pass --writer-mb-s (bench/writer.py)"
        return out
    out.update(writer_cores(tok, sh.hidden, per_value, rate))
    cores = o.host_cores or max(1, (os.cpu_count() or 1) // o.cards)
    threads = c.codec_threads or min(4, cores)  # shard_codec.DEFAULT_CODEC_THREADS' rule
    usable = min(cores, threads)
    out.update({"host_cores": cores, "codec_threads": threads, "bound": out["cores"] > usable,
                "writer_tokens_s": usable * rate * 1e6 / (sh.hidden * per_value)})  # fmt: skip
    if out["bound"]:
        need = math.ceil(out["cores"])
        if need <= cores:
            out["suggest"].append(f"cache.codec_threads={need} (more encoder threads)")
        light = [(k, out["mb_s"] / r) for k, r in WRITER_MB_PER_CORE_S.items() if k != key]
        light = sorted((n, k) for k, n in light if n <= usable)
        if light:
            out["suggest"].append("a lighter codec (cache.codec, cache.level, cache.shuffle): "
                                  + ", ".join(f"{k} ({n:.1f} cores)" for n, k in light))  # fmt: skip
        if not out["suggest"]:
            out["suggest"].append(
                f"no codec keeps up on {usable} cores: the build runs at the writer's "
                f"~{out['writer_tokens_s']:,.0f} tokens/s per card unless each card gets "
                f"{need} cores (a bigger host, or fewer cards per host)"
            )
    return out


def format_writer(w: dict) -> str:
    """The plan's line about the cache writer against one card's pre-inference output."""
    if "cores" not in w:
        src = w.get("rate_source") or w["tokens_source"]
        return f"writer  cache codec {w['codec']}: {src}"
    verdict = (
        "WRITER-BOUND: " + "; or ".join(w["suggest"])
        if w["bound"]
        else f"keeps up ({w['cores']:.1f} of {min(w['host_cores'], w['codec_threads'])} cores)"
    )
    return (
        f"writer  one card pre-infers ~{w['tokens_per_s']:,.0f} tokens/s ({w['tokens_source']}) "
        f"= {w['mb_s']:,.0f} MB/s of cache; {w['codec']} writes {w['mb_per_core_s']:.0f} MB per "
        f"core-second ({w['rate_source']}) -> {w['cores']:.1f} cores per card; it has "
        f"{w['host_cores']} (cache.codec_threads {w['codec_threads']}): {verdict}"
    )
