"""Pre-inference throughput: `cache build` end to end vs the bare forward of the same prefix.

    .venv/bin/python -m bench.preinfer_throughput [--documents 600] [--repeats 2]

In one run on one machine, over the demo model cut into one block per layer:
- tokens/s of `cache build --block K` (Ray already started; actor start-up, token reads,
  forward, encoding, checksums, fsync and the manifest all included) vs the bare in-memory
  forward of blocks 0..K-1 in the same dtype and micro-batch, on all threads of this process;
- in process (preinfer.executor=local, the default on one machine) vs 1 and 2 Ray actors;
- refresh of boundary K from K-1 vs build of K from tokens, for K = 2 and 3 (ideal ≈ 1/K of
  the compute when blocks are equal; the ideal from bare forwards is printed beside it), end to
  end and in worker seconds (the actors' summed per-shard read + compute + write time: what
  grows with the data, without the job's fixed actor start-up, planning and manifest).

The demo blocks are one layer of H=128: a shard's encode/decode (blosc-zstd) costs a good part
of a block's compute there. `--set model.hidden_size=512 model.num_heads=8 --arms refresh`
measures the same on blocks with more compute per stored byte (own work dir per --set).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from pipelines.cache_build import build_cache, refresh_cache
from pipelines.init import run_init
from pipelines.ray_env import ensure_ray
from pipelines.tokenize import run_tokenize
from preinfer.adapters import forward_blocks
from preinfer.cache_identity import compute_choice, plan_caches
from preinfer.checkpoint import Checkpoint
from preinfer.config import load_config
from preinfer.device import torch_dtype
from storage.layout import remove_cache
from storage.tokens import TokenStore


def quiet(*a, **k):
    pass


def tokens_total(cfg) -> int:
    store = TokenStore(cfg.data.out_dir)
    return (store.num_samples("train") + store.num_samples("val")) * store.seq_len


def bare_forward(cfg, block: int, first: int = 0) -> float:
    """Seconds of the bare forward of blocks [first, block) over all samples, in memory, in the
    fastest dtype this machine runs (the compute dtype a build resolves: fp32 on a CPU without
    native bf16, where a bf16 matmul is ~50x slower)."""
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    dtype = torch_dtype(compute_choice(cfg).compute)
    model, adapter = ckpt.load(range(first, block))
    model.to(dtype).eval()
    store = TokenStore(cfg.data.out_dir)
    mb = cfg.preinfer.micro_batch
    batches = []
    for split in ("train", "val"):
        ids = torch.from_numpy(store.read(split, 0, store.num_samples(split))[:, :-1]).long()
        batches += list(ids.split(mb))
    if first > 0:  # the input of a refresh: hidden entering block `first`, in one tensor as a
        # worker holds a decoded shard (a list of per-batch outputs, interleaved with the
        # forward's temporaries, fragments the heap and slowed the timed loop by up to 1.5x)
        m0, a0 = ckpt.load(range(first))
        m0.to(dtype).eval()
        sizes = [len(x) for x in batches]
        hidden = torch.empty((sum(sizes), batches[0].shape[1], a0.hidden_size), dtype=dtype)
        with torch.inference_mode():
            for h, x in zip(hidden.split(sizes), batches, strict=True):
                h.copy_(forward_blocks(a0, ckpt.partition, x, 0, first))
        del m0, a0
        batches = list(hidden.split(sizes))
    with torch.inference_mode():  # warm: oneDNN builds its bf16 kernels on first use
        forward_blocks(adapter, ckpt.partition, batches[0], first, block)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for x in batches:
            forward_blocks(adapter, ckpt.partition, x, first, block)
    return time.perf_counter() - t0


PHASES = ("read_s", "compute_s", "write_s")  # pipelines.cache_build.PHASES


def timed_build(cfg, block: int, fn=build_cache, phases: list | None = None) -> float:
    """Seconds of one build (or refresh) of boundary `block`, its old caches removed first;
    appends the workers' summed phase seconds ({read_s, compute_s, write_s}) to `phases`."""
    for p in plan_caches(cfg, block, create=False):
        remove_cache(cfg.cache.root, p.fingerprint)
    t0 = time.perf_counter()
    res = fn(cfg, block, log=quiet)
    assert res["action"] in ("built", "refreshed"), res
    if phases is not None:
        phases.append({**{k: res[k] for k in PHASES}, "startup_s": res["startup_s"],
                       "seconds": res["seconds"]})  # fmt: skip
    return time.perf_counter() - t0


def worker_seconds(phases: list[dict]) -> float:
    """Median over runs of the workers' summed read + compute + write seconds."""
    return statistics.median(sum(p[k] for k in PHASES) for p in phases)


def after_startup(phases: list[dict]) -> float:
    """Median over runs of the job's seconds from the first shard begun to the last written:
    without actor start-up (process spawn, imports, weight loading), a fixed cost per job."""
    return statistics.median(p["seconds"] - p["startup_s"] for p in phases)


def ensure_current(cfg, block: int) -> None:
    if not all(p.complete for p in plan_caches(cfg, block, create=False)):
        build_cache(cfg, block, log=quiet)


