"""Stage `preinfer eval`: held-out loss and perplexity of the checkpoint on the val split."""

from __future__ import annotations

import time

from preinfer.adapters import forward_blocks
from preinfer.checkpoint import Checkpoint
from preinfer.config import Config
from preinfer.device import autocast, resolve_device
from preinfer.loss import evaluate_tokens
from preinfer.metrics import append_metrics
from storage.tokens import TokenStore


def run_eval(cfg: Config, *, max_batches: int = 0, split: str = "val", log=print) -> dict:
    store = TokenStore(cfg.data.out_dir)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    device = resolve_device(cfg.run.device)
    model, adapter = ckpt.load(range(ckpt.num_blocks), device=device)
    model.eval()
    M, part = ckpt.num_blocks, ckpt.partition

    def forward(ids):
        with autocast(device, cfg.run.precision):
            return forward_blocks(adapter, part, ids, 0, M)

    t0 = time.perf_counter()
    res = evaluate_tokens(
        forward,
        store,
        split=split,
        batch_size=cfg.train.batch_size,
        max_batches=max_batches,
        device=device,
    )
    res = {
        "split": split,
        **res,
        "seconds": time.perf_counter() - t0,
        "checkpoint": ckpt.prefix_hash(M),
    }
    append_metrics(cfg, {"event": "eval", **res, "time": time.time()})
    log(
        f"eval: {split} loss {res['loss']:.4f}, perplexity {res['ppl']:.2f} "
        f"over {res['tokens']:,} tokens"
    )
    return res
