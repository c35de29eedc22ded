"""train.freeze=[embed] (issue #41): the token embedding, and a tied LM head with it, never
trains; block 0's layers still do, and with a tied head the rest of the head (the final norm)
trains through train.always_train."""

from __future__ import annotations

import pytest
import torch

from core.config import ConfigError
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.config import load_config
from tests.test_suffix_rank import FAST, blocks, changed, visit
from tests.test_suffix_rank import llama_run as llama_run  # noqa: F401 (a fixture)


def _embed_names(cfg) -> set[str]:
    _, adapter = Checkpoint.open(cfg.run.checkpoint).load()
    return set(adapter.part_names()["embed"])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_frozen_embedding_stays_bit_identical_and_block_0_still_trains(tiny_run, llama_run, arch):
    """GPT-2 (tied: wte is also the head) and LLaMA (untied): block 0's visit with
    train.freeze=[embed] changes block 0's layers and none of the embedding's tensors, and
    trains fewer parameters than the same visit without the freeze."""
    make = tiny_run if arch == "gpt2" else llama_run
    cfg = make(*FAST, "train.freeze=[embed]")
    embed = _embed_names(cfg)
    assert embed
    before = blocks(cfg)
    frozen = visit(cfg, 0)
    moved = changed(before[0], blocks(cfg)[0])
    assert moved and not moved & embed  # layers trained, the embedding did not
    free = make(*FAST)
    before = blocks(free)
    unfrozen = visit(free, 0)
    # without the freeze it trains (its optimizer state starts fresh beside the kept one)
    assert changed(before[0], blocks(free)[0]) & embed
    assert frozen["trainable_params"] < unfrozen["trainable_params"]


def test_freeze_lists_a_part_once_and_only_known_parts(tmp_path):
    with pytest.raises(ConfigError, match="twice"):
        load_config("configs/demo.yaml", [f"run.dir={tmp_path}", "train.freeze=[embed,embed]"])
    with pytest.raises(ConfigError):
        load_config("configs/demo.yaml", [f"run.dir={tmp_path}", "train.freeze=[head]"])


def test_a_frozen_embedding_gets_no_gradient(tiny_run):
    """The frozen embedding carries no grad after a step: no weight-gradient of the tied head."""
    from preinfer.run.visit import Visit, VisitSpec

    cfg = tiny_run(*FAST, "train.freeze=[embed]", "train.max_steps=1")
    v = Visit(
        cfg, VisitSpec(block=0, mode="bcd-recompute", shuffle=False), device=torch.device("cpu")
    )
    emb = dict(v.model.named_parameters())
    for n in _embed_names(cfg):
        if n in emb:
            assert not emb[n].requires_grad, n


def test_the_planner_counts_a_frozen_embedding(tiny_run):
    """preinfer plan: block 0's visit trains fewer parameters and needs less memory with the
    embedding frozen; the other blocks' visits are the same."""
    import dataclasses

    from preinfer.model.shape import model_shape
    from preinfer.plan.memory import setup_for, trainer_memory

    cfg = tiny_run(*FAST)
    sh, part = model_shape(cfg.model), Checkpoint.open(cfg.run.checkpoint).partition
    p = setup_for(
        sh,
        cfg.train,
        cfg.cache,
        cfg.preinfer,
        target="cpu",
        seq=cfg.data.seq_len,
        token_rows=cfg.data.shard_rows,
    )
    frozen = dataclasses.replace(p, freeze_embed=True)
    a, b = trainer_memory(sh, part, "bcd", 0, p), trainer_memory(sh, part, "bcd", 0, frozen)
    assert b["peak"] < a["peak"]
    assert (
        trainer_memory(sh, part, "bcd", 2, p)["peak"]
        == trainer_memory(sh, part, "bcd", 2, frozen)["peak"]
    )
