"""Stage `preinfer report`: PNG plots and a markdown summary of one run directory.

    <run.dir>/report/
      progress.png        val perplexity against tokens trained and wall-clock, by block and round
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

Gathering the data: pipelines/report_data.py; the plots: pipelines/report_plots.py; the markdown
summary: pipelines/report_summary.py; `run_report` below drives them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pipelines.report_data import collect
from pipelines.report_plots import (
    plot_cache_timeline,
    plot_loss,
    plot_progress,
    plot_throughput,
    plot_val_ppl,
)
from pipelines.report_summary import _f, write_summary
from preinfer.run.config import Config
from preinfer.run.provenance import check_settings
from preinfer.run.state import check_run

PLOTS = ("progress", "loss", "val_ppl", "cache_timeline", "throughput")


def run_report(cfg: Config, out_dir: str | Path | None = None, log=print) -> dict:
    """Write `<run.dir>/report/` (or out_dir): the PNGs and summary.md.

    Returns {"dir", "files": {name: path}, "final_ppl", "final_val_loss", "visits", "caches",
    "evals", "timings", ...} (the numbers the summary shows)."""
    data = collect(cfg)
    rec = {k: v if isinstance(v, dict) else None for k, v in data["recorded"].items()}
    check_settings(cfg, "report", tokens=rec["tokens"], checkpoint=rec["checkpoint"])
    if rec["checkpoint"] is not None:  # the visits it reports are in the checkpoint it names
        ckpt = SimpleNamespace(index=rec["checkpoint"], path=cfg.run.checkpoint)  # reads only
        check_run(cfg.run.dir, ckpt, "report")
    out = Path(out_dir) if out_dir is not None else Path(cfg.run.dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = {name: out / f"{name}.png" for name in PLOTS}
    plot_progress(data, plots["progress"])
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
        "progress": data["progress"],
    }
