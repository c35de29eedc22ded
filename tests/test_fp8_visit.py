"""bench/fp8_visit.py's --quick form end to end (issue #56's fp8 measurement): for each seed the
last block's visit ran from a bf16 and from an fp8 cache of the same rows, both evaluated on the
whole val split from tokens, and the fp8 cache is the smaller one."""

from __future__ import annotations

import json
import math

import pytest

from bench import fp8_visit


@pytest.mark.slow
@pytest.mark.functional
def test_quick_compares_the_visit_and_the_bytes_of_fp8_and_bf16(tmp_path):
    out = tmp_path / "r.json"
    res = fp8_visit.main(["--quick", "--work", str(tmp_path / "w"), "--out", str(out)])
    assert [(a["dtype"], a["seed"]) for a in res["arms"]] == [
        ("bf16", 0), ("fp8_e4m3", 0), ("bf16", 1), ("fp8_e4m3", 1)
    ]  # fmt: skip
    for a in res["arms"]:
        assert math.isfinite(a["val_loss"]) and a["val_rows"] > 0 and a["cache"]["values"] > 0
    # the same rows in both caches: the same number of values, fewer bytes in fp8
    by = {(a["dtype"], a["seed"]): a for a in res["arms"]}
    assert by["bf16", 0]["cache"]["values"] == by["fp8_e4m3", 0]["cache"]["values"]
    assert res["bytes_ratio"] < 1 and res["loss_ratio_minus_1"]["of"] == 2
    assert isinstance(res["target"]["loss_met"], bool)
    assert json.loads(out.read_text())["bytes_ratio"] == res["bytes_ratio"]
