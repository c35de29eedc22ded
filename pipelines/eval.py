"""Stage `preinfer eval`: held-out loss and perplexity of the checkpoint on the val split.

The loss is the one the model trains on (data.objective): next-token (causal) over every token
or the response tokens, or masked-LM (mlm) over the stored masked positions (the perplexity is
then exp of the masked-token loss, not a sequence perplexity)."""

from __future__ import annotations

import time

from core.config import ConfigError
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks
from preinfer.model.evaluation import evaluate_tokens, sample_words
from preinfer.run.config import Config
from preinfer.run.provenance import check_settings
from preinfer.run.state import check_run
from preinfer.runtime.device import autocast, resolve_device
from preinfer.runtime.metrics import append_metrics
from preinfer.schedule.rotation import val_indices
from storage.tokens import TokenStore

# (objective, store has labels) -> the positions the loss is a mean over
TARGETS = {("causal", False): "all", ("causal", True): "response", ("mlm", True): "masked"}
NOTE = {
    "all": "",
    "response": "; response tokens only: prompts are masked",
    "masked": "; the masked positions' own tokens",
    "assistant": "; assistant turns only (through their end-of-turn token)",
}


def run_eval(
    cfg: Config, *, max_batches: int = 0, split: str = "val", log=print, per_row: bool = False
) -> dict:
    """The checkpoint's loss on `split`: over all of it (max_batches 0), else over max_batches x
    train.batch_size rows spread over it (rotation.val_indices by train.seed: the rows a run's
    visits evaluate on when max_batches = train.eval_batches), with its standard error.
    per_row: the result also holds each row's summed loss ("row_sums", evaluate_tokens); it is
    not written to metrics.jsonl."""
    if max_batches < 0:
        raise ConfigError(
            f"--batches must be >= 0 (0 = the whole split, N = N x train.batch_size rows "
            f"spread over it), got {max_batches}"
        )
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
        rows=val_indices(
            store.num_samples(split), max_batches * cfg.train.batch_size, cfg.train.seed
        ),
        device=device,
        per_row=per_row,
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
    rec = {k: v for k, v in res.items() if k != "row_sums"}
    append_metrics(
        cfg.run.dir, {"event": "eval", **rec, "time": time.time()}, tensorboard=cfg.run.tensorboard
    )
    sampled = res["rows"] < res["of_rows"]  # then each figure +- its standard error
    loss_se, ppl_se = (f" +- {res[k]:.4g}" if sampled else "" for k in ("se", "ppl_se"))
    log(
        f"eval: {split} loss {res['loss']:.4f}{loss_se}, perplexity {res['ppl']:.2f}{ppl_se} "
        f"over {res['tokens']:,} tokens of {sample_words(res).replace('val', split)} "
        f"(objective: {res['objective']}{NOTE[res['targets']]})"
    )
    return res
