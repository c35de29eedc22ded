"""Yesterday's cache still works: a tiny run written by the code at 0495351 (before the
layering and the compute-dtype changes; tests/data/cache_0495351, made_by.json records how)
verifies, and the current code plans the same fingerprints for it, so a build reuses it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipelines.cache_build import build_cache, plan_block
from preinfer.run.config import load_config
from storage.reader import open_cache
from tests.pipeline_fixtures import quiet

DATA = Path(__file__).resolve().parent / "data" / "cache_0495351"


def _cfg(run: Path, *extra: str):
    made = json.loads((DATA / "made_by.json").read_text())
    over = [o for o in made["overrides"] if not o.startswith("run.dir=")]
    # the old code's rule: every sampled row, all of val (train.epochs=null, eval_batches=0);
    # it computed bf16 caches in bf16 (what compute_dtype=bf16 does on any machine)
    return made, load_config(None, [*over, f"run.dir={run}", "train.epochs=null", *extra])


def test_a_cache_written_before_this_round_verifies_and_is_reused(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(DATA, run)
    made, cfg = _cfg(run, "preinfer.compute_dtype=bf16")
    for fp in made["fingerprints"].values():
        assert open_cache(cfg.cache.root, fp, expected_fingerprint=fp).verify() == []
    plans = plan_block(cfg, 1).caches
    assert {p.split: p.fingerprint for p in plans} == made["fingerprints"]
    assert all(p.complete for p in plans)
    res = build_cache(cfg, 1, log=quiet)
    assert res["action"] == "reused" and res["fingerprints"] == made["fingerprints"]
    # computed another way (fp32, rounded at block boundaries) it is another cache, never a
    # stale read of this one
    _, fp32 = _cfg(run, "preinfer.compute_dtype=fp32")
    other = plan_block(fp32, 1).fingerprints
    assert not set(other.values()) & set(made["fingerprints"].values())
