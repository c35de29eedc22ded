"""Property tests: any config / override / CLI argument ends in a result or a clear error.

Never a traceback from deep inside a library, never a write outside the run directory.
"""

import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.config import ConfigError, apply_override
from pipelines.cli import main
from preinfer.config import config_from_dict, load_config

SECTIONS = ["run", "model", "data", "partition", "cache", "preinfer", "train"]
KEYS = [
    "dir",
    "arch",
    "vocab_size",
    "seq_len",
    "num_blocks",
    "dtype",
    "codec",
    "shuffle",
    "level",
    "actors",
    "sample_fraction",
    "lr",
    "optimizer",
    "max_steps",
    "betas",
    "mode",
    "checkpoint",
    "source",
    "nope",
    "",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
)
values = st.one_of(scalars, st.dictionaries(st.sampled_from(KEYS), scalars, max_size=3))


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(SECTIONS + ["bogus"]),
        st.one_of(values, st.dictionaries(st.sampled_from(KEYS), values, max_size=4)),
        max_size=4,
    )
)
def test_config_dicts_load_or_raise_config_error(data):
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        assert str(e) and len(str(e)) < 2000
        return
    # whatever loads has resolved, absolute local paths
    assert os.path.isabs(cfg.run.dir) or "://" in cfg.run.dir


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_override_strings(spec):
    data = {}
    try:
        apply_override(data, spec)
        load_config(None, [spec])
    except ConfigError as e:
        assert str(e)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cmd=st.sampled_from(["tokenize", "init", "eval", "train", "config"]),
    over=st.lists(
        st.sampled_from(
            [
                "partition.num_blocks=0",
                "partition.num_blocks=-3",
                "data.seq_len=1",
                "data.seq_len=x",
                "cache.level=99",
                "train.batch_size=0",
                "train.lr=-1",
                "model.hidden_size=7",
                "data.val_fraction=1.5",
                "run.device=tpu",
                "train.betas=[2,3]",
                "preinfer.sample_fraction=0",
                "model.num_kv_heads=3",
                "data.max_documents=1",
                "train.workers=-1",
                "cache.shard_mb=0",
            ]
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_cli_bad_values_exit_2_and_write_nothing(tmp_path_factory, capsys, cmd, over):
    run_dir = tmp_path_factory.mktemp("fuzz")
    argv = [cmd, "--config", "configs/demo.yaml", "--set", f"run.dir={run_dir}"]
    if cmd == "train":
        argv += ["--block", "0"]
    for o in over:
        argv += ["--set", o]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error:" in err and "Traceback" not in err
    assert list(run_dir.iterdir()) == []


@pytest.mark.parametrize(
    "text",
    ["run: [1, 2", "- a\n- b", "train: 3", "model:\n  arch: rnn", "\x00\x01", "run:\n  dir: ''"],
)
def test_yaml_files(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError):
        load_config(p)
    assert yaml  # the YAML module stays the only parser of config files
