"""What a user gets by default is the measured best (issue #42): a rotation with today's
defaults (the head trained in every visit, each visit rows of its own, an untied head where the
config unties it) ends below the same rotation with the old settings (no head in every visit,
train.cache_visits=1, a tied head), on a tiny LLaMA and a tiny GPT-2, same seeds and steps.
Fails when a default is reverted or stops helping."""

from __future__ import annotations

import pytest

from pipelines.bcd import run_bcd
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.run.config import load_config
from preinfer.train.config import TrainConfig
from tests.pipeline_fixtures import quiet

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
        # issue #41's measured fine-tune levers (docs/economics.md)
        assert c.train.suffix_rank == 16 and c.train.freeze == ["embed"]


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
