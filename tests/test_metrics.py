"""metrics.jsonl and its TensorBoard mirror: the same scalars per step, visit and eval."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelines.eval import run_eval
from preinfer.run.visit import Visit, VisitSpec
from tests.pipeline_fixtures import quiet


def test_tensorboard_mirrors_the_metrics(tiny_run):
    cfg = tiny_run("train.max_steps=3", "train.eval_every=2")
    Visit(cfg, VisitSpec(block=0, mode="bcd"), device=torch.device("cpu")).run(log=quiet)
    run_eval(cfg, max_batches=1, log=quiet)
    recs = [
        json.loads(line) for line in Path(cfg.run.dir, "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in recs if r["event"] == "step"]
    acc = EventAccumulator(str(Path(cfg.run.dir) / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == [1, 2, 3]
    assert [s.value for s in loss] == [torch.tensor(r["loss"]).float().item() for r in steps]
    assert len(acc.Scalars("val/loss")) == 2  # step 2 and the last step
    assert "visit/val_loss/r0-b0" in tags and "eval/ppl" in tags


def test_tensorboard_off(tiny_run):
    cfg = tiny_run("train.max_steps=1", "run.tensorboard=false")
    Visit(cfg, VisitSpec(block=0, mode="bcd"), device=torch.device("cpu")).run(log=quiet)
    assert Path(cfg.run.dir, "metrics.jsonl").is_file()
    assert not Path(cfg.run.dir, "tensorboard").exists()
