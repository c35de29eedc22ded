"""Trainer step for block K: from the cache vs recomputing the frozen prefix vs full training.

    .venv/bin/python -m bench.trainer_step [--config configs/demo.yaml] [--repeats 7]
    .venv/bin/python -m bench.trainer_step --precision [--config configs/llama-small.yaml]
        [--seq 128] [--block 1] [--repeats 5] [--steps 3] [--set train.batch_size=B]
    .venv/bin/python -m bench.trainer_step --quick   # make bench: both, demo-sized, few repeats

For the last and a middle block: the step time of `bcd` (batches from a real boundary-K cache),
`bcd-recompute` (the prefix without grad, then the suffix) and `full`, interleaved; the ideal
cached/recompute ratio from bare forward/backward timings; each arm's peak memory in fresh
processes (median of --mem-repeats): the RSS growth over a baseline with every arm's libraries
loaded (the headline), and "cold", before the arm's own libraries load (GPU:
max_memory_allocated). Both arms of a ratio use the same loss.

--precision: one block's step (block 0 from token ids, else from a (B, S, H) hidden input as a
cache gives it) under run.precision=fp32 and =bf16, interleaved: the speed-up, tokens/s, and
what run.precision=auto resolves to here.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from bench.arms import BlockStep, PeakMemory, in_child
from bench.harness import headline_table, interleaved, load_average, write_results
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks
from preinfer.model.loss import blocks_loss
from preinfer.model.modeling import build_model
from preinfer.run.config import load_config
from preinfer.runtime.device import cpu_native_bf16, resolve_device, training_precision
from preinfer.train.batches import CacheBatches
from storage.cache import CacheWriter
from storage.reader import open_cache

ARMS = ("bcd", "bcd-recompute", "full")


def make_cache(cfg, ckpt, block: int, work: Path, n: int):
    """A real boundary-`block` cache of n samples (random ids through the real prefix)."""
    fp = f"bench-b{block}-{cfg.cache.dtype}-{n}"
    root = work / "cache"
    if (root / fp / "manifest.json").exists():
        return open_cache(root, fp)
    S = cfg.data.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ckpt.vocab_size, (n, S + 1), generator=g)
    model, adapter = ckpt.load(range(block))
    samples = {"sample_id": torch.arange(n).numpy(), "input_ids": ids[:, :-1].numpy(),
               "labels": ids[:, 1:].numpy()}  # fmt: skip
    w = CacheWriter.create(root, fp, samples=samples, seq_len=S, hidden_size=ckpt.hidden_size,
                           cache_cfg=cfg.cache, meta={"bench": True})  # fmt: skip
    with torch.inference_mode():
        for i in w.missing_shards():
            a, b = w.shard_range(i)
            w.write_shard(i, forward_blocks(adapter, ckpt.partition, ids[a:b, :-1], 0, block))
    w.finalize()
    return open_cache(root, fp)


def bare_ratio(a: BlockStep, repeats: int) -> float:
    """Ideal speed-up of the recompute arm `a` (already warm): time(prefix fwd + suffix
    fwd/bwd) / time(suffix fwd/bwd)."""
    x, labels = a.ids[:, :-1], a.ids[:, 1:]
    K = a.block
    pre, suf = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            h = forward_blocks(a.adapter, a.part, x, 0, K)
        t1 = time.perf_counter()
        blocks_loss(a.adapter, a.part, h, labels, K, a.chunk).backward()
        pre.append(t1 - t0)
        suf.append(time.perf_counter() - t1)
        a.opt.zero_grad(set_to_none=True)
    return 1 + median(pre) / median(suf)


def warm_up_runtime(cfg, ckpt, work: Path) -> None:
    """Load what every arm's process holds before it loads a model, so the measured growth is
    the trainer's own (weights, gradients, optimizer state, activations, batches, the reader's
    buffers) from one baseline: thread pools and allocator arenas (a tiny forward/backward),
    the model classes (transformers imports them lazily, ~150 MB: built on the meta device),
    the cache reader's libraries (pyarrow, pandas, ~50 MB: a batch of a 2-sample cache)."""
    lin = torch.nn.Linear(64, 64)
    lin(torch.randn(8, 64)).sum().backward()
    build_model(ckpt.model_config, device="meta", hf_config=ckpt.hf_config)
    tiny = make_cache(cfg, ckpt, 1, work / "warm-up", 2)
    next(iter(CacheBatches(tiny, batch_size=1, seed=0).epoch(0)))


