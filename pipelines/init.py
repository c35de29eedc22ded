"""Stage `preinfer init`: build the model (random init or local checkpoint), cut it into M
blocks and write the per-block checkpoint.

Everything that can refuse (the model's size against the memory, the token store's vocab and
positions, the run.dir lock) is checked before the first byte is written. A new checkpoint
under a run.dir moves the run's earlier records aside (preinfer/run/state.py): they describe
the checkpoint it replaced."""

from __future__ import annotations

from preinfer.checkpoint.init import build_blocks, init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.plan.guards import check_dims, check_init_memory
from preinfer.run.config import Config
from preinfer.run.lock import run_lock
from preinfer.run.state import reset_run
from storage.tokens import TokenStore


def run_init(cfg: Config, *, force: bool = False, log=print) -> Checkpoint:
    check_init_memory(cfg.model)  # before the model is built: a size it cannot hold is refused
    built = build_blocks(cfg.model, cfg.partition.num_blocks)
    if TokenStore.exists(cfg.data.out_dir):  # else `tokenize` has not run yet: nothing to check
        check_dims(built[0]["dims"], TokenStore(cfg.data.out_dir), cfg.run.checkpoint)
    # a bcd holding the run.dir would train on, and record visits of, a checkpoint replaced
    # under it: init waits for no one, it refuses
    with run_lock(cfg.run.dir, "init"):
        ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, cfg.run.checkpoint,
                               force=force, built=built)  # fmt: skip
        if ckpt.index.get("init_id") == built[0]["init_id"]:  # written now, not reused
            reset_run(cfg.run.dir, log=log)
    log(f"init: {ckpt.path}: {ckpt.summary()}")
    return ckpt
