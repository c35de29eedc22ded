"""The on-disk model checkpoint: one safetensors file per block plus `checkpoint.json`.

    <dir>/
      checkpoint.json                       written LAST (temp file + os.replace): the commit point
      block_000-<hash8>.safetensors         block 0's owned tensors (embed + its layers)
      block_001-<hash8>.safetensors         ...

File names carry the block's content hash, so a commit writes a new file beside the old one,
then replaces checkpoint.json, then deletes the old file: a reader holding the old index never
sees its file overwritten, and a crash at any point leaves a consistent checkpoint.

Tied tensors (GPT-2's lm_head.weight = wte.weight) are stored once, in block 0's file. A later
block that needs one (the head of block M-1) reads just that tensor from block 0's file by name;
no other block may write it.

The directory may be an object-store URL (s3://bucket/prefix, storage/fs.py). Each file is then
ONE PUT (atomic: never visible half-written) in the same order: new block file, then
checkpoint.json (the commit point), then the old file's delete. `init_checkpoint` writes the
block files straight under the prefix and checkpoint.json last (no directory rename there).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file
from torch import nn

from preinfer.adapters import Adapter, get_adapter
from preinfer.confload import from_dict, to_dict
from preinfer.fingerprint import chain, hash_obj, tensors_hash
from preinfer.modeling import ModelConfig, build_model, materialise
from preinfer.partition import (  # noqa: F401  (trainable_*: re-exported, used by the trainer)
    Partition,
    block_tensor_names,
    freeze_except,
    partition_model,
    trainable_named_parameters,
    trainable_parameters,
)
from storage import fs

FORMAT = "preinfer-checkpoint"
FORMAT_VERSION = 1
INDEX = "checkpoint.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, tampered with, or used wrongly."""


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


