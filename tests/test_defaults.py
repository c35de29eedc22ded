"""What a user gets by default is the measured best (issue #42): a rotation with today's
defaults (the head trained in every visit, each visit rows of its own, an untied head where the
config unties it) ends below the same rotation with the old settings (no head in every visit,
train.cache_visits=1, a tied head), on a tiny LLaMA and a tiny GPT-2, same seeds and steps.
Fails when a default is reverted or stops helping.

And the defaults by case (issue #54 lever 1): a run initialised from a pretrained model
(model.checkpoint set: a fine-tune or a chat fine-tune) gets the fine-tune levers
(train.suffix_rank 16, train.freeze [embed]) unless its config sets them; pretraining keeps the dataclass defaults. Each case fails when its lever is reverted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipelines.bcd import run_bcd
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.config import FINETUNE_DEFAULTS, load_config
from preinfer.train.config import TrainConfig
from tests.pipeline_fixtures import quiet
from tests.test_finetune import _save_hf_model

SHAPE = {
    "llama": ["model.arch=llama", "model.num_heads=4", "model.num_kv_heads=2",
              "model.intermediate_size=128"],
    "gpt2": ["model.arch=gpt2", "model.num_heads=4"],
}  # fmt: skip
COMMON = [
    "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=6",
    "model.max_positions=64", "data.max_documents=120", "data.vocab_size=512", "data.seq_len=64",
    "data.val_fraction=0.1", "partition.num_blocks=3", "cache.dtype=fp32", "train.workers=0",
    "train.batch_size=8", "train.max_steps=24", "train.rounds=2", "train.lr=0.003",
    "train.warmup_steps=4", "train.eval_every=0", "train.eval_batches=4",
    "train.checkpoint_every=0", "run.precision=fp32", "run.tensorboard=false",
    "preinfer.executor=local",
]  # fmt: skip
OLD = ["train.always_train=[]", "train.cache_visits=1", "model.tie_embeddings=true"]
MARGIN = 0.02  # val loss (nats) the defaults must win by


def test_the_dataclass_defaults_are_the_recipe():
    tc = TrainConfig()
    assert tc.always_train == ["head"] and tc.schedule == "run" and tc.cache_visits is None
    cfg = load_config("configs/demo.yaml")
    assert cfg.train.cache_visits == cfg.partition.num_blocks  # null -> M
    assert cfg.model.tie_embeddings is False
    for name in ("finetune", "chat"):
        c = load_config(f"configs/{name}.yaml")
        # the user's layout is kept (an untied export would change their model)
        assert c.model.tie_embeddings is True and c.train.always_train == ["head"]
        assert c.train.cache_visits == c.partition.num_blocks


# ---- defaults by case (issue #54 lever 1)

# issue #41's measured fine-tune levers (docs/log/2026-12-03.md): literal here, so a lever dropped
# from FINETUNE_DEFAULTS (or its value changed) fails every fine-tune case below
LEVERS = {"train.suffix_rank": 16, "train.freeze": ["embed"]}


def _levers(cfg) -> dict:
    return {"train.suffix_rank": cfg.train.suffix_rank, "train.freeze": cfg.train.freeze}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A user's model directory: a tiny GPT-2 and its tokenizer, written by save_pretrained."""
    out = tmp_path_factory.mktemp("user") / "my-gpt2"
    _save_hf_model(out, "gpt2")
    return out


def test_pretraining_case_keeps_its_own_defaults():
    cfg = load_config("configs/demo.yaml")
    assert _levers(cfg) == {"train.suffix_rank": 0, "train.freeze": []}
    assert cfg.from_case == {}
    # the pretraining recipe (issue #42), not the fine-tune levers
    assert cfg.train.always_train == ["head"] and cfg.train.schedule == "run"
    assert cfg.model.tie_embeddings is False


def test_finetune_case_gets_the_levers(hf_model):
    assert FINETUNE_DEFAULTS == LEVERS
    cfg = load_config("configs/demo.yaml", [f"model.checkpoint={hf_model}"])
    assert _levers(cfg) == LEVERS and cfg.from_case == LEVERS
    # configs/finetune.yaml no longer writes them: they come from the case
    cfg = load_config("configs/finetune.yaml", [f"model.checkpoint={hf_model}"])
    assert _levers(cfg) == LEVERS and cfg.from_case == LEVERS


