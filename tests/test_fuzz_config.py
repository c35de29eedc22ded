"""Property tests: any config / override / CLI argument ends in a result or a clear error.

Never a traceback from deep inside a library, never a write outside the run directory.
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.config import ConfigError, apply_override
from pipelines.cli import main
from preinfer.run.config import config_from_dict, load_config

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
    # the config is refused, naming a bad key: not some later failure (no token store yet, ...)
    bad = [o.split("=", 1)[0] for o in over]
    assert any(k in err for k in bad), (bad, err)
    assert err.count("\n") == 1  # one line
    assert list(run_dir.iterdir()) == []


@pytest.mark.parametrize(
    "text, names_file, says",
    [
        ("run: [1, 2", True, "is not valid YAML"),
        ("- a\n- b", True, "must hold a mapping of sections, got list"),
        ("train: 3", False, "train: expected a mapping of keys, got 3"),
        ("model:\n  arch: rnn", False, "model.arch: 'rnn' is not allowed; choose one of 'gpt2'"),
        ("\x00\x01", True, "is not valid YAML: unacceptable character"),
        ("run:\n  dir: ''", False, "run.dir must not be empty"),
    ],
)
def test_yaml_files(tmp_path, text, names_file, says):
    """A bad config file is one ConfigError that says what is wrong: the file when the file
    itself does not read as a mapping of sections, else the key and what it allows."""
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert says in msg
    assert (f"config file {p}" in msg) == names_file
    assert "Traceback" not in msg and len(msg) < 2000
