"""Partitioner: exact min-max block sizes, embed/head placement, tied ownership, errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from conftest import tiny_model_config
from core.config import ConfigError
from preinfer.model.adapters import get_adapter
from preinfer.model.modeling import build_model
from preinfer.model.partition import (
    Partition,
    block_tensor_names,
    freeze_except,
    partition_layers,
    partition_model,
    trainable_named_parameters,
    trainable_parameters,
)


def brute_force(layers, embed, head, m):
    """(optimal max block cost, lexicographically smallest optimal tuple of block ends)."""
    n = len(layers)
    best = None
    for cuts in itertools.combinations(range(1, n), m - 1):
        ends = (*cuts, n)
        starts = (0, *cuts)
        costs = [sum(layers[a:z]) for a, z in zip(starts, ends, strict=True)]
        costs[0] += embed
        costs[-1] += head
        key = (max(costs), ends)
        best = key if best is None or key < best else best
    return best


def test_matches_brute_force_on_random_cases():
    rng = random.Random(0)
    for case in range(400):
        n = rng.randint(1, 8)
        m = rng.randint(1, n)
        hi = rng.choice([3, 20, 10_000])  # small ranges -> many ties, exercising the tie-break
        layers = [rng.randint(0, hi) for _ in range(n)]
        embed, head = rng.randint(0, 3 * hi), rng.randint(0, 3 * hi)
        part = partition_layers(layers, embed, head, m)
        opt, ends = brute_force(layers, embed, head, m)
        assert max(part.block_params) == opt, (case, layers, embed, head, m)
        assert tuple(z for _, z in part.blocks) == ends, (case, layers, embed, head, m)
        assert part.num_blocks == m and part.blocks[0][0] == 0 and part.blocks[-1][1] == n
        assert sum(part.block_params) == sum(layers) + embed + head


def test_embed_joins_block0_and_head_joins_last():
    part = partition_layers([10] * 6, embed_params=100, head_params=0, num_blocks=3)
    assert part.blocks[0] == (0, 1)  # a heavy embedding leaves block 0 one layer
    assert part.block_params[0] == 110
    part = partition_layers([10] * 6, embed_params=0, head_params=100, num_blocks=3)
    assert part.blocks[-1] == (5, 6) and part.block_params[-1] == 110
    part = partition_layers([10] * 6, embed_params=0, head_params=0, num_blocks=3)
    assert part.blocks == [(0, 2), (2, 4), (4, 6)]
    # ties broken toward earlier (smaller) ends: 5 equal layers in 2 blocks -> 2 + 3
    assert partition_layers([1] * 5, 0, 0, 2).blocks == [(0, 2), (2, 5)]


def test_out_of_range_num_blocks():
    for m in (0, -1, 5):
        with pytest.raises(
            ConfigError, match=rf"num_blocks = {m} .* 4 layers.*1 <= num_blocks <= 4"
        ):
            partition_layers([1, 1, 1, 1], 0, 0, m)
    with pytest.raises(ConfigError, match="out of range"):
        partition_model(get_adapter(build_model(tiny_model_config("gpt2"))), 5)


def test_roundtrip_and_validation():
    part = partition_layers([3, 1, 4, 1, 5], 9, 2, 3)
    again = Partition.from_dict(part.to_dict())
    assert again == part
    assert [again.block_of_layer(i) for i in range(5)] == [
        b for b, (a, z) in enumerate(part.blocks) for _ in range(a, z)
    ]
    with pytest.raises(ValueError):
        part.block_of_layer(5)
    bad = part.to_dict() | {"blocks": [[0, 2], [3, 5]], "block_params": [1, 1]}
    with pytest.raises(ConfigError, match="contiguous"):
        Partition.from_dict(bad)
    with pytest.raises(ConfigError, match="malformed"):
        Partition.from_dict({"num_layers": 2})


def test_model_partition_counts_and_tied_ownership():
    cfg = tiny_model_config("gpt2", num_layers=5)
    model = build_model(cfg)
    ad = get_adapter(model, "gpt2")
    part = partition_model(ad, 3)
    unique = sum(p.numel() for p in model.parameters())  # .parameters() dedupes the tie
    assert sum(part.block_params) == unique
    names = [block_tensor_names(ad, part, b) for b in range(3)]
    flat = sum(names, [])
    assert len(flat) == len(set(flat)) == len(model.state_dict()) - 1
    assert "transformer.wte.weight" in names[0] and "transformer.wpe.weight" in names[0]
    assert "lm_head.weight" not in flat and "transformer.ln_f.weight" in names[2]
    for b in range(3):
        assert sum(model.state_dict()[n].numel() for n in names[b]) == part.block_params[b]
    wte = model.transformer.wte.weight
    last = trainable_parameters(model, ad, part, 2)
    assert all(p is not wte for p in last)
    assert model.lm_head.weight is wte  # the head still uses it, frozen
    assert any(p is wte for p in trainable_parameters(model, ad, part, 0))
    named = dict(trainable_named_parameters(model, ad, part, 1))
    assert set(named) == set(names[1])
    kept = freeze_except(model, ad, part, 2)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in kept}
    assert not wte.requires_grad


def test_training_last_block_leaves_tied_embedding_alone():
    model = build_model(tiny_model_config("gpt2"))
    ad = get_adapter(model, "gpt2")
    part = partition_model(ad, 2)
    before = model.transformer.wte.weight.detach().clone()
    opt = torch.optim.SGD(freeze_except(model, ad, part, 1), lr=1.0)
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    from preinfer.model.adapters import forward_blocks

    loss = forward_blocks(ad, part, ids, 0, 2).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    assert torch.equal(model.transformer.wte.weight, before)
    assert not torch.equal(
        model.transformer.ln_f.weight, torch.ones_like(model.transformer.ln_f.weight)
    )
