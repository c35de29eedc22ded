"""train.prefix_adapters=last (issue #41): the last visit of a round also adapts the blocks
before its own (the train.suffix_rank adapters on every layer but its block's), runs its prefix
from tokens and reads no cache; every other visit is as without it (preinfer/train/suffix.py)."""

from __future__ import annotations

import dataclasses

import pytest

from core.config import ConfigError
from pipelines.bcd import run_bcd
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.shape import model_shape
from preinfer.plan.memory import setup_for, trainer_memory
from preinfer.run.visit import VisitHooks
from preinfer.schedule.rotation import store_budget
from preinfer.schedule.visit_plan import plan_visit
from preinfer.train.config import TrainConfig
from preinfer.train.suffix import suffix_linears
from storage.tokens import TokenStore
from tests.test_suffix_rank import FAST, LLAMA, SUFFIX, blocks, changed, file_keys

LAST = ("train.prefix_adapters=last",)


@pytest.fixture
def llama4(tiny_run):
    """A tiny LLaMA-layout run of 4 blocks."""

    def make(*extra):
        cfg = tiny_run(*LLAMA, "partition.num_blocks=4", *extra)
        init_checkpoint(cfg.model, 4, cfg.run.checkpoint, force=True)
        return cfg

    return make


def linears(cfg, block: int, prefix: bool) -> set[str]:
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    _, adapter = ckpt.load()
    return {f"{n}.weight" for n, _ in suffix_linears(adapter, ckpt.partition, block, prefix=prefix)}


def test_prefix_adapters_needs_the_suffix_rank():
    with pytest.raises(ConfigError, match="train.suffix_rank is 0"):
        TrainConfig(prefix_adapters="last")
    assert TrainConfig(prefix_adapters="last", suffix_rank=4).prefix_adapters == "last"


def test_the_boundaries_serve_only_the_visits_before_the_last(tiny_run):
    """Ascending M=3: boundary 1 holds visit 1's window alone (not visit 2's, which reads
    tokens), and no visit makes boundary 2; without the lever boundary 1 holds both windows."""
    rows = (
        "train.epochs=1",
        "train.cache_visits=3",
    )  # each visit its own window of the round's rows
    on, off = tiny_run(*FAST, *SUFFIX, *LAST, *rows), tiny_run(*FAST, *SUFFIX, *rows)
    budget = store_budget(on.train, on.preinfer.sample_fraction, TokenStore(on.data.out_dir))
    plans = [plan_visit(on.train, budget, 3, 0, k) for k in range(3)]
    assert [p.adapts_prefix for p in plans] == [False, False, True]
    assert [p.boundary for p in plans] == [None, 1, None]
    assert plans[1].serves == (1,) and plans[1].cache_rows == budget.visit_rows
    was = plan_visit(off.train, budget, 3, 0, 1)
    assert was.serves == (1, 2) and was.cache_rows == 2 * budget.visit_rows
    assert plan_visit(off.train, budget, 3, 0, 2).boundary == 2
    # descending ends on block 0: nothing to adapt before it, every visit as without the lever
    desc = dataclasses.replace(on.train, order="descending")
    assert not any(plan_visit(desc, budget, 3, 0, k).adapts_prefix for k in range(3))


@pytest.mark.parametrize("order, seed", [("ascending", 0), ("random", 2)])
def test_the_last_visit_adapts_every_other_block(llama4, order, seed):
    """M=4, 2 rounds (random seed 2: [0, 3, 1, 2] then [3, 2, 1, 0]). A round's last visit of
    block K > 0 reads tokens and changes exactly the layer linears of every other block (+ its
    own block, + the head); every other visit leaves its prefix bit-identical and reads a
    cache when K > 0; the checkpoint holds no adapter tensor."""
    cfg = llama4(*FAST, *SUFFIX, *LAST, f"train.order={order}", f"train.seed={seed}",
                 "train.rounds=2")  # fmt: skip
    seen, starts, checked = {}, {}, []

    def check(v, default):
        seen[(v.spec.round, v.K)] = (v.plan.position, v.plan.adapts_prefix, v.from_cache)
        starts[(v.spec.round, v.K)] = blocks(cfg)
        return default

    def after(r, k, summary):
        position, adapts, from_cache = seen[(r, k)]
        was, now = starts[(r, k)], blocks(cfg)
        assert adapts == (position == 3 and k > 0), (r, k)
        assert from_cache == (k > 0 and not adapts), (r, k)
        adapted = linears(cfg, k, prefix=adapts)
        for b in range(len(was)):
            got, own = changed(was[b], now[b]), adapted & set(was[b])
            if b < k:  # the prefix: its linears under the lever, else nothing
                assert got == own and bool(own) == adapts, (r, k, b)
            elif b > k:  # the suffix: its linears (+ block M-1's head, trained every visit)
                assert own and own <= got, (r, k, b)
        assert changed(was[k], now[k]), (r, k)
        checked.append((r, k))

    res = run_bcd(cfg, log=quiet_log, hooks=VisitHooks(batches=check), on_visit=after)
    assert len(res["visits"]) == 8 and len(checked) == 8
    adapted = [key for key, (_, adapts, _) in seen.items() if adapts]
    assert adapted == ([(0, 3), (1, 3)] if order == "ascending" else [(0, 2)])
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    for f in ckpt.path.glob("*.safetensors"):
        assert not [k for k in file_keys(f) if "lora" in k], f.name


