"""Stage `preinfer eval`: held-out loss and perplexity of the checkpoint on the val split.

The loss is the one the model trains on (data.objective): next-token (causal) over every token
or the response tokens, or masked-LM (mlm) over the stored masked positions (the perplexity is
then exp of the masked-token loss, not a sequence perplexity)."""

from __future__ import annotations

import time

from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks
from preinfer.model.loss import evaluate_tokens
from preinfer.run.config import Config
from preinfer.run.provenance import check_settings
from preinfer.run.state import check_run
from preinfer.runtime.device import autocast, resolve_device
from preinfer.runtime.metrics import append_metrics
from storage.tokens import TokenStore

# (objective, store has labels) -> the positions the loss is a mean over
TARGETS = {("causal", False): "all", ("causal", True): "response", ("mlm", True): "masked"}
NOTE = {
    "all": "",
    "response": "; response tokens only: prompts are masked",
    "masked": "; the masked positions' own tokens",
    "assistant": "; assistant turns only (through their end-of-turn token)",
}


def run_eval(cfg: Config, *, max_batches: int = 0, split: str = "val", log=print) -> dict:
    store = TokenStore(cfg.data.out_dir)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    # the store and checkpoint this config asks for (a bert scored on next tokens, say, would
    # mean nothing)
    check_settings(cfg, "eval", tokens=store.manifest, checkpoint=ckpt.index)
    check_run(cfg.run.dir, ckpt, "eval")
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
    targets = TARGETS[store.objective, store.has_labels]  # what the loss is a mean over
    if targets == "response" and "chat" in store.manifest:  # a data.format=chat store
        targets = "assistant"
    res = {
        "split": split,
        **res,
        "objective": store.objective,
        "targets": targets,
        "seconds": time.perf_counter() - t0,
        "checkpoint": ckpt.prefix_hash(M),
    }
    append_metrics(
        cfg.run.dir, {"event": "eval", **res, "time": time.time()}, tensorboard=cfg.run.tensorboard
    )
    log(
        f"eval: {split} loss {res['loss']:.4f}, perplexity {res['ppl']:.2f} "
        f"over {res['tokens']:,} tokens (objective: {res['objective']}{NOTE[res['targets']]})"
    )
    return res
