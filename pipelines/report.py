"""Stage `preinfer report`: PNG plots and a markdown summary of one run directory.

    <run.dir>/report/
      loss.png            train loss per step (colour = block, shade = round), val loss markers
      val_ppl.png         val perplexity at the end of every block visit, + `preinfer eval` lines
      cache_timeline.png  cache built / refreshed / reused per boundary, and training visits, in time
      throughput.png      trainer tokens/s per step (running mean within each visit)
      summary.md          config, blocks, visits, caches (actions, sizes), timings, final perplexity

Everything comes from what the run wrote: `metrics.jsonl` (step / visit / cache / eval
records), `state.json` (which input each visit read), `checkpoint/checkpoint.json` (partition,
per-block params and hashes) and the cache manifests still on disk (the rotation deletes stale
caches; then only the cache events speak for them). Step records repeated after a resumed visit
are collapsed: the later record of a (mode, round, block, step) wins. Reads only; no Ray, no torch.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from preinfer.config import Config
from preinfer.confload import to_dict
from storage import fs
from storage.atomic import human

FIGSIZE = (6.0, 3.5)
DPI = 100
ACTION_COLOURS = {"built": "tab:red", "refreshed": "tab:orange", "reused": "tab:green"}
PLOTS = ("loss", "val_ppl", "cache_timeline", "throughput")


# ---- reading the run ----


def _ppl(loss) -> float:
    if not isinstance(loss, int | float) or math.isnan(loss):
        return float("nan")
    return math.exp(min(loss, 50.0))


def read_metrics(path: str | Path) -> dict:
    """Parse metrics.jsonl into ordered, de-duplicated records.

    Returns {"steps": {visit_key: [step records by step]}, "visits": {visit_key: visit record},
    "order": [visit_key in first-seen order], "cache": [...], "eval": [...]} where visit_key is
    (mode, round, block). A later step or visit record with the same key replaces an earlier one
    (steps redone after a resume, a visit rerun)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: nothing to report (run `preinfer bcd` or `preinfer train` first)"
        )
    steps: dict[tuple, dict[int, dict]] = {}
    visits: dict[tuple, dict] = {}
    order: list[tuple] = []
    cache, evals = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            # a process killed mid-write leaves at most a torn last line: skip it
            continue
        if not isinstance(rec, dict):
            continue
        ev = rec.get("event")
        if ev in ("step", "visit"):
            key = (rec.get("mode", "bcd"), int(rec.get("round", 0)), int(rec.get("block", 0)))
            if key not in steps:
                steps[key] = {}
                order.append(key)
            if ev == "step":
                steps[key][int(rec["step"])] = {**rec, "_line": n}
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
    from pipelines.cache_cli import FP_RE

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
    m = read_metrics(run / "metrics.jsonl")
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
            "start": None if start is None else start - t0,
            "end": None if end is None else end - t0,
            "first_global_step": gstep,
            "step_records": [
                {"global_step": gstep + i + 1, "step": s["step"], "loss": s.get("loss"),
                 "val_loss": s.get("val_loss"), "tokens_per_s": s.get("tokens_per_s"),
                 "peak_mem_mb": s.get("peak_mem_mb")}
                for i, s in enumerate(ss)
            ],  # fmt: skip
        })  # fmt: skip
        gstep += len(ss)

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
        "model_config": (ckpt or {}).get("model_config"),
        "data_config": (tokens.get("config") or {}).get("data"),
        "num_step_records": sum(len(v["step_records"]) for v in visits),
    }


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


