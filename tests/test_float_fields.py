"""Every float field of every stage config refuses nan and inf in one line (issue #53 item 9:
train.weight_decay=.nan reached torch's optimizer as a traceback). The fields are found by
walking the root Config's sections, so a float field added later is covered without a list."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import typing

import pytest

from core.config import ConfigError
from preinfer.run.config import Config, load_config
from preinfer.run.plan_report import PlanOptions, add_plan_arguments


def _float_fields(cls: type, where: str = "") -> list[tuple[str, bool]]:
    """(dotted name, is a list) of every field whose type holds float, in every section."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _float_fields(tp, f"{where}{f.name}.")
        elif "float" in str(tp):
            out.append((f"{where}{f.name}", typing.get_origin(tp) is list or "list[" in str(tp)))
    return out


FIELDS = _float_fields(Config)


def test_the_walk_finds_the_known_fields():
    names = {n for n, _ in FIELDS}
    assert {"train.weight_decay", "train.betas", "train.suffix_lr", "train.min_lr_ratio",
            "train.grad_clip", "data.val_fraction", "model.rope_theta",
            "preinfer.gpus_per_actor", "cache.shard_mb"} <= names  # fmt: skip
    assert all("." in n for n in names) and len(names) >= 20


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e999"])
@pytest.mark.parametrize(("name", "is_list"), FIELDS, ids=[n for n, _ in FIELDS])
def test_float_field_refuses_non_finite(name, is_list, value):
    spec = f"{name}=[{value}, 0.9]" if is_list else f"{name}={value}"
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo.yaml", [spec])
    msg = str(e.value)
    assert "\n" not in msg and name in msg, msg


@pytest.mark.parametrize(
    "spec",
    ["train.weight_decay=-0.1", "train.momentum=1.5", "train.min_delta=-1",
     "model.rope_theta=0", "preinfer.gpus_per_actor=-1"],
)  # fmt: skip
def test_float_field_out_of_range_is_refused(spec):
    with pytest.raises(ConfigError, match=spec.split("=")[0]):
        load_config("configs/demo.yaml", [spec])


def test_plan_float_options_refuse_non_finite():
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    hints = typing.get_type_hints(PlanOptions)
    floats = [f.name for f in dataclasses.fields(PlanOptions) if "float" in str(hints[f.name])]
    assert "gpu_mem" in floats and "mfu" in floats
    for name in floats:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([f"--{name.replace('_', '-')}", "nan"])
        assert e.value.code == 2


def test_cli_weight_decay_nan_is_one_line():
    p = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "config", "-c", "configs/demo.yaml",
         "--set", "train.weight_decay=.nan"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.weight_decay" in lines[0] and "finite" in lines[0], lines
