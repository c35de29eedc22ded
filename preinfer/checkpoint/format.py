"""What a checkpoint directory holds on disk, and how its files are written.

The layout and commit order are described in preinfer/checkpoint/store.py (the `Checkpoint` that reads
and commits them). Here: the format constants (FORMAT, FORMAT_VERSION, INDEX = checkpoint.json),
`CheckpointError`, the atomic writers of the two kinds of file (a .safetensors of a block's
weights or optimizer state, the JSON index; one PUT each on an object store), file names
(block_<b:03d>-<hash8>.safetensors, optim_<b:03d>-<hash8>.safetensors), the writer lock and
the sweep of what killed commits left, and building the index for a freshly cut model, with
the content key that says whether two checkpoints are "the same".
"""

from __future__ import annotations

import fcntl
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file
from torch import nn

from core import faults
from core.config import to_dict
from core.fingerprint import hash_obj, tensors_hash
from preinfer.model.adapters import Adapter
from preinfer.model.modeling import ModelConfig
from preinfer.model.partition import Partition
from storage import atomic, fs

FORMAT = "preinfer-checkpoint"
FORMAT_VERSION = 1
INDEX = "checkpoint.json"
# a block entry's key: the optimizer state of its parameters that trained in another block's
# visit (train.always_train), overlaying the block's own ("optim")
ALONGSIDE = "optim_alongside"
LOCK = ".lock"  # flock'ed by a local commit (never read)


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, tampered with, or used wrongly."""


class CheckpointExists(CheckpointError):
    """init found a different checkpoint (other config, partition or trained weights) there."""


class CommittedMeanwhile(CheckpointError):
    """A file the reader's index named is gone or other: a commit replaced checkpoint.json
    (`index`, the new one) since the reader read it. `Checkpoint` reads again against it."""

    def __init__(self, path, index: dict):
        super().__init__(
            f"checkpoint {path} was committed to while it was read (a running bcd or train); "
            "it is intact: rerun the command"
        )
        self.path, self.index = path, index

    def __reduce__(self):  # pickled whole (a Ray worker's error reaches its driver)
        return CommittedMeanwhile, (self.path, self.index)


# ---- the writers: storage/atomic.py's write, with the checkpoint's own temp names ----


def _tmp_beside(path: Path) -> Path:
    """A checkpoint file's temp: hidden, and matched by `_PARTIAL` (what `_sweep` deletes)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")


def _write_json_atomic(path: Path, obj: dict) -> None:
    """checkpoint.json, whole: temp, fsync, rename, fsync of the directory (the commit is
    durable once this returns); one PUT on an object store."""
    atomic.write_file(
        path,
        lambda f: f.write(atomic.json_bytes(obj)),
        tmp_name=_tmp_beside,
        before_replace=lambda: faults.kill_point("checkpoint.index_tmp"),
        fsync_dir=True,
    )


def _write_block_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """A block's weights or optimizer state as one .safetensors file (temp, fsync, rename);
    one PUT on an object store. safetensors' I/O errors (a full disk) come out as OSErrors."""
    state = {k: v.contiguous() for k, v in tensors.items()}
    if fs.is_url(path):
        fs.put(path, save_safetensors(state, meta))
        return

    def save(f) -> None:  # save_file writes by path: to f's, the open temp file
        try:
            save_file(state, f.name, metadata=meta)
        except SafetensorError as e:  # its I/O errors (disk full...) are not OSErrors
            err = atomic.as_os_error(e, path)
            if err is None:
                raise
            raise err from e

    atomic.write_file(
        path,
        save,
        tmp_name=_tmp_beside,
        before_replace=lambda: faults.kill_point("checkpoint.file_tmp"),
    )


_PLAIN_BLOCK_FILE = re.compile(r"block_[0-9]+-[0-9a-f]+\.safetensors")
_PLAIN_OPTIM_FILE = re.compile(r"optim_[0-9]+-[0-9a-f]+\.safetensors")
# temps of the writers above, as _tmp_beside names them
_PARTIAL = re.compile(r"\.(block_|optim_|checkpoint\.json).*\.partial")


def _block_file_name(b: int, digest: str) -> str:
    return f"block_{b:03d}-{digest[:8]}.safetensors"


def _optim_file_name(b: int, digest: str) -> str:
    return f"optim_{b:03d}-{digest[:8]}.safetensors"


@contextmanager
def _writer_lock(path: Path) -> Iterator[None]:
    """One committer at a time on a local checkpoint (flock on <dir>/.lock): a commit's sweep
    then never deletes a file another writer has in flight. Object stores: no lock (one writer
    by contract; the generation check catches a second)."""
    if fs.is_url(path):
        yield
        return
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _sweep(path: Path, keep: set[str]) -> None:
    """Under the writer lock: delete what killed commits left in a local checkpoint, the temps
    of its writers and block/optimizer files checkpoint.json does not name (`keep`)."""
    if fs.is_url(path):
        return
    for p in path.iterdir():
        name = p.name
        plain = _PLAIN_BLOCK_FILE.fullmatch(name) or _PLAIN_OPTIM_FILE.fullmatch(name)
        if (plain and name not in keep) or _PARTIAL.fullmatch(name):
            p.unlink(missing_ok=True)


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


