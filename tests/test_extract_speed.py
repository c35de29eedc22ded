"""bench/extract_speed.py: `cache extract` against the bare forward of the same compute (issue
#56's extract target), its --quick form end to end. Not a timing assertion: the arms ran, the
extracts wrote their caches each repeat, and every ratio is there and positive."""

from __future__ import annotations

import json

import pytest
import torch

from bench import extract_speed


@pytest.fixture(autouse=True)
def _same_threads():
    n = torch.get_num_threads()  # the bench pins its own: restored for the next test
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
@pytest.mark.functional
def test_quick_measures_both_extracts_against_the_bare_forward(tmp_path):
    out = tmp_path / "r.json"
    res = extract_speed.main(["--quick", "--repeats", "1", "--omp-wait", "default",
                              "--work", str(tmp_path), "--out", str(out)])  # fmt: skip
    assert res["layers"] == [2, 4, 6] and res["k"] == 3 and res["rows"] == 256
    arms = {"bare, 1 layer", "bare, 3 layers", "extract k=1", "extract k=3"}
    assert set(res["seconds"]) == arms and set(res["cpu_seconds"]) == arms
    for a in arms:
        assert res["seconds"][a]["of"] == 1 and res["seconds"][a]["median"] > 0
    for a in ("extract k=1", "extract k=3"):
        assert res["ratio"][a]["median"] > 0 and res["cpu_ratio"][a]["median"] > 0
        assert res["ratio_vs_bare_1_layer"][a]["median"] > 0
        st = res["extract_stats"][a]
        assert st["forward_s"]["median"] > 0 and st["write_s"]["median"] > 0  # it wrote
    cost = res["per_layer_cost"]
    for key in ("k1", "per_layer", "per_layer_vs_bare_1_layer", "marginal"):
        assert cost[key]["of"] == 1 and isinstance(cost[key]["median"], float)
    assert isinstance(res["target"]["met"], bool)
    assert res["load_before"] is not None and res["load_after"] is not None
    assert json.loads(out.read_text())["ratio"]["extract k=1"] == res["ratio"]["extract k=1"]
    assert not any(tmp_path.glob("docs20/root-*"))  # the arms' caches removed afterwards


@pytest.mark.parametrize("layers", ["6", "6,6", "a,b"])
def test_layers_for_the_k_arm_are_checked_in_one_line(layers, capsys):
    with pytest.raises(SystemExit) as e:
        extract_speed.main(["--layers", layers, "--omp-wait", "default"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "error: --layers" in err
