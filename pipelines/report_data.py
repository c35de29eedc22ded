"""What `preinfer report` reads from a run, gathered as plain data (pipelines/report.py).

`group_metrics` groups metrics.jsonl by visit (the later record of a step or visit wins);
`collect` joins it with state.json, the checkpoint index, the token store manifest and the cache
manifests still on disk into the one dict the plots (pipelines/report_plots.py) and the summary
(pipelines/report_summary.py) draw from. Reads only; no Ray, no torch, no matplotlib.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

from preinfer.run.config import Config
from preinfer.runtime.metrics import METRICS, read_metrics
from storage import fs
from storage.layout import FP_RE

# ---- reading the run ----


def _ppl(loss) -> float:
    if not isinstance(loss, int | float) or math.isnan(loss):
        return float("nan")
    return math.exp(min(loss, 50.0))


def group_metrics(run_dir: str | Path) -> dict:
    """The run's metrics.jsonl records (runtime.metrics.read_metrics), grouped and de-duplicated.

    Returns {"steps": {visit_key: [step records by step]}, "visits": {visit_key: visit record},
    "order": [visit_key in first-seen order], "cache": [...], "eval": [...]} where visit_key is
    (mode, round, block). A later step or visit record with the same key replaces an earlier one
    (steps redone after a resume, a visit rerun)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: nothing to report (run `preinfer bcd` or `preinfer train` first)"
        )
    steps: dict[tuple, dict[int, dict]] = {}
    visits: dict[tuple, dict] = {}
    order: list[tuple] = []
    cache, evals = [], []
    for rec in read_metrics(run_dir):
        ev = rec.get("event")
        if ev in ("step", "visit"):
            key = (rec.get("mode", "bcd"), int(rec.get("round", 0)), int(rec.get("block", 0)))
            if key not in steps:
                steps[key] = {}
                order.append(key)
            if ev == "step":
                steps[key][int(rec["step"])] = rec
            else:
                visits[key] = rec
        elif ev == "cache":
            cache.append(rec)
        elif ev == "eval":
            evals.append(rec)
    return {
        "steps": {k: [v[s] for s in sorted(v)] for k, v in steps.items()},
        "visits": visits,
        "order": order,
        "cache": cache,
        "eval": evals,
    }


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _cache_info(root: Path, fp: str | None) -> dict | None:
    """Sizes from a cache manifest still on disk, or None (deleted, unfinished, unreadable)."""

    if not fp or not FP_RE.fullmatch(str(fp)):  # a hand-edited state.json never leaves the root
        return None
    m = _read_json(root / fp / "manifest.json")
    if not isinstance(m, dict):
        return None
    keys = ("num_samples", "seq_len", "hidden_size", "dtype", "total_bytes", "value_bytes",
            "bytes_per_value", "compression_ratio", "ratio_vs_bf16")  # fmt: skip
    info = {k: m[k] for k in keys if k in m}
    if isinstance(m.get("codec"), dict):
        info["codec"] = "/".join(str(v) for v in m["codec"].values() if v is not None)
    return info


def _visit_key_str(key: tuple) -> str:
    mode, r, b = key
    return f"r{r}-b{b}" + ("" if mode == "bcd" else f" ({mode})")


