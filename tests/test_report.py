"""`preinfer report`: plots open, summary numbers match metrics.jsonl (synthetic and real tiny run)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from pipelines.report import PLOTS, run_report
from pipelines.report_data import group_metrics
from preinfer.run.config import load_config
from tests.pipeline_fixtures import quiet

M, ROUNDS, STEPS = 3, 2, 6


def _fp(r: int, b: int, split: str) -> str:
    return {"train": "a", "val": "b"}[split] + f"{r}{b}" + "cd" * 30  # hex, like real ones


def _write_synthetic_run(run: Path) -> dict:
    """A bcd run of 2 rounds x 3 blocks, as the rotation writes it: visit r0-b1 was killed at
    step 3 and resumed from its step-2 state, so steps 3.. appear twice (the later ones count);
    caches of round 0 were dropped, those of round 1 are still on disk; evals before and after."""
    lines, t = [], 1_000_000.0
    in_use, state_visits, events = [], {}, []
    expect = {"visits": [], "cache": [], "final_ppl": None, "steps": {}}

    def emit(rec):
        lines.append(json.dumps(rec))

    emit({"event": "eval", "split": "val", "loss": 6.0, "ppl": math.exp(6.0), "tokens": 960,
          "seconds": 0.5, "checkpoint": "c0" * 32, "time": t})  # fmt: skip
    for r in range(ROUNDS):
        for b in range(M):
            action = "tokens"
            if b > 0:
                action = "built" if b == 1 else "refreshed"
                secs = 2.0 if action == "built" else 1.0
                t += secs
                fps = {"train": _fp(r, b, "train"), "val": _fp(r, b, "val")}
                ev = {"time": t, "action": action, "boundary": b, "round": r,
                      "fingerprints": fps, "seconds": secs}  # fmt: skip
                emit({"event": "cache", **ev})
                events.append(ev)
                in_use = sorted(fps.values())
                expect["cache"].append((r, b, action))
            losses = {}
            attempts = [range(1, 4), range(3, STEPS + 1)] if (r, b) == (0, 1) else [range(1, 7)]
            for a, steps in enumerate(attempts):
                for s in steps:
                    t += 0.1
                    loss = (
                        5.0
                        - 0.3 * r
                        - 0.05 * b
                        - 0.1 * s
                        + (0.777 if len(attempts) == 2 and a == 0 and s == 3 else 0)
                    )
                    rec = {"event": "step", "mode": "bcd", "round": r, "block": b, "step": s,
                           "loss": loss, "tokens_per_s": 1000.0 + 100 * b + s,
                           "peak_mem_mb": 50.0 + b, "time": t}  # fmt: skip
                    if s % 3 == 0:
                        rec["val_loss"] = loss + 0.2
                    emit(rec)
                    losses[s] = loss
            expect["steps"][(r, b)] = losses
            visit = {"event": "visit", "mode": "bcd", "round": r, "block": b, "steps": STEPS,
                     "stopped": "max_steps", "loss": losses[STEPS], "val_loss": losses[STEPS] + 0.2,
                     "seconds": 0.1 * STEPS, "tokens_per_s": 1234.5 + b, "peak_mem_mb": 60.0 + b,
                     "peak_mem_growth_mb": 5.0, "trainable_params": 1000 * (b + 1),
                     "spec": {"block": b, "round": r, "mode": "bcd"}}  # fmt: skip
            emit(visit)
            state_visits[f"r{r}-b{b}"] = {**visit, "cache": action}
            expect["visits"].append((f"r{r}-b{b}", action, visit))
    t += 0.5
    final = 4.1234567
    emit({"event": "eval", "split": "val", "loss": final, "ppl": math.exp(final), "tokens": 960,
          "seconds": 0.5, "checkpoint": "c1" * 32, "time": t})  # fmt: skip
    lines.insert(5, '{"event": "step", "mode": "bcd", "round"')  # a torn line is skipped
    expect["final_ppl"] = math.exp(final)

    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "state.json").write_text(json.dumps(
        {"visits": state_visits, "caches_in_use": in_use, "events": events, "mode": "bcd",
         "pending": None}))  # fmt: skip
    ck = run / "checkpoint"
    ck.mkdir()
    (ck / "checkpoint.json").write_text(json.dumps({
        "format": "preinfer-checkpoint", "format_version": 1,
        "partition": {"num_layers": 4, "blocks": [[0, 1], [1, 3], [3, 4]],
                      "block_params": [300, 200, 310]},
        "blocks": [{"file": f"block_{b:03d}-x.safetensors", "hash": f"{b}" * 64,
                    "num_params": [300, 200, 310][b]} for b in range(M)],
    }))  # fmt: skip
    for fp in in_use:
        d = run / "cache" / fp
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({
            "fingerprint": fp, "num_samples": 40, "seq_len": 16, "hidden_size": 32,
            "dtype": "bf16", "codec": {"codec": "zstd", "shuffle": "none", "level": 3},
            "total_bytes": 30_000, "value_bytes": 29_000, "bytes_per_value": 1.416,
            "compression_ratio": 1.41, "ratio_vs_bf16": 1.41,
        }))  # fmt: skip
    return expect


def _section(md: str, title: str) -> str:
    m = re.search(rf"^## {title}\n(.*?)(?=^## |\Z)", md, re.S | re.M)
    assert m, f"no section {title!r} in summary.md"
    return m.group(1)


def _table_rows(section: str) -> list[list[str]]:
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows[2:]]


def _check_pngs(files: dict) -> None:
    import matplotlib.image as mpimg

    for name in PLOTS:
        p = Path(files[name])
        assert p.is_file() and p.stat().st_size > 2000, p
        img = mpimg.imread(p)
        h, w = img.shape[:2]
        assert 250 <= h <= 500 and 450 <= w <= 1100, (name, img.shape)
        assert img[..., :3].std() > 0.01, f"{name} looks blank"


def _check_summary_matches_metrics(md: str, metrics: Path) -> None:
    """Every number the summary states about visits, caches and the final perplexity is the one
    metrics.jsonl holds (later record wins for repeated visits)."""
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.startswith('{"event"')
            and ln.endswith("}")]  # fmt: skip
    visits = {}
    for r in recs:
        if r["event"] == "visit":
            visits[(r["round"], r["block"])] = r
    rows = _table_rows(_section(md, "Visits"))
    assert [row[0] for row in rows] == [f"r{r}-b{b}" for r, b in visits]
    for row, v in zip(rows, visits.values(), strict=True):
        assert int(row[2]) == v["steps"]
        assert row[3] == v["stopped"]
        assert float(row[4]) == pytest.approx(v["loss"], abs=1e-4)
        assert float(row[5]) == pytest.approx(v["val_loss"], abs=1e-4)
        assert float(row[6]) == pytest.approx(math.exp(v["val_loss"]), rel=1e-3)
    cache = [r for r in recs if r["event"] == "cache"]
    crow = _table_rows(_section(md, "Caches")) if cache else []
    assert [(int(c[0]), int(c[1]), c[2]) for c in crow] == [
        (c["round"], c["boundary"], c["action"]) for c in cache
    ]
    evals = [r for r in recs if r["event"] == "eval" and r["split"] == "val"]
    got = float(re.search(r"\*\*Final val perplexity: ([0-9.]+)\*\*", md).group(1))
    want = evals[-1]["ppl"] if evals else math.exp(list(visits.values())[-1]["val_loss"])
    assert got == pytest.approx(want, abs=0.006)


def test_report_synthetic_run(tmp_path):
    run = tmp_path / "run"
    expect = _write_synthetic_run(run)
    cfg = load_config(None, [f"run.dir={run}", "run.name=synthetic", "train.rounds=2"])
    res = run_report(cfg, log=quiet)

    out = run / "report"
    assert res["dir"] == str(out)
    assert set(res["files"]) == {*PLOTS, "summary"}
    _check_pngs(res["files"])
    md = (out / "summary.md").read_text()
    _check_summary_matches_metrics(md, run / "metrics.jsonl")

    # the returned numbers are the ones metrics.jsonl holds
    assert res["final_ppl"] == pytest.approx(expect["final_ppl"])
    assert res["final_source"] == "eval"
    assert [(v["key"], v["input"], v["steps"], v["loss"]) for v in res["visits"]] == [
        (k, a, v["steps"], v["loss"]) for k, a, v in expect["visits"]
    ]
    assert [(c["round"], c["boundary"], c["action"]) for c in res["caches"]] == expect["cache"]
    # repeated steps of the resumed visit count once, with the later loss
    assert res["num_step_records"] == ROUNDS * M * STEPS
    assert res["timings"]["cache_counts"] == {"built": 2, "refreshed": 2}
    assert res["timings"]["cache_seconds"] == {"built": 4.0, "refreshed": 2.0}
    m = group_metrics(run)
    r0b1 = m["steps"][("bcd", 0, 1)]
    assert [s["step"] for s in r0b1] == list(range(1, STEPS + 1))
    assert [s["loss"] for s in r0b1] == [expect["steps"][(0, 1)][s] for s in range(1, STEPS + 1)]

    # caches: the dropped ones say so, the ones still in use (boundary 2, round 1) show sizes
    caches = _section(md, "Caches")
    assert caches.count("`: gone") == 6 and caches.count("1.41x vs bf16") == 2
    assert "29.3 KiB" in caches
    # blocks from the checkpoint index; inputs from state.json
    brows = _table_rows(_section(md, "Blocks"))
    assert [(r[0], r[1], r[2]) for r in brows] == [
        ("0", "[0, 1)", "300"), ("1", "[1, 3)", "200"), ("2", "[3, 4)", "310")
    ]  # fmt: skip
    assert [r[1] for r in _table_rows(_section(md, "Visits"))] == [
        a for _, a, _ in expect["visits"]
    ]
    for k in ("Config", "Timings", "Evaluations"):
        _section(md, k)

    # out_dir elsewhere; rerunning overwrites
    res2 = run_report(cfg, out_dir=tmp_path / "elsewhere", log=quiet)
    assert Path(res2["files"]["summary"]).parent == tmp_path / "elsewhere"


def test_report_partial_run_without_evals_or_state(tmp_path):
    """A killed first visit: no visit record, no eval, no state.json, no checkpoint yet."""
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"event": "step", "mode": "full", "round": 0, "block": 0, "step": s, "loss": 6.0 - s,
             "tokens_per_s": 500.0, "peak_mem_mb": 10.0, "time": 100.0 + s} for s in (1, 2)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = load_config(None, [f"run.dir={run}"])
    res = run_report(cfg, log=quiet)
    _check_pngs(res["files"])
    assert res["visits"][0]["stopped"] == "unfinished" and res["visits"][0]["loss"] == 4.0
    assert math.isnan(res["final_ppl"])
    md = Path(res["files"]["summary"]).read_text()
    assert "No checkpoint index" in md and "No cache events" in md


def test_report_without_metrics_is_a_clear_error(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path / 'none'}"])
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        run_report(cfg, log=quiet)


def test_report_real_tiny_run(tiny_run):
    """The real thing: a tiny rotation (block 0 from tokens, boundary 1 built, 2 refreshed),
    then an eval; the report's numbers are the run's."""
    from pipelines.bcd import run_bcd
    from pipelines.eval import run_eval

    cfg = tiny_run("train.max_steps=3", "train.eval_every=0", "train.eval_batches=1")
    run_bcd(cfg, log=quiet)
    ev = run_eval(cfg, max_batches=1, log=quiet)
    res = run_report(cfg, log=quiet)
    _check_pngs(res["files"])
    md = Path(res["files"]["summary"]).read_text()
    _check_summary_matches_metrics(md, Path(cfg.run.dir) / "metrics.jsonl")
    assert res["final_ppl"] == pytest.approx(ev["ppl"])
    assert [v["input"] for v in res["visits"]] == ["tokens", "built", "refreshed"]
    assert [c["action"] for c in res["caches"]] == ["built", "refreshed"]
    # boundary 2's caches are still in use, so their sizes are in the summary
    assert "B/value" in _section(md, "Caches")
    _check_progress_opens_the_report(md, Path(cfg.run.dir) / "metrics.jsonl",
                                     cfg.train.batch_size * cfg.data.seq_len)  # fmt: skip


def _check_progress_opens_the_report(md: str, metrics: Path, tokens_per_step: int) -> None:
    """The first section is val ppl per visit against cumulative tokens and wall-clock, and its
    numbers are the visit records' (tokens: steps x batch x seq_len, summed in run order)."""
    assert md.split("\n## ")[1].startswith("Val perplexity by block and round")
    assert "![progress](progress.png)" in _section(md, "Val perplexity by block and round")
    rows = _table_rows(_section(md, "Val perplexity by block and round"))
    rows = [r for r in rows if r[0] != "initial eval"]
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    visits = [r for r in recs if r["event"] == "visit"]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(v["round"], v["block"]) for v in visits]
    done = 0
    for r, v in zip(rows, visits, strict=True):
        done += v["steps"] * tokens_per_step
        assert v["tokens"] == v["steps"] * tokens_per_step
        assert int(r[2].replace(",", "")) == done
        assert float(r[4]) == pytest.approx(math.exp(v["val_loss"]), rel=1e-3)
    # wall-clock (rounded to 0.1 s): in run order, and the last visit's end comes after every
    # visit's own training time (a fast machine ends the first visit within 0.05 s: 0.0)
    times = [float(r[3]) for r in rows]
    assert times == sorted(times) and times[0] >= 0
    assert times[-1] >= sum(v["seconds"] for v in visits) - 0.05


