"""Block trainer: exactness of training from the cache, frozen blocks, tied weights."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import ConfigError
from pipelines.cache_build import build_cache
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.prefix import forward_prefix
from preinfer.run.visit import TrainingDiverged, Visit, VisitHooks, VisitSpec, state_path
from preinfer.runtime.device import torch_dtype
from storage.reader import open_cache
from storage.tokens import TokenStore
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


# (optimizer, cache dtype, the prefix's compute dtype, training precision): fp32, and the path
# a bf16-native device takes (CUDA, AMX-BF16 CPUs), forced here on any CPU
STEP_PATHS = [("adamw", "fp32", "fp32", "fp32"), ("sgd", "fp32", "fp32", "fp32"),
              ("adamw", "bf16", "bf16", "bf16")]  # fmt: skip


@pytest.mark.parametrize("optimizer, dtype, compute, precision", STEP_PATHS)
def test_step_from_cache_equals_step_with_prefix_recomputed(tiny_run, tmp_path, optimizer, dtype,
                                                            compute, precision):  # fmt: skip
    """The same step, once from the cache and once with the prefix rerun (bcd-recompute): the
    prefix computes as the build does, so the hidden entering block 1 and the step are equal."""
    over = [
        "train.max_steps=1",
        "train.eval_every=0",
        f"train.optimizer={optimizer}",
        "train.warmup_steps=0",
        f"cache.dtype={dtype}",
        f"preinfer.compute_dtype={compute}",
        f"run.precision={precision}",
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
        assert torch.equal(t, after_recompute[name]), name
        changed += not torch.equal(t, before[name])
    assert changed > 0, "the step changed nothing"
    # the recomputed prefix is the cache's rows, bit for bit (in training batches of 8 rows,
    # where the build computed micro-batches of 32)
    visit = Visit(recompute, VisitSpec(block=1, mode="bcd-recompute", shuffle=False),
                  device=torch.device("cpu"))  # fmt: skip
    cache = open_cache(cached.cache.root, fps["train"])
    hidden, _, sids = cache.read_rows(0, 8)
    sids = np.asarray(sids)
    rows = np.empty((8, recompute.data.seq_len + 1), np.int32)
    rows[np.argsort(sids)] = TokenStore(recompute.data.out_dir).read_indices_with_labels(
        "train", np.sort(sids))[0]  # fmt: skip
    _, adapter, choice = visit.prefix
    x = forward_prefix(adapter, visit.part, torch.from_numpy(rows[:, :-1]).long(), 0, 1,
                       dtype=torch_dtype(choice.compute),
                       round_to=choice.round_to and torch_dtype(choice.round_to))  # fmt: skip
    assert torch.equal(x.float(), hidden)


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


def _checkpoint_files(cfg) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(cfg.run.checkpoint).iterdir())}


def _metrics(cfg) -> list[dict]:
    path = Path(cfg.run.dir, "metrics.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("block", [0, 1])
def test_diverging_lr_stops_the_visit_and_commits_nothing(tiny_run, block):
    # sgd at lr 1e10 turns the tiny model's loss into NaN within a couple of steps
    cfg = tiny_run("train.optimizer=sgd", "train.lr=10000000000.0")
    before = _checkpoint_files(cfg)
    with pytest.raises(TrainingDiverged, match=rf"round 0, block {block}, step \d+") as err:
        one_step(cfg, block, "bcd-recompute")
    msg = str(err.value)
    assert "train.lr" in msg and "nothing was committed" in msg
    steps = [r["step"] for r in _metrics(cfg) if r["event"] == "step"]
    assert f"step {len(steps) + 1} " in msg  # the first step whose loss was not finite
    assert _checkpoint_files(cfg) == before  # block files and checkpoint.json as they were
    assert not [r for r in _metrics(cfg) if r["event"] == "visit"]
    spec = VisitSpec(block=block, mode="bcd-recompute")
    assert not state_path(cfg, spec).exists()  # a rerun does not resume the diverged path


def test_non_finite_weights_with_a_finite_loss_are_not_committed(tiny_run):
    # the loss is measured before each update: a last step that blows the weights up leaves
    # every recorded loss finite; the weight check before the commit must still catch it
    cfg = tiny_run("train.eval_every=3", "train.checkpoint_every=2")

    def blow_up(visit, step, val, seconds):
        if step == visit.tc.max_steps:
            with torch.no_grad():
                visit.params[-1].view(-1)[0] = float("inf")

    before = _checkpoint_files(cfg)
    spec = VisitSpec(block=1, mode="bcd-recompute", shuffle=False)
    visit = Visit(cfg, spec, device=torch.device("cpu"), hooks=VisitHooks(on_eval=blow_up))
    with pytest.raises(TrainingDiverged, match=r"round 0, block 1, step 6 .*NaN/inf"):
        visit.run(log=quiet)
    assert all(math.isfinite(r["loss"]) for r in _metrics(cfg) if r["event"] == "step")
    assert _checkpoint_files(cfg) == before
    assert not [r for r in _metrics(cfg) if r["event"] == "visit"]
    assert not state_path(cfg, spec).exists()