# ---- plots (matplotlib Figure objects: no pyplot, no global backend state) ----


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def _colour(block: int, round_: int, rounds: int):
    """Colour per block (tab10); earlier rounds lighter, the last round full strength."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgb

    base = to_rgb(colormaps["tab10"](block % 10))
    if rounds <= 1:
        return base
    f = 0.55 * (rounds - 1 - round_) / (rounds - 1)  # 0 for the last round
    return tuple(c + (1 - c) * f for c in base)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_loss(data: dict, path: Path) -> None:
    fig, ax = _figure()
    rounds = max((v["round"] for v in data["visits"]), default=0) + 1
    any_val = False
    for v in data["visits"]:
        recs = [s for s in v["step_records"] if isinstance(s["loss"], int | float)]
        if not recs:
            continue
        col = _colour(v["block"], v["round"], rounds)
        ax.plot([s["global_step"] for s in recs], [s["loss"] for s in recs], color=col, lw=1.2,
                label=f"r{v['round']} b{v['block']}")  # fmt: skip
        ax.axvline(v["first_global_step"] + 0.5, color="0.85", lw=0.6, zorder=0)
        vals = [s for s in v["step_records"] if isinstance(s["val_loss"], int | float)]
        if vals:
            any_val = True
            ax.plot([s["global_step"] for s in vals], [s["val_loss"] for s in vals], "x",
                    color=col, ms=5, mew=1.5)  # fmt: skip
    if data["num_step_records"]:
        ax.set_xlabel("optimizer step (all visits in order)")
        ax.set_ylabel("train loss" + ("  (x: val loss)" if any_val else ""))
        ax.legend(fontsize=6, ncol=max(1, min(6, len(data["visits"]) // 4 + 1)), loc="upper right")
    else:
        _empty(ax, "no step records")
    ax.set_title(f"{data['name']}: train loss per step, by block and round", fontsize=9)
    _save(fig, path)


def plot_val_ppl(data: dict, path: Path) -> None:
    fig, ax = _figure()
    done = [v for v in data["visits"] if v["finished"] and not math.isnan(v["val_ppl"])]
    rounds = max((v["round"] for v in data["visits"]), default=0) + 1
    if done:
        xs = list(range(len(done)))
        ax.plot(xs, [v["val_ppl"] for v in done], color="0.6", lw=1, zorder=1)
        for x, v in zip(xs, done, strict=True):
            ax.scatter([x], [v["val_ppl"]], color=[_colour(v["block"], v["round"], rounds)],
                       zorder=2, s=30)  # fmt: skip
        ax.set_xticks(xs, [v["key"].replace("-", "\n") for v in done], fontsize=7)
        ax.set_xlabel("block visit")
    vals = [e for e in data["evals"] if e["split"] == "val" and isinstance(e["ppl"], int | float)]
    for i, e in enumerate(vals):
        first, last = i == 0 and len(vals) > 1, i == len(vals) - 1
        ax.axhline(e["ppl"], ls="--", lw=0.9, color="k" if last else "0.5",
                   label=f"eval {'final' if last else 'initial' if first else i}: {e['ppl']:.2f}")  # fmt: skip
    if done or vals:
        ax.set_ylabel("val perplexity")
        if max([v["val_ppl"] for v in done] + [e["ppl"] for e in vals]) > 20 * min(
            [v["val_ppl"] for v in done] + [e["ppl"] for e in vals]
        ):
            ax.set_yscale("log")
        if vals:
            ax.legend(fontsize=7)
    else:
        _empty(ax, "no finished visits or evals")
    ax.set_title("val perplexity after each block visit", fontsize=9)
    _save(fig, path)


def plot_cache_timeline(data: dict, path: Path) -> None:
    from matplotlib.patches import Patch

    fig, ax = _figure()
    caches, visits = data["caches"], [v for v in data["visits"] if v["start"] is not None]
    boundaries = sorted({c["boundary"] for c in caches if c["boundary"] is not None})
    blocks = sorted({v["block"] for v in visits})
    rows = [f"cache {b}" for b in boundaries] + [f"train {b}" for b in blocks]
    rows += ["eval"] if data["evals"] else []
    y = {r: i for i, r in enumerate(rows)}
    span = data["timings"]["wall_seconds"] or 1.0
    for c in caches:
        if c["boundary"] is None:
            continue
        yy, col = y[f"cache {c['boundary']}"], ACTION_COLOURS.get(c["action"], "tab:gray")
        w = max(c["end"] - c["start"], 0.0)
        if w < span * 0.004:  # too short for a bar (a reuse): a marker
            ax.plot([c["end"]], [yy], "D", color=col, ms=6)
        else:
            ax.barh(yy, w, left=c["start"], height=0.6, color=col, edgecolor="k", lw=0.4)
    for v in visits:
        # a visit far shorter than the run still shows (min width: 0.6% of the span)
        ax.barh(y[f"train {v['block']}"], max(v["end"] - v["start"], span * 0.006), left=v["start"],
                height=0.6, color=_colour(v["block"], 0, 1), alpha=0.6, edgecolor="k", lw=0.4)  # fmt: skip
    for e in data["evals"]:
        secs = e["seconds"] if isinstance(e["seconds"], int | float) else 0.0
        ax.barh(y["eval"], max(secs, span * 0.006), left=e["time"] - secs, height=0.6,
                color="0.6", edgecolor="k", lw=0.4)  # fmt: skip
    if rows:
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_xlim(left=0)
        ax.set_xlabel("seconds since the run's first record")
        handles = [Patch(color=ACTION_COLOURS[a], label=a) for a in ACTION_COLOURS
                   if any(c["action"] == a for c in caches)]  # fmt: skip
        handles += [Patch(color="0.6", label="eval")] if data["evals"] else []
        if handles:
            ax.legend(handles=handles, fontsize=7, loc="lower right")
    else:
        _empty(ax, "no cache events or visits")
    ax.set_title("cache build / refresh / reuse and training, over time", fontsize=9)
    _save(fig, path)


def plot_throughput(data: dict, path: Path) -> None:
    fig, ax = _figure()
    rounds = max((v["round"] for v in data["visits"]), default=0) + 1
    drawn = False
    for v in data["visits"]:
        recs = [s for s in v["step_records"] if isinstance(s["tokens_per_s"], int | float)]
        if not recs:
            continue
        drawn = True
        ax.plot([s["global_step"] for s in recs], [s["tokens_per_s"] for s in recs], lw=1.2,
                color=_colour(v["block"], v["round"], rounds), label=f"r{v['round']} b{v['block']}")  # fmt: skip
    if drawn:
        ax.set_xlabel("optimizer step (all visits in order)")
        ax.set_ylabel("tokens/s (running mean in visit)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6, ncol=max(1, min(6, len(data["visits"]) // 4 + 1)), loc="lower right")
    else:
        _empty(ax, "no step records")
    ax.set_title("trainer throughput", fontsize=9)
    _save(fig, path)


# ---- the markdown summary ----


def _f(x, fmt: str = ".4f") -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return "–"
    return format(x, fmt)


def _human(n) -> str:
    return human(n) if isinstance(n, int | float) else "–"


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _config_rows(cfg: Config, data: dict) -> list[list]:
    """Model and data as the run made them (checkpoint index, token store manifest) when those
    exist; the rest as given to the report (the run does not record its train/cache settings)."""
    c = cfg
    mc = data.get("model_config") or {}
    dc = data.get("data_config") or {}
    model_src = "checkpoint" if mc else "config"
    mc = mc or to_dict(c.model)
    data_src = "token store" if dc else "config"
    dc = dc or to_dict(c.data)
    nb = len(data["blocks"]) or c.partition.num_blocks
    rows = [
        ["model", model_src, f"{mc.get('arch')}, H={mc.get('hidden_size')}, "
                             f"L={mc.get('num_layers')}, heads={mc.get('num_heads')}, "
                             f"vocab={mc.get('vocab_size')}"
                             + (f", from {mc['checkpoint']}" if mc.get("checkpoint") else "")],
        ["data", data_src, f"{dc.get('source')}, seq_len={dc.get('seq_len')}, "
                           f"tokenizer={dc.get('tokenizer')}, vocab={dc.get('vocab_size')}, "
                           f"val_fraction={dc.get('val_fraction')}"],
        ["partition", "checkpoint" if data["blocks"] else "config", f"num_blocks={nb}"],
        ["train", "config", f"mode={c.train.mode}, rounds={c.train.rounds}, "
                            f"max_steps={c.train.max_steps}, batch_size={c.train.batch_size}, "
                            f"optimizer={c.train.optimizer}, lr={c.train.lr}, "
                            f"eval_every={c.train.eval_every}, workers={c.train.workers}"],
        ["cache", "config", f"dtype={c.cache.dtype}, codec={c.cache.codec}, "
                            f"shuffle={c.cache.shuffle}, keep={c.cache.keep}, root={c.cache.root}"],
        ["run", "config", f"dir={c.run.dir}, device={c.run.device}, precision={c.run.precision}"],
    ]  # fmt: skip
    return rows


def write_summary(cfg: Config, data: dict, plots: dict[str, Path], path: Path) -> None:
    fin = data["final"]
    L = [f"# preinfer report: {data['name']}", ""]
    L.append(f"Run directory `{data['run_dir']}`, mode `{data['mode']}`; generated "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}.")  # fmt: skip
    L.append("")
    L.append(f"**Final val perplexity: {_f(fin['ppl'], '.2f')}** (val loss {_f(fin['loss'])}; "
             f"from {'the last `preinfer eval`' if fin['source'] == 'eval' else fin['source']})")  # fmt: skip
    L.append("")
    L += ["## Plots", ""]
    L += [f"![{k}]({p.name})" for k, p in plots.items()]
    L += ["", "## Config", ""]
    L += _table(["section", "from", "settings"], _config_rows(cfg, data))
    L += ["", "<details><summary>resolved config (JSON)</summary>", "", "```json",
          cfg.to_json(), "```", "", "</details>"]  # fmt: skip

    L += ["", "## Blocks", ""]
    if data["blocks"]:
        rows = [[b["block"], f"[{b['layers'][0]}, {b['layers'][1]})", f"{b['params']:,}"
                 if isinstance(b["params"], int) else "–", f"`{(b['hash'] or '')[:12]}`",
                 ", ".join(b["trains"]) or "–"] for b in data["blocks"]]  # fmt: skip
        L += _table(["block", "layers", "params", "hash (now)", "trained in"], rows)
    else:
        L.append(f"No checkpoint index at `{cfg.run.checkpoint}`.")

    L += ["", "## Visits", ""]
    if data["visits"]:
        rows = [[v["key"], v["input"], v["steps"], v["stopped"], _f(v["loss"]), _f(v["val_loss"]),
                 _f(v["val_ppl"], ".2f"), _f(v["seconds"], ".2f"), _f(v["tokens_per_s"], ".0f"),
                 _f(v["peak_mem_mb"], ".1f"),
                 f"{v['trainable_params']:,}" if isinstance(v["trainable_params"], int) else "–"]
                for v in data["visits"]]  # fmt: skip
        L += _table(["visit", "input", "steps", "stopped", "train loss", "val loss", "val ppl",
                     "seconds", "tokens/s", "peak MB", "trainable"], rows)  # fmt: skip
        L.append("")
        L.append(f"{data['num_step_records']} step records (a step redone after a resume counts "
                 "once: its later record wins). Val loss of a visit is measured on its own input "
                 "(cache or tokens) over `train.eval_batches` batches.")  # fmt: skip
    else:
        L.append("No visits recorded.")

    L += ["", "## Caches", ""]
    if data["caches"]:
        rows = []
        for c in data["caches"]:
            sizes = []
            for split, fp in sorted(c["fingerprints"].items()):
                info = c["sizes"].get(split)
                if info is None:
                    recorded = (c.get("bytes") or {}).get(split)
                    sizes.append(
                        f"{split} `{fp[:12]}`: gone"
                        + (f" (was {_human(recorded)})" if recorded else "")
                    )
                else:
                    ratio = info.get("ratio_vs_bf16")
                    sizes.append(f"{split} `{fp[:12]}`: {info.get('num_samples', '?')} samples, "
                                 f"{_human(info.get('total_bytes'))}, "
                                 f"{_f(info.get('bytes_per_value'), '.3f')} B/value, "
                                 f"{_f(info.get('compression_ratio'), '.2f')}x compressed, "
                                 f"{_f(ratio, '.2f')}x vs bf16")  # fmt: skip
            rows.append([c["round"], c["boundary"], c["action"], _f(c["seconds"], ".2f"),
                         _f(c["start"], ".1f"), "<br>".join(sizes) or "–"])  # fmt: skip
        L += _table(["round", "boundary", "action", "seconds", "at (s)", "caches"], rows)
        L.append("")
        L.append("Sizes come from the cache manifests still on disk; `gone` = removed since "
                 "(cache.keep=false drops caches the rotation no longer needs).")  # fmt: skip
    else:
        L.append("No cache events (block 0 and non-bcd modes read tokens).")

    L += ["", "## Evaluations", ""]
    if data["evals"]:
        rows = [[i, e["split"], _f(e["loss"]), _f(e["ppl"], ".2f"),
                 f"{e['tokens']:,}" if isinstance(e["tokens"], int) else "–",
                 _f(e["seconds"], ".2f"), f"`{(e['checkpoint'] or '')[:12]}`",
                 _f(e["time"], ".1f")] for i, e in enumerate(data["evals"])]  # fmt: skip
        L += _table(["#", "split", "loss", "ppl", "tokens", "seconds", "checkpoint", "at (s)"],
                    rows)  # fmt: skip
    else:
        L.append("No `preinfer eval` records; the final perplexity above is the last visit's.")

    t = data["timings"]
    L += ["", "## Timings", ""]
    rows = [["wall (first record to last)", _f(t["wall_seconds"], ".1f")],
            ["training (sum of visits)", _f(t["train_seconds"], ".1f")],
            ["evaluation", _f(t["eval_seconds"], ".1f")]]  # fmt: skip
    for a, s in t["cache_seconds"].items():
        rows.append([f"cache {a} (x{t['cache_counts'][a]})", _f(s, ".1f")])
    L += _table(["what", "seconds"], rows)
    L.append("")
    path.write_text("\n".join(L) + "\n")


def run_report(cfg: Config, out_dir: str | Path | None = None, log=print) -> dict:
    """Write `<run.dir>/report/` (or out_dir): the four PNGs and summary.md.

    Returns {"dir", "files": {name: path}, "final_ppl", "final_val_loss", "visits", "caches",
    "evals", "timings", ...} (the numbers the summary shows)."""
    data = collect(cfg)
    out = Path(out_dir) if out_dir is not None else Path(cfg.run.dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = {name: out / f"{name}.png" for name in PLOTS}
    plot_loss(data, plots["loss"])
    plot_val_ppl(data, plots["val_ppl"])
    plot_cache_timeline(data, plots["cache_timeline"])
    plot_throughput(data, plots["throughput"])
    summary = out / "summary.md"
    write_summary(cfg, data, plots, summary)
    files = {**{k: str(p) for k, p in plots.items()}, "summary": str(summary)}
    log(f"report: {len(data['visits'])} visits, {len(data['caches'])} cache events, final val "
        f"perplexity {_f(data['final']['ppl'], '.2f')} -> {out}")  # fmt: skip
    return {
        "dir": str(out),
        "files": files,
        "final_ppl": data["final"]["ppl"],
        "final_val_loss": data["final"]["loss"],
        "final_source": data["final"]["source"],
        "visits": [{k: v for k, v in vis.items() if k != "step_records"} for vis in data["visits"]],
        "caches": data["caches"],
        "evals": data["evals"],
        "timings": data["timings"],
        "num_step_records": data["num_step_records"],
    }
