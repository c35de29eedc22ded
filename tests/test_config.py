import dataclasses
import os
from pathlib import Path

import pytest

from core.config import ConfigError, field_docs
from preinfer.run.config import Config, load_config

CONFIGS = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))


def test_there_are_configs():
    names = {p.stem for p in CONFIGS}
    assert {"demo", "gpt2-small", "llama-small", "minilm"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_yaml_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.data.out_dir and cfg.run.checkpoint and cfg.cache.root


def test_every_field_has_a_doc():
    from preinfer.run import config as root

    for sect in dataclasses.fields(Config):
        cls = root.Config.__dataclass_fields__[sect.name].default_factory
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{sect.name}: fields without a one-line doc: {missing}"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.nope=1", "unknown key(s) nope"),
        ("nope.lr=1", "unknown key(s) nope"),
        ("train.lr=abc", "train.lr"),
        ("cache.dtype=f32", "choose one of 'fp32'"),
        ("partition.num_blocks=0", "partition.num_blocks must be >= 1"),
        ("train.max_steps=1.5", "train.max_steps: expected an integer"),
        ("data.seq_len=100000", "larger than model.max_positions"),
        ("trainlr=1", "key must be section.key"),
        ("train=1", "key must be section.key"),
        ("train.lr", "must look like section.key=value"),
        ("cache.shuffle=bit", None),  # allowed with the default blosc-zstd codec
        ("cache.codec=zstd", "needs cache.codec='blosc-zstd'"),
    ],
)
def test_bad_overrides_are_named(override, needle):
    if needle is None:
        load_config("configs/demo.yaml", [override])
        return
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo.yaml", [override])
    assert needle in str(e.value)


def test_override_types_and_resolved_paths():
    cfg = load_config(
        "configs/demo.yaml", ["train.lr=0.5", "run.dir=/x/y", "train.betas=[0.8,0.9]"]
    )
    assert cfg.train.lr == 0.5 and cfg.train.betas == [0.8, 0.9]
    assert cfg.data.out_dir == "/x/y/tokens" and cfg.cache.root == "/x/y/cache"
    rel = load_config("configs/demo.yaml", ["run.dir=runs/rel"])
    assert rel.run.checkpoint == os.path.abspath("runs/rel/checkpoint")
    again = load_config(None, [f"{k}={v}" for k, v in []])
    assert again.partition.num_blocks == 3


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)
    bad.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train: expected a mapping"):
        load_config(bad)


def test_codec_threads_come_from_the_config():
    from storage import shard_codec

    load_config(None, ["cache.codec_threads=1"])
    assert shard_codec.CODEC_THREADS == 1 and shard_codec._thread_pool() is None
    load_config(None, ["cache.codec_threads=3"])
    assert shard_codec.CODEC_THREADS == 3
    load_config(None)
    assert shard_codec.CODEC_THREADS == shard_codec.DEFAULT_CODEC_THREADS
    with pytest.raises(ConfigError, match="codec_threads"):
        load_config(None, ["cache.codec_threads=0"])


def test_a_float_with_an_exponent_and_no_dot_is_a_number(tmp_path):
    """YAML 1.1 reads 1e-4 and 3e-05 (what Python's :g writes) as strings; a float field takes
    them as numbers, in a file and in an override, and still refuses words."""
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 1e-4\n")
    assert load_config(p).train.lr == 1e-4
    assert load_config(p, ["train.lr=3e-05"]).train.lr == 3e-05
    assert load_config(p, ["train.lr=2E+1"]).train.lr == 20.0
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(p, ["train.lr=fast"])
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(p, ["train.lr=1e"])
