"""Pre-inference throughput: `cache build` end to end vs the bare forward of the same compute.

    .venv/bin/python -m bench.preinfer_throughput --quick            # in process vs bare, x5
    .venv/bin/python -m bench.preinfer_throughput --quick --arms throughput actors
    .venv/bin/python -m bench.preinfer_throughput --arms refresh

The bare forward computes what the build computes (forward_prefix over the build's own rows, in
its micro-batches per shard, on the same threads); arms alternate after one untimed run
(harness.interleaved), the ratio bare seconds / the arm's taken per repeat (docs/writer.md,
section 4). Arms: throughput = the build in process; actors = on 2 Ray actors; overlap =
preinfer.write_queue=0 vs the config's queue; refresh = refresh of boundary K from K-1 vs a
build of K, K = 2, 3; dtype = the bare forward in bf16 vs fp32 rounded to bf16 per block.
--s3: cache.root on a moto S3 server.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import (
    add_omp_wait,
    headline_table,
    interleaved,
    load_average,
    omp_wait_policy,
    publish,
    quiet,
    show,
    spread,
)
from bench.writer import moto_server, timed
from pipelines.cache_build import PHASES, build_cache, create_writers, plan_block, refresh_cache
from pipelines.init import run_init
from pipelines.ray_env import ensure_ray
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.prefix import forward_prefix
from preinfer.run.config import load_config
from preinfer.runtime.device import pin_threads, resolve_device, torch_dtype
from preinfer.schedule.cache_identity import compute_choice
from storage.cache import CacheWriter
from storage.layout import remove_cache


def build_inputs(cfg, block: int) -> list[list[torch.Tensor]]:
    """The build's micro-batches of token ids (n <= micro_batch, S), per shard of each cache
    (train, val) in its order."""
    out = []
    for p in create_writers(cfg, block):  # creates the writers (samples.parquet): the build's rows
        w = CacheWriter.open(cfg.cache.root, p.fingerprint)
        for s in range(w.num_shards):
            ids = torch.from_numpy(np.array(w.read_input_ids(*w.shard_range(s)))).long()
            out.append(list(ids.split(cfg.preinfer.micro_batch)))
    return out


class BareForward:
    """Blocks [first, block) over shards' micro-batches as PrefixWorker._compute runs them:
    each output kept until its shard's are joined (freed at once, glibc hands the heap top back
    and the next micro-batch page-faults it in again: 1.6x the build's CPU seconds)."""

    def __init__(self, cfg, block: int, first: int = 0, round_to: str | None = None):
        choice = compute_choice(cfg.preinfer, cfg.cache, cfg.run.device)
        self.dtype = torch_dtype(choice.compute)
        round_to = round_to or choice.round_to
        self.round_to = torch_dtype(round_to) if round_to else None
        ckpt = Checkpoint.open(cfg.run.checkpoint)
        self.part, self.first, self.block = ckpt.partition, first, block
        self.device = resolve_device(cfg.run.device)
        self.model, self.adapter = ckpt.load(range(first, block), device=self.device)
        self.model.to(self.dtype).eval()

    @torch.inference_mode()
    def outputs(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each micro-batch's output, its input to the device and back as a worker moves them."""
        return [forward_prefix(self.adapter, self.part, x.to(self.device), self.first,
                               self.block, dtype=self.dtype, round_to=self.round_to).cpu()
                for x in batches]  # fmt: skip

    def __call__(self, shards: list[list[torch.Tensor]]) -> float:
        """Seconds of the forward of every shard, its outputs joined."""
        t0 = time.perf_counter()
        for batches in shards:
            torch.cat(self.outputs(batches))
        return time.perf_counter() - t0


def timed_build(cfg, block: int, fn=build_cache, phases: list | None = None) -> float:
    """Seconds of one build (or refresh) of boundary `block`, its old caches removed first;
    appends the workers' summed phase seconds ({read_s, compute_s, write_s}) to `phases`."""
    for p in plan_block(cfg, block).caches:
        remove_cache(cfg.cache.root, p.fingerprint)
    t0 = time.perf_counter()
    res = fn(cfg, block, log=quiet)
    assert res["action"] in ("built", "refreshed"), res
    if phases is not None:
        phases.append({**{k: res[k] for k in PHASES}, "startup_s": res["startup_s"],
                       "seconds": res["seconds"], "executor": res["executor"]})  # fmt: skip
    return time.perf_counter() - t0


def with_threads(n: int, fn):
    """fn() on n torch threads, then back to the process's count."""
    was = torch.get_num_threads()
    pin_threads(n)
    try:
        return fn()
    finally:
        pin_threads(was)


def paired(bare_fn, build_fns: dict, repeats: int) -> dict:
    """harness.interleaved over the bare forward and the arms; per-round ratios bare seconds /
    arm seconds, by wall clock and by this process's CPU seconds (less moved by what else the
    machine runs; Ray actors' CPU is not in it)."""
    fns = {"bare": bare_fn, **build_fns}
    got = interleaved({k: functools.partial(timed, f) for k, f in fns.items()}, repeats)
    out = {}
    for i, key, ratio in ((0, "seconds", "ratio"), (2, "cpu_seconds", "cpu_ratio")):
        xs = {k: [v[i] for v in vs] for k, vs in got.items()}
        out[key] = {k: spread(v) for k, v in xs.items()}
        out[ratio] = {k: spread([b / a for b, a in zip(xs["bare"], xs[k], strict=True)])
                      for k in build_fns}  # fmt: skip
    return out


def run(args, s3_url: str | None = None) -> dict:
    tag = f"docs{args.documents}"  # one token set (and checkpoint) per workload
    if args.set:
        tag += "-" + hashlib.sha256(" ".join(args.set).encode()).hexdigest()[:8]
    # train.epochs=null: every row cached, as the bare forward computes every row
    over = [f"run.dir={Path(args.work) / tag}", f"data.max_documents={args.documents}",
            "partition.num_blocks=6", f"preinfer.micro_batch={args.micro_batch}",
            "cache.dtype=bf16", "train.epochs=null", "train.eval_batches=0", *args.set]  # fmt: skip
    if s3_url:
        over += [f"cache.root=s3://bench/{tag}", f"storage.endpoint_url={s3_url}",
                 "storage.key=testing", "storage.secret=testing", "storage.region=us-east-1"]  # fmt: skip
    cfg = load_config(args.config, over)
    store = run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    ntok = (store.num_samples("train") + store.num_samples("val")) * store.seq_len
    K = args.block
    res: dict = {"bench": "preinfer_throughput", "tokens": ntok, "dtype": cfg.cache.dtype,
                 "compute": compute_choice(cfg.preinfer, cfg.cache, cfg.run.device).compute,
                 "set": args.set, "threads": pin_threads(),  # as PrefixWorker pins them
                 "block": K, "micro_batch": args.micro_batch, "repeats": args.repeats,
                 "documents": args.documents, "s3": bool(s3_url), "codec": cfg.cache.codec,
                 "codec_threads": cfg.cache.codec_threads, "load_before": load_average(),
                 "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                 "arms": {}}  # fmt: skip
    batches = build_inputs(cfg, K)
    assert sum(x.shape[0] * x.shape[1] for b in batches for x in b) == ntok, "bare != build rows"
    bare = functools.partial(BareForward(cfg, K), batches)
    local = load_config(args.config, [*over, "preinfer.executor=local"])
    if "throughput" in args.arms:
        fns = {"in process": lambda: timed_build(local, K)}
        for n in args.bare_threads:  # the bare forward on other thread counts, for contrast
            fns[f"bare, {n} thread(s)"] = functools.partial(with_threads, n, bare)
        res["arms"]["throughput"] = paired(bare, fns, args.repeats)
    if "dtype" in args.arms:  # the forward in bf16 against fp32 rounded to bf16 per block
        f32 = BareForward(load_config(args.config, [*over, "preinfer.compute_dtype=fp32"]), K)
        b16 = BareForward(load_config(args.config, [*over, "preinfer.compute_dtype=bf16"]), K)
        res["arms"]["dtype"] = paired(lambda: b16(batches), {"fp32 rounded": lambda: f32(batches)},
                                      args.repeats)  # fmt: skip
    if "overlap" in args.arms:
        q0 = load_config(args.config, [*over, "preinfer.executor=local", "preinfer.write_queue=0"])
        res["arms"]["overlap"] = paired(
            bare,
            {"write_queue=0": lambda: timed_build(q0, K),
             f"write_queue={local.preinfer.write_queue}": lambda: timed_build(local, K)},
            args.repeats,
        )  # fmt: skip
    if "actors" in args.arms:
        ensure_ray()  # excluded from every timing
        ray = load_config(args.config, [*over, "preinfer.executor=ray", "preinfer.actors=2"])
        ph = []
        fns = {"2 actor(s)": lambda: timed_build(ray, K, phases=ph)}
        res["arms"]["actors"] = paired(bare, fns, args.repeats)
        # where an actor build's seconds go: start-up (spawn, imports, weights) before its
        # first shard, the workers' summed phases, and the rest (plan, finalize)
        res["arms"]["actors"]["phases"] = {2: ph[1:]}  # after warm-up
    for k in (2, 3) if "refresh" in args.arms else ():
        if not plan_block(local, k - 1).reads.complete:
            build_cache(local, k - 1, log=quiet)  # the refresh's source stays
        bk = build_inputs(local, k)
        src = BareForward(local, k - 1, round_to=local.cache.dtype)  # what a refresh reads
        one = functools.partial(BareForward(local, k, first=k - 1), [src.outputs(b) for b in bk])
        bp, rp = [], []  # the build's and the refresh's phases
        r = paired(functools.partial(BareForward(local, k), bk),
                   {"build": lambda k=k, bp=bp: timed_build(local, k, phases=bp),
                    "refresh": lambda k=k, rp=rp: timed_build(local, k, refresh_cache, rp),
                    "bare refresh": one}, args.repeats)  # fmt: skip
        r["phases"] = {"build": bp, "refresh": rp}
        r["refresh_over_build"] = statistics.median(
            a / b for a, b in zip(r["seconds"]["refresh"]["values"],
                                  r["seconds"]["build"]["values"], strict=True))  # fmt: skip
        r["ideal"] = r["seconds"]["bare refresh"]["median"] / r["seconds"]["bare"]["median"]
        res["arms"][f"refresh K={k}"] = r
    res["load_after"] = load_average()
    return res


def table(res: dict) -> str:
    rows = [("arms", "arm", "seconds median [min, max]", "tokens/s", "bare / arm median [min, max]",
             "CPU seconds", "bare / arm by CPU seconds")]  # fmt: skip
    for name, a in res["arms"].items():
        for arm, s in a["seconds"].items():
            rows.append((name, arm, show(s), f"{res['tokens'] / s['median']:,.0f}",
                         show(a["ratio"][arm]) if arm in a["ratio"] else "1 (reference)",
                         f"{a['cpu_seconds'][arm]['median']:.2f}",
                         show(a["cpu_ratio"][arm]) if arm in a["cpu_ratio"] else "1 (reference)"))  # fmt: skip
        for n, ps in (a.get("phases") or {}).items() if name == "actors" else ():
            su = statistics.median(p["startup_s"] for p in ps)
            work = statistics.median(sum(p[k] for k in PHASES) for p in ps)
            rows.append((name, f"{n} actor(s): start-up s / workers' read+compute+write s",
                         f"{su:.2f} / {work:.2f}", "", "", "", ""))  # fmt: skip
        if "refresh_over_build" in a:
            rows.append((name, "refresh / build seconds", f"{a['refresh_over_build']:.2f} (ideal "
                         f"{a['ideal']:.2f})", "", "", "", ""))  # fmt: skip
    return (f"workload: {res['tokens']:,} tokens (train+val), cache {res['dtype']}, compute "
            f"{res['compute']}, micro-batch {res['micro_batch']}, {res['threads']} threads, "
            f"{res['repeats']} paired repeats after one warm-up; OMP_WAIT_POLICY "
            f"{res['omp_wait_policy']}; load average before {res['load_before']}, after "
            f"{res['load_after']}" + (f"; overrides: {' '.join(res['set'])}" if res.get("set") else "")
            + "\n\n" + headline_table(rows))  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--documents", type=int, default=600)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default="/tmp/preinfer-bench-throughput")
    ap.add_argument("--out", default=None, help="JSON path; default bench/results/<name>-<time>")
    ap.add_argument("--quick", action="store_true", help="20 documents (make bench)")
    ap.add_argument("--set", nargs="+", default=[], help="config overrides (e.g. a wider model)")
    ap.add_argument("--arms", nargs="+", default=["throughput"],
                    choices=["throughput", "actors", "overlap", "refresh", "dtype"])  # fmt: skip
    ap.add_argument("--s3", action="store_true", help="cache.root on a moto S3 server")
    ap.add_argument("--bare-threads", type=int, nargs="*", default=[],
                    help="also the bare forward on these torch thread counts (e.g. 1)")  # fmt: skip
    add_omp_wait(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    omp_wait_policy(
        args.omp_wait, "bench.preinfer_throughput", argv
    )  # both arms' threads wait the same way
    if args.quick:
        args.documents = min(args.documents, 20)
    with moto_server() if args.s3 else contextlib.nullcontext() as url:
        res = run(args, url)
    publish(res, table(res), args.out, "preinfer_throughput")
    return res


if __name__ == "__main__":
    main()
