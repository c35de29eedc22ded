"""What a checkpoint directory holds on disk, and how its files are written.

The layout and commit order are described in preinfer/checkpoint.py (the `Checkpoint` that reads
and commits them). Here: the format constants (FORMAT, FORMAT_VERSION, INDEX = checkpoint.json),
`CheckpointError`, the atomic writers of the two kinds of file (a block's .safetensors, the JSON
index; one PUT each on an object store), block file names (block_<b:03d>-<hash8>.safetensors),
and building the index for a freshly cut model, with the content key that says whether two
checkpoints are "the same".
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file
from torch import nn

from core.config import to_dict
from core.fingerprint import hash_obj, tensors_hash
from preinfer.adapters import Adapter
from preinfer.modeling import ModelConfig
from preinfer.partition import Partition
from storage import fs

FORMAT = "preinfer-checkpoint"
FORMAT_VERSION = 1
INDEX = "checkpoint.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, tampered with, or used wrongly."""


class CheckpointExists(CheckpointError):
    """init found a different checkpoint (other config, partition or trained weights) there."""


# ---- small atomic-write helpers (same pattern as storage/atomic.py, no storage import) ----


def _tmp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: dict) -> None:
    if fs.is_url(path):  # one PUT: atomic on an object store
        fs.put(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())
        return
    tmp = _tmp_beside(path)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_block_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    if fs.is_url(path):  # one PUT: atomic on an object store
        fs.put(path, save_safetensors({k: v.contiguous() for k, v in tensors.items()}, meta))
        return
    tmp = _tmp_beside(path)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_PLAIN_BLOCK_FILE = re.compile(r"block_[0-9]+-[0-9a-f]+\.safetensors")


def _block_file_name(b: int, digest: str) -> str:
    return f"block_{b:03d}-{digest[:8]}.safetensors"


def _spec(t: torch.Tensor) -> list:
    return [str(t.dtype).removeprefix("torch."), list(t.shape)]


def _cpu_state(tensors: dict[str, torch.Tensor], names: list[str], what: str) -> dict:
    out = {}
    for n in names:
        t = tensors[n]
        if t.is_meta:
            raise CheckpointError(f"{what}: tensor {n} is not loaded (meta); load its block first")
        out[n] = t.detach().to("cpu").contiguous()
    return out


# ---- the index ----


def _make_index(model_cfg: ModelConfig, model: nn.Module, adapter: Adapter, partition: Partition,
                states: list[dict[str, torch.Tensor]]) -> dict:  # fmt: skip
    tied = adapter.tied()
    owners = sorted(set(tied.values()))
    all_state = {n: t for s in states for n, t in s.items()}
    info = getattr(model, "init_info", {})
    hf = getattr(model, "config", None)
    blocks = []
    for b, state in enumerate(states):
        digest = tensors_hash(state)
        blocks.append({
            "file": _block_file_name(b, digest),
            "hash": digest,
            "num_params": sum(t.numel() for t in state.values()),
            "tensors": sorted(state),
            "specs": {n: _spec(t) for n, t in sorted(state.items())},
        })  # fmt: skip
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generation": 0,
        "arch": model_cfg.arch,
        "model_config": to_dict(model_cfg),
        "hf_config": hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else None,
        "dims": {
            "num_layers": adapter.num_layers,
            "hidden_size": adapter.hidden_size,
            "vocab_size": adapter.vocab_size,
            "max_positions": adapter.max_positions,
        },
        "partition": partition.to_dict(),
        "blocks": blocks,
        "tied": tied,
        # per-tensor hashes of tied owners: a block that reads only the tied tensor verifies it
        "tied_hashes": {o: tensors_hash({o: all_state[o]}) for o in owners},
        "init": {
            "source": info.get("source", "random"),
            "checkpoint": info.get("checkpoint"),
            "fresh": sorted({tied.get(n, n) for n in info.get("fresh", [])}),
            "unused": list(info.get("unused", [])),
        },
    }


# HF config keys that say where/with what it was made, not what the model is
_VOLATILE_HF_KEYS = ("transformers_version", "_name_or_path")


def _stable_hf(hf: dict) -> dict:
    return {k: v for k, v in hf.items() if k not in _VOLATILE_HF_KEYS}


def _content_key(index: dict) -> str:
    """What makes two checkpoints "the same": architecture, partition and every block's bytes."""
    hf = _stable_hf(index["hf_config"] or {})
    return hash_obj({
        "model_config": index["model_config"],
        "hf_config": hf,
        "partition": index["partition"],
        "tied": index["tied"],
        "blocks": [b["hash"] for b in index["blocks"]],
    })  # fmt: skip
