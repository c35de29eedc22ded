"""The frozen prefix's forward as the activation cache computes it: the hidden entering block
`stop`, one block at a time in the compute dtype, each block's output rounded to the stored
dtype (`preinfer.runtime.device.compute_dtype`). The cache build runs it per micro-batch; a
bcd-recompute visit runs it per training batch, so recomputing the prefix and reading the
cache feed the active block the same values."""

from __future__ import annotations

import torch

from preinfer.model.adapters import Adapter, forward_blocks
from preinfer.model.partition import Partition


@torch.no_grad()
def forward_prefix(
    adapter: Adapter,
    partition: Partition,
    x: torch.Tensor,
    first: int,
    stop: int,
    *,
    dtype: torch.dtype,
    round_to: torch.dtype | None,
) -> torch.Tensor:
    """(B, S) ids (first == 0) or (B, S, H) hidden entering block `first` -> (B, S, H) hidden
    entering block `stop`, in `dtype` (round_to: the stored dtype, which the output is in)."""
    if x.is_floating_point():
        x = x.to(dtype)
    for b in range(first, stop):
        x = forward_blocks(adapter, partition, x, b, b + 1)
        if round_to is not None:  # the hidden entering every block is what a cache holds
            x = x.to(round_to) if b == stop - 1 else x.to(round_to).to(dtype)
    return x
