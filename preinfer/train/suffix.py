"""train.suffix_rank: low-rank updates of the frozen blocks after the active one, in the same
backward pass (as BREAD, NeurIPS'25: BCD plus low-rank updates of its inactive blocks).

A bcd visit of block K < M-1 trains block K; the loss gradient already flows through blocks
K+1..M-1 to reach it. With suffix_rank r > 0 every selected linear layer inside the transformer
layers of those blocks gets a LoRA adapter, so its forward is

    y = W x (+ b) + (alpha / r) * B (A x)      A (r, in) ~ U(-1/sqrt(in), 1/sqrt(in)), B (out, r) = 0

and A, B train in the visit's optimizer (their own param group, train.suffix_lr) in the same
backward as block K. At the visit's end they are merged (W += alpha / r * B @ A, in W's dtype)
and the changed blocks are committed with block K in its one commit: the checkpoint stays a
plain model. Never the embedding, the LM head (train.always_train) or blocks <= K: the prefix
every cache of boundary <= K was made from does not change during a visit, and a boundary
j > K is invalidated by block K's own update anyway. The one exception is opt-in:
train.prefix_adapters=last adapts blocks 0..K-1 too in a round's last visit, which then runs
its prefix from tokens (it reads no cache) and leaves every boundary of the round stale, as the
next round's first visits would anyway.

The adapters are forward hooks on the modules (the state dict, its names and the block files
are untouched while they are attached); `detach` removes them. Model code does no I/O.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from preinfer.model.adapters import Adapter
from preinfer.model.partition import Partition

MODULES = ("all", "attn", "mlp")


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's c_attn, c_proj, c_fc): y = x @ W + b, W (in, out)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(m, Conv1D)


def _part_of_layer(name: str) -> str:
    """attn or mlp, from a module's name inside its layer: attention's own modules are named
    attn / self_attn (GPT-2, LLaMA) or attention (BERT: attention.self.query,
    attention.output.dense); everything else (mlp.*, intermediate.dense, output.dense, fc1) is
    the MLP's."""
    return "attn" if any("attn" in p or "attention" in p for p in name.split(".")) else "mlp"


def adapted_blocks(part: Partition, block: int, prefix: bool = False) -> list[int]:
    """The blocks a visit of `block` adapts: block+1..M-1, and with `prefix` then 0..block-1 (the
    suffix first: its adapters' indices, and so their seeds, are those of a visit without)."""
    return [*range(block + 1, part.num_blocks), *(range(block) if prefix else ())]


def suffix_linears(
    adapter: Adapter, part: Partition, block: int, modules: str = "all", prefix: bool = False
) -> list[tuple[str, nn.Module]]:
    """(state-dict name of the module, module) of every selected linear layer (nn.Linear or
    GPT-2's Conv1D) in the layers of blocks block+1..M-1, then (with `prefix`) of blocks
    0..block-1, each in layer order."""
    if modules not in MODULES:
        raise ValueError(f"suffix modules must be one of {MODULES}, got {modules!r}")
    layers, out = adapter.layer_modules(), []
    for b in adapted_blocks(part, block, prefix):
        for i in part.layers(b):
            for name, m in layers[i].named_modules():
                if not (isinstance(m, nn.Linear) or _is_conv1d(m)):
                    continue
                if modules == "all" or _part_of_layer(name) == modules:
                    out.append((f"{adapter.layer_prefix(i)}.{name}", m))
    return out


