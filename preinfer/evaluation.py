"""Language-model loss and held-out evaluation over a token store."""

from __future__ import annotations

import math

import numpy as np
import torch

from preinfer.loss import lm_loss


def split_sample(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, S+1) int32 token rows -> inputs (n, S) long and labels (n, S) long."""
    t = torch.from_numpy(np.ascontiguousarray(rows)).long()
    return t[:, :-1], t[:, 1:]


@torch.inference_mode()
def evaluate_tokens(
    forward,
    store,
    *,
    split: str = "val",
    batch_size: int = 16,
    max_batches: int = 0,
    device: torch.device | str = "cpu",
) -> dict:
    """Mean loss and perplexity of `forward(input_ids) -> logits` over the first batches of a split.

    Deterministic: always the same leading batches, so evaluations are comparable over time.
    """
    n = store.num_samples(split)
    if max_batches:
        n = min(n, max_batches * batch_size)
    total, count = 0.0, 0
    for start in range(0, n, batch_size):
        ids, labels = split_sample(store.read(split, start, min(n, start + batch_size)))
        logits = forward(ids.to(device))
        total += lm_loss(logits, labels.to(device)).item() * labels.numel()
        count += labels.numel()
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}
