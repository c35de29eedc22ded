"""Model configs and builders: HF GPT-2 / LLaMA / BERT or a plain nn.Sequential, from config
(random init with a seed) or from a local HF checkpoint directory. No I/O beyond reading a
local checkpoint, no Ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from preinfer.confload import ConfigError


@dataclass(kw_only=True)
class ModelConfig:
    arch: Literal["gpt2", "llama", "bert", "sequential"] = "gpt2"
    """Model family; decides the adapter (embed -> layers -> head)."""
    checkpoint: str | None = None
    """Local HF checkpoint dir (or `pkg:<module>/<subdir>` inside an installed package); null = random init."""
    vocab_size: int = 4096
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    hidden_size: int = 128
    """Width H of the hidden state (the cached tensor is [N, S, H])."""
    num_layers: int = 6
    """Number of transformer layers L (blocks are cut on layer boundaries)."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (llama); null = num_heads."""
    intermediate_size: int | None = None
    """MLP width; null = 4 * hidden_size (gpt2, bert) or 8/3 * hidden_size rounded (llama)."""
    max_positions: int = 512
    """Longest sequence the model accepts (learned positions or rotary limit)."""
    rope_theta: float = 10000.0
    """Rotary base (llama)."""
    tie_embeddings: bool = True
    """Tie the LM head to the token embedding (gpt2 default; the tied tensor belongs to block 0)."""
    dropout: float = 0.0
    """Dropout in embeddings/attention/MLP (0 keeps cached and recomputed paths identical)."""
    init_seed: int = 0
    """Seed of the random initialisation."""

    def __post_init__(self):
        if self.checkpoint is None:
            for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_positions"):
                if getattr(self, name) < 1:
                    raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"model.hidden_size ({self.hidden_size}) must be divisible by "
                    f"model.num_heads ({self.num_heads})"
                )
            kv = self.num_kv_heads or self.num_heads
            if self.num_heads % kv:
                raise ConfigError(
                    f"model.num_heads ({self.num_heads}) must be divisible by "
                    f"model.num_kv_heads ({kv})"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
