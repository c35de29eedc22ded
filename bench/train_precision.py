"""Training step time by run.precision: fp32 against bf16 autocast, one block visit's step.

    .venv/bin/python -m bench.train_precision [--config configs/llama-small.yaml] [--seq 128]
        [--block 1] [--repeats 5] [--steps 3] [--quick]

For one block of the config's model (block 0 from token ids, else from a (B, S, H) hidden
input as a cache gives it), the same optimizer steps (bench/arms.py's BlockStep: train_step
over the fused LM head + loss, AdamW, grad clip) under run.precision=fp32 and =bf16, the arms
interleaved after a warm-up; median and spread of the per-step seconds, tokens/s, the
speed-up, the load average, and what run.precision=auto resolves to here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.arms import BlockStep
from bench.harness import interleaved, write_results
from preinfer.checkpoint.init import init_checkpoint
from preinfer.run.config import load_config
from preinfer.runtime.device import cpu_native_bf16, resolve_device, training_precision

ARMS = ("fp32", "bf16")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-small.yaml")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--batch", type=int, default=None, help="default: the config's train.batch_size"
    )
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm per repeat")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a small model, 2 repeats (make bench)")
    a = ap.parse_args(argv)
    if a.quick:
        a.config, a.seq, a.repeats, a.steps = "configs/demo.yaml", 64, 2, 1
    cfg = load_config(a.config, a.set)
    device = resolve_device(cfg.run.device)
    B, S, K = a.batch or cfg.train.batch_size, a.seq, a.block
    g = torch.Generator().manual_seed(0)
    V, H = cfg.model.vocab_size, cfg.model.hidden_size
    labels = torch.randint(0, V, (B, S), generator=g)
    x = torch.randint(0, V, (B, S), generator=g) if K == 0 else torch.randn(B, S, H, generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, f"{tmp}/ckpt")
        load_start = os.getloadavg()
        arms = {p: BlockStep("bcd", cfg, ckpt, K, device) for p in ARMS}
        times = interleaved({p: lambda p=p: sum(arms[p].step((x, labels), precision=p)
                                                for _ in range(a.steps)) / a.steps
                             for p in ARMS}, a.repeats)  # fmt: skip
    med = {arm: statistics.median(t) for arm, t in times.items()}
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
        "load_start": load_start, "load_end": os.getloadavg(),
    }  # fmt: skip
    print(f"block {K} of {a.config} ({', '.join(a.set) or 'as configured'}), batch {B} x S {S}, "
          f"{res['threads']} threads, {res['device']} {res['cpu'] or ''}")  # fmt: skip
    print("| precision | median s/step | spread (min..max) | tokens/s |\n|---|---|---|---|")
    for arm in ARMS:
        lo, hi = res["spread"][arm]
        print(f"| {arm} | {med[arm]:.3f} | {lo:.3f}..{hi:.3f} | {res['tokens_per_s'][arm]:.0f} |")
    pairs = sorted(res["paired_speedups"])
    print(f"bf16 speed-up: {res['speedup_bf16']:.2f}x (medians); per interleaved pair: median "
          f"{statistics.median(pairs):.2f}x, {pairs[0]:.2f}..{pairs[-1]:.2f}")  # fmt: skip
    print(
        f"run.precision=auto here: {auto} ({why})\nload average: {load_start} -> {res['load_end']}"
    )
    if a.out:
        write_results(Path(a.out), res)
    return res


if __name__ == "__main__":
    main()