def test_cache_sizes_never_read_outside_the_cache_root(tmp_path):
    from pipelines.report_data import _cache_info

    root = tmp_path / "cache"
    (root / "ab12cd34").mkdir(parents=True)
    (root / "ab12cd34" / "manifest.json").write_text('{"num_samples": 3}')
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "manifest.json").write_text('{"num_samples": 9}')
    assert _cache_info(root, "ab12cd34") == {"num_samples": 3}
    assert _cache_info(root, "../outside") is None  # e.g. a hand-edited state.json


def test_report_describes_the_run_as_it_ran(tiny_run):
    """The config table comes from the run's recorded config.json, not the report's config."""
    import json as _json
    from pathlib import Path as _Path

    from pipelines.report_data import _recorded_config
    from pipelines.report_summary import _config_rows

    ran = tiny_run("cache.dtype=fp32", "train.rounds=2")
    _Path(ran.run.dir, "config.json").write_text(_json.dumps(ran.to_dict()))
    asked = tiny_run("cache.dtype=bf16")
    rows = {r[0]: r for r in _config_rows(asked, {"run_config": _recorded_config(asked),
                                                  "blocks": []})}  # fmt: skip
    assert rows["cache"][1] == "run" and "dtype=fp32" in rows["cache"][2]
    assert "rounds=2" in rows["train"][2]
    _Path(ran.run.dir, "config.json").unlink()
    rows = {r[0]: r for r in _config_rows(asked, {"run_config": _recorded_config(asked),
                                                  "blocks": []})}  # fmt: skip
    assert rows["cache"][1] == "config" and "dtype=bf16" in rows["cache"][2]
