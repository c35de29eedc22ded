"""The language-model loss, with the LM head fused into the cross-entropy a chunk of tokens at a time.

The plain loss materialises the whole batch's logits (N, V) in fp32, and autograd keeps them,
their log-softmax and both gradients alive through backward: four (N, V) fp32 tensors, which for
the last block of a small model are most of the trainer's memory. `linear_cross_entropy` runs the
head's final linear layer and the loss over `chunk` tokens at a time and computes the gradients
of its inputs in the same pass (d loss / d logits = (softmax - onehot) / n is known as soon as a
chunk's softmax is), so only one chunk's logits are ever alive and backward only rescales.
The matmuls are the same three a plain forward + backward does; nothing is recomputed.

    loss = head_loss(adapter, hidden, labels, chunk=256)   # == lm_loss(adapter.head(hidden), labels)

Held-out figures (per-row losses, their estimate of a split) are preinfer.model.evaluation's.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from preinfer.model.adapters import forward_blocks
from storage.tokens import IGNORE  # label of a position that does not count (F.cross_entropy's)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits[:, t] against labels[:, t], in fp32; logits (B, S, V), labels
    (B, S) long. No shift here: labels[:, t] is already position t's target (the next token
    for a causal LM, see split_sample; the original token of a masked position for mlm)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x runs in here: autocast's, when autocast is on for x's device."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """mean CE(x @ weight.T + bias, labels) over labels != IGNORE, with gradients made in forward."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, chunk: int, need_x: bool, need_w: bool):
        # x (N, H) features entering the head's linear; weight (V, H); bias (V,) or None;
        # labels (N,) long
        dt = _compute_dtype(x)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        w = weight.to(dt)
        valid = labels != IGNORE
        n = int(valid.sum())
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        db = (
            torch.zeros(bias.shape, dtype=torch.float32, device=x.device)
            if need_w and bias is not None
            else None
        )
        scale = 1.0 / max(n, 1)
        for a in range(0, x.shape[0], chunk):
            xc, yc, vc = x[a : a + chunk].to(dt), labels[a : a + chunk], valid[a : a + chunk]
            logits = xc @ w.T  # (c, V) in the compute dtype
            if bias is not None:
                logits = logits + bias.to(dt)
            p = logits.float()  # (c, V) fp32; becomes softmax, then d loss / d logits
            del logits
            rows = torch.arange(len(yc), device=x.device)
            y = yc.clamp_min(0)
            target = p[rows, y]  # (c,)
            lse = torch.logsumexp(p, dim=-1)  # (c,)
            total += ((lse - target) * vc).sum()
            if need_x or need_w:
                p.sub_(lse[:, None]).exp_()
                p[rows, y] -= 1.0
                p.mul_((vc.float() * scale)[:, None])
                g = p.to(dt)
                del p
                if need_x:
                    dx[a : a + chunk] = (g @ w).to(x.dtype)  # (c, H)
                if need_w:
                    if g.dtype == torch.float32:
                        dw.addmm_(g.T, xc)  # (V, H), accumulated in place: no (V, H) temporary
                    else:
                        dw += (g.T @ xc).float()
                    if db is not None:
                        db += g.float().sum(0)
            else:
                del p
        ctx.save_for_backward(dx, dw, db)
        return total * scale

    @staticmethod
    def backward(ctx, grad):
        dx, dw, db = ctx.saved_tensors
        gx = dx * grad.to(dx.dtype) if ctx.needs_input_grad[0] else None
        gw = gb = None
        if ctx.needs_input_grad[1]:
            gw = (dw * grad).to(ctx.weight_dtype)
        if ctx.needs_input_grad[2] and db is not None:
            gb = (db * grad).to(ctx.bias_dtype)
        return gx, gw, gb, None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T (+ bias) against labels, `chunk` rows at a
    time; x (N, H), weight (V, H), labels (N,) long (IGNORE rows do not count)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if x.dim() != 2 or labels.shape != x.shape[:1] or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"need x (N, H), weight (V, H), labels (N,); got x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    grad_on = torch.is_grad_enabled()
    need_x = grad_on and x.requires_grad
    need_w = grad_on and (weight.requires_grad or (bias is not None and bias.requires_grad))
    return _LinearCrossEntropy.apply(x, weight, bias, labels, chunk, need_x, need_w)


def head_loss(adapter, hidden: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean LM loss of the hidden (B, S, H) leaving the last layer; labels (B, S) long.

    chunk > 0 and a head of (norm or transform) + linear: the fused chunked loss; else the plain
    loss over the whole batch's logits (same value, more memory). The head acts per position,
    so it runs only where a label counts when some do not (an mlm row's ~15% masked positions,
    a prompt/response row's responses): the same loss and gradients, a fraction of the work."""
    keep = labels != IGNORE  # (B, S)
    n = int(keep.sum())
    if 0 < n < keep.numel():
        hidden, labels = hidden[keep][None], labels[keep][None]  # (1, n, H), (1, n)
    split = adapter.head_split() if chunk > 0 else None
    if split is None:
        return lm_loss(adapter.head(hidden), labels)
    features, linear = split
    f = features(hidden)  # (B, S, H)
    return linear_cross_entropy(
        f.flatten(0, 1), linear.weight, linear.bias, labels.flatten(), chunk
    )


def blocks_loss(
    adapter, partition, x: torch.Tensor, labels: torch.Tensor, start: int, chunk: int
) -> torch.Tensor:
    """Mean LM loss of running blocks [start, M) on x (ids (B, S) if start == 0, else the
    hidden (B, S, H) entering block `start`)."""

    hidden = forward_blocks(adapter, partition, x, start, partition.num_blocks, head=False)
    adapter.require_loaded("head")
    return head_loss(adapter, hidden, labels, chunk)


def mode_loss(
    adapter, partition, x: torch.Tensor, labels: torch.Tensor, *, mode: str, block: int,
    chunk: int, whole: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The loss a trainer step of `mode` takes for block `block`. x: ids (B, S) for full, for
    block 0 and with `whole` (a visit that runs its prefix from tokens: train.prefix_adapters);
    else the hidden (B, S, H) entering the block (bcd: read from the cache; bcd-recompute: its
    caller reran the frozen prefix, preinfer.model.prefix.forward_prefix)."""
    start = 0 if mode == "full" or whole else block
    return blocks_loss(adapter, partition, x, labels, start, chunk)


def split_sample(
    rows: np.ndarray, labels: np.ndarray | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, S+1) int32 token rows [and their (n, S) stored labels, IGNORE where masked] ->
    inputs (n, S) long and labels (n, S) long. The one place a causal shift is made: without
    stored labels, labels = rows[:, 1:] (next token); stored labels are used as they are
    (prompt/response: shifted when packed; mlm: unshifted, the masked inputs' own ids)."""
    t = torch.from_numpy(np.ascontiguousarray(rows)).long()
    if labels is None:
        return t[:, :-1], t[:, 1:]
    return t[:, :-1], torch.from_numpy(np.ascontiguousarray(labels)).long()


def count_targets(labels: torch.Tensor) -> int:
    """Positions that count in the loss (labels != IGNORE): the weight of a batch's mean loss."""
    return int((labels != IGNORE).sum())
