"""One training step of block 0 from tokens: a preinfer visit's step against BAdam's same step.

    .venv/bin/python -m bench.visit_step                       # SmolLM2 (make real-model), block 0 of 3
    .venv/bin/python -m bench.visit_step --batch 8 --seq 128 --repeats 9 --block 1

Every arm trains the same parameters of the same weights on the same batches, fp32, in one
process, interleaved (docs/log/2026-12-02.md, "A visit's step against BAdam's same step"):
`preinfer` (BlockStep in bcd-recompute mode, the config's fused chunked loss), `preinfer,
unfused loss` (train.loss_chunk=0), with --compile `preinfer, torch.compile` (the same loss
under torch.compile; its first step holds the compile) and `badam` (the HF model, PyPI badam's BlockOptimizer over
preinfer's blocks, the peers bench's loss). Each step is split into forward + loss, backward,
and clip + optimizer step; the first-step losses must agree.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.arms import BlockStep
from bench.harness import ROOT, headline_table, interleaved, load_average, publish, show, spread
from bench.peers_arms import INSTALL, REAL_MODEL, badam_step, hf_step
from preinfer.checkpoint.init import init_checkpoint
from preinfer.run.config import load_config


def run(args) -> dict:
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model at {args.model}; {INSTALL}")
    torch.set_num_threads(args.threads)
    over = ["model.arch=llama", f"model.checkpoint={args.model}", f"data.tokenizer={args.model}"]
    cfg = load_config(ROOT / "configs" / "finetune.yaml", [*over, *args.set])
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, Path(tmp) / "checkpoint")
        mine = {k: BlockStep("bcd-recompute", cfg, ckpt, args.block, torch.device("cpu"), chunk=c)
                for k, c in (("preinfer", None), ("preinfer, unfused loss", 0))}  # fmt: skip
        steps = {k: lambda x, y, a=a: hf_step(a.opt, lambda: a.loss(x, y), a.model)
                 for k, a in mine.items()}  # fmt: skip
        if args.compile:  # the trainer's own loss under torch.compile (inductor), same weights
            a = BlockStep("bcd-recompute", cfg, ckpt, args.block, torch.device("cpu"))
            fn = torch.compile(a.loss)
            steps["preinfer, torch.compile"] = lambda x, y, a=a, fn=fn: hf_step(
                a.opt, lambda: fn(x, y), a.model
            )
        steps["badam"] = badam_step(args.model, ckpt.partition.blocks, args.block, cfg.train.lr)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ckpt.vocab_size, (4, args.batch, args.seq + 1), generator=g)
    batches = [(b[:, :-1], b[:, 1:]) for b in ids]

    def arm(step):  # every arm reads the batches in the same order, the first one untimed
        it = itertools.cycle(batches)
        return lambda: step(*next(it))

    arms = {k: arm(step) for k, step in steps.items()}
    load0 = load_average()
    first, first_s = {}, {}  # the first step's loss, and its seconds (torch.compile's compile)
    for k, fn in arms.items():
        t0 = time.perf_counter()
        first[k] = fn()[0]
        first_s[k] = time.perf_counter() - t0
    got = interleaved(arms, args.repeats, warm_up=False)
    secs = {k: [sum(p) for _, p in v] for k, v in got.items()}
    ref = secs["badam"]
    return {
        "bench": "visit_step", "model": str(args.model), "block": args.block,
        "blocks": [list(b) for b in ckpt.partition.blocks], "batch": args.batch, "seq": args.seq,
        "threads": args.threads, "repeats": args.repeats, "loss_chunk": cfg.train.loss_chunk,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_before": load0, "load_after": load_average(), "first_step_loss": first,
        "first_step_s": first_s,
        "seconds": {k: spread(v) for k, v in secs.items()},
        "parts": {k: [statistics.median(p[i] for _, p in v) for i in range(3)]
                  for k, v in got.items()},
        "badam_over_arm": {k: spread([b / a for b, a in zip(ref, v, strict=True)])
                           for k, v in secs.items()},
    }  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--set", nargs="+", default=[], help="config overrides, e.g. train.lr=3e-5")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="add the trainer's step with its loss under torch.compile",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = run(args)
    rows = [("arm", "first-step loss", "first step s", "step s, median [min, max]",
             "BAdam / arm (speed)", "forward+loss s", "backward s", "clip+step s")]  # fmt: skip
    rows += [(k, f"{res['first_step_loss'][k]:.4f}", f"{res['first_step_s'][k]:.1f}",
              show(s, "{:.3f}"),
              show(res["badam_over_arm"][k], "{:.3f}"), *(f"{p:.3f}" for p in res["parts"][k]))
             for k, s in res["seconds"].items()]  # fmt: skip
    text = (f"block {res['block']} of {res['blocks']} from tokens, batch {res['batch']} x "
            f"{res['seq']}, fp32, {res['threads']} threads, {res['repeats']} interleaved repeats; "
            f"load {res['load_before']} -> {res['load_after']}\n\n" + headline_table(rows))  # fmt: skip
    publish(res, text, args.out, "visit_step")
    return res


if __name__ == "__main__":
    main()