def collect(cfg: Config) -> dict:
    """Everything the plots and the summary need, as plain data (also returned by run_report)."""
    run = Path(cfg.run.dir)
    m = group_metrics(run)
    state = _read_json(run / "state.json") or {}
    ckpt = _read_json(fs.path(cfg.run.checkpoint) / "checkpoint.json")
    tokens = _read_json(fs.path(cfg.data.out_dir) / "manifest.json") or {}
    cache_root = fs.path(cfg.cache.root)  # local or object storage

    # the time origin: the earliest timestamp the run wrote
    spans = {k: _visit_span(m["steps"][k], m["visits"].get(k, {})) for k in m["order"]}
    stamps = [a for a, _ in spans.values() if a is not None]
    stamps += [c["time"] - c.get("seconds", 0.0) for c in m["cache"] if "time" in c]
    stamps += [e["time"] - e.get("seconds", 0.0) for e in m["eval"] if "time" in e]
    t0 = min(stamps) if stamps else 0.0

    visits, gstep = [], 0
    for key in m["order"]:
        mode, r, b = key
        ss = m["steps"][key]
        v = m["visits"].get(key, {})
        input_ = None
        if state.get("mode", mode) == mode:  # state.json keys visits by round and block only
            input_ = (state.get("visits", {}).get(f"r{r}-b{b}") or {}).get("cache")
        if input_ is None:
            input_ = _infer_input(m["cache"], mode, r, b)
        start, end = spans[key]
        tokens_per_step = _tokens_per_step(ss, v)
        visits.append({
            "key": _visit_key_str(key),
            "mode": mode,
            "round": r,
            "block": b,
            "input": input_,
            "finished": bool(v),
            "steps": v.get("steps", ss[-1]["step"] if ss else 0),
            "stopped": v.get("stopped", "unfinished"),
            "loss": v.get("loss", ss[-1]["loss"] if ss else float("nan")),
            "val_loss": v.get("val_loss"),
            "val_ppl": _ppl(v.get("val_loss")),
            "seconds": v.get("seconds"),
            "tokens_per_s": v.get("tokens_per_s", ss[-1].get("tokens_per_s") if ss else None),
            "peak_mem_mb": v.get("peak_mem_mb"),
            "peak_mem_growth_mb": v.get("peak_mem_growth_mb"),
            "trainable_params": v.get("trainable_params"),
            "tokens_per_step": tokens_per_step,
            "start": None if start is None else start - t0,
            "end": None if end is None else end - t0,
            "first_global_step": gstep,
            "step_records": [
                {"global_step": gstep + i + 1, "step": s["step"], "loss": s.get("loss"),
                 "val_loss": s.get("val_loss"), "tokens_per_s": s.get("tokens_per_s"),
                 "peak_mem_mb": s.get("peak_mem_mb"),
                 "time": s["time"] - t0 if isinstance(s.get("time"), int | float) else None}
                for i, s in enumerate(ss)
            ],  # fmt: skip
        })  # fmt: skip
        gstep += len(ss)
    progress = _progress(visits)

    caches = []
    for c in m["cache"]:
        fps = c.get("fingerprints") or {}
        sizes = {split: _cache_info(cache_root, fp) for split, fp in sorted(fps.items())}
        end = c.get("time", t0) - t0
        caches.append({
            "round": c.get("round"),
            "boundary": c.get("boundary"),
            "action": c.get("action"),
            "seconds": c.get("seconds", 0.0),
            "fixed_s": c.get("fixed_s"),  # plan + start-up + finalize (None: reused, or older)
            "rows": c.get("rows"),
            "start": end - c.get("seconds", 0.0),
            "end": end,
            "fingerprints": fps,
            "bytes": c.get("bytes") or {},
            "sizes": sizes,
        })  # fmt: skip

    evals = [
        {"split": e.get("split", "val"), "loss": e.get("loss"), "ppl": e.get("ppl"),
         "tokens": e.get("tokens"), "seconds": e.get("seconds"),
         "checkpoint": e.get("checkpoint"), "time": e.get("time", t0) - t0}
        for e in m["eval"]
    ]  # fmt: skip
    val_evals = [e for e in evals if e["split"] == "val"]
    final_eval = val_evals[-1] if val_evals else None
    done = [v for v in visits if v["finished"]]
    if final_eval is not None:
        final = {"ppl": final_eval["ppl"], "loss": final_eval["loss"], "source": "eval"}
    elif done:
        last = done[-1]
        final = {"ppl": last["val_ppl"], "loss": last["val_loss"], "source": f"visit {last['key']}"}
    else:
        final = {"ppl": float("nan"), "loss": float("nan"), "source": "none"}

    blocks = []
    if ckpt:
        part = ckpt.get("partition", {})
        ranges = part.get("blocks", [])
        for b, info in enumerate(ckpt.get("blocks", [])):
            first, stop = ranges[b] if b < len(ranges) else (None, None)
            blocks.append({
                "block": b,
                "layers": (first, stop),
                "params": info.get("num_params"),
                "hash": info.get("hash"),
                "trains": [v["key"] for v in done if v["block"] == b or v["mode"] == "full"],
            })  # fmt: skip

    def total(xs):
        return sum(x for x in xs if isinstance(x, int | float))

    all_times = [v["end"] for v in visits if v["end"] is not None]
    all_times += [c["end"] for c in caches] + [e["time"] for e in evals]
    timings = {
        "wall_seconds": max(all_times) if all_times else 0.0,
        "train_seconds": total(v["seconds"] for v in visits),
        "eval_seconds": total(e["seconds"] for e in evals),
        "cache_seconds": {
            a: total(c["seconds"] for c in caches if c["action"] == a)
            for a in sorted({c["action"] for c in caches})
        },
        "cache_counts": {
            a: sum(1 for c in caches if c["action"] == a)
            for a in sorted({c["action"] for c in caches})
        },
    }
    return {
        "run_dir": str(run),
        "name": cfg.run.name,
        "mode": state.get("mode") or (visits[0]["mode"] if visits else cfg.train.mode),
        "visits": visits,
        "caches": caches,
        "evals": evals,
        "final": final,
        "blocks": blocks,
        "timings": timings,
        "caches_in_use": state.get("caches_in_use", []),
        "run_config": _recorded_config(cfg),
        "model_config": (ckpt or {}).get("model_config"),
        "data_config": (tokens.get("config") or {}).get("data"),
        # what the token store and the checkpoint record (the report refuses other settings)
        "recorded": {"tokens": tokens or None, "checkpoint": ckpt},
        "num_step_records": sum(len(v["step_records"]) for v in visits),
        "progress": progress,
    }


