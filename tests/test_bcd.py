"""The BCD rotation: cache decisions per block, bounded disk, resume after a kill."""

import json
import os
import subprocess
import sys
from pathlib import Path

from pipelines.bcd import run_bcd
from preinfer.checkpoint.store import Checkpoint
from tests.pipeline_fixtures import TINY, assert_same_weights, quiet


def hashes(cfg):
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    return [ckpt.block_hash(b) for b in range(ckpt.num_blocks)]


def test_rotation_builds_then_refreshes_then_reuses(tiny_run):
    cfg = tiny_run("train.rounds=2", "train.max_steps=3", "train.eval_every=0")
    start = hashes(cfg)
    res = run_bcd(cfg, log=quiet)
    actions = [v["cache"] for v in res["visits"]]
    # round 0: block 0 from tokens, boundary 1 built, boundary 2 refreshed from 1; round 1 the same
    # (block 0 changed, so every boundary is stale again)
    assert actions == ["tokens", "built", "refreshed"] * 2
    end = hashes(cfg)
    assert all(a != b for a, b in zip(start, end, strict=True))
    # bounded disk: only the caches still in use remain
    state = json.loads(Path(cfg.run.dir, "state.json").read_text())
    left = sorted(p.name for p in Path(cfg.cache.root).iterdir() if p.is_dir())
    assert left == sorted(state["caches_in_use"]) and len(left) == 2
    # a rerun of a finished rotation does nothing
    again = run_bcd(cfg, log=quiet)
    assert hashes(cfg) == end and len(again["visits"]) == 6


def test_keep_caches_and_reuse(tiny_run):
    cfg = tiny_run("train.max_steps=2", "train.eval_every=0", "cache.keep=true")
    run_bcd(cfg, log=quiet)
    assert len([p for p in Path(cfg.cache.root).iterdir() if p.is_dir()]) == 4
    # block 2 retrains from the same boundary: its cache is reused
    state = Path(cfg.run.dir, "state.json")
    s = json.loads(state.read_text())
    del s["visits"]["r0-b2"]
    state.write_text(json.dumps(s))
    res = run_bcd(cfg, log=quiet)
    assert res["visits"][2]["cache"] == "reused"


def _cli(run_dir, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    args = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "bcd",
        "--config",
        "configs/demo.yaml",
        "--set",
        f"run.dir={run_dir}",
    ]
    for s in TINY + ["train.max_steps=6", "train.checkpoint_every=2", "train.eval_every=3"]:
        args += ["--set", s]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


def test_killed_rotation_resumes_to_identical_weights(tiny_base, tmp_path):
    import shutil

    clean, killed = tmp_path / "clean", tmp_path / "killed"
    shutil.copytree(tiny_base, clean)
    shutil.copytree(tiny_base, killed)
    r = _cli(clean)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli(killed, {"PREINFER_TEST_KILL_AT": "0:1:3"})  # round 0, block 1, step 3
    assert r.returncode == 137, r.stderr[-3000:]
    state = json.loads((killed / "state.json").read_text())
    assert list(state["visits"]) == ["r0-b0"] and state["pending"]["key"] == "r0-b1"
    r = _cli(killed)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed bcd block 1 round 0 at step 2" in r.stdout
    assert_same_weights(clean / "checkpoint", killed / "checkpoint")
    a = Checkpoint.open(clean / "checkpoint")
    assert a.block_hash(1) != Checkpoint.open(tiny_base / "checkpoint").block_hash(1)
