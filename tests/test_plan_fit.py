"""`preinfer plan --fit` (preinfer/plan/fit.py): the planner turned around. Given a card's
memory it names the precision, per-card batch and M that train the model; each answer is
checked against the memory model it searched (the chosen M fits, M - 1 does not, a larger
batch does not), on the paper's shapes (meta device, arithmetic only)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from preinfer.model.partition import partition_layers
from preinfer.model.shape import model_shape
from preinfer.plan.memory import Setup, smallest_fitting_m, trainer_memory
from preinfer.run import plan_report as plan
from preinfer.run.config import load_config

GiB = 2**30


def _fit(name, tmp_path, card, **opts):
    cfg = load_config(f"configs/{name}", [f"run.dir={tmp_path}"])
    o = plan.PlanOptions(card=card, free_disk=1000.0, fit=True, **opts)
    return cfg, plan.build_plan(cfg, o)


def _worst(sh, m, setup):
    part = partition_layers(list(sh.layers), sh.embed, sh.head, m)
    return max(trainer_memory(sh, part, "bcd", k, setup)["peak"] for k in range(m))


@pytest.mark.parametrize("batch", [1, 8])
def test_the_paper_2b_on_one_24gb_card_names_a_setting_that_fits_and_nothing_smaller(
    tmp_path, batch
):
    cfg, p = _fit("plan-l2b.yaml", tmp_path, "rtx4090", batch=batch)
    fit, sh = p["fit"], model_shape(cfg.model)
    assert fit["best"] is not None and not any(r["full_fits"] for r in fit["rows"] if r["fits"])
    base = Setup(**{k: v for k, v in p["setup"].items() if k in Setup.__dataclass_fields__})
    for r in fit["rows"]:
        if not r["fits"]:
            continue
        q = dataclasses.replace(base, precision=r["precision"], batch=r["batch"])
        assert _worst(sh, r["M"], q) <= fit["card_bytes"] == 24 * GiB
        if r["M"] > 1:
            assert _worst(sh, r["M"] - 1, q) > fit["card_bytes"]  # the fewest blocks
        if r["batch"] < batch:  # the largest batch: twice it has no M that fits
            bigger = dataclasses.replace(q, batch=min(batch, 2 * r["batch"]))
            assert smallest_fitting_m(sh, bigger, fit["card_bytes"]) is None
        assert r["bcd_step_s"] > 0 and r["full_step_s"] > r["bcd_step_s"]
    # the best is the faster precision where batch and M tie (a 4090's bf16 peak is 2x fp32's)
    rows = {r["precision"]: r for r in fit["rows"] if r["fits"]}
    if set(rows) == {"fp32", "amp-bf16"} and (rows["fp32"]["batch"], rows["fp32"]["M"]) == (
        rows["amp-bf16"]["batch"],
        rows["amp-bf16"]["M"],
    ):
        assert fit["best"]["precision"] == "amp-bf16"


def test_the_paper_7b_on_a_24gb_card_fits_nothing_and_says_what_it_needs(tmp_path):
    _, p = _fit("plan-l7b.yaml", tmp_path, "rtx4090")
    assert p["fit"]["best"] is None
    for r in p["fit"]["rows"]:
        assert not r["fits"] and r["needs"] > 24 * GiB and r["needs_stage"] == "bcd block 0"
    _, p80 = _fit("plan-l7b.yaml", tmp_path, "a800-80")  # the paper's one A800
    assert p80["fit"]["best"] is not None
    assert all(r["fits"] and not r["full_fits"] for r in p80["fit"]["rows"])


def test_a_card_that_holds_full_training_needs_one_block(tmp_path):
    _, p = _fit("plan-l2b.yaml", tmp_path, "rtx4090", gpu_mem=1000.0)
    assert p["fit"]["best"]["M"] == 1
    assert all(r["fits"] and r["full_fits"] and r["M"] == 1 for r in p["fit"]["rows"])


def test_the_cli_prints_the_fit_lines():
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "plan", "-c", "configs/plan-l2b.yaml",
         "--card", "rtx4090", "--fit"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "fit    what trains in 24.0 GiB per card" in text
    assert "best: --set run.precision=" in text and "partition.num_blocks=" in text
    without = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "plan", "-c", "configs/plan-l2b.yaml"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert without.returncode == 0 and "fit    what trains" not in without.stdout
