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


def trained_bpe_warning(cfg: Config, store: TokenStore) -> str | None:
    """A line when a pretrained model (model.checkpoint) is to read a token store made with a
    BPE trained on the corpus: its ids are not the model's vocabulary, so the pretrained
    embeddings would read other tokens (sizes can match and nothing else would say so)."""
    made = (store.manifest.get("config") or {}).get("data") or {}
    if cfg.model.checkpoint is None or made.get("tokenizer") != "bpe":
        return None
    return (
        f"init: warning: the token store {store.path} was made with a BPE trained on the corpus "
        "(data.tokenizer=bpe), not with the tokenizer of model.checkpoint "
        f"{cfg.model.checkpoint}: its ids are another vocabulary, so the pretrained embeddings "
        "would read other tokens. Set data.tokenizer to the model's directory and rerun "
        "`preinfer tokenize --force`"
    )


def run_init(cfg: Config, *, force: bool = False, log=print) -> Checkpoint:
    check_init_memory(cfg.model)  # before the model is built: a size it cannot hold is refused
    built = build_blocks(cfg.model, cfg.partition.num_blocks)
    if TokenStore.exists(cfg.data.out_dir):  # else `tokenize` has not run yet: nothing to check
        store = TokenStore(cfg.data.out_dir)
        check_dims(built[0]["dims"], store, cfg.run.checkpoint)
        if warning := trained_bpe_warning(cfg, store):
            log(warning)
    # a bcd holding the run.dir would train on, and record visits of, a checkpoint replaced
    # under it: init waits for no one, it refuses
    with run_lock(cfg.run.dir, "init"):
        ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, cfg.run.checkpoint,
                               force=force, built=built)  # fmt: skip
        if ckpt.index.get("init_id") == built[0]["init_id"]:  # written now, not reused
            reset_run(cfg.run.dir, log=log)
    log(f"init: {ckpt.path}: {ckpt.summary()}")
    return ckpt
