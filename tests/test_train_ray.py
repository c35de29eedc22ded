"""Ray Train: 2 DDP workers (gloo) follow the same loss curve as 1 worker with the same global batch.

Slow whatever the step count (52-81 s, `nice -n 19` on 2 busy CPUs, + the fixture): a Ray start,
Ray Train's controller, and 2 worker processes importing torch, transformers and ray.train. The
ranks' code (pipelines.train.run_rank) runs without Ray in `make test`: tests/test_ddp.py."""

import json
from pathlib import Path

import pytest
import torch

from pipelines.train import run_train
from preinfer.checkpoint.store import Checkpoint
from tests.pipeline_fixtures import quiet

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.functional]


def losses(cfg):
    recs = [json.loads(x) for x in Path(cfg.run.dir, "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["event"] == "step"]


def test_two_workers_match_one_worker(tiny_run, tmp_path):
    import shutil

    over = ["train.max_steps=5", "train.eval_every=0", "train.batch_size=8"]
    one = tiny_run("train.workers=1", *over)
    two_dir = tmp_path / "two"
    shutil.copytree(one.run.dir, two_dir)
    two = tiny_run("train.workers=2", f"run.dir={two_dir}", *over)
    run_train(one, 0, mode="bcd-recompute", log=quiet)
    run_train(two, 0, mode="bcd-recompute", log=quiet)
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 5
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=1e-5)
    ca, cb = Checkpoint.open(one.run.checkpoint), Checkpoint.open(two.run.checkpoint)
    wa, _ = ca.load([0])
    wb, _ = cb.load([0])
    for (n, p), (_, q) in zip(wa.named_parameters(), wb.named_parameters(), strict=True):
        if p.device.type != "meta":
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=n)
