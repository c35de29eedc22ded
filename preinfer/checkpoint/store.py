"""The on-disk model checkpoint: one safetensors file per block plus `checkpoint.json`.

    <dir>/
      checkpoint.json                       written LAST (temp file + os.replace): the commit point;
                                            "tokens": the token store the last commit trained on
      block_000-<hash8>.safetensors         block 0's owned tensors (embed + its layers)
      block_001-<hash8>.safetensors         ...
      optim_000-<hash8>.safetensors         with train.keep_optimizer_state: block 0's optimizer
                                            state as its last visit left it (named and hashed in
                                            checkpoint.json; not part of the block hash)

File names carry their content hash, so a commit writes every new file (of one block, or of all
M in --mode full) beside the old ones, then replaces checkpoint.json ONCE, then deletes the old
files: a reader holding the old index never sees its file overwritten (one that finds a file
gone reads checkpoint.json again and, when a commit replaced it, the new commit's files: only a
file missing while the index is unchanged is damage), and a crash at any point leaves the old
or the new checkpoint, never a mix. A local commit holds <dir>/.lock and ends by
sweeping what killed commits left (temps, files checkpoint.json does not name).

Tied tensors (GPT-2's lm_head.weight = wte.weight) are stored once, in block 0's file. A later
block that needs one (the head of block M-1) reads just that tensor from block 0's file by name;
no other block may write it.

The directory may be an object-store URL (s3://bucket/prefix, storage/fs.py). Each file is then
ONE PUT (atomic: never visible half-written) in the same order: new block file, then
checkpoint.json (the commit point), then the old file's delete. `init_checkpoint` writes the
block files straight under the prefix and checkpoint.json last (no directory rename there).

Here: `Checkpoint`, an opened checkpoint (what its index says, reading and hash-checking blocks
and optimizer states, committing blocks). The format itself (constants, file names, the index,
atomic file writes) is in preinfer/checkpoint/format.py, creating a checkpoint
(`init_checkpoint`) in preinfer/checkpoint/init.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from torch import nn

from core import faults
from core.config import from_dict
from core.fingerprint import chain, tensors_hash, update_tensor
from preinfer.checkpoint.format import (
    ALONGSIDE,
    INDEX,
    CheckpointError,
    CommittedMeanwhile,
    _block_file_name,
    _check_index,
    _checked_state,
    _cpu_state,
    _files,
    _new_name,
    _optim_file_name,
    _record_tokens,
    _stable_hf,
    _sweep,
    _write_block_file,
    _write_json_atomic,
    _writer_lock,
)
from preinfer.checkpoint.optim_state import SEP
from preinfer.model.adapters import Adapter, get_adapter
from preinfer.model.modeling import ModelConfig, build_model, materialise
from preinfer.model.partition import (
    Partition,
    block_tensor_names,
)
from storage import fs

# reads of one load against successive indexes: each retry follows a commit that replaced a file
# the read needed; a bcd commits once a visit (seconds apart), so this many in a row is a writer
# that never stops, which the reader reports (not damage)
READ_TRIES = 10
# what to do about a file of the index that is gone or other while the index has not changed
DAMAGED = (
    "the checkpoint is damaged: restore its directory from a copy (`preinfer init --force` "
    "re-creates it, losing its training: only when no run's training should be kept)"
)


def _read_file(path: Path, names: list[str] | None = None) -> tuple[set[str], dict]:
    """(every tensor name in the safetensors file at `path`, its tensors named in `names`, all
    when None, on CPU). An object store is read in one GET; a local file is mapped, not read,
    so a file as large as a block is held once. Raises FileNotFoundError, SafetensorError."""
    if fs.is_url(path):
        tensors = load_safetensors(path.read_bytes())
        have = set(tensors)
        names = list(tensors) if names is None else names
        return have, {n: tensors[n] for n in names if n in have}
    if not path.is_file():
        raise FileNotFoundError(path)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        have = set(f.keys())
        names = list(f.keys()) if names is None else names
        return have, {n: f.get_tensor(n) for n in names if n in have}


def _read_hashed(path: Path, keep: Callable[[str], bool] | None = None) -> tuple[str, dict]:
    """(tensors_hash of every tensor in the safetensors file at `path`, those tensors whose
    name `keep` accepts, all when None), each its own copy: a tensor safe_open maps is a view
    of the file, and an optimizer's first step would copy-on-write its pages beside the file
    pages the hash read (twice the state in RSS), and one kept view keeps the whole file
    mapped. Raises FileNotFoundError, SafetensorError."""
    h, out = hashlib.sha256(), {}
    if fs.is_url(path):
        tensors = load_safetensors(path.read_bytes())
        for n in sorted(tensors):
            update_tensor(h, n, tensors[n])
        return h.hexdigest(), {n: t for n, t in tensors.items() if keep is None or keep(n)}
    if not path.is_file():
        raise FileNotFoundError(path)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for n in sorted(f.keys()):
            t = f.get_tensor(n)
            update_tensor(h, n, t)
            if keep is None or keep(n):
                out[n] = t.clone()
    return h.hexdigest(), out


def _optim_entry(b: int, entry: dict, key: str, state: dict, optimizer: str) -> list[tuple]:
    """Set entry[key] ("optim" or ALONGSIDE) to `state`'s file; the write it needs, if any."""
    ostate = _cpu_state(state, sorted(state), f"optimizer state of block {b}")
    digest, old = tensors_hash(ostate), entry.get(key) or {}
    name, writes = old.get("file"), []
    if digest != old.get("hash"):
        others = [entry.get(k) or {} for k in ("optim", ALONGSIDE)]
        name = _optim_file_name(b, digest)
        for o in others:
            _new_name(name, o)
        writes.append((name, ostate, digest))
    entry[key] = {"file": name, "hash": digest, "optimizer": optimizer}
    return writes


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
        _check_index(idx, index)
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
    def trained_tokens(self) -> dict | None:
        """The token store the last commit trained on (a token_record + the committed "blocks");
        None fresh from init, or committed before the record (or without one)."""
        return rec if isinstance(rec := self.index.get("tokens"), dict) else None

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
    def _damaged(self, why: str) -> CheckpointError:
        """The error for a file self.index names found missing, unreadable or other than the
        index says (`why`, with what to do): CommittedMeanwhile when checkpoint.json changed
        since it was read (a commit replaced the file and deleted the old one: no damage),
        else CheckpointError(why)."""
        try:
            now = Checkpoint.open(self.path).index
        except CheckpointError:  # the index itself is gone bad too: name the file first
            now = self.index
        return CheckpointError(why) if now == self.index else CommittedMeanwhile(self.path, now)

    def _consistent(self, read: Callable[[], object]):
        """read() (of files self.index names), again against the new index whenever a commit
        replaced one of them meanwhile (CommittedMeanwhile), READ_TRIES reads in all: what it
        returns is one commit's, and self.index is that commit's index."""
        for attempt in range(READ_TRIES):
            try:
                return read()
            except CommittedMeanwhile as e:
                if attempt == READ_TRIES - 1:
                    raise
                if e.index.get("init_id") != self.index.get("init_id"):
                    raise CheckpointError(
                        f"checkpoint {self.path} was initialised anew (`preinfer init --force`) "
                        "while it was read; rerun the command"
                    ) from None
                self.index = e.index
        raise AssertionError("unreachable")

    def _read(self, b: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Tensors of block b's file (all, or only `names`), read on CPU."""
        path = self.block_file(b)
        want = names if names is not None else self.index["blocks"][b]["tensors"]
        try:
            have, tensors = _read_file(path, want)
        except FileNotFoundError:
            raise self._damaged(
                f"block {b}'s file {path.name} is missing from {self.path}, which {INDEX} "
                f"names; {DAMAGED}"
            ) from None
        except SafetensorError as e:
            raise self._damaged(
                f"block {b}'s file {path.name} is unreadable ({e}); {DAMAGED}"
            ) from None
        lacking = [n for n in want if n not in have]
        if lacking or (names is None and have != set(want)):
            raise self._damaged(
                f"block {b}'s file {path.name} does not hold the tensors {INDEX} lists (missing "
                f"{lacking[:3]}): it was replaced by hand; {DAMAGED}"
            )
        return tensors

    def _read_block(self, b: int) -> dict[str, torch.Tensor]:
        tensors = self._read(b)
        if tensors_hash(tensors) != self.block_hash(b):
            raise self._damaged(
                f"block {b}'s file {self.block_file(b).name} does not match the hash in "
                f"{INDEX}: it was modified or replaced by hand; {DAMAGED}"
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
        name from their owner's file. Modules of other blocks stay on meta and refuse to run.
        A commit that replaces a file while they are read (a reader beside a running bcd) is
        read again: the model is one commit's, and self.index that commit's index."""
        blocks = None if blocks is None else list(blocks)
        return self._consistent(lambda: self._load(blocks, device))

    def _load(self, blocks: list[int] | None, device: str | torch.device):
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
                raise self._damaged(
                    f"tied tensor {owner} in block {self._block_of(owner)}'s file does not match "
                    f"its hash in {INDEX}: the file was modified or replaced by hand; {DAMAGED}"
                )
            loaded.update(t)
        materialise(model, loaded, self.tied, device)
        return model.eval(), adapter

    def optimizer_state(
        self, b: int, params: Collection[str] | None = None
    ) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Block b's kept optimizer state, hash-checked: (optimizer, {'<param>::<key>': tensor}),
        or None when its last commit kept none (train.keep_optimizer_state off): its own
        visit's, overlaid by the state of the parameters trained alongside a later visit of
        another block ("optim_alongside": train.always_train's head). params: only those
        parameters' entries are held (every file is still hashed)."""
        blk = self.index["blocks"][self._check_block(b)]
        entries = [blk[k] for k in ("optim", ALONGSIDE) if blk.get(k)]
        if not entries:
            return None
        keep = None if params is None else (lambda k: k.rpartition(SEP)[0] in params)
        tensors: dict[str, torch.Tensor] = {}
        for entry in entries:
            tensors.update(self._read_optim(b, entry, keep))
        return entries[-1]["optimizer"], tensors

    def _read_optim(self, b: int, entry: dict, keep) -> dict[str, torch.Tensor]:
        path = self.path / entry["file"]
        fix = (
            "restore it, or set train.keep_optimizer_state=false to train the block with a fresh "
            "optimizer (its next commit drops the saved state)"
        )
        try:
            digest, tensors = _read_hashed(path, keep)
        except FileNotFoundError:
            raise self._damaged(
                f"block {b}'s optimizer state file {path.name} is missing from {self.path}; {fix}"
            ) from None
        except SafetensorError as e:
            raise self._damaged(
                f"block {b}'s optimizer state file {path.name} is unreadable ({e}); {fix}"
            ) from None
        if digest != entry["hash"]:
            raise self._damaged(
                f"block {b}'s optimizer state file {path.name} does not match the hash in {INDEX}: "
                f"it was modified or replaced; {fix}"
            )
        return tensors

    def check_files(self, blocks: Iterable[int]) -> None:
        """The cheap check beside `verify`: refuse (CheckpointError) when a block file the
        caller will load is missing or damaged (truncated, not safetensors). Its header is
        read, not its tensors (a stat and a few KB a block); loading checks the hashes.
        Object-store checkpoints are left to the load (a request per file)."""
        if fs.is_url(self.path):
            return
        for b in blocks:
            path = self.block_file(b)
            if not path.is_file():
                raise self._damaged(f"block {b}'s file {path} is missing; {DAMAGED}")
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    f.keys()
            except (SafetensorError, OSError) as e:
                raise self._damaged(
                    f"block {b}'s file {path} is damaged (cut short or overwritten: {e}); {DAMAGED}"
                ) from None

    def verify(self) -> None:
        """Read every block file (and kept optimizer state) and check its hash (raises
        CheckpointError naming the block); a commit meanwhile is verified again, as in load."""

        def read() -> None:
            for b in range(self.num_blocks):
                self._read_block(b)
                self.optimizer_state(b)

        self._consistent(read)

    def tidy(self) -> None:
        """Delete what a commit killed before its end left (old files, temps); a local
        checkpoint only (an object store's commit deletes its old files itself)."""
        with _writer_lock(self.path):
            _sweep(self.path, _files(self.index))

    # ---- writing ----
    def block_state(self, model: nn.Module, adapter: Adapter, b: int) -> dict[str, torch.Tensor]:
        """Block b's owned tensors, detached on CPU (views of CPU weights: commit them before the
        next optimizer step, or clone)."""
        names = block_tensor_names(adapter, self.partition, self._check_block(b))
        return _cpu_state(adapter.tensors(), names, f"block {b}")

    def commit_block(self, b: int, tensors: dict[str, torch.Tensor]) -> str:
        """Make `tensors` block b's new weights; returns the new block hash (commit_blocks)."""
        return self.commit_blocks({b: tensors})[b]

    def commit_blocks(
        self,
        blocks: dict[int, dict[str, torch.Tensor]],
        *,
        optim: dict[int, dict[str, torch.Tensor]] | None = None,
        keep_optim: Iterable[int] = (),
        alongside: dict[int, dict[str, torch.Tensor]] | None = None,
        optimizer: str | None = None,
        tokens: dict | None = None,
    ) -> dict[int, str]:
        """Make `blocks` ({b: tensors}) those blocks' new weights in ONE commit; returns their
        hashes. optim: each block's optimizer state ({'<param>::<key>': tensor}, made by
        `optimizer`) kept beside it; without it a committed block's saved state is dropped
        (it belonged to the old weights). keep_optim: blocks (with optim, the rest of `blocks`)
        whose own saved state stays in its file, unread: another block's visit changed their
        weights but not their optimizer (a saved state of another optimizer is dropped).
        alongside: of those, the state of parameters that trained in this visit (the head
        under train.always_train), in a file of its own that overlays the block's own state
        when read. tokens: the token store they were trained on (atoken_record; checkpoint_format._record_tokens). Every new file is written aside, then
        checkpoint.json is replaced once (the commit point), then the files it no longer names
        are deleted."""
        if not blocks:
            raise CheckpointError("commit_blocks needs at least one block")
        keep, alongside = set(keep_optim), alongside or {}
        if optim is not None and (
            set(optim) | keep != set(blocks)
            or set(optim) & keep
            or not optimizer
            or not set(alongside) <= keep
        ):
            raise CheckpointError(
                f"commit of blocks {sorted(blocks)}: optimizer state must come for exactly those "
                f"blocks, given (got {sorted(optim)}) or kept (got {sorted(keep)}; alongside "
                f"{sorted(alongside)} only of those kept), and name its optimizer (got "
                f"{optimizer!r})"
            )
        if optim is None and (keep or alongside):
            raise CheckpointError(
                f"commit of blocks {sorted(blocks)}: keep_optim {sorted(keep)} and alongside "
                f"{sorted(alongside)} need optim (the state of the blocks that trained)"
            )
        new = json.loads(json.dumps(self.index))
        writes = []  # (file name, tensors, hash), in commit order
        for b in sorted(blocks):
            state = _checked_state(self.index, self._check_block(b), blocks[b])
            digest, entry = tensors_hash(state), new["blocks"][b]
            if digest != entry["hash"]:
                writes.append((_new_name(_block_file_name(b, digest), entry), state, digest))
                entry.update(file=writes[-1][0], hash=digest)
                for owner in new["tied_hashes"]:
                    if owner in state:
                        new["tied_hashes"][owner] = tensors_hash({owner: state[owner]})
            if optim is None:  # the old state belonged to the old weights
                entry.pop("optim", None)
                entry.pop(ALONGSIDE, None)
            elif b in keep:
                for key in ("optim", ALONGSIDE):
                    if (entry.get(key) or {}).get("optimizer") not in (None, optimizer):
                        entry.pop(key)
                if b in alongside:
                    writes += _optim_entry(b, entry, ALONGSIDE, alongside[b], optimizer)
            else:  # the block's own visit: its state is the newest of all its parameters
                writes += _optim_entry(b, entry, "optim", optim[b], optimizer)
                entry.pop(ALONGSIDE, None)
        _record_tokens(new, sorted(blocks), tokens)
        hashes = {b: new["blocks"][b]["hash"] for b in blocks}
        if new == self.index:
            return hashes  # the same bytes are committed already
        with _writer_lock(self.path):
            on_disk = Checkpoint.open(self.path).index
            if on_disk.get("generation") != self.index.get("generation"):
                raise CheckpointError(
                    f"{self.path} changed on disk since it was opened (another writer?); reopen "
                    "it with Checkpoint.open and retry"
                )
            new["generation"] = self.index.get("generation", 0) + 1
            for name, tensors, digest in writes:
                # one metadata key: safetensors writes several in a random order
                _write_block_file(self.path / name, tensors, {"hash": digest})
                faults.kill_point("checkpoint.file")
            _write_json_atomic(self.path / INDEX, new)  # the commit point
            faults.kill_point("checkpoint.index")
            old_files, self.index = _files(self.index) - _files(new), new
            for f in sorted(old_files):
                (self.path / f).unlink(missing_ok=True)
                faults.kill_point("checkpoint.unlink")
            _sweep(self.path, _files(new))
        return hashes
