"""bench/fp8_probe.py's --quick form end to end (issue #56's probe measurement): per seed the
example's probe trained on a bf16 and on an fp8 layer cache of the same rows, held out on the
same val rows, and the fp8 cache is the smaller one."""

from __future__ import annotations

import json
import math

import pytest

from bench import fp8_probe


@pytest.mark.slow
@pytest.mark.functional
def test_quick_compares_a_probe_trained_on_fp8_and_on_bf16(tmp_path):
    out = tmp_path / "r.json"
    res = fp8_probe.main(["--quick", "--seeds", "0", "1", "--work", str(tmp_path / "w"),
                          "--out", str(out)])  # fmt: skip
    assert [(a["dtype"], a["seed"]) for a in res["arms"]] == [
        ("bf16", 0), ("bf16", 1), ("fp8_e4m3", 0), ("fp8_e4m3", 1)
    ]  # fmt: skip
    for a in res["arms"]:
        assert math.isfinite(a["after"]) and a["steps"] == 40 and a["val_rows"] == 64
    c = res["caches"]
    # the same rows in both dtypes (the same number of values), fewer bytes in fp8
    assert c["bf16"]["train"]["values"] == c["fp8_e4m3"]["train"]["values"]
    assert c["bf16"]["train"]["fingerprint"] != c["fp8_e4m3"]["train"]["fingerprint"]
    assert res["bytes_ratio"] < 0.7 and res["loss_ratio_minus_1"]["of"] == 2
    # the same seed and rows on bf16 twice: the same probe (the figure is not noise)
    again = fp8_probe.main(["--quick", "--seeds", "0", "--work", str(tmp_path / "w"),
                            "--out", str(tmp_path / "r2.json")])  # fmt: skip
    assert again["arms"][0]["after"] == res["arms"][0]["after"]
    assert json.loads(out.read_text())["bytes_ratio"] == res["bytes_ratio"]
