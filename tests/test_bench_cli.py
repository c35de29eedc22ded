"""Every benchmark in bench/ runs: its --help, and its --tiny or --quick form end to end (the
ones with a test of their own elsewhere: study, peers, visit_step, run_all). bench/arms.py's
peak-memory child and arm runner, which plan_accuracy, tokenize_scale, trainer_step, study,
economics and peers share."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from bench import arms, run_all

BENCHES = sorted(s["name"] for s in run_all.discover()) + ["gpu_check", "run_all"]


@pytest.fixture(autouse=True)
def _same_threads():
    n = torch.get_num_threads()  # a bench sets its own: restored for the next test
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", [b for b in BENCHES if b != "check_results"])
def test_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"bench.{name}").main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def _hello(spec, ask):
    print("not the protocol: goes to the log")
    return {"got": spec["x"], "answer": ask({"q": spec["x"]})["a"]}


def test_a_function_in_a_child_process_asks_its_parent(tmp_path):
    log = tmp_path / "child.log"
    res = arms.in_child("tests.test_bench_cli:_hello", {"x": 3},
                        answer=lambda q: {"a": q["q"] * 2}, log_path=log)  # fmt: skip
    assert res == {"got": 3, "answer": 6} and "not the protocol" in log.read_text()
    with pytest.raises(RuntimeError, match="KeyError"):
        arms.in_child("tests.test_bench_cli:_hello", {"y": 1})


def test_peak_memory_sees_a_transient_and_pauses(tmp_path):
    mem = arms.PeakMemory()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del x
    mem.mark("big")
    with mem.paused():
        y = torch.ones(128 * 2**20 // 4)
        del y
    peak = mem.stop()
    assert mem.phases["big"] >= 50 and peak - mem.baseline < 100  # the paused 128 MiB: not seen


def test_cache_io_tiny(tmp_path):
    from bench import cache_io

    res = cache_io.main(["--tiny", "--out", str(tmp_path / "r.json")])
    assert res["io"] and res["io"][0]["read_ratio"] > 0 and len(res["sources"][0]["codecs"]) > 10


def test_cache_io_on_real_states_tiny(tmp_path):
    from bench import cache_io

    res = cache_io.main(["--skip-io", "--states", "gpt2", "--samples", "8", "--docs", "20",
                         "--seq", "16", "--states-dir", str(tmp_path)])  # fmt: skip
    (src,) = res["sources"]
    info = Path(src["path"]).with_suffix(".json")
    assert json.loads(info.read_text())["shape"][:2] == [8, 16] and src["shape"][:2] == [8, 16]


def test_tokenize_scale_tiny(tmp_path):
    from bench import tokenize_scale

    res = tokenize_scale.main(["--tiny", "--work", str(tmp_path)])
    a, b = res["sizes"]
    assert b["tokens"] > a["tokens"] > 0 and a["peak_rss_mb"] >= a["base_rss_mb"] > 0


def test_trainer_step_precision_quick(tmp_path):
    from bench import trainer_step

    res = trainer_step.main(["--precision", "--config", "configs/demo.yaml", "--seq", "64",
                             "--repeats", "2", "--steps", "1", "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert set(res["median_step_s"]) == {"fp32", "bf16"} and res["speedup_bf16"] > 0


def test_writer_quick_local(tmp_path):
    from bench import writer

    res = writer.main(["--quick", "--targets", "local", "--mb", "2", "--codecs", "none",
                       "--threads", "1", "--dir", str(tmp_path), "--out", str(tmp_path / "r.json")])  # fmt: skip
    (a,) = res["arms"].values()
    assert a["mb_s"]["median"] > 0 and a["ratio"] > 0


@pytest.mark.slow
@pytest.mark.functional
def test_trainer_step_tiny(tmp_path):
    from bench import trainer_step

    res = trainer_step.main(["--tiny", "--out", str(tmp_path / "r.json")])
    (row,) = res["rows"]
    assert row["of_blocks"] == 2 and all(v > 0 for v in row["peak_mem_growth_mb"].values())


@pytest.mark.slow
@pytest.mark.functional
def test_plan_accuracy_tiny(tmp_path):
    from bench import plan_accuracy

    res = plan_accuracy.main(["--tiny", "--json", str(tmp_path / "r.json")])
    assert res["headline"]["arms"] == 4 and all(r["measured"] > 0 for r in res["rows"])
    assert {"load", "backward", "step"} <= set(res["rows"][-1]["phases"])  # trainer full


@pytest.mark.slow
@pytest.mark.functional
def test_preinfer_throughput_quick(tmp_path):
    from bench import preinfer_throughput

    res = preinfer_throughput.main(["--quick", "--repeats", "1", "--omp-wait", "default",
                                    "--work", str(tmp_path), "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert res["arms"]["throughput"]["ratio"]["in process"]["median"] > 0


@pytest.mark.slow
@pytest.mark.functional
def test_economics_tiny_counts_a_seed_that_did_not_reach(tmp_path):
    from bench import economics

    out = tmp_path / "r.json"
    economics.main(["--tiny", "--work", str(tmp_path / "w"), "--out", str(out)])
    (s,) = json.loads(out.read_text())["studies"]
    (row,) = s["seeds"]
    full, bcd, rec = row["arms"]
    assert full["mode"] == "full" and full["steps"] == economics.SMALLEST.full_cap
    assert all(a["own_process"] and a["peak_rss_mb"] > 0 for a in row["arms"])
    assert len(rec["curve"]) == len(bcd["curve"])  # recompute: the same visits
    med = s["median"]["cache_to_full_time"]  # one seed: its own figure, or not reached
    assert (med is None) == (not row["reached"]) and math.isfinite(s["median"]["cache_share"])
    assert f"{int(row['reached'])} of 1 reached" in json.loads(out.read_text())["table"]


@pytest.mark.slow
@pytest.mark.functional
def test_ray_train_steps_tiny(tmp_path):
    from bench import ray_train_steps

    res = ray_train_steps.main(["--tiny", "--out", str(tmp_path / "r.json")])
    assert res["headline"]["ray_train_over_in_process"] > 0
