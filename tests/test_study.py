"""bench/study.py (the study to the plateau): its arithmetic on synthetic curves, its argument
checks, and (slow) one tiny run end to end."""

from __future__ import annotations

import json
import math

import pytest

from bench import study
from bench.arms import Stop
from bench.harness import first_reach, interleave, multiplier, plateau, select_lr, show, spread


def _curve(ppls, every=10, s_per_step=0.5):
    return [{"steps": every * (i + 1), "seconds": every * (i + 1) * s_per_step, "ppl": p}
            for i, p in enumerate(ppls)]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# plateau: patience counts evaluations without a gain of more than min_rel_delta


def test_plateau_stops_after_patience_points_without_improvement():
    c = _curve([100, 80, 70, 69.9, 71, 75, 60])
    p = plateau(c, patience=3, min_rel_delta=0.01)
    # 69.9 is below 70 but by less than 1%: it does not reset patience, yet it is the best point
    assert p["plateaued"] and p["stop_index"] == 5
    assert p["best"]["ppl"] == 69.9 and p["best"]["steps"] == 40
    # without a minimum gain, 69.9 resets the count: 71, 75 are only two bad points
    p0 = plateau(c, patience=3, min_rel_delta=0.0)
    assert not p0["plateaued"] and p0["stop_index"] is None and p0["best"]["ppl"] == 60


def test_plateau_waits_for_min_steps():
    c = _curve([100, 90, 91, 92, 93, 80])  # an early plateau at steps 30-40, then a drop
    assert plateau(c, patience=2)["stop_index"] == 3
    p = plateau(c, patience=2, min_steps=60)
    assert not p["plateaued"] and p["best"]["ppl"] == 80
    assert plateau(c[:5], patience=2, min_steps=50)["stop_index"] == 4  # bad points kept counting


def test_plateau_of_a_curve_still_improving_is_its_last_point():
    p = plateau(_curve([10, 9, 8, 7]), patience=2)
    assert p == {"best": _curve([10, 9, 8, 7])[-1], "plateaued": False, "stop_index": None}


def test_plateau_rejects_bad_input():
    with pytest.raises(ValueError, match="patience"):
        plateau(_curve([1.0]), patience=0)
    with pytest.raises(ValueError, match="empty"):
        plateau([], patience=2)


# ---------------------------------------------------------------------------------------------
# reach and the B-F multiplier / wall-clock ratio


def test_first_reach_is_the_first_point_at_or_below_target():
    c = _curve([90, 70, 50, 40, 50])
    assert first_reach(c, 50)["steps"] == 30  # equal counts
    assert first_reach(c, 45)["steps"] == 40
    assert first_reach(c, 39.9) is None


def test_multiplier_arithmetic():
    full_best = {"steps": 120, "seconds": 60.0, "ppl": 50.0}
    bcd = _curve([90, 60, 49], every=60, s_per_step=0.2)  # reaches at 180 steps, 36 s
    m = multiplier(first_reach(bcd, full_best["ppl"]), full_best)
    assert m == {"bf_multiplier": 1.5, "time_ratio": 0.6, "reached": True}
    assert multiplier(None, full_best) == {"bf_multiplier": None, "time_ratio": None,
                                           "reached": False}  # fmt: skip
    with pytest.raises(ValueError, match="steps and seconds"):
        multiplier(bcd[0], {"steps": 0, "seconds": 1.0})


# ---------------------------------------------------------------------------------------------
# lr selection: best against best, medians over seeds, not reached = infinite