def _tokens_per_step(steps: list[dict], visit: dict) -> float | None:
    """Tokens one optimizer step trained: the usual gap between consecutive step records'
    running `tokens` (a resumed visit restarts that count), else the visit's mean."""
    gaps = sorted(
        b["tokens"] - a["tokens"]
        for a, b in zip(steps, steps[1:], strict=False)
        if b["step"] == a["step"] + 1
        and isinstance(a.get("tokens"), int | float)
        and isinstance(b.get("tokens"), int | float)
        and b["tokens"] > a["tokens"]
    )
    if gaps:
        return gaps[len(gaps) // 2]
    if steps and steps[0]["step"] == 1 and isinstance(steps[0].get("tokens"), int | float):
        return steps[0]["tokens"]
    tps, sec, n = visit.get("tokens_per_s"), visit.get("seconds"), visit.get("steps")
    if all(isinstance(x, int | float) for x in (tps, sec, n)) and n:
        return tps * sec / n  # older runs: no `tokens` in the records
    return None


def _progress(visits: list[dict]) -> list[dict]:
    """Val perplexity against tokens trained and wall-clock, one point per in-visit evaluation
    and per finished visit, in run order. tokens: cumulative over every visit before it (the
    optimizer's tokens: what the arms of a BCD vs full comparison are charged for)."""
    points, done = [], 0.0
    for v in visits:
        tps = v.get("tokens_per_step")
        for s in v["step_records"]:
            if isinstance(s["val_loss"], int | float):
                points.append({"key": v["key"], "round": v["round"], "block": v["block"],
                               "step": s["step"], "ppl": _ppl(s["val_loss"]),
                               "tokens": None if tps is None else done + tps * s["step"],
                               "time": s["time"]})  # fmt: skip
        if tps is not None:
            done += tps * (v["steps"] or 0)
        if v["finished"] and not (points and points[-1]["key"] == v["key"]
                                  and points[-1]["step"] == v["steps"]):  # fmt: skip
            points.append({"key": v["key"], "round": v["round"], "block": v["block"],
                           "step": v["steps"], "ppl": v["val_ppl"],
                           "tokens": None if tps is None else done, "time": v["end"]})  # fmt: skip
    return points


def _recorded_config(cfg: Config) -> SimpleNamespace | None:
    """The train, cache and run settings the run recorded (`bcd` writes <run.dir>/config.json,
    credentials masked) as attributes; None when there is none or it does not read. Not loaded
    as a Config: that would configure object storage with the masked credentials."""
    p = Path(cfg.run.dir) / "config.json"
    try:
        d = json.loads(p.read_text()) if p.is_file() else None
        if not isinstance(d, dict):
            return None
        return SimpleNamespace(**{k: SimpleNamespace(**d[k]) for k in ("train", "cache", "run")})
    except (ValueError, TypeError, OSError, KeyError):
        return None


def _visit_span(steps: list[dict], visit: dict) -> tuple[float | None, float | None]:
    """(start, end) wall time of a visit from its step records: end = the last step; start =
    end - the visit's own seconds when it finished, else the first step less one step's time."""
    times = sorted(s["time"] for s in steps if isinstance(s.get("time"), int | float))
    if not times:
        return None, None
    secs = visit.get("seconds")
    if isinstance(secs, int | float) and secs >= times[-1] - times[0]:
        return times[-1] - secs, times[-1]
    dt = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return times[0] - dt, times[-1]


def _infer_input(cache_events: list[dict], mode: str, r: int, b: int) -> str:
    if mode != "bcd" or b == 0:
        return "tokens"
    acts = [c.get("action") for c in cache_events if c.get("round") == r and c.get("boundary") == b]
    return acts[-1] if acts else "?"
