"""The `preinfer` command line: bad input -> one clear line and exit 2, nothing half written."""

import json
from pathlib import Path

import pytest

from pipelines.cli import main
from tests.pipeline_fixtures import TINY


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def sets(run_dir, *extra):
    args = []
    for s in [*TINY, f"run.dir={run_dir}", *extra]:
        args += ["--set", s]
    return args


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["tokenize", "--set", "train.nope=1"], "unknown key(s) nope"),
        (["tokenize", "--set", "train.lr"], "must look like section.key=value"),
        (["tokenize", "--set", "cache.dtype=f8"], "choose one of"),
        (["tokenize", "--config", "configs/missing.yaml"], "does not exist"),
        (["tokenize", "--set", "data.source=/no/such/corpus"], "does not exist"),
        (["tokenize", "--set", "data.seq_len=100000"], "larger than model.max_positions"),
        (["tokenize", "--set", "model.vocab_size=300"], "raise model.vocab_size"),
        (["init", "--set", "partition.num_blocks=99"], "num_blocks"),
        (["init", "--set", "partition.num_blocks=0"], "partition.num_blocks must be >= 1"),
        (["eval"], "preinfer tokenize"),
        (["train", "--block", "0"], "preinfer tokenize"),  # the first stage missing
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(capsys, tmp_path, argv, needle):
    argv = [*argv[:1], "--config", "configs/demo.yaml", "--set", f"run.dir={tmp_path}", *argv[1:]]
    if "configs/missing.yaml" in argv:
        argv = [a for a in argv if a != "configs/demo.yaml"]
        argv.remove("--config")
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert needle in err and "Traceback" not in err
    assert not list(tmp_path.glob("tokens*")) and not list(tmp_path.glob("checkpoint*"))


def test_config_prints_resolved_paths(capsys, tmp_path):
    code, out, _ = run(capsys, "config", "--config", "configs/demo.yaml", *sets(tmp_path))
    cfg = json.loads(out)
    assert code == 0 and cfg["run"]["checkpoint"] == str(tmp_path / "checkpoint")


def test_cache_tools_verify_repair_and_gc(capsys, tiny_run):
    cfg = tiny_run()
    args = ["--config", "configs/demo.yaml", *sets(cfg.run.dir)]
    code, out, _ = run(capsys, "cache", "build", "--block", "1", *args)
    assert code == 0
    fps = json.loads(out.strip().splitlines()[-1])["fingerprints"]
    code, out, _ = run(capsys, "cache", "ls", *args)
    assert code == 0 and fps["train"][:12] in out and fps["val"][:12] in out
    code, out, _ = run(capsys, "cache", "inspect", fps["train"], *args)
    assert code == 0 and json.loads(out)
    # flip one byte in one shard of the train cache
    shard = sorted(p for p in Path(cfg.cache.root, fps["train"], "hidden.zarr").rglob("c/*/0/0"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, _ = run(capsys, "cache", "verify", fps["train"], *args)
    assert code == 1 and "shard 1" in out and "--verify" in out
    code, out, _ = run(capsys, "cache", "build", "--block", "1", "--verify", *args)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["shards"] == 1
    code, out, _ = run(capsys, "cache", "verify", fps["train"], *args)
    assert code == 0 and "ok" in out
    # gc: nothing refers to these caches (no state.json), so both go; dry run first
    code, out, _ = run(capsys, "cache", "gc", "--dry-run", *args)
    assert code == 0 and out.count("would remove") == 2
    assert Path(cfg.cache.root, fps["train"]).is_dir()
    state = Path(cfg.run.dir, "state.json")
    state.write_text(json.dumps({"caches_in_use": [fps["train"]]}))
    code, out, _ = run(capsys, "cache", "gc", *args)
    assert code == 0 and Path(cfg.cache.root, fps["train"]).is_dir()
    assert not Path(cfg.cache.root, fps["val"]).exists()


@pytest.mark.parametrize("fp", ["../../etc", "/abs/path", "ABCDEF12", "a" * 65, "x"])
def test_cache_names_cannot_escape_the_root(capsys, tmp_path, fp):
    for cmd in ("inspect", "verify"):
        code, _, err = run(
            capsys,
            "cache",
            cmd,
            fp,
            "--config",
            "configs/demo.yaml",
            "--set",
            f"run.dir={tmp_path}",
        )
        assert code == 2 and "not a cache fingerprint" in err


def test_demo_rerun_over_a_trained_run_says_what_to_do(tiny_run, capsys):
    """A second `make demo` finds the checkpoint its first run trained: it stops before any
    work with a message naming the run dir and how to start over, and changes nothing."""
    from preinfer.checkpoint.store import Checkpoint

    cfg = tiny_run()
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    state = ckpt.load([0])
    tensors = ckpt.block_state(*state, 0)
    ckpt.commit_block(0, {k: v + 1 for k, v in tensors.items()})  # as a trained block 0
    before = sorted(p.name for p in Path(cfg.run.checkpoint).iterdir())
    code, out, err = run(capsys, "demo", "--config", "configs/demo.yaml", *sets(cfg.run.dir))
    assert code != 0
    msg = out + err
    assert "already holds a run whose checkpoint was trained" in msg and "make clean" in msg
    assert str(cfg.run.dir) in msg
    assert sorted(p.name for p in Path(cfg.run.checkpoint).iterdir()) == before
