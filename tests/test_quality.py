"""bench/quality.py (the quality study) and bench/run_all.py (`make bench`).

Fast tests drive the study's analysis and report on synthetic records, and the bench runner on
throwaway benchmark modules; the slow one runs `python -m bench.quality --quick` end to end
(minutes: it trains five small arms and builds caches with Ray) and checks that the JSON,
markdown and figures it writes agree with each other.
"""

from __future__ import annotations

import json
import math
import struct
import textwrap
from pathlib import Path

import pytest

from bench import quality, run_all
from bench.quality_analysis import analyse, at_step, first_reach
from bench.quality_arms import Scale
from bench.quality_train import (
    GlobalOrderCacheBatches,
    arm_hooks,
    global_order_batches,
    parse_metrics,
)

ROOT = Path(__file__).resolve().parents[1]


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


# ---------------------------------------------------------------------------------------------
# parse_metrics: eval time subtracted, global steps, the robust clock


def test_parse_metrics_subtracts_evals_and_counts_steps(tmp_path):
    t0 = 1000.0
    recs = []
    t = t0
    # visit (0, 0): 4 steps of 1 s, eval after step 2 (2 s) and after step 4 (2 s)
    for step in range(1, 5):
        t += 1.0
        r = {"event": "step", "round": 0, "block": 0, "step": step, "time": t}
        if step % 2 == 0:
            r["val_loss"] = math.log(100.0 - step)
            t += 2.0  # the evaluation runs after the record is stamped
        recs.append(r)
    t += 5.0  # a cache build between visits
    recs.append({"event": "cache", "action": "built", "boundary": 1, "round": 0, "seconds": 5.0})
    # visit (0, 1): 2 steps of 0.5 s, with a 10 s stall on the second (contention)
    for step, dt in ((1, 0.5), (2, 10.0)):
        t += dt
        r = {"event": "step", "round": 0, "block": 1, "step": step, "time": t}
        if step == 2:
            r["val_loss"] = math.log(50.0)
        recs.append(r)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    out = parse_metrics(path, t0, [2.0, 2.0, 2.0])
    steps = [p["step"] for p in out["curve"]]
    assert steps == [2, 4, 6]
    walls = [p["wall_s"] for p in out["curve"]]
    assert walls == pytest.approx([2.0, 4.0, 4.0 + 5.5 + 10.0])
    assert out["cache_s"] == 5.0
    v0, v1 = out["visits"]
    assert (v0["steps"], v0["median_step_s"]) == (4, pytest.approx(1.0))
    assert v1["median_step_s"] == pytest.approx(10.0)  # one delta only: the stall is its median
    assert out["curve"][-1]["ppl"] == pytest.approx(50.0)
    assert out["robust_s"] == pytest.approx(v1["end_robust_s"])