def _dims(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    return m.weight.shape[0], m.weight.shape[1]  # Conv1D: weight (in, out)


def _seed(*values: int) -> int:
    seed = 0
    for v in values:
        seed = (seed * 1_000_003 + v) % 2**63
    return seed


class SuffixAdapters:
    """The LoRA adapters of one visit, attached as forward hooks (attach, merge, detach)."""

    def __init__(self, blocks: list[int], rank: int, scale: float, modules: str, prefix: bool):
        self.blocks = blocks  # the blocks whose weights a merge changes: K+1..M-1 (+ 0..K-1)
        self.rank, self.scale, self.modules, self.prefix = rank, scale, modules, prefix
        # (module name, module, A (r, in), B (out, r), hook handle)
        self.entries: list[tuple[str, nn.Module, nn.Parameter, nn.Parameter, object]] = []

    @classmethod
    def attach(
        cls,
        adapter: Adapter,
        part: Partition,
        block: int,
        *,
        rank: int,
        alpha: float | None = None,
        modules: str = "all",
        seed: tuple[int, ...] = (),
        device: torch.device | str = "cpu",
        prefix: bool = False,
    ) -> SuffixAdapters | None:
        """Adapters on the selected linears of blocks block+1..M-1, with `prefix` (a round's
        last visit, train.prefix_adapters=last) of blocks 0..block-1 too (None: rank 0, or no
        such linear, e.g. block M-1 without prefix). alpha None = 2 x rank. A's init draws from
        its own generator, seeded by (seed, block, the module's index among the suffix's, then
        the prefix's): every DDP rank and a rerun draw the same, and the global RNG (dropout's)
        is left alone."""
        linears = suffix_linears(adapter, part, block, modules, prefix) if rank > 0 else []
        if not linears:
            return None
        alpha = 2.0 * rank if alpha is None else float(alpha)
        blocks = adapted_blocks(part, block, prefix)
        self = cls(blocks, rank, alpha / rank, modules, prefix)
        for j, (name, m) in enumerate(linears):
            n_in, n_out = _dims(m)
            g = torch.Generator().manual_seed(_seed(*seed, block, j))
            bound = 1.0 / math.sqrt(n_in)  # kaiming_uniform(a=sqrt(5)), as nn.Linear and LoRA
            a = (torch.rand(rank, n_in, generator=g) * 2 - 1) * bound  # (r, in) fp32
            A = nn.Parameter(a.to(device))
            B = nn.Parameter(torch.zeros(n_out, rank, device=device))  # (out, r): starts as W
            handle = m.register_forward_hook(self._hook(A, B))
            self.entries.append((name, m, A, B, handle))
        return self

    def _hook(self, A: nn.Parameter, B: nn.Parameter):
        scale = self.scale

        def hook(module, args, out):
            x = args[0]  # (..., in); under autocast F.linear casts x, A, B to its dtype
            dt = x.dtype if not torch.is_autocast_enabled(x.device.type) else A.dtype
            return out + scale * F.linear(F.linear(x, A.to(dt)), B.to(dt))  # (..., out)

        return hook

    def parameters(self) -> list[nn.Parameter]:
        """[A, B] of every adapter, in module order (the visit's trainable tensors after its
        block's: a resumed visit restores them from its state, in this order)."""
        return [p for _, _, A, B, _ in self.entries for p in (A, B)]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def detach(self) -> None:
        """Remove the hooks: the modules compute W x again (merged or not)."""
        for _, _, _, _, handle in self.entries:
            handle.remove()
        self.entries = [(n, m, A, B, None) for n, m, A, B, _ in self.entries]

    @torch.no_grad()
    def merge(self) -> None:
        """W += scale * B @ A (computed in fp32, added in W's dtype), then detach: the model
        computes what it computed with the adapters, as a plain model."""
        for _, m, A, B, _ in self.entries:
            delta = self.scale * (B.float() @ A.float())  # (out, in)
            w = m.weight
            w.add_((delta if isinstance(m, nn.Linear) else delta.T).to(w.device, w.dtype))
        self.detach()


def adapter_linear_dims(arch: str, hidden: int, inter: int, kv_dim: int,
                        modules: str = "all") -> list[tuple[int, int]]:  # fmt: skip
    """(in, out) of the linears of ONE layer that suffix_linears selects, from the shapes alone
    (the memory planner: no model built). Checked against suffix_linears in the tests."""
    H, F_, KV = hidden, inter, kv_dim
    attn, mlp = {
        "gpt2": ([(H, 3 * H), (H, H)], [(H, F_), (F_, H)]),
        "llama": ([(H, H), (H, KV), (H, KV), (H, H)], [(H, F_), (H, F_), (F_, H)]),
        "bert": ([(H, H), (H, H), (H, H), (H, H)], [(H, F_), (F_, H)]),
    }.get(arch, ([], [(H, F_), (F_, H)]))  # sequential: a residual MLP
    return {"all": attn + mlp, "attn": attn, "mlp": mlp}[modules]


def suffix_spec(suffix: SuffixAdapters | None) -> dict:
    """What a visit's mid-block state records of its adapters (a resume must have the same)."""
    if suffix is None:
        return {"rank": 0}
    return {
        "rank": suffix.rank,
        "modules": suffix.modules,
        **({"prefix": True} if suffix.prefix else {}),
    }


def resume_mismatch(state: dict, suffix: SuffixAdapters | None) -> str | None:
    """Why a mid-block state cannot resume a visit with these adapters (None: it can): its
    params list holds the adapters it trained, and this visit's must be the same tensors."""
    was, now = state.get("suffix") or {"rank": 0}, suffix_spec(suffix)
    if was == now:
        return None

    def said(spec: dict) -> str:
        return (f"{spec['rank']} (suffix_modules={spec.get('modules', 'all')}, prefix_adapters="
                f"{'last' if spec.get('prefix') else 'none'})")  # fmt: skip

    return (
        f"with train.suffix_rank={said(was)}, but the visit now runs with {said(now)}: rerun "
        "with the settings it started with to resume it, or delete the file to start the visit "
        "over"
    )
