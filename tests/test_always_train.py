"""train.always_train (issue #27 item 1): the head (final norm + an untied LM head, block M-1's
tensors) trains in every bcd visit, its AdamW state kept across visits with block M-1's, and no
boundary cache is invalidated (the head follows every cached prefix)."""

from __future__ import annotations

import pytest
import torch

from pipelines.bcd import run_bcd
from pipelines.cache_build import build_cache, plan_block
from pipelines.train import run_train
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.optim_state import SEP
from preinfer.checkpoint.store import Checkpoint
from tests.pipeline_fixtures import quiet

FAST = ("train.eval_every=0", "train.checkpoint_every=0", "train.max_steps=2", "train.epochs=null")
LLAMA = ("model.arch=llama", "model.tie_embeddings=false", "model.num_kv_heads=1")


@pytest.fixture
def llama_run(tiny_run):
    def make(*extra):
        cfg = tiny_run(*LLAMA, *FAST, *extra)
        init_checkpoint(cfg.model, 3, cfg.run.checkpoint, force=True)
        return cfg

    return make


def state(cfg, b: int) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load([b])
    return {n: t.clone() for n, t in ckpt.block_state(model, adapter, b).items()}


def head_names(cfg) -> list[str]:
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    _, adapter = ckpt.load([2])
    return adapter.part_names()["head"]


def changed(before: dict, after: dict) -> set[str]:
    return {n for n in before if not torch.equal(before[n], after[n])}


def test_the_head_trains_in_every_visit_and_no_cache_is_invalidated(llama_run):
    cfg = llama_run("train.always_train=[head]")
    head = set(head_names(cfg))
    assert any("lm_head" in n for n in head) and any("norm" in n for n in head), head
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    last_before, prefixes = state(cfg, 2), [ckpt.prefix_hash(k) for k in (1, 2)]
    # block 1 from its boundary cache: block 1 and the head change, block 2's layers do not
    build_cache(cfg, 1, 0, log=quiet)
    summary = run_train(cfg, 1, 0, log=quiet)
    assert changed(last_before, state(cfg, 2)) == head
    assert summary["trainable_params"] > sum(t.numel() for n, t in last_before.items() if n in head)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert ckpt.prefix_hash(1) == prefixes[0]
    assert ckpt.prefix_hash(2) != prefixes[1]  # block 1 trained
    # block 1's cache is still current: the head is after it
    assert plan_block(cfg, 1, 0).reads.complete
    # its AdamW state: kept with block 2's (which keeps no layer state yet: never visited)
    saved = ckpt.optimizer_state(2)
    assert saved is not None and saved[0] == "adamw"
    assert {k.rpartition(SEP)[0] for k in saved[1]} == head
    assert all(float(t) == 2 for k, t in saved[1].items() if k.endswith(f"{SEP}step"))


def test_the_heads_adamw_state_runs_on_across_the_rotation(llama_run):
    """Rotation 0, 1, 2: the head takes 2 steps in each visit, one AdamW state throughout (step
    6 after block 2's own visit); block 2's layers keep their own (step 2), and the caches are
    the plain rotation's (built, refreshed), none rebuilt."""
    cfg = llama_run("train.always_train=[head]")
    head = set(head_names(cfg))
    res = run_bcd(cfg, log=quiet)
    assert [v["cache"] for v in res["visits"]] == ["tokens", "built", "refreshed"]
    steps = {
        k.rpartition(SEP)[0]: float(t)
        for k, t in Checkpoint.open(cfg.run.checkpoint).optimizer_state(2)[1].items()
        if k.endswith(f"{SEP}step")
    }
    assert {n for n, s in steps.items() if s == 6} == head
    assert {n for n, s in steps.items() if s == 2} == set(steps) - head != set()


def test_a_tied_head_keeps_its_matrix_in_block_0(tiny_run):
    """GPT-2 (tied): always_train head trains the final norm in every visit; the tied LM head
    matrix is the embedding, block 0's (training it elsewhere would change every cache)."""
    cfg = tiny_run(*FAST, "train.always_train=[head]")
    head = set(head_names(cfg))
    assert head and not any("wte" in n or "lm_head" in n for n in head), head
    first = state(cfg, 0)
    last = state(cfg, 2)
    build_cache(cfg, 1, 0, log=quiet)
    run_train(cfg, 1, 0, log=quiet)
    assert changed(last, state(cfg, 2)) == head
    assert changed(first, state(cfg, 0)) == set()


def test_other_visits_leave_the_saved_states_of_their_suffix_blocks_unread_in_their_files(
    llama_run,
):
    """Two rounds with the head in every visit and suffix adapters: a visit commits blocks
    K+1..M-1 (their adapters merged) without reading or rewriting their own optimizer states
    (same file, same hash); the head's state goes to block M-1's "optim_alongside" file, which
    overlays the own state when read and is folded into it (and its file deleted) by block
    M-1's own visit."""
    from preinfer.checkpoint.format import ALONGSIDE

    cfg = llama_run("train.always_train=[head]", "train.suffix_rank=2", "train.rounds=2")
    head = set(head_names(cfg))
    seen = {}

    def on_visit(r, k, summary):
        ck = Checkpoint.open(cfg.run.checkpoint)
        steps = {
            k.rpartition(SEP)[0]: float(t)
            for k, t in (ck.optimizer_state(2) or ("", {}))[1].items()
            if k.endswith(f"{SEP}step")
        }
        files = {p.name for p in ck.path.glob("optim_*")}
        seen[(r, k)] = ([dict(b) for b in ck.index["blocks"]], steps, files)

    run_bcd(cfg, log=quiet, on_visit=on_visit)
    blocks, steps, _ = seen[(0, 0)]
    assert "optim" not in blocks[2] and set(steps) == head and set(steps.values()) == {2}
    blocks, steps, files = seen[(0, 2)]
    assert ALONGSIDE not in blocks[2] and set(steps) > head
    assert {steps[n] for n in head} == {6} and {s for n, s in steps.items() if n not in head} == {2}
    assert files == {b["optim"]["file"] for b in blocks}  # the alongside files are gone
    own = {b: seen[(0, b)][0][b]["optim"] for b in (1, 2)}
    for r, k, head_steps in ((1, 0, 8), (1, 1, 10)):
        blocks, steps, files = seen[(r, k)]
        assert blocks[2]["optim"] == own[2], (r, k)  # not read, not rewritten
        assert blocks[2][ALONGSIDE]["file"] in files
        assert {steps[n] for n in head} == {head_steps}
    assert seen[(1, 0)][0][1]["optim"] == own[1]  # block 1: a suffix block of block 0's visit
    blocks, steps, _ = seen[(1, 2)]
    assert ALONGSIDE not in blocks[2] and {steps[n] for n in head} == {12}
    assert {s for n, s in steps.items() if n not in head} == {4}
    Checkpoint.open(cfg.run.checkpoint).verify()