def test_parse_metrics_mismatched_eval_count_falls_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"event": "step", "round": 0, "block": 0, "step": 1, "time": 1.0, "val_loss": 1})
    )
    out = parse_metrics(path, 0.0, [])  # no durations recorded: nothing subtracted
    assert out["curve"][0]["wall_s"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# analyse + render on synthetic results


def _arm(model, mode, seed, M, opt, ppls, step_every, wall_per_step, group="main", S=10):
    curve = [
        {
            "step": (i + 1) * step_every,
            "tokens": (i + 1) * step_every * 64,
            "wall_s": (i + 1) * step_every * wall_per_step,
            "robust_s": (i + 1) * step_every * wall_per_step,
            "ppl": p,
            "val_loss": math.log(p),
            "round": 0,
            "block": 0,
        }
        for i, p in enumerate(ppls)
    ]
    total = curve[-1]["step"]
    per_round = M * S
    visits = [
        {
            "round": r,
            "block": k,
            "steps": S,
            "median_step_s": wall_per_step * (1.0 if k == 0 else 0.5),
            "end_wall_s": ((r * M + k + 1) * S) * wall_per_step,
            "end_robust_s": ((r * M + k + 1) * S) * wall_per_step,
        }
        for r in range(max(1, total // per_round))
        for k in range(M if mode != "full" else 1)
    ]
    return {
        "id": f"{model}-{mode}-{opt}-M{M}-s{seed}",
        "model": model,
        "mode": mode,
        "seed": seed,
        "M": M,
        "optimizer": opt,
        "lr": 0.003 if opt == "adamw" else 0.3,
        "group": group,
        "rounds": total // per_round,
        "steps_per_visit": S,
        "total_steps": total,
        "curve": curve,
        "visits": visits,
        "wall_s": total * wall_per_step,
        "robust_s": total * wall_per_step,
        "cache_s": 1.0 if mode == "bcd" else 0.0,
        "final": [
            {"round": 1, "step": 30, "ppl": ppls[len(ppls) // 2 - 1]},
            {"round": 2, "step": 60, "ppl": ppls[-1]},
        ]
        if mode == "bcd"
        else [{"round": 1, "step": total, "ppl": ppls[-1]}],
        "cache_events": [],
    }


def _synthetic_results() -> dict:
    scale = Scale(
        documents=4,
        steps_per_visit=10,
        full_rounds=1,
        bcd_rounds=2,
        recompute_rounds=1,
        seeds=[0, 1],
        models=["gpt2"],
        sweep_M=[2, 3],
        sweep_seeds=[0],
        sgd_seeds=[0],
        model_sets={"gpt2": ["model.hidden_size=8"]},
    )
    arms = []
    for seed in (0, 1):
        arms.append(_arm("gpt2", "full", seed, 3, "adamw", [300, 200, 100], 10, 1.0))
        # bcd: reaches 100 at step 40 (seed 0) / never (seed 1); 104 (within 5%) at step 30
        last = 100 if seed == 0 else 101
        arms.append(_arm("gpt2", "bcd", seed, 3, "adamw", [350, 250, 104, last, 102, 101], 10, 0.5))
        arms.append(_arm("gpt2", "bcd-recompute", seed, 3, "adamw", [350, 250, 104], 10, 0.9))
    arms.append(_arm("gpt2", "bcd", 0, 3, "sgd", [400, 300, 200, 150, 120, 110], 10, 0.5, "sgd"))
    arms.append(_arm("gpt2", "bcd", 0, 2, "adamw", [330, 200, 99, 98, 97, 96], 10, 0.5, "sweep"))
    probes = [
        {"model": "gpt2", "mode": "full", "optimizer": "adamw", "M": 3, "block": 0,
         "rss_growth_mb": 100.0, "state_mb": 40.0},
        {"model": "gpt2", "mode": "bcd", "optimizer": "adamw", "M": 3, "block": 0,
         "rss_growth_mb": 90.0, "state_mb": 20.0},
        {"model": "gpt2", "mode": "bcd", "optimizer": "adamw", "M": 3, "block": 1,
         "rss_growth_mb": 40.0, "state_mb": 10.0},
        {"model": "gpt2", "mode": "bcd", "optimizer": "adamw", "M": 3, "block": 2,
         "rss_growth_mb": 45.0, "state_mb": 12.0},
        {"model": "gpt2", "mode": "bcd-recompute", "optimizer": "adamw", "M": 3, "block": 1,
         "rss_growth_mb": 60.0, "state_mb": 18.0},
        {"model": "gpt2", "mode": "bcd-recompute", "optimizer": "adamw", "M": 3, "block": 2,
         "error": "boom"},
    ]  # fmt: skip
    from dataclasses import asdict

    return {
        "command": "python bench/quality.py",
        "scale_name": "test",
        "scale": asdict(scale),
        "started": "now",
        "study_s": 60.0,
        "host": {"cpus": 2, "loadavg_start": 1.0, "loadavg_end": 1.0},
        "prep": {"train_samples": 10, "val_samples": 2, "initial": {"gpt2-s0": {"ppl": 2000.0}}},
        "ray_start_s": 1.0,
        "arms": arms,
        "probes": probes,
        "json_path": "x.json",
    }


def test_first_reach_and_at_step():
    curve = [{"step": 10, "ppl": 5.0}, {"step": 20, "ppl": 3.0}, {"step": 30, "ppl": 2.0}]
    assert first_reach(curve, 3.0)["step"] == 20
    assert first_reach(curve, 1.0) is None
    assert at_step(curve, 25)["step"] == 20
    assert at_step(curve, 5) is None


def test_analyse_multiplier_time_memory_targets():
    s = analyse(_synthetic_results())
    bcd = s["models"]["gpt2"]["arms"]["bcd"]
    # seed 0 reaches full's final (100) at step 40 of full's 30: 1.33; seed 1 never (bound 2.0)
    assert bcd["multiplier"][0] == pytest.approx(40 / 30)
    assert bcd["multiplier_censored"] == 1
    assert bcd["multiplier_worst"] == math.inf
    assert bcd["multiplier_close"][0] == pytest.approx(1.0)  # 104 <= 105 at step 30
    # ppl at full's step budget: 104 / 100
    assert bcd["ppl_ratio_at_full_steps"][0] == pytest.approx(1.04)
    # time to 1.05x: 30 steps x 0.5 s vs full's 30 x 1.0 s
    assert bcd["time_ratio_close"][0] == pytest.approx(0.5)
    # memory: BCD peak = block 0 (90) / full 100; later blocks 45 / 100
    assert bcd["mem_ratio_max"] == pytest.approx(0.9)
    assert bcd["mem_ratio_later"] == pytest.approx(0.45)
    # recompute: block 2 probe failed -> reported as missing, not invented
    rec = s["models"]["gpt2"]["arms"]["bcd-recompute"]
    assert rec["mem_rss"]["per_block"] == [90.0, 60.0, None]
    # recompute over cache, same steps (round 0): 0.9 / 0.5
    assert s["models"]["gpt2"]["recompute_over_cache_time"][0] == pytest.approx(1.8)
    t = s["targets"]["gpt2"]
    assert t["ppl_within_5pct"]["met"] is True
    assert t["time_to_close_le_full"]["met"] is True
    assert t["faster_than_recompute_1p5x"]["met"] is True
    assert t["peak_mem_le_half_full"]["met"] is False
    assert t["later_block_mem_le_half_full"]["met"] is True
    assert [r["M"] for r in s["sweep"]] == [2, 3]
    assert s["sweep"][0]["multiplier"][0] == pytest.approx(1.0)  # 99 <= 100 at step 30
    assert set(s["sgd"]) == {"adamw", "sgd"}
    assert s["sgd"]["sgd"]["censored"] == 1


def test_render_writes_markdown_and_small_figures(tmp_path):
    res = _synthetic_results()
    quality.render(res, tmp_path)
    md = (tmp_path / "quality.md").read_text()
    assert "## Main comparison" in md and "## Targets" in md and "## Block-count sweep" in md
    assert "**no**" in md  # a missed target is shown as missed
    for name in res["outputs"]["figures"]:
        png = Path(name) if Path(name).is_absolute() else ROOT / name
        assert png.is_file()
        assert _png_size(png) == (600, 350)
        assert f"]({png.name})" in md
    assert len(res["outputs"]["figures"]) == 4


# ---------------------------------------------------------------------------------------------
# run_all: discovery, subprocess per script, failures recorded


def _write(path: Path, body: str) -> None:
    path.write_text(textwrap.dedent(body))


def test_run_all_collects_results_and_records_failures(tmp_path):
    bench = tmp_path / "bench"  # a package of throwaway benchmarks, run as bench.<name>
    bench.mkdir()
    _write(bench / "__init__.py", "")
    _write(
        bench / "good.py",
        """
        import argparse
        from dataclasses import dataclass

        @dataclass
        class Knob:  # a dataclass needs its module in sys.modules
            quick: bool = False

        def main(argv=None):
            ap = argparse.ArgumentParser()
            ap.add_argument("--quick", action="store_true")
            a = ap.parse_args(argv)
            return {"quick": Knob(a.quick).quick, "speed": {"tok_s": 1234.5}, "nan": float("nan")}
        """,
    )
    _write(bench / "noargs.py", "def main():\n    return {'x': 1}\n")
    _write(bench / "broken.py", "def main(argv=None):\n    raise RuntimeError('kaput')\n")
    _write(bench / "nodict.py", "def main(argv=None):\n    return 0\n")
    _write(bench / "exits.py", "import os\ndef main(argv=None):\n    os._exit(3)\n")
    _write(bench / "helper.py", "X = 1\n")  # no main: not a benchmark
    _write(bench / "run_all.py", "def main(argv=None):\n    raise SystemExit('self')\n")
    out = tmp_path / "results"
    run = run_all.main(["--bench-dir", str(bench), "--results-dir", str(out), "--timeout", "60"])
    st = {k: v["status"] for k, v in run["scripts"].items()}
    assert st == {
        "broken": "failed",
        "exits": "failed",
        "good": "ok",
        "nodict": "failed",
        "noargs": "ok",
    }
    good = run["scripts"]["good"]
    assert good["argv"] == ["--quick"] and good["result"]["quick"] is True
    assert good["result"]["nan"] == "nan"  # non-finite floats survive JSON as strings
    assert "kaput" in run["scripts"]["broken"]["error"]
    assert "not a dict" in run["scripts"]["nodict"]["error"]
    js = sorted(out.glob("*.json"))
    md = sorted(out.glob("*.md"))
    assert len(js) == 1 and len(md) == 1
    saved = json.loads(js[0].read_text())
    assert saved["scripts"]["good"]["result"]["speed"]["tok_s"] == 1234.5
    text = md[0].read_text()
    assert "| `good` | ok | --quick |" in text and "speed.tok_s=1234" in text
    assert "| `broken` | failed |" in text


def test_run_all_discovers_the_repo_benchmarks():
    found = {s["name"]: s for s in run_all.discover()}
    assert {"quality", "economics", "cache_io", "plan_accuracy"} <= set(found)
    assert not {"run_all", "harness", "__init__", "quality_train"} & set(found)  # no main
    assert found["quality"]["module"] == "bench.quality" and found["quality"]["quick"] is True
    assert found["economics"]["quick"] is True


# ---------------------------------------------------------------------------------------------
# The study end to end, CI scale


@pytest.mark.slow
@pytest.mark.ray
def test_quality_quick_end_to_end(tmp_path):
    docs, results = tmp_path / "docs", tmp_path / "results"
    brief = quality.main(
        [
            "--quick",
            "--work",
            str(tmp_path / "work"),
            "--docs",
            str(docs),
            "--results",
            str(results),
        ]
    )
    files = sorted(results.glob("quality-*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert not res["failed_arms"], res["failed_arms"]
    ids = {a["id"] for a in res["arms"]}
    assert {"gpt2-full-adamw-M3-s0", "gpt2-bcd-adamw-M3-s0", "gpt2-bcd-sgd-M3-s0"} <= ids
    for a in res["arms"]:
        assert a["curve"], a["id"]
        steps = [p["step"] for p in a["curve"]]
        assert steps == sorted(steps) and steps[-1] == a["total_steps"]
        walls = [p["wall_s"] for p in a["curve"]]
        assert walls == sorted(walls) and walls[-1] <= a["wall_s"] + 0.01
        assert all(p["ppl"] > 1 for p in a["curve"])
    assert all("error" not in p for p in res["probes"]), res["probes"]
    assert all(p["rss_growth_mb"] > 0 and p["state_mb"] > 0 for p in res["probes"])
    # BCD state (params + grads + optimizer) of a later block is below full's
    st = {(p["mode"], p["M"], p["block"]): p["state_mb"] for p in res["probes"]}
    assert st[("bcd", 3, 2)] < st[("full", 3, 0)]
    md = (docs / "quality.md").read_text()
    for f in res["outputs"]["figures"]:
        name = Path(f).name
        assert (docs / name).is_file() and f"]({name})" in md
        assert _png_size(docs / name) == (600, 350)
    s = res["summary"]
    assert brief["targets"] == json.loads(json.dumps(s["targets"]))
    full_final = s["models"]["gpt2"]["arms"]["full"]["final_ppl"][0]
    assert f"{full_final:.1f}" in md


def test_global_order_reader_is_a_permutation():
    import torch

    class FakeCache:
        num_samples = 40

        def read_rows(self, a, b, dtype):
            ids = torch.arange(a, b)
            return ids[:, None, None].float().expand(-1, 2, 3), ids[:, None].expand(-1, 2), ids

    b = GlobalOrderCacheBatches(FakeCache(), batch_size=8, seed=3, shuffle=True)
    rows = torch.cat([lab[:, 0] for _, lab in b.epoch(0)])
    assert sorted(rows.tolist()) == list(range(40)) and rows.tolist() != list(range(40))
    h, lab = next(b.epoch(0))
    assert torch.equal(h[:, 0, 0].long(), lab[:, 0])  # hidden and labels stay aligned
    ordered = GlobalOrderCacheBatches(FakeCache(), batch_size=8, seed=0, shuffle=False)
    assert next(ordered.epoch(0))[1][:, 0].tolist() == list(range(8))


def test_arm_hooks_time_evaluations_and_swap_only_cache_batches():
    """The study's visit hooks (preinfer.visit.VisitHooks): on_eval collects every evaluation's
    seconds; with global_order, a cache-fed visit trains on GlobalOrderCacheBatches built with
    its reader's batch size, seed and shuffle, a token-fed visit keeps its batches."""
    from types import SimpleNamespace

    import torch

    from preinfer.visit import VisitHooks

    durations: list[float] = []
    hooks = arm_hooks(durations)
    assert isinstance(hooks, VisitHooks) and hooks.batches is None
    hooks.on_eval(None, 4, 1.5, 0.25)
    hooks.on_eval(None, 8, 1.4, 0.5)
    assert durations == [0.25, 0.5]
    assert arm_hooks([], global_order=True).batches is global_order_batches

    class FakeCache:
        num_samples = 16

        def read_rows(self, a, b, dtype):
            ids = torch.arange(a, b)
            return ids[:, None, None].float().expand(-1, 2, 3), ids[:, None].expand(-1, 2), ids

    default = SimpleNamespace(batch_size=4, seed=7, shuffle=False, steps_per_epoch=4)
    tokens = SimpleNamespace(from_cache=False)
    assert global_order_batches(tokens, default) is default
    cached = SimpleNamespace(from_cache=True, train_cache=FakeCache())
    got = global_order_batches(cached, default)
    assert isinstance(got, GlobalOrderCacheBatches)
    assert (got.batch_size, got.seed, got.shuffle, got.steps_per_epoch) == (4, 7, False, 4)
