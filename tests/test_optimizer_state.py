"""train.keep_optimizer_state: each block's optimizer state is committed with its weights and
resumed at the block's next visit (the default); off, the checkpoint is what it always was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from preinfer.checkpoint.format import INDEX, CheckpointError
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.visit import Visit, VisitSpec
from tests.pipeline_fixtures import quiet, tiny_cfg

CPU = torch.device("cpu")
SHORT = ["train.max_steps=3", "train.eval_every=0", "train.checkpoint_every=0"]
KEEP = "train.keep_optimizer_state=true"
OFF = "train.keep_optimizer_state=false"


def visit(cfg, block: int, round_: int) -> Visit:
    # bcd-recompute: block K trains from tokens, the prefix rerun; no cache, no Ray
    return Visit(cfg, VisitSpec(block=block, round=round_, mode="bcd-recompute"), device=CPU)


def ckpt(cfg) -> Checkpoint:
    return Checkpoint.open(cfg.run.checkpoint)


def test_second_round_starts_from_the_saved_state(tiny_run):
    cfg = tiny_run(*SHORT, KEEP)
    visit(cfg, 1, 0).run(log=quiet)
    kind, saved = ckpt(cfg).optimizer_state(1)
    assert kind == "adamw"
    v = visit(cfg, 1, 1)
    names = {n for n, _ in v.named[1]}
    assert {k.rpartition("::")[0] for k in saved} == names
    assert {k.rpartition("::")[2] for k in saved} == {"exp_avg", "exp_avg_sq", "step"}
    assert all(saved[f"{n}::step"].item() == 3 for n in names)
    assert all(ckpt(cfg).optimizer_state(b) is None for b in (0, 2))  # never visited
    opt = v.optimizer()
    for n, p in v.named[1]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], saved[f"{n}::{key}"]), (n, key)
    v.run(log=quiet)
    _, after = ckpt(cfg).optimizer_state(1)
    assert all(after[f"{n}::step"].item() == 6 for n in names)  # continued, not restarted
    ckpt(cfg).verify()


def test_the_state_is_held_once_on_cpu_when_it_is_committed_and_loaded(tiny_run):
    """A commit writes the optimizer's own CPU tensors (a copy would double the moments, as
    large as the block, at every commit), and a visit's optimizer takes the tensors just read
    from the file rather than copying them again; the values are what the optimizer held."""
    from preinfer.checkpoint.optim_state import load_optimizer_tensors, optimizer_tensors

    cfg = tiny_run(*SHORT, KEEP)
    visit(cfg, 1, 0).run(log=quiet)
    v = visit(cfg, 1, 1)
    opt = v.optimizer()
    out = optimizer_tensors(opt, v.named[1])
    for n, p in v.named[1]:
        assert out[f"{n}::exp_avg"].data_ptr() == opt.state[p]["exp_avg"].data_ptr()
    kind, saved = ckpt(cfg).optimizer_state(1)
    fresh = torch.optim.AdamW([p for _, p in v.named[1]])
    load_optimizer_tensors(fresh, v.named[1], saved, saved_by=kind, optimizer="adamw", what="b1")
    for n, p in v.named[1]:
        assert fresh.state[p]["exp_avg"].data_ptr() == saved[f"{n}::exp_avg"].data_ptr()
        assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_off_is_unchanged_and_the_state_never_moves_a_hash(tiny_run, tmp_path):
    off = tiny_run(*SHORT, OFF)
    shutil.copytree(off.run.dir, tmp_path / "on")
    on = tiny_cfg(tmp_path / "on", *SHORT, KEEP)
    for cfg in (off, on):
        visit(cfg, 1, 0).run(log=quiet)
    a, b = ckpt(off), ckpt(on)
    files = sorted(p.name for p in a.path.iterdir())
    assert not any(f.startswith("optim_") for f in files)
    assert not any("optim" in blk for blk in a.index["blocks"])
    # the first visit trains the same with the state kept: same weights, same block files, and
    # checkpoint.json differs only by the optimizer entry (cache fingerprints read block hashes)
    assert [a.block_hash(k) for k in range(3)] == [b.block_hash(k) for k in range(3)]
    assert a.block_file(1).read_bytes() == b.block_file(1).read_bytes()
    stripped = json.loads((b.path / INDEX).read_text())
    assert stripped["blocks"][1].pop("optim")["optimizer"] == "adamw"
    assert stripped == json.loads((a.path / INDEX).read_text())
    assert [a.prefix_hash(k) for k in range(4)] == [b.prefix_hash(k) for k in range(4)]
    # the second visit does differ: AdamW resumes its moments and bias correction
    for cfg in (off, on):
        visit(cfg, 1, 1).run(log=quiet)
    assert ckpt(off).block_hash(1) != ckpt(on).block_hash(1)
    # a visit with the switch off drops the saved state (it belonged to the old weights)
    old = ckpt(on).index["blocks"][1]["optim"]["file"]
    visit(tiny_cfg(tmp_path / "on", *SHORT, OFF), 1, 2).run(log=quiet)
    assert "optim" not in ckpt(on).index["blocks"][1] and not (ckpt(on).path / old).exists()


def test_corrupted_optimizer_file_is_refused(tiny_run):
    cfg = tiny_run(*SHORT, KEEP)
    visit(cfg, 2, 0).run(log=quiet)
    ck = ckpt(cfg)
    path = ck.path / ck.index["blocks"][2]["optim"]["file"]
    index_before = (ck.path / INDEX).read_bytes()
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if k.endswith("::exp_avg"))
    tensors[key] = tensors[key] + 1e-3
    save_file(tensors, str(path), metadata={"hash": ck.index["blocks"][2]["optim"]["hash"]})
    with pytest.raises(CheckpointError, match=r"block 2's optimizer state file .* does not match"):
        visit(cfg, 2, 1).run(log=quiet)
    with pytest.raises(CheckpointError, match="keep_optimizer_state=false"):
        ck.verify()
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"block 2's optimizer state file .* is unreadable"):
        visit(cfg, 2, 1).run(log=quiet)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"block 2's optimizer state file .* is missing"):
        visit(cfg, 2, 1).run(log=quiet)
    assert (ck.path / INDEX).read_bytes() == index_before  # nothing was committed
    index = json.loads(index_before)
    index["blocks"][2]["optim"]["file"] = "../elsewhere.safetensors"  # a commit would unlink it
    (ck.path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a plain block_/optim_"):
        ckpt(cfg)


def test_state_that_does_not_fit_is_refused(tiny_run):
    cfg = tiny_run(*SHORT, KEEP)
    visit(cfg, 1, 0).run(log=quiet)
    ck = ckpt(cfg)
    model, ad = ck.load([1])
    weights = ck.block_state(model, ad, 1)
    _, saved = ck.optimizer_state(1)
    first = sorted(saved)[0].rpartition("::")[0]

    def commit(optim, optimizer="adamw"):
        ckpt(cfg).commit_blocks({1: weights}, optim={1: optim}, optimizer=optimizer)

    commit({k: t for k, t in saved.items() if not k.startswith(first + "::")})
    with pytest.raises(CheckpointError, match=rf"does not fit its parameters \(missing \['{first}"):
        visit(cfg, 1, 1).optimizer()
    commit(saved | {f"{first}::exp_avg": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=rf"{first}::exp_avg has shape \[3\]"):
        visit(cfg, 1, 1).optimizer()
    commit(saved, optimizer="sgd")
    with pytest.raises(CheckpointError, match="is sgd's; this visit uses adamw"):
        visit(cfg, 1, 1).optimizer()
    visit(tiny_run(*SHORT, OFF), 1, 1).optimizer()  # with the switch off nothing is read
    with pytest.raises(CheckpointError, match="exactly those blocks"):
        ck.commit_blocks({1: weights}, optim={2: saved}, optimizer="adamw")


def test_a_read_state_is_its_own_memory_and_a_partial_read_still_checks_the_whole_file(tiny_run):
    """A tensor safe_open maps is a view of the file: kept as an optimizer's moment, its first
    step copies on write the pages the hash read (twice the state in RSS), and one kept view
    keeps the whole file mapped. So every tensor read is a copy (the file changing under it
    leaves it as read); a read of some parameters holds only theirs and still refuses a file
    damaged elsewhere."""
    import struct

    cfg = tiny_run(*SHORT, KEEP)
    visit(cfg, 1, 0).run(log=quiet)
    ck = ckpt(cfg)
    _, saved = ck.optimizer_state(1)
    names = sorted({k.rpartition("::")[0] for k in saved})
    _, part = ck.optimizer_state(1, {names[0]})
    assert set(part) == {k for k in saved if k.rpartition("::")[0] == names[0]}
    assert all(torch.equal(part[k], saved[k]) for k in part)
    before = {k: t.clone() for k, t in saved.items()}
    path = ck.path / ck.index["blocks"][1]["optim"]["file"]
    with open(path, "r+b") as f:  # every tensor's bytes zeroed in place, the header kept
        start = 8 + struct.unpack("<Q", f.read(8))[0]
        f.seek(0, 2)
        end = f.tell()
        f.seek(start)
        f.write(bytes(end - start))
    assert all(torch.equal(saved[k], before[k]) for k in saved)
    assert all(torch.equal(part[k], before[k]) for k in part)
    with pytest.raises(CheckpointError, match="does not match the hash"):
        ckpt(cfg).optimizer_state(1, {names[0]})
