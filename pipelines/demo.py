"""`make demo`: tokenize -> init -> eval -> bcd (rounds x blocks) -> eval, printing each step."""

from __future__ import annotations

import time

from pipelines.bcd import run_bcd
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.report import run_report
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint_format import CheckpointExists
from preinfer.config import Config


def run_demo(cfg: Config, log=print) -> dict:
    t0 = time.perf_counter()
    log(f"== preinfer demo: run dir {cfg.run.dir}")
    store = run_tokenize(cfg, log=log)
    try:
        ckpt = run_init(cfg, log=log)
    except CheckpointExists as e:  # an earlier demo trained this run's checkpoint
        raise CheckpointExists(
            f"{cfg.run.dir} already holds a run whose checkpoint was trained (an earlier "
            f"`make demo`?; its report is in {cfg.run.dir}/report). To run the demo again from "
            f"scratch, delete that directory (`make clean` deletes runs/), or run it elsewhere: "
            f"make demo SET=run.dir=runs/demo2. ({e})"
        ) from None
    for b, info in enumerate(ckpt.block_summaries()):
        log(f"  block {b}: {info}")
    nb = cfg.train.eval_batches
    before = run_eval(cfg, max_batches=nb, log=log)
    log(
        f"== BCD: {cfg.train.rounds} round(s) x {ckpt.num_blocks} blocks, "
        f"{cfg.train.max_steps} steps per block, mode {cfg.train.mode}"
    )
    bcd = run_bcd(cfg, log=log)
    after = run_eval(cfg, max_batches=nb, log=log)
    log(
        f"== val perplexity {before['ppl']:.1f} -> {after['ppl']:.1f} "
        f"({store.num_samples('train')} train samples; {time.perf_counter() - t0:.0f}s in all)"
    )
    report = run_report(cfg, log=log)
    return {"before": before, "after": after, "bcd": bcd, "report": report}
