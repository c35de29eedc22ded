"""Stage `preinfer init`: build the model (random init or local checkpoint), cut it into M
blocks and write the per-block checkpoint."""

from __future__ import annotations

from preinfer.checkpoint import Checkpoint
from preinfer.checkpoint_init import init_checkpoint
from preinfer.config import Config
from preinfer.guards import check_vocab
from storage.tokens import TokenStore


def run_init(cfg: Config, *, force: bool = False, log=print) -> Checkpoint:
    ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, cfg.run.checkpoint, force=force)
    if TokenStore.exists(cfg.data.out_dir):  # else `tokenize` has not run yet: nothing to check
        check_vocab(ckpt, TokenStore(cfg.data.out_dir))
    log(f"init: {ckpt.path}: {ckpt.summary()}")
    return ckpt
