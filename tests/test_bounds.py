"""Sizes refused before they are allocated (#53): data.vocab_size and model.vocab_size past
MAX_VOCAB, a BPE the trainer could not reserve, and a model `preinfer init` could not hold in
memory; each one line, exit 2. The CLI cases run in a process of their own under an address
space limit, so the code before the checks fails there (an abort or an allocation error)
instead of taking the machine's memory."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError
from preinfer.data import tokenization
from preinfer.model.modeling import MAX_VOCAB, ModelConfig
from preinfer.plan.guards import check_init_memory
from preinfer.run.config import load_config
from tests.pipeline_fixtures import TINY

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 16 << 30  # the CLI processes' address space (torch's import takes a few GiB of it)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.cli", *args, "--config", "configs/demo.yaml"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited)  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "want"),
    [
        ("data.vocab_size=1000000000", "data.vocab_size must be <= 1,048,576"),
        ("model.vocab_size=300000000", "model.vocab_size must be <= 1,048,576"),
    ],
)
def test_a_vocabulary_past_the_bound_is_refused_by_the_config(tmp_path, setting, want):
    with pytest.raises(ConfigError, match=want):
        load_config("configs/demo.yaml", [f"run.dir={tmp_path}", setting])
    ok = setting.split("=")[0] + f"={MAX_VOCAB}"
    load_config("configs/demo.yaml", [f"run.dir={tmp_path}", ok])  # the bound itself is taken


def test_a_bpe_the_trainer_cannot_reserve_is_refused_before_training(monkeypatch):
    monkeypatch.setattr(tokenization.hostmem, "available", lambda: 50 << 20)  # 50 MiB left
    texts = iter(["some text to learn merges from"] * 10)
    with pytest.raises(ConfigError, match=r"reserves about 0\.1 GiB .* only 0\.0 GiB"):
        tokenization.train_bpe(texts, MAX_VOCAB)
    assert next(texts)  # refused before it read a text
    assert tokenization.train_bpe(["some text to learn merges from"] * 10, 300)  # 21 KB: fits


def test_init_memory_check_counts_the_fp32_model_and_its_largest_tensor():
    cfg = ModelConfig(arch="gpt2", vocab_size=1000, hidden_size=64, num_layers=2, num_heads=2)
    est = check_init_memory(cfg, available_bytes=1 << 40)
    assert est["need"] == 4 * (est["params"] + 1000 * 64)  # the embedding is the largest
    with pytest.raises(ConfigError, match=r"needs about .* GiB to initialise .* available"):
        check_init_memory(cfg, available_bytes=est["need"] - 1)
    # a model of 2e11 parameters is estimated from its shapes, never allocated
    big = ModelConfig(arch="gpt2", vocab_size=MAX_VOCAB, hidden_size=16384, num_layers=64,
                      num_heads=128)  # fmt: skip
    with pytest.raises(ConfigError, match=r"223,360,352,256 parameters .* 896\.1 GiB"):
        check_init_memory(big, available_bytes=512 << 30)


def test_the_cli_refuses_each_size_in_one_line(tmp_path):
    run = [a for s in [*TINY, f"run.dir={tmp_path / 'run'}"] for a in ("--set", s)]
    for cmd, setting, want in [
        # was: SIGABRT (exit 134) and a 56-line Rust backtrace from the BPE trainer
        ("tokenize", "data.vocab_size=1000000000", "data.vocab_size must be <="),
        # was: a traceback (a 38 GB allocation)
        ("init", "model.vocab_size=300000000", "model.vocab_size must be <="),
        # within the bounds but 2e11 parameters: the planner's estimate against the memory
        ("init", "model.hidden_size=16384", "GiB to initialise (fp32), but only"),
    ]:
        extra = ["--set", "model.num_layers=64", "--set", "model.num_heads=128"]
        r = _cli(cmd, *run, "--set", setting, *(extra if "hidden" in setting else []))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (cmd, setting, r.returncode, r.stderr[-2000:])
        assert lines[0].startswith(f"preinfer {cmd}: error: ") and want in lines[0], lines
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert not (tmp_path / "run" / "tokens").exists()