def memory_child(spec: dict, _ask=None) -> dict:
    """In a fresh process: one arm's peak memory growth over 3 steps (cold: from before the
    arm's own libraries load)."""
    cfg = load_config(spec["config"], spec["set"])
    work = Path(spec["work"])
    device = resolve_device(cfg.run.device)
    ckpt = Checkpoint.open(work / "checkpoint")
    if not spec["cold"]:
        warm_up_runtime(cfg, ckpt, work)
    bcd = spec["arm"] == "bcd"
    cache = make_cache(cfg, ckpt, spec["block"], work, spec["samples"]) if bcd else None
    if spec["cold"]:  # the arm's own libraries count: what a fresh process's RSS shows
        torch.nn.Linear(8, 8)(torch.randn(2, 8)).sum().backward()
    mem = PeakMemory(device.type)
    arm = BlockStep(spec["arm"], cfg, ckpt, spec["block"], device, cache=cache)
    for _ in range(3):
        arm.step()
    return {"peak_growth_mb": mem.stop() - mem.baseline}


def measure_memory(args, arm: str, block: int, *, cold: bool = False) -> float:
    """Median over args.mem_repeats fresh processes (RSS high-water marks vary run to run)."""
    spec = {"arm": arm, "block": block, "work": args.work, "config": args.config,
            "samples": args.samples, "set": args.set, "cold": cold}  # fmt: skip
    return median(in_child("bench.trainer_step:memory_child", spec)["peak_growth_mb"]
                  for _ in range(args.mem_repeats))  # fmt: skip


