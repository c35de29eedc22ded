"""The token store a visit and a checkpoint were trained on: a visit's mid-block state resumed
over a re-tokenized store is refused (naming both stores, losing nothing), and every commit
records its tokens in checkpoint.json, which a later visit on other tokens names in a warning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipelines.train
from core import faults
from core.config import ConfigError
from pipelines.cli import main
from pipelines.tokenize import run_tokenize
from pipelines.train import run_train
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.visit import VisitSpec, state_path
from storage.tokens import TokenStore
from tests.conftest import tiny_model_config
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg

ROOT = Path(__file__).resolve().parents[1]
FAST = ("train.max_steps=1", "train.eval_every=0")


@pytest.fixture(scope="module")
def killed(tiny_base, tmp_path_factory) -> Path:
    """A run whose `preinfer train --block 0` was killed (os._exit) before step 3: its visit
    state (step 2, train.checkpoint_every=2) is on disk, nothing committed."""
    run = tmp_path_factory.mktemp("killed") / "run"
    shutil.copytree(tiny_base, run)
    args = [sys.executable, "-m", "pipelines.cli", "train", "--block", "0",
            "--config", "configs/demo.yaml", "--set", f"run.dir={run}"]  # fmt: skip
    for s in TINY:
        args += ["--set", s]
    env = {**os.environ, faults.KILL_AT: "0:0:3"}  # round 0, block 0, before step 3
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 137, r.stderr[-3000:]
    return run


def _copy(src: Path, tmp_path: Path) -> tuple[Path, object]:
    run = tmp_path / "run"
    shutil.copytree(src, run)
    cfg = tiny_cfg(run)
    return run, cfg


def _files(run: Path) -> dict[str, bytes]:
    """Every file the run holds but its token store and run lock (what a refusal must leave as
    it was)."""
    keep = [p for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"]
    return {str(p.relative_to(run)): p.read_bytes() for p in keep
            if "tokens" not in p.relative_to(run).parts}  # fmt: skip


def test_a_visit_resumed_over_a_retokenized_store_is_refused(killed, tmp_path, capsys, monkeypatch):
    run, cfg = _copy(killed, tmp_path)
    spath = state_path(cfg, VisitSpec(block=0, mode=cfg.train.mode))
    old_fp = TokenStore(cfg.data.out_dir).fingerprint
    saved = torch.load(spath, map_location="cpu", weights_only=True)
    assert saved["step"] == 2 and saved["tokens"]["fingerprint"] == old_fp
    # another corpus between the kill and the rerun: the ids the state trained on changed
    other = tiny_cfg(run, "data.max_documents=6")
    run_tokenize(other, force=True, log=quiet)
    new_fp = TokenStore(cfg.data.out_dir).fingerprint
    assert new_fp != old_fp
    before = _files(run)
    with pytest.raises(ConfigError) as e:
        run_train(other, 0, log=quiet)
    msg = str(e.value)
    assert "token store changed under this visit" in msg and "up to step 2" in msg
    assert old_fp[:12] in msg and new_fp[:12] in msg and "data.max_documents 8 -> 6" in msg
    assert "Re-tokenize back" in msg and f"delete {spath} to start the visit over" in msg
    assert _files(run) == before  # the state, the checkpoint and the metrics as they were

    # data-parallel (Ray Train workers): the same refusal, in the driver before Ray starts
    def no_ray(*_a, **_k):
        raise AssertionError("Ray was started before the refusal")

    monkeypatch.setattr(pipelines.train, "ensure_ray", no_ray)
    with pytest.raises(ConfigError, match="token store changed under this visit"):
        run_train(tiny_cfg(run, "data.max_documents=6", "train.workers=2"), 0, log=quiet)
    assert _files(run) == before
    # the CLI: one line, exit 2, nothing written either
    sets = [a for s in [f"run.dir={run}", *TINY, "data.max_documents=6"] for a in ("--set", s)]
    assert main(["train", "--block", "0", "--config", "configs/demo.yaml", *sets]) == 2
    err = capsys.readouterr().err
    assert "token store changed under this visit" in err and "Traceback" not in err
    assert _files(run) == before

    # way out 1, in a copy: delete the named state, the visit starts over on the new tokens
    fresh = tmp_path / "fresh"
    shutil.copytree(run, fresh)
    Path(str(spath).replace(str(run), str(fresh))).unlink()
    said = []
    res = run_train(tiny_cfg(fresh, "data.max_documents=6"), 0, log=said.append)
    assert res["steps"] == 6 and not [m for m in said if "resumed" in m]
    assert Checkpoint.open(fresh / "checkpoint").trained_tokens["fingerprint"] == new_fp
    # way out 2: re-tokenize back, the visit resumes where it was killed
    run_tokenize(cfg, force=True, log=quiet)
    assert TokenStore(cfg.data.out_dir).fingerprint == old_fp
    said = []
    run_train(cfg, 0, log=said.append)
    assert "  resumed bcd block 0 round 0 at step 2" in said
    assert Checkpoint.open(cfg.run.checkpoint).trained_tokens["fingerprint"] == old_fp
    assert not spath.exists()


def test_a_visit_state_without_a_token_record_starts_the_visit_over(killed, tmp_path):
    """A state from before the record (version 1) cannot tell which tokens it trained on: it
    is stale (said), the visit trains from its start, and the state file is replaced."""
    run, cfg = _copy(killed, tmp_path)
    spath = state_path(cfg, VisitSpec(block=0, mode=cfg.train.mode))
    old = torch.load(spath, map_location="cpu", weights_only=True)
    old = {k: v for k, v in old.items() if k != "tokens"} | {"version": 1}
    torch.save(old, spath)
    said = []
    res = run_train(cfg, 0, log=said.append)
    assert [m for m in said if "older preinfer" in m and str(spath) in m]
    assert not [m for m in said if "resumed" in m] and res["steps"] == 6
    metrics = [json.loads(x) for x in Path(run, "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if r["event"] == "step"][-6:] == [1, 2, 3, 4, 5, 6]


def test_each_commit_records_its_tokens_and_other_tokens_are_named_not_refused(tiny_run):
    cfg = tiny_run(*FAST)
    fp = TokenStore(cfg.data.out_dir).fingerprint
    said = []
    run_train(cfg, 0, log=said.append)  # fresh from init: no record, nothing to warn about
    assert not [m for m in said if "warning" in m]
    index = json.loads(Path(cfg.run.checkpoint, "checkpoint.json").read_text())
    assert index["tokens"]["fingerprint"] == fp and index["tokens"]["blocks"] == [0]
    assert index["tokens"]["data"]["max_documents"] == 8 and "path" not in index["tokens"]
    assert index["blocks"][0]["tokens"] == fp
    assert "tokens" not in index["blocks"][1] and "tokens" not in index["blocks"][2]

    # fine-tuning on another corpus: said in one warning line naming both stores, then trained
    other = tiny_run(*FAST, "data.max_documents=6", "train.mode=bcd-recompute")
    run_tokenize(other, force=True, log=quiet)
    new_fp = TokenStore(cfg.data.out_dir).fingerprint
    weights = Checkpoint.open(cfg.run.checkpoint).block_hash(1)
    said = []
    run_train(other, 1, log=said.append)
    warned = [m for m in said if "warning" in m]
    assert len(warned) == 1, said
    assert fp[:12] in warned[0] and new_fp[:12] in warned[0] and "blocks [0]" in warned[0]
    assert "data.max_documents 8 -> 6" in warned[0]
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert ckpt.block_hash(1) != weights  # trained and committed, not refused
    assert ckpt.trained_tokens["fingerprint"] == new_fp and ckpt.trained_tokens["blocks"] == [1]
    assert ckpt.index["blocks"][0]["tokens"] == fp and ckpt.index["blocks"][1]["tokens"] == new_fp
    said = []
    run_train(other, 2, log=said.append)  # its last commit is on these tokens: no warning
    assert not [m for m in said if "warning" in m]


def test_a_commit_without_a_token_record_drops_the_old_one(tmp_path):
    """Checkpoints from before the record read as ever; a commit that does not say what it
    trained on leaves no record claiming the old tokens for the new weights."""
    ck = init_checkpoint(tiny_model_config("gpt2"), 3, tmp_path / "ck")
    assert ck.trained_tokens is None and "tokens" not in ck.index
    model, ad = ck.load()
    rec = {"fingerprint": "ab" * 32, "vocab_size": 300}
    ck.commit_blocks(
        {b: ck.block_state(model, ad, b) for b in (0, 1)}, tokens={**rec, "path": "/x"}
    )
    again = Checkpoint.open(ck.path)  # same weights, new record: committed all the same
    assert again.trained_tokens == {**rec, "blocks": [0, 1]}  # where the store sat: not kept
    fps = [again.index["blocks"][b].get("tokens") for b in range(3)]
    assert fps == [rec["fingerprint"], rec["fingerprint"], None]
    state = {n: t + 1 for n, t in again.block_state(model, ad, 1).items()}
    again.commit_block(1, state)
    last = Checkpoint.open(ck.path)
    assert last.trained_tokens is None and "tokens" not in last.index["blocks"][1]
    assert last.index["blocks"][0]["tokens"] == rec["fingerprint"]  # block 0's weights: unchanged