def run(args) -> dict:
    tag = f"docs{args.documents}"  # one token set (and checkpoint) per workload
    if args.set:
        tag += "-" + hashlib.sha256(" ".join(args.set).encode()).hexdigest()[:8]
    work = Path(args.work) / tag
    over = [
        f"run.dir={work}",
        f"data.max_documents={args.documents}",
        "partition.num_blocks=6",
        f"preinfer.micro_batch={args.micro_batch}",
        f"cache.dtype={args.dtype}",
        "train.epochs=null",  # every row cached, as the bare forward computes every row
        "train.eval_batches=0",
        *args.set,
    ]
    cfg = load_config(args.config, over)
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    ntok = tokens_total(cfg)
    ensure_ray()  # excluded from every timing
    threads = torch.get_num_threads()
    rows = {}

    def med(fn, n=args.repeats):
        return statistics.median(fn() for _ in range(n))

    K = args.block
    headline: dict = {"tokens": ntok}
    bare = None
    if "throughput" in args.arms:
        bare = med(lambda: bare_forward(cfg, K))
        c = load_config(args.config, [*over, "preinfer.executor=local"])
        rows[f"build K={K}, in process"] = med(lambda c=c: timed_build(c, K))
        for actors in (2, 1):
            c = load_config(args.config, [*over, "preinfer.executor=ray",
                                          f"preinfer.actors={actors}"])  # fmt: skip
            rows[f"build K={K}, {actors} actor(s)"] = med(lambda c=c: timed_build(c, K))
        rows[f"bare forward K={K} ({threads} threads)"] = bare
        b0 = rows[f"build K={K}, in process"]
        b2, b1 = rows[f"build K={K}, 2 actor(s)"], rows[f"build K={K}, 1 actor(s)"]
        headline["build in process / bare forward (target >= 0.9)"] = bare / b0
        headline["build (2 actors) / bare forward"] = bare / b2
        headline["2 actors / 1 actor speed"] = b1 / b2
    refresh = {}
    for k in (2, 3) if "refresh" in args.arms else ():
        ensure_current(cfg, k - 1)  # the refresh's source stays; only boundary k is redone
        bp: list[dict] = []
        rp: list[dict] = []
        build_t = med(lambda k=k, bp=bp: timed_build(cfg, k, phases=bp))
        refresh_t = med(lambda k=k, rp=rp: timed_build(cfg, k, refresh_cache, rp))
        ideal = med(lambda k=k: bare_forward(cfg, k, first=k - 1)) / med(
            lambda k=k: bare_forward(cfg, k)
        )
        refresh[k] = {
            "build_s": build_t,
            "refresh_s": refresh_t,
            "refresh_over_build": refresh_t / build_t,
            "build_worker_s": worker_seconds(bp),
            "refresh_worker_s": worker_seconds(rp),
            "worker_refresh_over_build": worker_seconds(rp) / worker_seconds(bp),
            "startup_s": [p["startup_s"] for p in bp + rp],
            "steady_refresh_over_build": after_startup(rp) / after_startup(bp),
            # the workers' compute alone (no read, encode or write): what 1/K is about
            "compute_refresh_over_build": statistics.median(p["compute_s"] for p in rp)
            / statistics.median(p["compute_s"] for p in bp),
            "build_phases": bp,
            "refresh_phases": rp,
            "ideal_bare": ideal,
            "one_over_k": 1 / k,
        }
        headline[f"refresh/build K={k} (ideal {ideal:.2f})"] = refresh_t / build_t
        headline[f"refresh/build K={k}, worker seconds"] = refresh[k]["worker_refresh_over_build"]
        headline[f"refresh/build K={k}, after actor start-up"] = refresh[k][
            "steady_refresh_over_build"
        ]
    return {
        "bench": "preinfer_throughput",
        "headline": headline,
        "tokens": ntok,
        "dtype": args.dtype,
        "set": args.set,
        "threads": threads,
        "block": K,
        "seconds": rows,
        "tokens_per_s": {k: ntok / v for k, v in rows.items()},
        "build_over_bare": {k: (ntok / v) / (ntok / bare) for k, v in rows.items()} if bare else {},
        "refresh": refresh,
        "repeats": args.repeats,
    }


def table(res: dict) -> str:
    lines = [
        f"workload: {res['tokens']:,} tokens (train+val), dtype {res['dtype']}, "
        f"medians of {res['repeats']}"
        + (f", overrides: {' '.join(res['set'])}" if res.get("set") else ""),
    ]
    if res["seconds"]:
        lines += ["", "| arm | seconds | tokens/s | vs bare forward |", "|---|---|---|---|"]
    for k, s in res["seconds"].items():
        lines.append(
            f"| {k} | {s:.1f} | {res['tokens_per_s'][k]:,.0f} | {res['build_over_bare'][k]:.2f} |"
        )
    lines += (
        []
        if not res["refresh"]
        else [
            "",
            "| boundary K | build s | refresh s | refresh/build | worker s build | worker s refresh "
            "| refresh/build (worker s) | after actor start-up | compute only | ideal (bare) | 1/K |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    )
    for k, r in res["refresh"].items():
        lines.append(
            f"| {k} | {r['build_s']:.1f} | {r['refresh_s']:.1f} | "
            f"{r['refresh_over_build']:.2f} | {r['build_worker_s']:.1f} | "
            f"{r['refresh_worker_s']:.1f} | {r['worker_refresh_over_build']:.2f} | "
            f"{r['steady_refresh_over_build']:.2f} | {r['compute_refresh_over_build']:.2f} | "
            f"{r['ideal_bare']:.2f} | {r['one_over_k']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--documents", type=int, default=600)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", default="/tmp/preinfer-bench-throughput")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="200 documents (make bench)")
    ap.add_argument("--set", nargs="+", default=[], help="config overrides (e.g. a wider model)")
    ap.add_argument(
        "--arms",
        nargs="+",
        default=["throughput", "refresh"],
        choices=["throughput", "refresh"],
        help="throughput: build vs bare forward, 1 vs 2 actors; refresh: refresh vs build",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.documents = min(args.documents, 200)
    res = run(args)
    print(table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