def run(args) -> dict:
    cfg = load_config(args.config, args.set)
    device = resolve_device(cfg.run.device)
    work = Path(args.work)
    if not (work / "checkpoint" / "checkpoint.json").exists():
        init_checkpoint(cfg.model, cfg.partition.num_blocks, work / "checkpoint")
    ckpt = Checkpoint.open(work / "checkpoint")
    M = ckpt.num_blocks
    make_cache(cfg, ckpt, 1, work / "warm-up", 2)  # for the memory children's warm-up
    rows = []
    for block in sorted({M - 1, max(1, M // 2)}):
        cache = make_cache(cfg, ckpt, block, work, args.samples)
        arms = {n: BlockStep(n, cfg, ckpt, block, device, cache=cache) for n in ARMS}
        times = interleaved({n: a.step for n, a in arms.items()}, args.repeats)
        med = {n: median(t) for n, t in times.items()}
        ideal = bare_ratio(arms["bcd-recompute"], args.repeats)
        del arms
        mem = {n: measure_memory(args, n, block) for n in ARMS}
        cold = {n: measure_memory(args, n, block, cold=True) for n in ARMS}
        speedup = med["bcd-recompute"] / med["bcd"]
        rows.append({"block": block, "of_blocks": M, "step_ms": {n: 1000 * v for n, v in med.items()},
                     "speedup_cached_vs_recompute": speedup, "ideal_ratio": ideal,
                     "speedup_over_ideal": speedup / ideal, "peak_mem_growth_mb": mem,
                     "mem_bcd_over_full": mem["bcd"] / mem["full"], "peak_mem_growth_cold_mb": cold,
                     "mem_bcd_over_full_cold": cold["bcd"] / cold["full"]})  # fmt: skip
    last = rows[-1]
    headline = {
        "last block: cached vs recompute speed-up": last["speedup_cached_vs_recompute"],
        "last block: ideal speed-up": last["ideal_ratio"],
        "last block: of ideal (target >= 0.9)": last["speedup_over_ideal"],
        "last block: bcd / full memory (target <= 0.5)": last["mem_bcd_over_full"],
    }
    memory = ("peak RSS growth (VmHWM, reset) over the RSS with every arm's libraries loaded, "
              "before the arm loads anything (CPU); cold: before the arm's own libraries load"
              if device.type == "cpu" else "torch.cuda.max_memory_allocated")  # fmt: skip
    return {"bench": "trainer_step", "headline": headline, "config": args.config,
            "device": str(device), "memory": memory, "repeats": args.repeats,
            "mem_repeats": args.mem_repeats, "loss_chunk": cfg.train.loss_chunk, "rows": rows}  # fmt: skip


def table(res: dict) -> str:
    rows = [("block", "bcd ms", "recompute ms", "full ms", "cached/recompute", "ideal",
             "of ideal", "mem bcd MB", "mem recompute MB", "mem full MB", "bcd/full mem",
             "bcd/full mem cold")]  # fmt: skip
    for r in res["rows"]:
        s, m = r["step_ms"], r["peak_mem_growth_mb"]
        rows.append((f"{r['block']} of {r['of_blocks']}", *(f"{s[k]:.1f}" for k in s),
                     f"{r['speedup_cached_vs_recompute']:.2f}x", f"{r['ideal_ratio']:.2f}x",
                     f"{r['speedup_over_ideal']:.2f}", *(f"{m[k]:.0f}" for k in m),
                     f"{r['mem_bcd_over_full']:.2f}", f"{r['mem_bcd_over_full_cold']:.2f}"))  # fmt: skip
    return headline_table(rows) + (f"\n\nmemory: {res['memory']}; medians of {res['mem_repeats']} "
                                   f"processes; times: medians of {res['repeats']} repeats; "
                                   f"loss_chunk {res['loss_chunk']}")  # fmt: skip


def precision(a) -> dict:
    """fp32 against bf16 autocast, one block's optimizer steps (see the module doc)."""
    cfg = load_config(a.config, a.set)
    device = resolve_device(cfg.run.device)
    B, S, K = cfg.train.batch_size, a.seq, a.block
    g = torch.Generator().manual_seed(0)
    V, H = cfg.model.vocab_size, cfg.model.hidden_size
    labels = torch.randint(0, V, (B, S), generator=g)
    x = torch.randint(0, V, (B, S), generator=g) if K == 0 else torch.randn(B, S, H, generator=g)
    arms = ("fp32", "bf16")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, f"{tmp}/ckpt")
        load_start = load_average()
        step = {p: BlockStep("bcd", cfg, ckpt, K, device) for p in arms}
        times = interleaved({p: lambda p=p: sum(step[p].step((x, labels), precision=p)
                                                for _ in range(a.steps)) / a.steps
                             for p in arms}, a.repeats)  # fmt: skip
    med = {arm: median(t) for arm, t in times.items()}
    auto, why = training_precision(device, "auto")
    res = {
        "config": a.config, "sets": a.set, "block": K, "batch": B, "seq": S,
        "threads": torch.get_num_threads(), "device": str(device),
        "cpu": cpu_native_bf16()[1] if device.type == "cpu" else None,
        "auto": auto, "auto_why": why, "repeats": a.repeats, "steps": a.steps,
        "step_s": times, "median_step_s": med,
        "spread": {arm: [min(t), max(t)] for arm, t in times.items()},
        "tokens_per_s": {arm: B * S / m for arm, m in med.items()},
        "speedup_bf16": med["fp32"] / med["bf16"],
        # each repeat's pair (run back to back): steadier than the medians' ratio under load
        "paired_speedups": [f / b for f, b in zip(times["fp32"], times["bf16"], strict=True)],
        "load_start": load_start, "load_end": load_average(),
    }  # fmt: skip
    pairs = sorted(res["paired_speedups"])
    rows = [("precision", "median s/step", "spread (min..max)", "tokens/s")]
    rows += [(p, f"{med[p]:.3f}", "{:.3f}..{:.3f}".format(*res["spread"][p]),
              f"{res['tokens_per_s'][p]:.0f}") for p in arms]  # fmt: skip
    print(f"block {K} of {a.config} ({', '.join(a.set) or 'as configured'}), batch {B} x S {S}, "
          f"{res['threads']} threads, {res['device']} {res['cpu'] or ''}\n{headline_table(rows)}\n"
          f"bf16 speed-up: {res['speedup_bf16']:.2f}x (medians); per interleaved pair: median "
          f"{median(pairs):.2f}x, {pairs[0]:.2f}..{pairs[-1]:.2f}\nrun.precision=auto "
          f"here: {auto} ({why})\nload average: {load_start} -> {res['load_end']}")  # fmt: skip
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None,
                    help="default configs/demo.yaml; --precision: configs/llama-small.yaml")  # fmt: skip
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--repeats", type=int, default=None, help="default 7; --precision: 5")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--mem-repeats", type=int, default=3, help="fresh processes per memory figure")
    ap.add_argument("--precision", action="store_true",
                    help="fp32 against bf16 autocast, one block's step, instead")  # fmt: skip
    ap.add_argument("--seq", type=int, default=128, help="--precision: S")
    ap.add_argument("--block", type=int, default=1, help="--precision: the block")
    ap.add_argument("--steps", type=int, default=3, help="--precision: timed steps per repeat")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--quick", action="store_true",
                    help="the demo model: 3 repeats, 1 memory process, then --precision's "
                         "comparison at S 64, 2 repeats (make bench)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a 2-block demo model, 1 repeat (tests)")
    args = ap.parse_args(argv)
    if args.precision:
        args.config = args.config or "configs/llama-small.yaml"
        args.repeats = args.repeats or 5
        res = precision(args)
    else:
        args.config = args.config or "configs/demo.yaml"
        args.repeats = args.repeats or 7
        if args.tiny:
            args.set += ["partition.num_blocks=2", "model.num_layers=2", "data.seq_len=32"]
            args.repeats, args.samples, args.mem_repeats = 1, 16, 1
        if args.quick:
            args.repeats, args.samples, args.mem_repeats = 3, 64, 1
        with tempfile.TemporaryDirectory() as tmp:
            args.work = args.work or tmp
            res = run(args)
        print(table(res))
        if args.quick:
            args.seq, args.repeats, args.steps = 64, 2, 1
            res["precision"] = precision(args)
    if args.out:
        write_results(Path(args.out), res)
    return res


if __name__ == "__main__":
    main()