class Checkpoint:
    """An opened checkpoint directory (read the index; tensors are read by `load`)."""

    def __init__(self, path: Path, index: dict):
        self.path = fs.path(path)  # a Path, or a RemotePath (s3://...)
        self.index = index

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        fs.check(path, "checkpoint")
        p = fs.path(path)
        if not (p / INDEX).is_file() and not p.is_dir():
            raise CheckpointError(
                f"checkpoint {p} does not exist; create it with `preinfer init` (init_checkpoint)"
            )
        idx = p / INDEX
        if not idx.is_file():
            raise CheckpointError(
                f"checkpoint {p} is incomplete or not a checkpoint ({INDEX} missing); "
                "rerun `preinfer init` (remove the directory if it holds something else)"
            )
        try:
            index = json.loads(idx.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{idx} is not valid JSON ({e}); the checkpoint is damaged"
            ) from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise CheckpointError(f"{idx} is not a preinfer checkpoint index")
        if index.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{idx} has format version {index.get('format_version')!r}; this preinfer reads "
                f"version {FORMAT_VERSION}; re-create the checkpoint with this version"
            )
        blocks = index.get("blocks") if isinstance(index.get("blocks"), list) else [None]
        names = [b.get("file") if isinstance(b, dict) else b for b in blocks]
        if not all(isinstance(f, str) and _PLAIN_BLOCK_FILE.fullmatch(f) for f in names):
            raise CheckpointError(  # commit_block reads and later unlinks the named file
                f"{idx} names a block file that is not a plain block_*.safetensors file inside "
                f"the checkpoint ({names!r:.160}); the checkpoint is damaged or hand-edited"
            )
        return cls(p, index)

    # ---- what the index says ----
    @property
    def model_config(self) -> ModelConfig:
        return from_dict(ModelConfig, self.index["model_config"], "checkpoint.model_config")

    @property
    def hf_config(self) -> dict | None:
        return self.index["hf_config"]

    @property
    def partition(self) -> Partition:
        return Partition.from_dict(self.index["partition"])

    @property
    def num_blocks(self) -> int:
        return len(self.index["blocks"])

    num_layers = property(lambda self: self.index["dims"]["num_layers"], doc="L")
    hidden_size = property(lambda self: self.index["dims"]["hidden_size"], doc="H")
    vocab_size = property(lambda self: self.index["dims"]["vocab_size"], doc="embedding rows")
    max_positions = property(
        lambda self: self.index["dims"]["max_positions"], doc="longest sequence (None: no limit)"
    )

    @property
    def model_config_dict(self) -> dict:
        """The architecture, for cache fingerprints: arch, dims, our model config and the HF
        config (minus where/with-what-version it was made). Weights are NOT in it (prefix_hash)."""
        hf = self.index["hf_config"]
        return {
            "arch": self.index["arch"],
            "dims": self.index["dims"],
            "model_config": self.index["model_config"],
            "hf_config": None if hf is None else _stable_hf(hf),
        }

    @property
    def tied(self) -> dict[str, str]:
        return dict(self.index["tied"])

    @property
    def fresh(self) -> list[str]:
        """Tensors initialised here although a pretrained checkpoint was given (e.g. MLM head)."""
        return list(self.index["init"]["fresh"])

    def _check_block(self, b: int) -> int:
        if not isinstance(b, int) or not 0 <= b < self.num_blocks:
            raise CheckpointError(f"block {b!r} is out of range 0..{self.num_blocks - 1}")
        return b

    def block_file(self, b: int) -> Path:
        return self.path / self.index["blocks"][self._check_block(b)]["file"]

    def block_hash(self, b: int) -> str:
        """Content hash (sha256 over names, dtypes, shapes, bytes) of block b's tensors."""
        return self.index["blocks"][self._check_block(b)]["hash"]

    def prefix_hash(self, k: int) -> str:
        """Chained hash of blocks 0..k-1 (0 <= k <= M): the frozen prefix feeding boundary k.
        Goes into the activation-cache fingerprint; changes iff one of those blocks changed."""
        if not 0 <= k <= self.num_blocks:
            raise CheckpointError(f"prefix length {k} is out of range 0..{self.num_blocks}")
        return chain("prefix", blocks=[self.block_hash(b) for b in range(k)])

    def summary(self) -> str:
        part = self.partition
        sizes = ", ".join(str(a) if z - a == 1 else f"{a}-{z - 1}" for a, z in part.blocks)
        return (
            f"{self.index['arch']} L={self.num_layers} H={self.hidden_size} V={self.vocab_size}, "
            f"{self.num_blocks} blocks (layers {sizes}; params "
            f"{', '.join(str(p) for p in part.block_params)}), init={self.index['init']['source']}"
        )

    def block_summaries(self) -> list[str]:
        """One line per block: layers, what else it holds, parameter count, hash, file."""
        part, out = self.partition, []
        for b, blk in enumerate(self.index["blocks"]):
            first, stop = part.blocks[b]
            layers = f"layer {first}" if stop - first == 1 else f"layers {first}-{stop - 1}"
            parts = ["embed"] * (b == 0) + [layers] + ["head"] * (b == part.num_blocks - 1)
            out.append(
                f"{' + '.join(parts)}, {blk['num_params']:,} params, hash {blk['hash'][:12]}, "
                f"{blk['file']}"
            )
        return out

    # ---- reading ----
    def _read(self, b: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Tensors of block b's file (all, or only `names`), read on CPU."""
        path = self.block_file(b)
        missing = CheckpointError(
            f"block {b}'s file {path.name} is missing from {self.path}; the checkpoint is "
            "damaged (restore it or re-create it with `preinfer init --force`)"
        )
        want = names if names is not None else self.index["blocks"][b]["tensors"]
        if fs.is_url(path):
            try:
                tensors = load_safetensors(path.read_bytes())
            except FileNotFoundError:
                raise missing from None
            except SafetensorError as e:
                raise CheckpointError(f"block {b}'s file {path.name} is unreadable: {e}") from None
            lacking = [n for n in want if n not in tensors]
            if lacking or (names is None and set(tensors) != set(want)):
                raise CheckpointError(
                    f"block {b}'s file {path.name} does not hold the tensors checkpoint.json "
                    f"lists (missing {lacking[:3]}); the file was replaced or damaged"
                )
            return {n: tensors[n] for n in want}
        if not path.is_file():
            raise missing
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                have = set(f.keys())
                missing = [n for n in want if n not in have]
                if missing or (names is None and have != set(want)):
                    raise CheckpointError(
                        f"block {b}'s file {path.name} does not hold the tensors checkpoint.json "
                        f"lists (missing {missing[:3]}); the file was replaced or damaged"
                    )
                return {n: f.get_tensor(n) for n in want}
        except SafetensorError as e:
            raise CheckpointError(f"block {b}'s file {path.name} is unreadable: {e}") from None

    def _read_block(self, b: int) -> dict[str, torch.Tensor]:
        tensors = self._read(b)
        if tensors_hash(tensors) != self.block_hash(b):
            raise CheckpointError(
                f"block {b}'s file {self.block_file(b).name} does not match the hash in "
                f"{INDEX}: it was modified or replaced; restore it or re-create the checkpoint"
            )
        return tensors

    def _block_of(self, name: str) -> int:
        for b, blk in enumerate(self.index["blocks"]):
            if name in blk["specs"]:
                return b
        raise CheckpointError(f"tensor {name} is in no block of {self.path}")

    def load(
        self, blocks: Iterable[int] | None = None, device: str | torch.device = "cpu"
    ) -> tuple[nn.Module, Adapter]:
        """Build the model on meta and materialise ONLY the listed blocks (None = all), each read
        from its own file and hash-checked; tied tensors another loaded block needs are read by
        name from their owner's file. Modules of other blocks stay on meta and refuse to run."""
        blocks = range(self.num_blocks) if blocks is None else blocks
        want = sorted({self._check_block(int(b)) for b in blocks})
        if not want:
            raise CheckpointError("load() needs at least one block index")
        model = build_model(self.model_config, device="meta", hf_config=self.hf_config)
        adapter = get_adapter(model, self.index["arch"])
        partition = self.partition
        for b in want:
            names = sorted(block_tensor_names(adapter, partition, b))
            if names != self.index["blocks"][b]["tensors"]:
                raise CheckpointError(
                    f"block {b}: the model built from {INDEX} owns different tensors than the "
                    "file lists; the checkpoint was written by an incompatible preinfer version"
                )
        loaded: dict[str, torch.Tensor] = {}
        for b in want:
            loaded.update(self._read_block(b))
        # tied aliases inside loaded parts whose owner lives in a block not loaded
        for alias, owner in self.tied.items():
            if owner in loaded or partition.block_of_part(*adapter.part_of(alias)) not in want:
                continue
            t = self._read(self._block_of(owner), [owner])
            if tensors_hash(t) != self.index["tied_hashes"][owner]:
                raise CheckpointError(
                    f"tied tensor {owner} in block {self._block_of(owner)}'s file does not match "
                    f"its hash in {INDEX}: the file was modified or replaced"
                )
            loaded.update(t)
        materialise(model, loaded, self.tied, device)
        return model.eval(), adapter

    def verify(self) -> None:
        """Read every block file and check its hash (raises CheckpointError naming the block)."""
        for b in range(self.num_blocks):
            self._read_block(b)

    # ---- writing ----
    def block_state(self, model: nn.Module, adapter: Adapter, b: int) -> dict[str, torch.Tensor]:
        """Block b's owned tensors, detached on CPU (views of CPU weights: commit them before the
        next optimizer step, or clone)."""
        names = block_tensor_names(adapter, self.partition, self._check_block(b))
        return _cpu_state(adapter.tensors(), names, f"block {b}")

    def commit_block(self, b: int, tensors: dict[str, torch.Tensor]) -> str:
        """Make `tensors` block b's new weights; returns the new block hash. The new file is
        written aside, then checkpoint.json is replaced atomically, then the old file deleted."""
        blk = self.index["blocks"][self._check_block(b)]
        expect, got = set(blk["tensors"]), set(tensors)
        if got != expect:
            tied = sorted(
                n for n in got - expect if n in self.tied or n in self.index["tied_hashes"]
            )
            if tied:
                raise CheckpointError(
                    f"block {b} may not write tied tensor(s) {tied}: they belong to block "
                    f"{self._block_of(self.tied.get(tied[0], tied[0]))}; leave them out"
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
        digest = tensors_hash(state)
        if digest == blk["hash"]:
            return digest
        on_disk = Checkpoint.open(self.path).index
        if on_disk.get("generation") != self.index.get("generation"):
            raise CheckpointError(
                f"{self.path} changed on disk since it was opened (another writer?); reopen it "
                "with Checkpoint.open and retry"
            )
        name = _block_file_name(b, digest)
        if name == blk["file"]:
            raise CheckpointError(f"block {b}: hash prefix collision on {name}; cannot commit")
        _write_block_file(self.path / name, state, {"preinfer_block": str(b), "hash": digest})
        new = json.loads(json.dumps(self.index))
        new["generation"] = self.index.get("generation", 0) + 1
        new["blocks"][b].update(file=name, hash=digest)
        for owner in new["tied_hashes"]:
            if owner in state:
                new["tied_hashes"][owner] = tensors_hash({owner: state[owner]})
        _write_json_atomic(self.path / INDEX, new)  # the commit point
        old = self.path / blk["file"]
        self.index = new
        old.unlink(missing_ok=True)
        return digest


def init_checkpoint(
    model_cfg: ModelConfig, num_blocks: int, out_dir: str | Path, *, force: bool = False
) -> Checkpoint:
    """Build the model of `model_cfg`, cut it into `num_blocks` blocks and write the checkpoint.

    Written into a temp dir beside `out_dir` and renamed into place, so a crash never leaves a
    directory that looks complete. An existing checkpoint with the same content is reused; a
    different one is an error unless force=True, which writes the new block files beside the old
    ones and replaces checkpoint.json atomically (then deletes files no longer referenced)."""
    fs.check(out_dir, "checkpoint")
    out = fs.path(out_dir)
    if not fs.is_url(out) and out.exists() and not out.is_dir():
        raise CheckpointError(f"checkpoint path {out} is a file; choose a directory")
    model = build_model(model_cfg)
    adapter = get_adapter(model, model_cfg.arch)
    partition = partition_model(adapter, num_blocks)
    tensors = adapter.tensors()
    states = [
        _cpu_state(tensors, block_tensor_names(adapter, partition, b), f"block {b}")
        for b in range(partition.num_blocks)
    ]
    index = _make_index(model_cfg, model, adapter, partition, states)
    if (out / INDEX).exists():
        existing = Checkpoint.open(out)
        if _content_key(existing.index) == _content_key(index):
            return existing
        if not force:
            raise CheckpointError(
                f"{out} holds a different checkpoint (other config, partition or trained "
                "weights); use another run.checkpoint dir, or force (`preinfer init --force`) to "
                "replace it"
            )
        referenced = {b["file"]: b["hash"] for b in existing.index["blocks"]}
        for blk, state in zip(index["blocks"], states, strict=True):
            if referenced.get(blk["file"]) == blk["hash"]:
                continue  # the same bytes are already there under this name
            if blk["file"] in referenced:
                raise CheckpointError(f"hash prefix collision on {blk['file']}; cannot replace")
            _write_block_file(out / blk["file"], state, {"hash": blk["hash"]})
        index["generation"] = existing.index.get("generation", 0) + 1
        _write_json_atomic(out / INDEX, index)
        keep = {b["file"] for b in index["blocks"]}
        for f in referenced:
            if f not in keep:
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
    tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"
    tmp.mkdir()
    try:
        for blk, state in zip(index["blocks"], states, strict=True):
            _write_block_file(tmp / blk["file"], state, {"hash": blk["hash"]})
        _write_json_atomic(tmp / INDEX, index)
        os.replace(tmp, out)  # onto a missing or empty directory: atomic on POSIX
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # a concurrent init of the same config won the rename: its checkpoint is ours
        if isinstance(e, OSError) and (out / INDEX).is_file():
            winner = Checkpoint.open(out)
            if _content_key(winner.index) == _content_key(index):
                return winner
        raise
    _fsync_dir(out.parent)
    return Checkpoint.open(out)


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