def test_chat_case_gets_the_levers(hf_model):
    cfg = load_config("configs/chat.yaml")  # chat + a checkpoint
    assert _levers(cfg) == LEVERS and cfg.from_case == LEVERS
    # chat or prompt_response data on a random init (no checkpoint) is pretraining: nothing frozen
    for fmt in ("chat", "prompt_response"):
        cfg = load_config("configs/demo.yaml", [f"data.format={fmt}", f"data.tokenizer={hf_model}"])
        assert _levers(cfg) == {"train.suffix_rank": 0, "train.freeze": []}, fmt
        assert cfg.from_case == {}, fmt


def test_a_set_value_is_never_replaced(hf_model, tmp_path):
    over = [f"model.checkpoint={hf_model}"]
    cfg = load_config("configs/demo.yaml", [*over, "train.suffix_rank=0", "train.freeze=[]"])
    assert _levers(cfg) == {"train.suffix_rank": 0, "train.freeze": []} and cfg.from_case == {}
    own = tmp_path / "own.yaml"  # set in the user's own YAML: kept; the other one filled in
    own.write_text(f"model:\n  checkpoint: {hf_model}\ntrain:\n  suffix_rank: 4\n")
    cfg = load_config(own)
    assert cfg.train.suffix_rank == 4 and cfg.train.freeze == ["embed"]
    assert cfg.from_case == {"train.freeze": ["embed"]}


def test_preinfer_config_shows_the_resolved_levers_and_their_case(hf_model):
    p = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "config", "-c", "configs/demo.yaml",
         "--set", f"model.checkpoint={hf_model}", "--set", "train.freeze=[]"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    train = json.loads(p.stdout)["train"]
    assert train["suffix_rank"] == 16 and train["freeze"] == []
    assert "fine-tune defaults" in p.stderr and "train.suffix_rank=16" in p.stderr
    assert "train.freeze" not in p.stderr  # set by the user: not the case's


@pytest.mark.slow
@pytest.mark.functional
def test_a_finetune_run_trains_with_the_levers_and_records_them(hf_model, tmp_path):
    """demo.yaml + the user's checkpoint, no lever set: the run's config.json holds them, the
    visits train suffix adapters and the embedding stays as the user's model has it."""
    cfg = load_config("configs/demo.yaml", [
        f"run.dir={tmp_path / 'run'}", f"model.checkpoint={hf_model}", f"data.tokenizer={hf_model}",
        "data.max_documents=8", "data.seq_len=16", "data.val_fraction=0.25",
        "cache.dtype=fp32", "preinfer.micro_batch=32", "preinfer.executor=local",
        "train.batch_size=8", "train.max_steps=2", "train.warmup_steps=1", "train.eval_every=0",
        "train.eval_batches=1", "train.workers=0", "train.lr=0.003", "train.epochs=null",
        "run.precision=fp32", "run.tensorboard=false",
    ])  # fmt: skip
    run_tokenize(cfg, log=quiet)
    ckpt = run_init(cfg, log=quiet)
    embed = ckpt.load([0])[0].transformer.wte.weight.detach().clone()
    res = run_bcd(cfg, log=quiet)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert recorded["suffix_rank"] == 16 and recorded["freeze"] == ["embed"]
    assert res["visits"][0]["suffix_params"] > 0  # block 0's visit adapts blocks 1..M-1
    after = Checkpoint.open(cfg.run.checkpoint).load([0])[0].transformer.wte.weight
    assert torch.equal(after, embed)


@pytest.mark.slow
@pytest.mark.functional
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_defaults_beat_the_old_settings(tmp_path, arch):
    losses = {}
    for name, extra in (("defaults", ["model.tie_embeddings=false"]), ("old", OLD)):
        cfg = load_config("configs/demo.yaml", [f"run.dir={tmp_path / name}",
                                                f"data.out_dir={tmp_path / 'tokens'}",
                                                *COMMON, *SHAPE[arch], *extra])  # fmt: skip
        run_tokenize(cfg, log=quiet)
        run_init(cfg, log=quiet)
        run_bcd(cfg, log=quiet)
        losses[name] = run_eval(cfg, log=quiet)["loss"]  # the whole val split
    assert losses["defaults"] < losses["old"] - MARGIN, losses
