"""metrics.jsonl and its TensorBoard mirror: the same scalars per step, visit and eval."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelines.eval import run_eval
from preinfer.run.visit import Visit, VisitSpec
from preinfer.runtime.metrics import append_metrics, last_visit_summary, read_metrics
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


def test_a_line_torn_by_a_kill_costs_no_later_record(tmp_path):
    """A kill mid-append leaves a last line without its end: the next record still gets a line
    of its own, and every reader (the resume's last_visit_summary, plan, report) skips the torn
    one instead of failing on it."""
    append_metrics(tmp_path, {"event": "visit", "block": 0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"event": "visit", "block": 1, "lo')
    append_metrics(tmp_path, {"event": "visit", "block": 2})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2]) == {"event": "visit", "block": 2}
    assert [r["block"] for r in read_metrics(tmp_path)] == [0, 2]
    assert last_visit_summary(tmp_path) == {"event": "visit", "block": 2}
    assert read_metrics(tmp_path / "none") == [] and last_visit_summary(tmp_path / "none") == {}