def _checked_state(index: dict, b: int, tensors: dict[str, torch.Tensor]) -> dict:
    """Block b's tensors as a commit writes them (CPU, contiguous), checked against the names,
    dtypes and shapes `index` holds for the block."""
    blk = index["blocks"][b]
    expect, got = set(blk["tensors"]), set(tensors)
    if got != expect:
        tied = sorted(n for n in got - expect if n in index["tied"] or n in index["tied_hashes"])
        if tied:
            owner = index["tied"].get(tied[0], tied[0])
            where = [i for i, x in enumerate(index["blocks"]) if owner in x["specs"]]
            raise CheckpointError(
                f"block {b} may not write tied tensor(s) {tied}: they belong to block "
                f"{where[0] if where else '?'}; leave them out"
            )
        raise CheckpointError(
            f"commit of block {b}: tensor names differ from the block's "
            f"(missing {sorted(expect - got)[:3]}, unexpected {sorted(got - expect)[:3]})"
        )
    state = {}
    for n in sorted(expect):
        t = tensors[n].detach()
        if t.is_meta:
            raise CheckpointError(f"commit of block {b}: {n} is on the meta device")
        if _spec(t) != blk["specs"][n]:
            raise CheckpointError(
                f"commit of block {b}: {n} is {_spec(t)}, the checkpoint holds {blk['specs'][n]}"
            )
        state[n] = t.to("cpu").contiguous()
    return state


def _new_name(name: str, old: dict) -> str:
    """A new file's name, which must differ from the one it replaces (`old`: its entry)."""
    if name == old.get("file"):
        raise CheckpointError(f"hash prefix collision on {name}; cannot commit")
    return name


def _files(index: dict) -> set[str]:
    """The block and optimizer files an index names."""
    optim = {
        (blk.get(k) or {}).get("file") for blk in index["blocks"] for k in ("optim", ALONGSIDE)
    }
    return {blk["file"] for blk in index["blocks"]} | (optim - {None})


# ---- the index ----


def _check_index(idx: Path, index: object) -> None:
    """Refuse an index (`idx`'s parsed JSON) that is not one this preinfer reads, or that names
    a file other than a plain block_/optim_*.safetensors inside the checkpoint. Optional keys:
    a block's "optim" (train.keep_optimizer_state) and "optim_alongside" (the state of its
    parameters trained in another block's visit: train.always_train), "tokens" (the token store a commit trained
    on, top level and per block; checkpoints committed before it have none)."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{idx} is not a preinfer checkpoint index")
    if index.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{idx} has format version {index.get('format_version')!r}; this preinfer reads "
            f"version {FORMAT_VERSION}; re-create the checkpoint with this version"
        )
    blocks = index.get("blocks") if isinstance(index.get("blocks"), list) else [None]
    names = [b.get("file") if isinstance(b, dict) else b for b in blocks]
    optim = [
        b.get(k) for b in blocks for k in ("optim", ALONGSIDE) if isinstance(b, dict) and k in b
    ]
    onames = [  # an entry lacking its hash or optimizer is as damaged as a bad name
        o.get("file") if isinstance(o, dict) and isinstance(o.get("hash"), str)
        and isinstance(o.get("optimizer"), str) else repr(o) for o in optim
    ]  # fmt: skip
    if not all(isinstance(f, str) and _PLAIN_BLOCK_FILE.fullmatch(f) for f in names) or not all(
        isinstance(f, str) and _PLAIN_OPTIM_FILE.fullmatch(f) for f in onames
    ):
        raise CheckpointError(  # a commit reads and later unlinks the named files
            f"{idx} names a file that is not a plain block_/optim_*.safetensors file inside "
            f"the checkpoint ({(names + onames)!r:.160}); the checkpoint is damaged or "
            "hand-edited"
        )


def _record_tokens(index: dict, blocks: list[int], tokens: dict | None) -> None:
    """Record in `index` (a commit's new one) the token store `blocks` were just trained on:
    `tokens` (a preinfer.plan.guards.token_record, less its path: a checkpoint's bytes follow what
    it was trained on, not where the run sat) as the top-level "tokens" with those "blocks",
    its fingerprint as each of their entries' "tokens". None (a commit from elsewhere, data
    unknown): the old records of the top level and of those blocks go (they described other
    weights)."""
    index.pop("tokens", None)
    for b in blocks:
        index["blocks"][b].pop("tokens", None)
        if tokens is not None:
            index["blocks"][b]["tokens"] = tokens["fingerprint"]
    if tokens is not None:
        index["tokens"] = {**{k: v for k, v in tokens.items() if k != "path"}, "blocks": blocks}


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
            # model.tie_embeddings false on a tied checkpoint: the head copied from the embedding
            **({"untied": info["untied"]} if info.get("untied") else {}),
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
