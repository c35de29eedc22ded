"""A block's optimizer state as flat named tensors, kept in the checkpoint across rounds
(train.keep_optimizer_state; Checkpoint.commit_blocks writes it, Checkpoint.optimizer_state
reads it back hash-checked).

    '<param name>::<key>'  ->  tensor      param name as in the block's checkpoint file;
                                           key: AdamW/Adam exp_avg, exp_avg_sq (the param's
                                           shape), step (a scalar); SGD momentum_buffer
"""

from __future__ import annotations

import torch
from torch import nn

from preinfer.checkpoint.format import CheckpointError

SEP = "::"


def optimizer_tensors(
    opt: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]
) -> dict[str, torch.Tensor]:
    """The state `opt` holds for the (name, param) pairs, on CPU: the optimizer's own tensors
    where they are there (a commit writes them before the next step changes them; a copy would
    double the state at the commit), copies from another device."""
    out = {}
    for name, p in named:
        for key, v in opt.state.get(p, {}).items():
            if v is None:  # SGD without momentum
                continue
            t = v.detach() if torch.is_tensor(v) else torch.tensor(float(v))
            out[f"{name}{SEP}{key}"] = t.to("cpu").contiguous()
    return out


def load_optimizer_tensors(
    opt: torch.optim.Optimizer,
    named: list[tuple[str, nn.Parameter]],
    saved: dict[str, torch.Tensor],
    *,
    saved_by: str,
    optimizer: str,
    what: str,
) -> None:
    """Give `opt` the state optimizer_tensors made for the same (name, param) pairs (each
    tensor onto its param's device; moments in its dtype). Raises CheckpointError, naming what
    differs, when the optimizer, the parameter names or a shape do not match."""
    fresh = (
        "or set train.keep_optimizer_state=false to train it with a fresh optimizer (its next "
        "commit drops the saved state)"
    )
    if saved_by != optimizer:
        raise CheckpointError(
            f"{what}'s saved optimizer state is {saved_by}'s; this visit uses {optimizer}: set "
            f"train.optimizer={saved_by}, {fresh}"
        )
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in saved.items():
        name, _, key = k.rpartition(SEP)
        by_param.setdefault(name, {})[key] = t
    names = {n for n, _ in named}
    if set(by_param) != names:
        raise CheckpointError(
            f"{what}'s saved optimizer state does not fit its parameters (missing "
            f"{sorted(names - set(by_param))[:3]}, unexpected {sorted(set(by_param) - names)[:3]}); "
            f"the model or partition changed since it was saved: {fresh}"
        )
    for name, p in named:
        state = {}
        for key, t in by_param[name].items():
            if t.dim() == 0:  # step: a CPU scalar, as the optimizer makes it
                state[key] = t.clone()
                continue
            if t.shape != p.shape:
                raise CheckpointError(
                    f"{what}'s saved optimizer state {name}{SEP}{key} has shape "
                    f"{list(t.shape)}, the parameter {list(p.shape)}: {fresh}"
                )
            # `saved` is this load's own (a file just read): no copy where device and dtype fit
            state[key] = t.to(p.device, p.dtype if t.is_floating_point() else t.dtype)
        opt.state[p] = state
