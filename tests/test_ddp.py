"""DDP without Ray: 2 ranks of a plain torch.distributed gloo group run `run_rank` (what Ray
Train's workers run) and end where one in-process worker fed the same global batches ends."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipelines.cache_build import build_cache, plan_block
from pipelines.train import run_rank, run_train, visit_spec, worker_loop_config
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.visit import VisitHooks
from tests.pipeline_fixtures import quiet

WORLD = 2
# block 1 from its cache (adamw, clipped); block 2 recomputing blocks 0..1 with plain SGD and
# no clipping, where a gradient summed instead of averaged over ranks takes twice the step
# (adam's update and a clipped norm hide the scale)
VISITS = [
    (1, "bcd", []),
    (2, "bcd-recompute", ["train.optimizer=sgd", "train.grad_clip=0", "train.lr=0.3"]),
]


class Recorded:
    """A visit's batch source that keeps every (x, labels) it hands out, in step order."""

    def __init__(self, inner, seen: list):
        self.inner, self.seen, self.steps_per_epoch = inner, seen, inner.steps_per_epoch

    def epoch(self, e: int):
        for x, labels in self.inner.epoch(e):
            self.seen.append((x.clone(), labels.clone()))
            yield x, labels


class Fed:
    """The global batches the DDP ranks read, step by step: rank parts concatenated."""

    def __init__(self, batches: list):
        self.batches, self.steps_per_epoch = batches, len(batches)

    def epoch(self, e: int):
        assert e == 0, "the visit ran past the recorded batches"
        yield from self.batches


def run_ranks(rank: int, init_file: str, configs: list[dict]) -> list[dict]:
    """This process as `rank`: join the gloo group, run the visits in order; what it saw."""
    # generous: on a loaded 2-CPU machine a rank can be starved for minutes (a dead peer is
    # seen at once: its sockets close)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=600),
    )
    threads = torch.get_num_threads()  # run_rank sets the worker's share; pytest's is restored
    try:
        results = []
        for config in configs:
            seen: list = []
            hooks = VisitHooks(batches=lambda _v, default, seen=seen: Recorded(default, seen))
            summary = run_rank(config, rank=rank, world=WORLD, log=quiet, hooks=hooks)
            results.append({"loss": summary["loss"], "val_loss": summary["val_loss"],
                            "steps": summary["steps"], "seen": seen})  # fmt: skip
        return results
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _spawned_rank(rank: int, init_file: str, configs: list[dict], out: str, ready) -> None:
    ready.set()  # imported: about to join the group
    torch.save(run_ranks(rank, init_file, configs), out)


def step_losses(cfg) -> list[float]:
    recs = [json.loads(x) for x in Path(cfg.run.dir, "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["event"] == "step"]


def block_weights(cfg, b: int) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load([b])
    return {k: v.clone() for k, v in ckpt.block_state(model, adapter, b).items()}


def row_hashes(xs) -> set[bytes]:
    return {hashlib.sha1(r.numpy().tobytes()).digest() for x in xs for r in x}


def test_two_gloo_ranks_match_one_worker_fed_the_same_global_batches(tiny_run, tmp_path):
    one = tiny_run("train.workers=0")
    fps = build_cache(one, 1, log=quiet)["fingerprints"]
    two_dir = tmp_path / "two"
    shutil.copytree(one.run.dir, two_dir)
    start = {b: block_weights(one, b) for b, _, _ in VISITS}

    # the DDP run: the loop configs Ray Train would get, run by 2 ranks of a gloo group
    cfgs2 = [tiny_run("train.workers=2", f"run.dir={two_dir}", *o) for _, _, o in VISITS]
    configs = [
        worker_loop_config(c, visit_spec(plan_block(c, b, 0, mode=m)))
        for c, (b, m, _) in zip(cfgs2, VISITS, strict=True)
    ]
    assert configs[0]["spec"]["cache_train"] == fps["train"]  # the caches just built
    # rank 1 in a fresh process, rank 0 here (already warm: one import of torch+transformers
    # less on a 2-CPU machine)
    init_file, out = str(tmp_path / "pg"), tmp_path / "rank1.pt"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(
        target=_spawned_rank, args=(1, init_file, configs, str(out), ready), daemon=True
    )
    child.start()
    try:
        while not ready.wait(0.5):  # a rank 1 that dies importing fails the test now, not
            assert child.is_alive(), f"rank 1 exited with {child.exitcode} before joining"
        ranks = [run_ranks(0, init_file, configs)]  # ... when the group's timeout runs out
    finally:
        child.join(timeout=600)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0, f"rank 1 exited with {child.exitcode} (its traceback: stderr)"
    ranks.append(torch.load(out, weights_only=True))

    # the reference: one worker in this process (run_train's train.workers=0 path)
    for i, (b, m, o) in enumerate(VISITS):
        r0, r1 = ranks[0][i], ranks[1][i]
        steps = r0["steps"]
        assert steps == r1["steps"] >= 4 and len(r0["seen"]) == len(r1["seen"]) == steps
        for (x0, _), (x1, _) in zip(r0["seen"], r1["seen"], strict=True):
            assert len(x0) == len(x1) == one.train.batch_size // WORLD
        # every rank reports the averaged loss and the same val loss
        assert r0["loss"] == r1["loss"] and r0["val_loss"] == r1["val_loss"]
        seen: list = []
        if m == "bcd":
            # a cache is read as one contiguous stream slice per rank: the ranks' rows are
            # disjoint, and the single worker is fed their union step by step
            assert not row_hashes(x for x, _ in r0["seen"]) & row_hashes(x for x, _ in r1["seen"])
            fed = [
                (torch.cat([x0, x1]), torch.cat([y0, y1]))
                for (x0, y0), (x1, y1) in zip(r0["seen"], r1["seen"], strict=True)
            ]
            hooks = VisitHooks(batches=lambda _v, _d, fed=fed: Fed(fed))
        else:
            hooks = VisitHooks(batches=lambda _v, d, seen=seen: Recorded(d, seen))
        ref = run_train(tiny_run("train.workers=0", *o), b, mode=m, log=quiet,
                        memory_check=False, hooks=hooks)  # fmt: skip
        torch.testing.assert_close(r0["loss"], ref["loss"], rtol=1e-4, atol=1e-5)
        if m == "bcd-recompute":
            # from tokens, rank r reads rows r, r+world, ... of the global batch the single
            # worker reads: together exactly that batch, no row twice
            assert len(seen) == steps
            for (x, y), (x0, y0), (x1, y1) in zip(seen, r0["seen"], r1["seen"], strict=True):
                assert torch.equal(x[0::2], x0) and torch.equal(x[1::2], x1)
                assert torch.equal(y[0::2], y0) and torch.equal(y[1::2], y1)

    a, b2 = step_losses(one), step_losses(cfgs2[0])
    assert len(a) == len(b2) == sum(r["steps"] for r in ranks[0])
    torch.testing.assert_close(torch.tensor(b2), torch.tensor(a), rtol=1e-4, atol=1e-5)
    for b, _, _ in VISITS:
        wa, wb = block_weights(one, b), block_weights(cfgs2[0], b)
        assert wa.keys() == wb.keys() == start[b].keys()
        moved = max((wa[k] - start[b][k]).abs().max().item() for k in wa)
        assert moved > 1e-3, f"block {b} barely trained ({moved:g}): the check would be vacuous"
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=f"block {b} {k}")
