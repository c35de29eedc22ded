"""Held-out figures as estimates of a whole split: per-row losses, their mean and its error.

An evaluation reads some rows of a split (all of them, or a sample spread over it:
`preinfer.schedule.rotation.val_indices`). Its loss is the token-weighted mean over those rows,
an estimate of the whole split's; `val_estimate` gives it with its standard error, so a line
that prints a val figure can say how far to trust it:

    est = val_estimate(sums, counts, of_rows=store.num_samples("val"))
    log(f"val loss {est['loss']:.3f} +- {est['se']:.3f} over {sample_words(est)}")
    # val loss 4.193 +- 0.174 over 64 of 1,142 val rows
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from core.config import ConfigError
from preinfer.model.adapters import forward_blocks
from preinfer.model.loss import count_targets, head_loss, split_sample
from storage.tokens import IGNORE  # label of a position that does not count (F.cross_entropy's)


class NothingToEvaluate(ConfigError):
    """No position of the rows read counts in the loss: there is no val figure to give."""


def val_estimate(sums, counts, of_rows: int) -> dict:
    """{loss, ppl, tokens, rows, of_rows, se, ppl_se} of the rows read: sums[i] is row i's
    summed loss over its counts[i] target positions, of a split of `of_rows` rows.

    loss = sum(sums) / sum(counts), the loss over every target token read. se: its standard
    error as an estimate of the whole split's loss (a ratio estimator over the rows, with the
    finite-population correction: 0 when every row was read; nan from a single row of a
    larger split). ppl_se = ppl x se (first order). Raises NothingToEvaluate when no position
    counts: a loss of 0 tokens is never a figure."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    k, tokens = len(sums), int(counts.sum())
    if not tokens:
        raise NothingToEvaluate(
            f"no position of the {k} val row(s) read counts in the loss (every label masked, "
            "or no row read): there is no val figure; read more rows (`eval --batches 0` reads "
            "the whole split) or check the data's format (data.format, the masks it makes)"
        )
    loss = float(sums.sum() / tokens)
    # the rows are a sample of the split's of_rows: the finite-population correction (1 - k/N)
    se = 0.0 if k >= of_rows else ratio_se(sums, counts, loss) * math.sqrt(1 - k / of_rows)
    ppl = math.exp(min(loss, 50.0))
    return {"loss": loss, "ppl": ppl, "tokens": tokens, "rows": k, "of_rows": int(of_rows),
            "se": se, "ppl_se": ppl * se}  # fmt: skip


def ratio_se(num: np.ndarray, den: np.ndarray, ratio: float) -> float:
    """Standard error of ratio = sum(num) / sum(den) over k sampled rows (num[i], den[i] row
    i's), by the delta method: sqrt(sum (num_i - ratio den_i)^2 / (k (k-1))) / mean(den), for
    rows drawn from an unbounded population; nan from fewer than 2 rows."""
    k = len(num)
    if k < 2:
        return math.nan
    resid = num - ratio * den
    return float(math.sqrt((resid**2).sum() / (k * (k - 1))) / den.mean())


def sample_words(est: dict) -> str:
    """What an estimate read: '32 of 1,142 val rows' or 'the whole val split, 1,142 rows'."""
    if est["rows"] >= est["of_rows"]:
        return f"the whole val split, {est['of_rows']:,} rows"
    return f"{est['rows']:,} of {est['of_rows']:,} val rows"


def logits_row_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[list, list]:
    """(summed loss, target count) per row of logits (B, S, V) against labels (B, S)."""
    nll = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(labels.shape)  # 0 where ignored
    return nll.sum(1).tolist(), (labels != IGNORE).sum(1).tolist()


def blocks_row_losses(
    adapter, partition, x: torch.Tensor, labels: torch.Tensor, start: int, chunk: int
) -> tuple[list, list]:
    """(summed loss, target count) per row of running blocks [start, M) on x (ids (B, S) if
    start == 0, else the hidden (B, S, H) entering block `start`): the loss the step trains
    on (head_loss, fused when chunk > 0), one forward of the blocks for the batch and the
    head row by row."""
    hidden = forward_blocks(adapter, partition, x, start, partition.num_blocks, head=False)
    adapter.require_loaded("head")
    sums, counts = [], []
    for i in range(len(labels)):
        k = count_targets(labels[i : i + 1])
        loss = head_loss(adapter, hidden[i : i + 1], labels[i : i + 1], chunk) if k else None
        sums.append(float(loss) * k if k else 0.0)
        counts.append(k)
    return sums, counts


@torch.inference_mode()
def evaluate_tokens(
    forward,
    store,
    *,
    split: str = "val",
    batch_size: int = 16,
    rows: np.ndarray | None = None,
    device: torch.device | str = "cpu",
    per_row: bool = False,
) -> dict:
    """val_estimate of `forward(input_ids) -> logits` over the ascending token-store `rows` of
    a split (None: all of it).

    The mean is over the positions that count: every token of a text store, the response
    tokens (and their EOS) of a prompt/response store, the masked positions of an mlm store;
    `tokens` is how many there were. The same rows give the same figure: pass the same
    rotation.val_indices to compare evaluations. per_row: also each row's summed loss
    ("row_sums", in `rows` order), for an error paired over rows between two evaluations of
    the same rows (paired_ratio)."""
    n = store.num_samples(split)
    rows = np.arange(n) if rows is None else np.asarray(rows)
    sums, counts = [], []
    for a in range(0, len(rows), batch_size):
        part = rows[a : a + batch_size]
        if store.has_labels:
            ids, labels = split_sample(*store.read_indices_with_labels(split, part))
        else:
            ids, labels = split_sample(store.read_indices(split, part))
        if not count_targets(labels):  # nothing counts in this batch: no forward needed
            sums += [0.0] * len(part)
            counts += [0] * len(part)
            continue
        s, c = logits_row_losses(forward(ids.to(device)), labels.to(device))
        sums += s
        counts += c
    est = val_estimate(sums, counts, n)
    if per_row:
        est["row_sums"] = [float(x) for x in sums]
    return est


def paired_ratio(a_sums, b_sums) -> dict:
    """{ratio, se, rows} of two evaluations of the same rows (row i's summed loss a_sums[i],
    b_sums[i], over the same targets): ratio = loss_a / loss_b, and its standard error as
    an estimate over the population the rows were drawn from (the delta method, paired: a
    row hard for both arms moves both losses and not their ratio). nan from fewer than 2 rows."""
    a, b = np.asarray(a_sums, np.float64), np.asarray(b_sums, np.float64)
    if len(a) != len(b) or not b.sum():
        raise ValueError(f"paired_ratio needs the same rows in both, got {len(a)} and {len(b)}")
    ratio = float(a.sum() / b.sum())
    return {"ratio": ratio, "se": ratio_se(a, b, ratio), "rows": len(a)}