def test_select_lr_takes_the_lowest_median_and_flags_the_grid_edge():
    runs = {
        1e-3: [{"bf": 1.2}, {"bf": 1.4}, {"bf": 0.9}],  # median 1.2
        2e-3: [{"bf": 1.0}, {"bf": None}, {"bf": 0.8}],  # median 1.0 (None = inf)
        4e-3: [{"bf": 0.5}, {"bf": None}, {"bf": None}],  # median inf: misses on 2 of 3
    }
    s = select_lr(runs, "bf")
    assert s["lr"] == 2e-3 and s["median"] == 1.0 and not s["edge"]
    assert s["by_lr"] == {1e-3: 1.2, 2e-3: 1.0, 4e-3: None}
    runs[1e-3] = [{"bf": 0.7}] * 3
    s = select_lr(runs, "bf")
    assert s["lr"] == 1e-3 and s["edge"]  # the best at the grid's end: widen the sweep


def test_select_lr_breaks_ties_and_handles_nothing_reached():
    runs = {1e-3: [{"bf": None, "ppl": 80.0}], 2e-3: [{"bf": None, "ppl": 70.0}]}
    s = select_lr(runs, "bf", tie="ppl")
    assert s["lr"] == 2e-3 and s["median"] is None
    with pytest.raises(ValueError, match="no lr"):
        select_lr({}, "bf")


def test_one_summary_rule_counts_a_seed_that_did_not_reach():
    """#42: the median over every seed, not reached ranked above every value; 'n of N'."""
    s = spread([3.0, None, 1.0, 2.0])  # ranked 1, 2, 3, not reached: the median is 2.5
    assert s == {"median": 2.5, "min": 1.0, "max": None, "n": 3, "of": 4,
                 "values": [3.0, None, 1.0, 2.0]}  # fmt: skip
    assert spread([1.2, None, None])["median"] is None  # 2 of 3 missed: not reached
    assert spread([1.0, None, 2.0])["median"] == 2.0 and spread([None])["median"] is None
    assert spread([0.5, 0.7])["max"] == 0.7 and spread([])["n"] == 0  # timings: plain spread
    assert show(spread([1.2, None, 1.0])) == "1.20 [1.00, not reached]"
    assert show(spread([None])) == "not reached" and show(spread([1.234])) == "1.23"


def test_interleave():
    assert interleave([1, 2, 3], 1) == [2, 3, 1] and interleave([1, 2, 3], 4) == [2, 3, 1]
    assert interleave([], 2) == []


def test_analyse_compares_best_against_best():
    """full's best lr by median best ppl; each BCD arm's by median multiplier, at its own lr."""

    def full(ppl, steps):
        return {"best_ppl": ppl, "steps_to_best": steps, "plateaued": True,
                "best": {"steps": steps, "seconds": steps * 0.5, "ppl": ppl}}  # fmt: skip

    def bcd(bf, ppl):
        return {"bf_multiplier": bf, "time_ratio": None if bf is None else bf / 2,
                "reach_steps": None if bf is None else bf * 255,
                "reached": bf is not None, "best_ppl": ppl, "cache_share": 0.1}  # fmt: skip

    full_runs = {1e-3: [full(60, 300), full(62, 330)], 2e-3: [full(50, 240), full(52, 270)]}
    bcd_runs = {"bcd": {1e-3: [bcd(2.0, 49), bcd(None, 55)], 4e-3: [bcd(1.2, 48), bcd(1.4, 50)]}}
    a = study.analyse(full_runs, bcd_runs)
    assert a["full"]["select"]["lr"] == 2e-3 and a["full"]["best_ppl"]["median"] == 51
    assert a["full"]["plateaued"] == 2 and a["full"]["steps_to_best"]["median"] == 255
    b = a["bcd"]
    assert b["select"]["lr"] == 4e-3 and b["reached"] == 2
    assert math.isclose(b["bf_multiplier"]["median"], 1.3)
    assert math.isclose(b["time_ratio"]["median"], 0.65)
    table = study.render([{"layout": "llama", "M": 3, "analysis": a}])
    assert "| llama | 3 | bcd | 0.004 (edge) (0.001, 0.004) |" in table
    assert "1.30 [1.20, 1.40]" in table and "plateau 2/2" in table and "2 of 2 reached" in table
    assert "| 332 [306, 357] |" in table  # steps to full's best ppl: 1.3 x 255
    # at lr 1e-3 one seed of two missed: its median counts it (not reached), not the other's 2.0
    a = study.analyse(full_runs, {"bcd": {1e-3: bcd_runs["bcd"][1e-3]}})
    assert a["bcd"]["bf_multiplier"]["median"] is None and a["bcd"]["reached"] == 1
    table = study.render([{"layout": "llama", "M": 3, "analysis": a}])
    assert "| not reached [2.00, not reached] |" in table and "| 1 of 2 reached |" in table


