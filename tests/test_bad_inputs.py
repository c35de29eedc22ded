"""Bad inputs a new user gives (issue #26), each refused in one clear line (exit 2 from the CLI)
with nothing written or left behind, or counted where it is skipped: settings other than the
token store's or the checkpoint's, unusable rows, `--set` values YAML reads as null, empty
files, invalid UTF-8, pairs all too long, export paths and file modes, concurrent tokenizes."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import preinfer.checkpoint.export
from core.config import ConfigError, to_dict
from pipelines.bcd import run_bcd
from pipelines.cache_build import build_cache, refresh_cache
from pipelines.cli import main
from pipelines.eval import run_eval
from pipelines.export import run_export
from pipelines.report import run_report
from pipelines.tokenize import run_tokenize
from preinfer.data.corpus import CorpusError
from preinfer.run.config import load_config
from preinfer.run.provenance import data_changes
from storage.tokens import TokenStore, TokenStoreWriter
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg

FAST = ("train.max_steps=1", "train.eval_every=0", "train.mode=bcd-recompute")
PAIRS = ("data.format=prompt_response", "data.max_documents=1000", "data.seq_len=32")


def cli(capsys, cmd: list[str], run_dir, *extra) -> tuple[int, str]:
    """`preinfer CMD` on configs/demo.yaml + the tiny settings: (exit code, stderr)."""
    args = [*cmd, "--config", "configs/demo.yaml"]
    for s in [*TINY, f"run.dir={run_dir}", *extra]:
        args += ["--set", s]
    code = main(args)
    return code, capsys.readouterr().err


def files(root: Path) -> dict[str, bytes]:
    """Every file under root but a run lock (what a refusal must leave as it was)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}  # fmt: skip


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair(i: int) -> dict:
    return {"prompt": f"What is {i} plus {i % 7}?", "response": f"It is {i + i % 7}."}


# --------------------------------------------------------------- 1: settings between stages


