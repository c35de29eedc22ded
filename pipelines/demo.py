"""`make demo`: tokenize -> init -> eval -> bcd (rounds x blocks) -> eval -> report -> export,
printing each step.

A killed demo resumes: `<run.dir>/demo.json` records the settings it runs with and the val
perplexity before training, and the rotation underneath resumes from state.json, so a rerun
with the same settings finds its own partly trained checkpoint and goes on. A demo.json of other
settings, or a trained checkpoint no demo recorded, is refused before any work, with what
differs. The demo holds the run.dir's lock throughout (preinfer/run/lock.py), and ends by
exporting the model as a transformers directory, `<run.dir>/export`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from core.config import ConfigError
from pipelines.bcd import run_bcd
from pipelines.eval import run_eval
from pipelines.export import run_export
from pipelines.init import run_init
from pipelines.report import run_report
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.format import CheckpointExists
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.config import Config
from preinfer.run.lock import run_lock
from preinfer.run.state import load_run_state
from storage import fs
from storage.atomic import write_json

RECORD = "demo.json"
EXPORT = "export"

# settings of how fast (where, with how many workers), not what, the demo computes: a resume
# may change them
_FREE = ("run.verbose", "run.tensorboard", "storage.", "preinfer.actors", "preinfer.cpus_per_",
         "preinfer.gpus_per_", "preinfer.executor", "preinfer.malloc_", "preinfer.shards_per_",
         "preinfer.max_", "preinfer.write_queue", "cache.codec_threads", "cache.keep",
         "train.cpus_per_worker")  # fmt: skip


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(recorded: dict, cfg: Config) -> list[str]:
    """'key: value there, value now' for each setting a resume may not change."""
    old = _flat(recorded)
    now = _flat(json.loads(json.dumps(fs.redact(cfg.to_dict()))))  # as demo.json holds it
    return [f"{k}: {old.get(k)!r} there, {now.get(k)!r} now" for k in sorted(old.keys() | now)
            if not k.startswith(_FREE) and old.get(k) != now.get(k)]  # fmt: skip


def _checkpoint_diff(cfg: Config) -> list[str]:
    """How the checkpoint at run.checkpoint differs from what this config would init."""
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    diff = config_diff({"model": ckpt.index["model_config"]}, cfg)
    diff = [d for d in diff if d.startswith("model.")]
    if ckpt.num_blocks != cfg.partition.num_blocks:
        diff.append(
            f"partition.num_blocks: {ckpt.num_blocks} there, {cfg.partition.num_blocks} now"
        )
    return diff


def run_demo(cfg: Config, log=print) -> dict:
    with run_lock(cfg.run.dir, "demo", log=log):
        return _demo(cfg, log)


def _demo(cfg: Config, log) -> dict:
    t0 = time.perf_counter()
    run_dir = Path(cfg.run.dir)
    log(f"== preinfer demo: run dir {run_dir}")
    rec_path = run_dir / RECORD
    rec = json.loads(rec_path.read_text()) if rec_path.is_file() else None
    if rec is not None and (diff := config_diff(rec["config"], cfg)):
        raise ConfigError(
            f"{run_dir} holds a demo made with other settings ({'; '.join(diff)}): resuming it "
            f"with these would mix two runs. Rerun with the settings it was made with (all in "
            f"{rec_path}) to resume it, or run elsewhere: make demo SET=run.dir=runs/demo2 "
            "(`make clean` deletes runs/)"
        )
    store = run_tokenize(cfg, log=log)
    try:
        ckpt = run_init(cfg, log=log)
    except CheckpointExists as e:
        if rec is None:  # trained, but by no demo: not ours to resume
            other = _checkpoint_diff(cfg)
            what = f"made by another config ({'; '.join(other)})" if other else "trained"
            raise CheckpointExists(
                f"{run_dir} already holds a run whose checkpoint was {what}, and no {RECORD} "
                f"of a demo this could resume (its report, if any, is in {run_dir}/report). To "
                f"run the demo again from scratch, delete that directory (`make clean` deletes "
                f"runs/), or run it elsewhere: make demo SET=run.dir=runs/demo2. ({e})"
            ) from None
        ckpt = Checkpoint.open(cfg.run.checkpoint)  # the one this demo trained so far
        done = len(load_run_state(cfg.run.dir)["visits"])
        log(
            f"== resuming the interrupted demo in {run_dir}: {done} of "
            f"{cfg.train.rounds * ckpt.num_blocks} block visits done (state.json)"
        )
    for b, info in enumerate(ckpt.block_summaries()):
        log(f"  block {b}: {info}")
    if rec is not None and rec.get("before"):
        before = rec["before"]  # the untrained checkpoint's, measured by the first run
        whole = "of_rows" in before and before["rows"] == before["of_rows"]
        how = "the whole val split" if whole else "its first val rows: not comparable"
        log(f"  val perplexity before training: {before['ppl']:.1f} (as the first run measured, "
            f"{how})")  # fmt: skip
    else:
        before = run_eval(cfg, log=log)  # the whole val split: seconds
        write_json(rec_path, {"config": fs.redact(cfg.to_dict()), "before": before})
    log(
        f"== BCD: {cfg.train.rounds} round(s) x {ckpt.num_blocks} blocks, "
        f"{cfg.train.max_steps} steps per block, mode {cfg.train.mode}"
    )
    bcd = run_bcd(cfg, log=log)
    after = run_eval(cfg, log=log)
    log(
        f"== val perplexity {before['ppl']:.1f} -> {after['ppl']:.1f} on the whole val split "
        f"({after['of_rows']:,} rows; {store.num_samples('train')} train samples; "
        f"{time.perf_counter() - t0:.0f}s in all)"
    )
    report = run_report(cfg, log=log)
    # the demo's own export (replaced on a rerun): where it is and how to load it
    exp = run_export(cfg, str(run_dir / EXPORT), force=True, log=lambda _: None)
    out, auto = exp["out"], exp["auto_class"]
    log(
        f"== exported the trained model ({exp['model_class']}, {exp['num_params']:,} params) "
        f"and its tokenizer to {out}; load it with\n"
        f"     from transformers import {auto}, AutoTokenizer\n"
        f"     model = {auto}.from_pretrained({out!r})\n"
        f"     tokenizer = AutoTokenizer.from_pretrained({out!r})"
    )
    return {"before": before, "after": after, "bcd": bcd, "report": report, "export": exp}