def quiet_log(*_):
    pass


def test_the_planner_counts_the_last_visits_prefix(tiny_run):
    """Block M-1's visit under the lever: every block loaded, no cache reader, adapters on every
    earlier layer, and more activations than the visit from its cache."""
    cfg = tiny_run(*FAST, *SUFFIX, *LAST)
    sh, part = model_shape(cfg.model), Checkpoint.open(cfg.run.checkpoint).partition
    setup = setup_for(sh, cfg.train, cfg.cache, cfg.preinfer, target="cpu", seq=cfg.data.seq_len,
                      token_rows=cfg.data.shard_rows, run_precision=cfg.run.precision)  # fmt: skip
    assert setup.prefix_last
    off = dataclasses.replace(setup, prefix_last=False)
    last, was = trainer_memory(sh, part, "bcd", 2, setup), trainer_memory(sh, part, "bcd", 2, off)
    assert was["suffix_params"] == 0 and was["loaded_blocks"] == [2]
    assert last["loaded_blocks"] == [0, 1, 2] and last["basis"]["cache_buffer"] == 0
    assert last["suffix_params"] == trainer_memory(sh, part, "bcd", 0, setup)["suffix_params"] * (
        part.blocks[2][0] / (part.num_layers - part.blocks[0][1])
    )
    assert last["basis"]["act"] > was["basis"]["act"]  # every layer's, for the prefix's adapters
    # the other visits are as without the lever
    for k in (0, 1):
        assert trainer_memory(sh, part, "bcd", k, setup) == trainer_memory(sh, part, "bcd", k, off)


def test_no_cache_is_built_for_the_last_visit(tiny_run):
    from pipelines.cache_build import build_cache

    cfg = tiny_run(*FAST, *SUFFIX, *LAST)
    with pytest.raises(ConfigError, match="train.prefix_adapters=none to cache boundary 2"):
        build_cache(cfg, 2, log=quiet_log)
    assert build_cache(cfg, 1, log=quiet_log)["fingerprints"]


def test_the_planner_and_the_disk_check_follow_the_order(tiny_run):
    """Only an ascending round is planned with block M-1 from tokens; with M = 2 that leaves no
    boundary to build, so the rotation's disk check asks for none."""
    from preinfer.plan.guards import DiskSpaceError, check_disk_for_rotation

    cfg = tiny_run(*FAST, *SUFFIX, *LAST)
    sh = model_shape(cfg.model)
    for order, planned in (("ascending", True), ("descending", False), ("random", False)):
        train = dataclasses.replace(cfg.train, order=order)
        setup = setup_for(sh, train, cfg.cache, cfg.preinfer, target="cpu", seq=cfg.data.seq_len,
                          token_rows=cfg.data.shard_rows, run_precision=cfg.run.precision)  # fmt: skip
        assert setup.prefix_last is planned, order
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, TokenStore(cfg.data.out_dir))
    kw = dict(hidden=sh.hidden, seq=cfg.data.seq_len, free_bytes=1)  # 1 byte free: any need fails
    assert check_disk_for_rotation(cfg.cache, cfg.train, budget, M=2, **kw) is None
    off = dataclasses.replace(cfg.train, prefix_adapters="none")
    with pytest.raises(DiskSpaceError):
        check_disk_for_rotation(cfg.cache, off, budget, M=2, **kw)
