"""bench/visit_step.py on a tiny random LLaMA: the preinfer arms and BAdam's step train the same
weights (their first-step losses agree), and the table and ratios come out. The real-model run
is `python -m bench.visit_step`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import visit_step
from bench.peers_arms import build_tiny_model, instruction_pairs

pytest.importorskip("badam", reason="the badam arm needs the `real` extra")


@pytest.mark.parametrize("block", [0, 1])
def test_preinfer_and_badam_step_the_same_model(tmp_path, block):
    model = build_tiny_model(tmp_path / "tiny", instruction_pairs("stdlib", 40))
    out = tmp_path / "res.json"
    threads = torch.get_num_threads()
    try:
        res = visit_step.main(["--model", str(model), "--block", str(block), "--batch", "2",
                               "--seq", "16", "--repeats", "2", "--threads", "1",
                               "--out", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["block"] == block
    first = res["first_step_loss"]
    assert set(first) == {"preinfer", "preinfer, unfused loss", "badam"}
    # same weights, same batch: preinfer's model and loss give HF's loss
    for arm, loss in first.items():
        assert math.isclose(loss, first["badam"], rel_tol=1e-5), (arm, first)
    for arm, s in res["seconds"].items():
        assert s["n"] == 2 and s["min"] > 0, arm
        assert len(res["parts"][arm]) == 3 and all(p > 0 for p in res["parts"][arm]), arm
    assert res["badam_over_arm"]["badam"]["median"] == 1.0


@pytest.mark.slow  # torch.compile's inductor build: about a minute on 2 CPUs
def test_the_compiled_step_trains_the_same_model(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", instruction_pairs("stdlib", 40))
    threads = torch.get_num_threads()
    try:
        res = visit_step.main(["--model", str(model), "--batch", "2", "--seq", "16",
                               "--repeats", "2", "--threads", "1", "--compile",
                               "--out", str(tmp_path / "res.json")])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    first = res["first_step_loss"]
    assert math.isclose(first["preinfer, torch.compile"], first["badam"], rel_tol=1e-5), first
    assert res["seconds"]["preinfer, torch.compile"]["n"] == 2
    assert all(s > 0 for s in res["first_step_s"].values())