# ---------------------------------------------------------------------------------------------
# arguments: variants are config overrides, checked before anything runs


def test_variants_are_checked():
    v = study.parse_variant(["head", "train.always_train=[head]", "train.mode=bcd-recompute"])
    assert v.name == "head" and v.mode == "bcd-recompute" and len(v.overrides) == 2
    for bad, msg in (
        (["x"], "at least one"),
        (["bcd", "train.lr=1"], "base arm"),
        (["x", "train.lr"], "not KEY=VALUE"),
        (["x", "model.num_layers=2"], "every arm shares"),
        (["x", "train.mode=full"], "bcd or bcd-recompute"),
    ):
        with pytest.raises(ValueError, match=msg):
            study.parse_variant(bad)


# ---------------------------------------------------------------------------------------------
# end to end, tiny


def test_an_arm_of_another_seed_trains_from_that_seeds_checkpoint(tmp_path):
    """Seed 1's arm reads the init checkpoint made with model.init_seed=1 (the run's config
    said 0 once, and the rotation refused the checkpoint as made with other settings)."""
    rec = study.run_one(study.TINY, tmp_path, study.Arm("bcd", []), layout="gpt2", M=3, seed=1,
                        lr=1e-2, stop=Stop(max_visits=1), inline=True)  # fmt: skip
    assert rec["seed"] == 1 and rec["steps"] == study.TINY.steps_per_visit
    assert rec["final_ppl"] == rec["curve"][-1]["ppl"] and not rec["own_process"]


@pytest.mark.slow
@pytest.mark.functional
def test_study_tiny_end_to_end(tmp_path):
    out = tmp_path / "study.json"
    # 2 lrs x (full, bcd, a variant): minutes on 2 busy CPUs
    brief = study.main(["--tiny", "--lrs", "0.01", "0.03", "--arms", "bcd", "--work",
                        str(tmp_path / "work"), "--out", str(out),
                        "--variant", "desc", "train.order=descending"])  # fmt: skip
    res = json.loads(out.read_text())
    (s,) = res["studies"]
    a = s["analysis"]
    assert set(a) == {"full", "bcd", "desc"} and res["command"].count("<work>") == 1
    fsel = a["full"]["select"]["lr"]
    for recs in s["full_runs"].values():
        (r,) = recs
        steps = [p["steps"] for p in r["curve"]]
        assert steps == sorted(steps) and steps[-1] <= study.TINY.full_cap
        assert r["best_ppl"] == min(p["ppl"] for p in r["curve"])
    target = s["full_runs"][str(fsel)][0]["best"]
    for name in ("bcd", "desc"):
        for recs in s["bcd_runs"][name].values():
            (r,) = recs
            assert r["target_ppl"] == target["ppl"]
            assert r["curve"][-1]["steps"] <= r["cap_steps"] + study.TINY.steps_per_visit
            if r["reached"]:
                assert math.isclose(r["bf_multiplier"] * target["steps"],
                                    first_reach(r["curve"], target["ppl"])["steps"])  # fmt: skip
    assert "| gpt2 | 3 | full |" in res["table"] and str(tmp_path) not in out.read_text()
    assert brief["results"] and set(brief["headline"]) >= {"gpt2.M3.bcd.bf_multiplier"}
