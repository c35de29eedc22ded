"""Creating a checkpoint: `init_checkpoint` builds a model, cuts it into blocks and writes it.

Locally the block files and checkpoint.json are written into a temp dir beside the target and
renamed into place; under an object-store prefix (`_init_remote`) the block files are PUT first
and checkpoint.json last (the commit point). Re-exported by preinfer/checkpoint/store.py, where the
layout is described; the format helpers it uses are in preinfer/checkpoint/format.py.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch

from preinfer.checkpoint.format import (
    INDEX,
    CheckpointError,
    CheckpointExists,
    _content_key,
    _cpu_state,
    _files,
    _make_index,
    _write_block_file,
    _write_json_atomic,
    _writer_lock,
)
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import get_adapter
from preinfer.model.modeling import ModelConfig, build_model
from preinfer.model.partition import block_tensor_names, partition_model
from storage import atomic, fs


def build_blocks(model_cfg: ModelConfig, num_blocks: int) -> tuple[dict, list[dict]]:
    """The model of `model_cfg` cut into `num_blocks` blocks, in memory: (checkpoint.json's
    index, one {tensor name: tensor} per block). Writes nothing: a stage checks the index
    (vocab, positions) before `init_checkpoint` writes it."""
    model = build_model(model_cfg)
    adapter = get_adapter(model, model_cfg.arch)
    partition = partition_model(adapter, num_blocks)
    tensors = adapter.tensors()
    states = [
        _cpu_state(tensors, block_tensor_names(adapter, partition, b), f"block {b}")
        for b in range(partition.num_blocks)
    ]
    index = _make_index(model_cfg, model, adapter, partition, states)
    # which init this checkpoint descends from: commits carry it, a re-init draws a new one,
    # so a run's state.json can tell "its" checkpoint from a re-initialised one
    index["init_id"] = uuid.uuid4().hex
    return index, states


def init_checkpoint(
    model_cfg: ModelConfig,
    num_blocks: int,
    out_dir: str | Path,
    *,
    force: bool = False,
    built: tuple[dict, list[dict]] | None = None,
) -> Checkpoint:
    """Build the model of `model_cfg` (or take `built`, from build_blocks), cut it into
    `num_blocks` blocks and write the checkpoint.

    Written into a temp dir beside `out_dir` and renamed into place, so a crash never leaves a
    directory that looks complete. An existing checkpoint with the same content is reused; a
    different one is an error unless force=True, which writes the new block files beside the old
    ones and replaces checkpoint.json atomically (then deletes files no longer referenced)."""

    fs.check(out_dir, "checkpoint")
    out = fs.path(out_dir)
    if not fs.is_url(out) and out.exists() and not out.is_dir():
        raise CheckpointError(f"checkpoint path {out} is a file; choose a directory")
    index, states = built if built is not None else build_blocks(model_cfg, num_blocks)
    if (out / INDEX).exists():
        existing = Checkpoint.open(out)
        if _content_key(existing.index) == _content_key(index):
            return existing
        if not force:
            raise CheckpointExists(
                f"{out} holds a different checkpoint (other config, partition or trained "
                "weights); use another run.checkpoint dir, or force (`preinfer init --force`) to "
                "replace it"
            )
        referenced = {b["file"]: b["hash"] for b in existing.index["blocks"]}
        with _writer_lock(out):  # no commit runs meanwhile
            for blk, state in zip(index["blocks"], states, strict=True):
                if referenced.get(blk["file"]) == blk["hash"]:
                    continue  # the same bytes are already there under this name
                if blk["file"] in referenced:
                    raise CheckpointError(f"hash prefix collision on {blk['file']}; cannot replace")
                _write_block_file(out / blk["file"], state, {"hash": blk["hash"]})
            index["generation"] = existing.index.get("generation", 0) + 1
            _write_json_atomic(out / INDEX, index)
            for f in _files(existing.index) - _files(index):  # old weights and optimizer states
                (out / f).unlink(missing_ok=True)
        return Checkpoint.open(out)
    if fs.is_url(out):
        return _init_remote(out, index, states)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(
            f"{out} exists, is not empty and holds no {INDEX}: it is not a preinfer checkpoint "
            "(or an interrupted copy of one); remove it or choose another directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)

    def fill(tmp: Path) -> None:
        for blk, state in zip(index["blocks"], states, strict=True):
            _write_block_file(tmp / blk["file"], state, {"hash": blk["hash"]})
        _write_json_atomic(tmp / INDEX, index)

    try:  # the parent's fsync is below, outside: a failing one is no lost race
        atomic.write_dir(out, fill, tmp_name=_tmp_dir, fsync_dir=False)
    except OSError:
        # a concurrent init of the same config won the rename: its checkpoint is ours
        if (out / INDEX).is_file():
            winner = Checkpoint.open(out)
            if _content_key(winner.index) == _content_key(index):
                return winner
        raise
    atomic.fsync_path(out.parent)
    return Checkpoint.open(out)


def _tmp_dir(out: Path) -> Path:
    """The hidden temp directory a new checkpoint is written into, beside `out`."""
    return out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"


def _init_remote(out, index: dict, states: list[dict[str, torch.Tensor]]) -> Checkpoint:
    """A new checkpoint under an object-store prefix: block files (content-hash names, one PUT
    each), then checkpoint.json last; a prefix without it is incomplete. Leftover block files
    of an interrupted init are overwritten (same names = same bytes) or left unreferenced."""

    others = [p.name for p in out.iterdir() if not p.name.startswith("block_")]
    if others:
        raise CheckpointError(
            f"{out} is not empty and holds no {INDEX} (found {others[:3]}): it is not a preinfer "
            "checkpoint; remove those objects or choose another prefix"
        )
    for blk, state in zip(index["blocks"], states, strict=True):
        _write_block_file(out / blk["file"], state, {"hash": blk["hash"]})
    _write_json_atomic(out / INDEX, index)  # the commit point
    return Checkpoint.open(out)
