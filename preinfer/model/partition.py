"""Partitioning `layers[0..L-1]` into M contiguous blocks balanced by parameter count."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from core.config import ConfigError


@dataclass(kw_only=True)
class PartitionConfig:
    num_blocks: int = 3
    """M, the number of blocks (1 <= M <= number of layers)."""

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ConfigError(f"partition.num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(kw_only=True)
class Partition:
    """M contiguous, non-empty blocks of layers; block b holds layers [blocks[b][0], blocks[b][1]).

    The embedding joins block 0 and the head (final norm + LM head) joins block M-1, so
    block_params[b] = its layers (+ embed if b == 0) (+ head if b == M-1), in elements."""

    num_layers: int
    blocks: list[tuple[int, int]]
    block_params: list[int]
    layer_params: list[int] = field(default_factory=list)
    embed_params: int = 0
    head_params: int = 0

    def __post_init__(self):
        self.blocks = [(int(a), int(b)) for a, b in self.blocks]
        if not self.blocks:
            raise ConfigError("a partition needs at least one block")
        expect = 0
        for b, (first, stop) in enumerate(self.blocks):
            if first != expect or stop <= first:
                raise ConfigError(
                    f"partition blocks {self.blocks} are not contiguous non-empty layer ranges "
                    f"covering 0..{self.num_layers} (block {b})"
                )
            expect = stop
        if expect != self.num_layers:
            raise ConfigError(
                f"partition blocks {self.blocks} do not cover {self.num_layers} layers"
            )
        if len(self.block_params) != len(self.blocks):
            raise ConfigError("partition: one parameter count per block is required")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def layers(self, b: int) -> range:
        """Layer indices of block b."""
        return range(*self.blocks[b])

    def block_of_layer(self, i: int) -> int:
        if not 0 <= i < self.num_layers:
            raise ValueError(f"layer {i} is out of range 0..{self.num_layers - 1}")
        return next(b for b, (first, stop) in enumerate(self.blocks) if first <= i < stop)

    def block_of_part(self, kind: str, idx: int = 0) -> int:
        """Block holding an adapter part: embed -> 0, head -> M-1, layers idx -> its block."""
        if kind == "embed":
            return 0
        if kind == "head":
            return self.num_blocks - 1
        return self.block_of_layer(idx)

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "blocks": [list(x) for x in self.blocks],
            "block_params": list(self.block_params),
            "layer_params": list(self.layer_params),
            "embed_params": self.embed_params,
            "head_params": self.head_params,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Partition:
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(f"stored partition is malformed: {e}") from None


def partition_layers(
    layer_params: list[int], embed_params: int, head_params: int, num_blocks: int
) -> Partition:
    """Cut L layers into M contiguous non-empty blocks minimising the largest block's parameter
    count (embed counted in block 0, head in block M-1). Exact: a DP over (blocks, first layer).

    Tie-break (deterministic): among all optimal cuts, the lexicographically smallest tuple of
    block end layers, i.e. earlier blocks are as small as the optimum allows."""
    L, M = len(layer_params), num_blocks
    if not 1 <= M <= L:
        raise ConfigError(
            f"partition.num_blocks = {M} is out of range for a model with {L} layers; "
            f"choose 1 <= num_blocks <= {L}"
        )
    prefix = [0]
    for p in layer_params:
        prefix.append(prefix[-1] + int(p))

    def cost(b: int, first: int, stop: int) -> int:  # parameters of block b = layers [first, stop)
        extra = (embed_params if b == 0 else 0) + (head_params if b == M - 1 else 0)
        return prefix[stop] - prefix[first] + extra

    # best[b][s]: smallest possible max cost of blocks b..M-1 covering layers [s, L)
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(M + 1)]
    best[M][L] = 0
    for b in range(M - 1, -1, -1):
        for s in range(b, L - (M - 1 - b)):  # leave >= 1 layer for each later block
            best[b][s] = min(
                max(cost(b, s, e), best[b + 1][e]) for e in range(s + 1, L - (M - 2 - b))
            )
    opt = best[0][0]
    blocks, s = [], 0
    for b in range(M):  # greedy: earliest end that still reaches the optimum
        e = next(
            e for e in range(s + 1, L - (M - 2 - b)) if max(cost(b, s, e), best[b + 1][e]) <= opt
        )
        blocks.append((s, e))
        s = e
    return Partition(
        num_layers=L,
        blocks=blocks,
        block_params=[cost(b, *blocks[b]) for b in range(M)],
        layer_params=[int(p) for p in layer_params],
        embed_params=int(embed_params),
        head_params=int(head_params),
    )


def partition_model(adapter, num_blocks: int) -> Partition:
    """Partition an adapted model (preinfer.model.adapters.Adapter) by its owned parameter counts."""
    embed, layers, head = adapter.part_params()
    return partition_layers(layers, embed, head, num_blocks)


def block_tensor_names(adapter, partition: Partition, b: int) -> list[str]:
    """State-dict names owned by block b: its layers, + embed if b == 0, + head if b == M-1.
    Tied aliases are not listed anywhere: their owner (the embedding) belongs to block 0."""
    if not 0 <= b < partition.num_blocks:
        raise ConfigError(f"block {b} is out of range 0..{partition.num_blocks - 1}")
    if partition.num_layers != adapter.num_layers:
        raise ConfigError(
            f"partition covers {partition.num_layers} layers but the model has {adapter.num_layers}"
        )
    parts = adapter.part_names()
    names = list(parts["embed"]) if b == 0 else []
    for i in partition.layers(b):
        names += parts["layers"][i]
    if b == partition.num_blocks - 1:
        names += parts["head"]
    return names


def trainable_named_parameters(
    model, adapter, partition: Partition, b: int
) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs block b may update: its owned parameters. Tied tensors are owned
    by block 0, so block M-1's head never updates the shared embedding."""
    state = adapter.tensors()
    out = []
    for n in block_tensor_names(adapter, partition, b):
        p = state[n]
        if isinstance(p, nn.Parameter):
            if p.is_meta:
                raise ConfigError(f"block {b} is not loaded ({n} is on meta); load it first")
            out.append((n, p))
    return out


def trainable_parameters(model, adapter, partition: Partition, b: int) -> list[nn.Parameter]:
    """The parameters block b may update (for the optimizer)."""
    return [p for _, p in trainable_named_parameters(model, adapter, partition, b)]


def freeze_except(model, adapter, partition: Partition, b: int) -> list:
    """requires_grad only on block b's trainable parameters (gradients still flow through the
    frozen later blocks' activations); returns those parameters."""
    keep = trainable_parameters(model, adapter, partition, b)
    ids = {id(p) for p in keep}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return keep