def test_a_changed_data_source_is_refused_by_every_stage_that_reads_the_store(
    tiny_run, tmp_path, capsys
):
    cfg = tiny_run(*FAST)
    run_bcd(cfg, log=quiet)  # tokenize -> init -> bcd on builtin
    run = Path(cfg.run.dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("another corpus entirely " * 40)
    other = tiny_run(*FAST, f"data.source={corpus}")
    before = files(run)
    stages = {
        "bcd": lambda: run_bcd(other, log=quiet),
        "cache build": lambda: build_cache(other, 1, log=quiet),
        "cache refresh": lambda: refresh_cache(other, 2, log=quiet),
        "eval": lambda: run_eval(other, log=quiet),
        "report": lambda: run_report(other, log=quiet),
        "export": lambda: run_export(other, str(tmp_path / "hf"), log=quiet),
    }
    for stage, call in stages.items():
        with pytest.raises(ConfigError) as e:
            call()
        msg = str(e.value)
        assert f"data.source 'builtin' -> '{corpus}'" in msg, (stage, msg)
        assert f"`preinfer {stage}` would read the store as it is" in msg
        assert "preinfer tokenize --force" in msg and "Set them back" in msg
    for cmd in (["bcd"], ["train", "--block", "0"]):
        code, err = cli(capsys, cmd, run, *FAST, f"data.source={corpus}")
        assert code == 2 and "data.source 'builtin' -> " in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    # nothing written: config.json still records what ran, and so do state.json and the
    # checkpoint; no export directory
    assert files(run) == before and not (tmp_path / "hf").exists()
    assert json.loads((run / "config.json").read_text())["data"]["source"] == "builtin"
    # the fix the message names: remake the store (the rotation then refuses the run's old
    # tokens, as before), or set it back
    run_eval(tiny_run(*FAST), max_batches=1, log=quiet)


@pytest.mark.parametrize(
    "setting, want",
    [("model.hidden_size=64", "model.hidden_size 32 -> 64"),
     ("partition.num_blocks=2", "partition.num_blocks 3 -> 2")],
)  # fmt: skip
def test_a_changed_model_setting_is_refused(tiny_run, tmp_path, capsys, setting, want):
    cfg = tiny_run(*FAST, setting)
    before = files(Path(cfg.run.dir))
    for call in (lambda: run_bcd(cfg, log=quiet), lambda: run_eval(cfg, log=quiet),
                 lambda: build_cache(cfg, 1, log=quiet),
                 lambda: run_export(cfg, str(tmp_path / "hf"), log=quiet)):  # fmt: skip
        with pytest.raises(ConfigError, match="was made with other model settings") as e:
            call()
        assert want in str(e.value) and "preinfer init --force" in str(e.value)
    code, err = cli(capsys, ["train", "--block", "0"], cfg.run.dir, *FAST, setting)
    assert code == 2 and want in err
    assert files(Path(cfg.run.dir)) == before and not Path(cfg.run.dir, "config.json").exists()


def test_settings_that_change_nothing_computed_pass_and_paths_compare_absolute(
    tiny_run, tmp_path, monkeypatch
):
    # where a store is sharded, the bad-row rule, settings of another format or objective,
    # and the compute-location knobs: exempt
    cfg = tiny_run("data.shard_rows=7", "data.on_bad_rows=skip", "data.prompt_field=q",
                   "data.mask_seed=3", "preinfer.actors=1", "train.workers=0")  # fmt: skip
    assert run_eval(cfg, max_batches=1, log=quiet)["tokens"] > 0
    # a store made from `corpus` in this directory is the config's <abs>/corpus/
    asked = tiny_cfg(tmp_path / "r", f"data.source={tmp_path / 'corpus'}/")
    monkeypatch.chdir(tmp_path)
    manifest = {"config": {"data": {**to_dict(asked.data), "source": "corpus"}}}
    assert data_changes(asked, manifest) == []
    manifest["config"]["data"]["source"] = "elsewhere"
    assert data_changes(asked, manifest) == [f"data.source 'elsewhere' -> '{tmp_path}/corpus/'"]


# --------------------------------------------------------------- 2: rows never lost silently


def test_pairs_without_a_response_over_1pct_are_refused_with_count_and_lines(tmp_path, capsys):
    rows = [pair(i) if i % 2 == 0 else {"prompt": f"Q{i}", "answer": f"A{i}"} for i in range(30)]
    src = write_jsonl(tmp_path / "half.jsonl", rows)
    code, err = cli(capsys, ["tokenize"], tmp_path / "run", f"data.source={src}", *PAIRS)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "15 of 30 rows (50.0%, more than 1%) are unusable (15 with 'response' missing" in err
    assert "half.jsonl line 2, half.jsonl line 4, half.jsonl line 6" in err
    assert "data.on_bad_rows=skip" in err and not (tmp_path / "run").exists()
    # skip: tokenized without them, and counted in the log and the manifest
    said = []
    cfg = tiny_cfg(tmp_path / "run", f"data.source={src}", *PAIRS, "data.on_bad_rows=skip")
    store = run_tokenize(cfg, log=said.append)
    assert store.manifest["rows"]["bad"] == {"'response' missing": 15}
    assert store.manifest["rows"]["read"] == 30 and store.manifest["documents"]["train"] + \
        store.manifest["documents"]["val"] == 15  # fmt: skip
    assert [m for m in said if "skipped 15 of 30 rows as unusable" in m]


def test_null_empty_and_non_string_responses_follow_one_rule(tmp_path):
    bad = [{"prompt": "p1", "response": ""}, {"prompt": "p2", "response": None},
           {"prompt": "p3", "response": 7}, {"prompt": 8, "response": "r4"}]  # fmt: skip
    # 4 bad rows in 404 (1.0%): at the limit, skipped and counted
    src = write_jsonl(tmp_path / "few.jsonl", [pair(i) for i in range(400)] + bad)
    said = []
    store = run_tokenize(tiny_cfg(tmp_path / "a", f"data.source={src}", *PAIRS), log=said.append)
    assert store.manifest["rows"]["bad"] == {"'response' empty": 1, "'response' null": 1,
                                              "'response' not a string": 1,
                                              "'prompt' not a string": 1}  # fmt: skip
    assert store.manifest["rows"]["bad_examples"] == [
        f"few.jsonl line {n}" for n in (401, 402, 403)
    ]
    assert sum(store.manifest["documents"].values()) == 400  # the empty one is not trained on
    assert [m for m in said if "skipped 4 of 404 rows as unusable" in m]
    # the same 4 in 104 rows: refused
    src = write_jsonl(tmp_path / "many.jsonl", [pair(i) for i in range(100)] + bad)
    with pytest.raises(CorpusError, match=r"4 of 104 rows \(3.8%, more than 1%\)"):
        run_tokenize(tiny_cfg(tmp_path / "b", f"data.source={src}", *PAIRS), log=quiet)
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------- 3: --set values read as null


def test_a_set_value_yaml_reads_as_null_or_cut_by_a_comment_is_refused(tmp_path, capsys):
    code, err = cli(capsys, ["config"], tmp_path, r"data.prompt_template=### Instruction:\n{x}")
    assert code == 2 and "reads as data.prompt_template=null" in err and "quote the value" in err
    assert "prompt_field" not in err
    code, err = cli(capsys, ["config"], tmp_path, "data.source=my corpus #2")
    assert code == 2 and "reads as data.source='my corpus'" in err
    # quoted, or null on purpose: as written
    cfg = load_config(None, ['data.prompt_template="### Instruction:\\n{x}\\n"',
                             "data.max_documents=null", "model.intermediate_size=~",
                             "data.text_field=a#b"])  # fmt: skip
    assert cfg.data.prompt_template == "### Instruction:\n{x}\n" and cfg.data.text_field == "a#b"
    assert cfg.data.max_documents is None and cfg.model.intermediate_size is None


# --------------------------------------------------------------- 4, 8: export


def test_export_under_a_file_is_refused_and_a_failed_one_leaves_no_directory(
    tiny_run, tmp_path, capsys, monkeypatch
):
    cfg = tiny_run()
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "sub" / "hf"
    code, err = cli(capsys, ["export", "--out", str(out)], cfg.run.dir)
    assert code == 2 and "Traceback" not in err
    assert f"export --out {out}: its parent {tmp_path / 'afile'} is a file" in err
    assert (tmp_path / "afile").read_text() == "mine"

    def no_disk(root):
        raise OSError(errno.EIO, "injected", str(root))

    monkeypatch.setattr(preinfer.checkpoint.export, "_fsync_tree", no_disk)
    with pytest.raises(OSError, match="injected"):
        run_export(cfg, str(tmp_path / "new" / "deeper" / "hf"), log=quiet)
    assert not (tmp_path / "new").exists()


def test_exported_files_follow_the_umask(tiny_run, tmp_path):
    cfg = tiny_run()
    old = os.umask(0o027)
    try:
        res = run_export(cfg, str(tmp_path / "hf"), log=quiet)
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(res["files"]) == set(modes)
    assert modes == dict.fromkeys(modes, 0o640)


# --------------------------------------------------------------- 5-7: the corpus


def test_every_pair_too_long_says_so_and_leaves_nothing(tmp_path, capsys):
    rows = [{"prompt": f"question {i} " * 30, "response": "a long answer " * 30} for i in range(30)]
    src = write_jsonl(tmp_path / "long.jsonl", rows)
    run_dir = tmp_path / "runs" / "long"
    code, err = cli(capsys, ["tokenize"], run_dir, f"data.source={src}", *PAIRS)
    assert code == 2 and "Traceback" not in err
    assert "train pairs are longer than S+1 = 33 tokens" in err and "fewer than" not in err
    assert "so all were dropped and nothing was written" in err
    assert "the longest is" in err and "data.split_pairs=true" in err
    assert not (tmp_path / "runs").exists()  # no empty run.dir left behind


def test_an_empty_file_is_refused_alone_and_skipped_in_a_directory(tmp_path, capsys):
    d = tmp_path / "data"
    d.mkdir()
    (d / "empty.jsonl").write_text("\n")
    write_jsonl(d / "pairs.jsonl", [pair(i) for i in range(40)])
    code, err = cli(
        capsys, ["tokenize"], tmp_path / "a", f"data.source={d / 'empty.jsonl'}", *PAIRS
    )
    assert code == 2 and f"data.source: {d / 'empty.jsonl'} is empty" in err
    assert "column" not in err and not (tmp_path / "a").exists()
    said = []
    store = run_tokenize(tiny_cfg(tmp_path / "b", f"data.source={d}", *PAIRS), log=said.append)
    assert store.manifest["rows"]["empty_files"] == [str(d / "empty.jsonl")]
    assert [m for m in said if "skipped 1 empty file(s)" in m]
    (d / "pairs.jsonl").write_text("")
    with pytest.raises(CorpusError, match="all 2 file\\(s\\) under it are empty"):
        run_tokenize(tiny_cfg(tmp_path / "c", f"data.source={d}", *PAIRS), log=quiet)


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_invalid_utf8_is_named_by_file_line_and_offset(tmp_path, capsys, suffix):
    lines = [json.dumps({"text": f"line {i}: " + "some words " * 8}) for i in range(400)]
    head = "\n".join(lines[:299]).encode() + b"\n"
    data = head + b'{"text": "caf\xe9"}\n' + "\n".join(lines[300:]).encode()
    f = tmp_path / f"latin1{suffix}"
    f.write_bytes(data)
    offset = len(head) + len(b'{"text": "caf')
    code, err = cli(capsys, ["tokenize"], tmp_path / "run", f"data.source={f}",
                    "data.max_documents=1000")  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert f"{f} line 300 is not valid UTF-8 (byte 0xe9 at offset {offset} of the file)" in err
    assert not (tmp_path / "run").exists()


def test_split_pairs_with_text_data_is_refused(tmp_path, capsys):
    code, err = cli(capsys, ["config"], tmp_path, "data.split_pairs=true")
    assert code == 2 and "data.split_pairs=true cuts prompt/response pairs" in err
    assert "data.format is text" in err
    for cfg in sorted(Path("configs").glob("*.yaml")):  # the shipped configs still load
        load_config(cfg)


# --------------------------------------------------------------- 8: concurrent tokenize --force


def test_a_second_concurrent_tokenize_force_is_refused(tiny_run, monkeypatch, capsys):
    """Two `tokenize --force` on one store: the one that commits second finds the store
    changed since it began and is refused, as without --force; the first one's store stays."""
    cfg = tiny_run()
    run = Path(cfg.run.dir)
    first = tiny_run("data.max_documents=5")
    real = TokenStoreWriter.commit
    ran = []

    def commit_after_another(self, manifest, **kw):
        if not ran:  # the other tokenize commits while this one writes its shards
            ran.append(None)
            ran[0] = run_tokenize(first, force=True, log=quiet).fingerprint
        return real(self, manifest, **kw)

    monkeypatch.setattr(TokenStoreWriter, "commit", commit_after_another)
    code, err = cli(capsys, ["tokenize", "--force"], run, "data.max_documents=6")
    assert code == 2 and "Traceback" not in err
    assert f"{cfg.data.out_dir} changed while this tokenize ran" in err
    assert f"store {ran[0][:12]}" in err and "this one wrote nothing" in err
    assert TokenStore(cfg.data.out_dir).fingerprint == ran[0]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("tokens")) == ["tokens"]
