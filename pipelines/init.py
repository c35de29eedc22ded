"""Stage `preinfer init`: build the model (random init or local checkpoint), cut it into M
blocks and write the per-block checkpoint."""

from __future__ import annotations

from core.config import ConfigError
from preinfer.checkpoint import Checkpoint
from preinfer.checkpoint_init import init_checkpoint
from preinfer.config import Config
from storage.tokens import TokenStore


def check_vocab(cfg: Config, ckpt: Checkpoint) -> None:
    """A token id the embedding cannot look up is an error before anything runs."""
    if not TokenStore.exists(cfg.data.out_dir):
        return
    store = TokenStore(cfg.data.out_dir)
    vocab = ckpt.vocab_size
    if store.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer at {store.path} has {store.vocab_size} tokens but the model's embedding "
            f"has {vocab} rows; raise model.vocab_size (or use the model's own tokenizer)"
        )
    max_pos = ckpt.max_positions
    if max_pos is not None and store.seq_len > max_pos:
        raise ConfigError(
            f"the token store's S={store.seq_len} is larger than the model's {max_pos} positions; "
            "lower data.seq_len and re-tokenize"
        )


def run_init(cfg: Config, *, force: bool = False, log=print) -> Checkpoint:
    ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, cfg.run.checkpoint, force=force)
    check_vocab(cfg, ckpt)
    log(f"init: {ckpt.path}: {ckpt.summary()}")
    return ckpt
