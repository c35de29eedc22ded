"""Block trainer: exactness of training from the cache, frozen blocks, tied weights."""

import json
from pathlib import Path

import pytest
import torch

from core.config import ConfigError
from pipelines.cache_build import build_cache
from preinfer.checkpoint import Checkpoint
from preinfer.visit import Visit, VisitSpec
from tests.pipeline_fixtures import quiet


def block_tensors(cfg, b):
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load([b])
    return {k: v.clone() for k, v in ckpt.block_state(model, adapter, b).items()}


def one_step(cfg, block, mode, fps=None):
    spec = VisitSpec(
        block=block,
        mode=mode,
        shuffle=False,
        cache_train=fps and fps["train"],
        cache_val=fps and fps["val"],
    )
    return Visit(cfg, spec, device=torch.device("cpu")).run(log=quiet)


@pytest.mark.ray
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_step_from_cache_equals_step_with_prefix_recomputed(tiny_run, tmp_path, optimizer):
    over = [
        "train.max_steps=1",
        "train.eval_every=0",
        f"train.optimizer={optimizer}",
        "train.warmup_steps=0",
    ]
    cached = tiny_run(*over)
    fps = build_cache(cached, 1, log=quiet)["fingerprints"]
    before = block_tensors(cached, 1)
    one_step(cached, 1, "bcd", fps)
    after_cached = block_tensors(cached, 1)

    import shutil

    other_dir = tmp_path / "recompute"
    shutil.copytree(tmp_path / "run", other_dir, ignore=shutil.ignore_patterns("cache", "*.jsonl"))
    recompute = tiny_run(*over, f"run.dir={other_dir}")
    # the copy's checkpoint already holds the cached step's result: restore block 1 first
    Checkpoint.open(recompute.run.checkpoint).commit_block(1, before)
    # the same samples in the same order: a visit from tokens reads the round's rows in the
    # cache's row order
    one_step(recompute, 1, "bcd-recompute")
    after_recompute = block_tensors(recompute, 1)
    changed = 0
    for name, t in after_cached.items():
        torch.testing.assert_close(t, after_recompute[name], rtol=1e-5, atol=1e-7)
        changed += not torch.equal(t, before[name])
    assert changed > 0, "the step changed nothing"


def test_frozen_blocks_byte_identical_and_tied_embedding_untouched(tiny_run):
    cfg = tiny_run("train.max_steps=2", "train.eval_every=0")
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    hashes = [ckpt.block_hash(b) for b in range(3)]
    files = [ckpt.block_file(b).read_bytes() for b in range(3)]
    wte = block_tensors(cfg, 0)["transformer.wte.weight"]
    one_step(cfg, 0, "bcd-recompute")  # block 0 from tokens
    after = Checkpoint.open(cfg.run.checkpoint)
    assert after.block_hash(0) != hashes[0]
    assert [after.block_file(b).read_bytes() for b in (1, 2)] == files[1:]
    # the last block (final norm + tied LM head) trains: block 0 (wte) must not move
    hashes = [after.block_hash(b) for b in range(3)]
    files = [after.block_file(b).read_bytes() for b in range(3)]
    wte = block_tensors(cfg, 0)["transformer.wte.weight"]
    one_step(cfg, 2, "bcd-recompute")
    last = Checkpoint.open(cfg.run.checkpoint)
    assert last.block_hash(2) != hashes[2]
    assert [last.block_file(b).read_bytes() for b in (0, 1)] == files[:2]
    assert torch.equal(block_tensors(cfg, 0)["transformer.wte.weight"], wte)


def test_metrics_and_early_stopping(tiny_run):
    cfg = tiny_run(
        "train.max_steps=40", "train.eval_every=1", "train.patience=1", "train.min_delta=100.0"
    )
    summary = one_step(cfg, 0, "bcd")
    assert summary["stopped"] == "early_stop" and summary["steps"] == 2
    lines = Path(cfg.run.dir, "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("loss", "tokens_per_s", "peak_mem_mb", "block", "round", "val_loss"):
        assert key in steps[0]


def test_bcd_without_cache_is_a_clear_error(tiny_run):
    from pipelines.train import run_train

    with pytest.raises(ConfigError, match="cache build --block 1"):
        run_train(tiny_run(), 1, log=quiet)
    with pytest.raises(ValueError, match="out of range"):
        one_step(tiny_run(), 3, "bcd-recompute")


def test_train_warns_before_starting_when_the_estimate_exceeds_the_device(tiny_run, monkeypatch):
    import types

    import psutil

    from pipelines.train import run_train

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=1))
    said = []
    cfg = tiny_run("train.workers=0", "train.max_steps=1", "train.eval_every=0")
    run_train(cfg, 0, log=said.append)
    warned = [m for m in said if "exceeds" in m]
    assert len(warned) == 1 and "bcd block 0" in warned[0] and "partition.num_blocks" in warned[0]
    said.clear()
    run_train(cfg, 0, log=said.append, memory_check=False)
    assert not [m for m in said if "exceeds" in m]
