"""A run.dir tells the truth (issue #40): paths that are files or cannot be written, a huge
one-line document, a BPE far smaller than asked, a config directory or a YAML key written twice,
a cache missing a shard file, a truncated block file. Each user mistake is one line on stderr
and exit 2, and writes nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.config import ConfigError, load_yaml
from pipelines.cli import main
from preinfer.checkpoint.store import Checkpoint
from preinfer.data.tokenization import builtin_corpus_root
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg, write_small_cache

REPO = Path(__file__).resolve().parents[1]
FAST = ("train.max_steps=1", "train.eval_every=0")


def cli(capsys, cmd: list[str], run_dir, *extra) -> tuple[int, str, str]:
    """`preinfer CMD` on configs/demo.yaml + the tiny settings: (exit code, stdout, stderr)."""
    args = [*cmd, "--config", "configs/demo.yaml"]
    for s in [*TINY, f"run.dir={run_dir}", *extra]:
        args += ["--set", s]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def files(root: Path) -> dict[str, bytes]:
    """Every file under root but a run lock (what a refusal must leave as it was)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}  # fmt: skip


def _writable(path: Path) -> bool:
    """Whether this process can still write there (a file in a directory; a file appended)."""
    try:
        if path.is_dir():
            (path / ".probe").write_text("x")
            (path / ".probe").unlink()
        else:
            with open(path, "a"):
                pass
    except OSError:
        return False
    return True


@pytest.fixture
def unwritable():
    """Makes a path unwritable for this process, and writable again after the test: `chattr
    +i` as root (root writes past any mode bits), else chmod; skips where neither works."""
    undo = []

    def make(path: Path) -> Path:
        if os.geteuid() == 0:
            if shutil.which("chattr") is None:
                pytest.skip("running as root, and no chattr to make a directory immutable")
            r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"chattr +i is not supported here: {r.stderr.strip()}")
            undo.append(["chattr", "-i", str(path)])
        else:
            mode = path.stat().st_mode
            path.chmod(0o555 if path.is_dir() else 0o444)
            undo.append(lambda p=path, m=mode: p.chmod(m))
        if _writable(path):
            pytest.skip(f"{path} stays writable after chattr/chmod on this filesystem")
        return path

    yield make
    for u in reversed(undo):
        if callable(u):
            u()
        else:
            subprocess.run(u, check=False)


# ------------------------------------------------------------- 5: a run.dir that is a file

WRITERS = (["tokenize"], ["init"], ["train", "--block", "0"], ["bcd"], ["eval"], ["report"],
           ["cache", "build", "--block", "1"], ["demo"])  # fmt: skip


@pytest.mark.parametrize("under", [False, True], ids=["run.dir=file", "run.dir=file/sub"])
def test_a_run_dir_that_is_a_file_is_one_line_and_writes_nothing(tmp_path, capsys, under):
    somefile = tmp_path / "somefile"
    somefile.write_text("not a directory\n")
    run_dir = somefile / "sub" if under else somefile
    for cmd in WRITERS:
        code, _, err = cli(capsys, cmd, run_dir)
        line = one_line(err)
        assert code == 2, (cmd, err)
        assert line.startswith(f"preinfer {cmd[0]}: error: run.dir {run_dir}"), line
        assert f"{somefile} is a file, not a directory" in line and "set run.dir" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somefile"]
    assert somefile.read_text() == "not a directory\n"


def test_the_library_stages_refuse_a_run_dir_that_is_a_file(tmp_path):
    from pipelines.tokenize import run_tokenize
    from preinfer.run.lock import run_lock

    somefile = tmp_path / "somefile"
    somefile.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run_tokenize(tiny_cfg(somefile), log=quiet)
    for d in (somefile, somefile / "sub"):
        lock = run_lock(d, "bcd", log=quiet)
        with pytest.raises(ConfigError, match=f"{somefile} is a file, not a directory"), lock:
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["somefile"]


def test_an_os_error_of_a_path_in_the_way_is_named_in_one_line(tmp_path):
    from pipelines.cli import path_error

    # the errors the stages hit where the pre-flight cannot look (a file made meanwhile, a
    # library caller): real ones, as os and pathlib raise them
    somefile = tmp_path / "somefile"
    somefile.write_text("x")
    with pytest.raises(NotADirectoryError) as e:
        os.mkdir(somefile / "sub")
    line = path_error(e.value)
    assert line and f"{somefile} is a file, not a directory" in line and "run.dir" in line
    with pytest.raises(FileExistsError) as e:
        somefile.mkdir(parents=True, exist_ok=True)
    assert f"{somefile} is a file, not a directory" in path_error(e.value)
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "x"))
    assert "no access to" in path_error(denied) and "make it writable" in path_error(denied)
    assert path_error(OSError(errno.EIO, "I/O error", str(somefile))) is None
    assert path_error(FileExistsError(errno.EEXIST, "exists", str(tmp_path))) is None


# ------------------------------------------------------ 6: a run.dir that cannot be written


def test_an_unwritable_run_dir_is_one_line_and_writes_nothing(tiny_run, capsys, unwritable):
    cfg = tiny_run(*FAST)
    run = Path(cfg.run.dir)
    before = files(run)
    unwritable(run)
    for cmd, extra in ((["tokenize", "--force"], ["data.max_documents=6"]),
                       (["init", "--force"], []), (["train", "--block", "0"], []), (["bcd"], []),
                       (["eval"], []), (["report"], []),
                       (["cache", "build", "--block", "1"], [])):  # fmt: skip
        code, _, err = cli(capsys, cmd, run, *FAST, *extra)
        line = one_line(err)
        assert code == 2, (cmd, err)
        assert f"run.dir {run} is not writable" in line and "make it writable" in line, line
    assert files(run) == before
    # a store that is current is not written: tokenize says so, read-only or not
    code, out, err = cli(capsys, ["tokenize"], run, *FAST)
    assert code == 0 and not err and "nothing to do" in out


def test_an_unwritable_parent_of_a_new_run_dir_is_refused(tmp_path, capsys, unwritable):
    (tmp_path / "ro").mkdir()
    parent = unwritable(tmp_path / "ro")
    code, _, err = cli(capsys, ["tokenize"], parent / "run")
    line = one_line(err)
    assert code == 2 and f"{parent}, where it is made, is not writable" in line
    assert not (parent / "run").exists()


def test_an_unwritable_file_at_run_time_is_one_line(tiny_run, capsys, unwritable):
    # past the pre-flight: run.dir is writable, the file eval appends to is not
    cfg = tiny_run(*FAST)
    metrics = Path(cfg.run.dir, "metrics.jsonl")
    metrics.write_text("")
    unwritable(metrics)
    code, out, err = cli(capsys, ["eval", "--batches", "1"], cfg.run.dir, *FAST)
    line = one_line(err)
    assert code == 2 and f"no access to {metrics}" in line and "make it writable" in line
    assert metrics.read_text() == ""


# -------------------------------------------------------------- 7: one huge line, a small BPE


def _one_line_text(chars: int) -> str:
    """`chars` characters of the stdlib's sources, newlines made spaces: one long line."""
    parts, n = [], 0
    for f in sorted(builtin_corpus_root().glob("*.py")):
        parts.append(f.read_text(errors="replace"))
        n += len(parts[-1])
        if n >= chars:
            break
    return " ".join(parts)[:chars].replace("\r", " ").replace("\n", " ")


def test_a_long_text_in_pieces_gives_the_merges_and_ids_of_the_whole():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from preinfer.data.tokenization import encode_ids, pieces, train_bpe

    # a long line, odd whitespace, and a stretch with none (cut between letters and digits)
    text = _one_line_text(150_000) + " a\t\tb  \n  c's\u3000d" * 300 + "abc123def(" * 2000 + " end"
    cut = pieces(text, 4096)
    assert "".join(cut) == text and len(cut) > 40 and max(map(len, cut)) <= 4096
    assert pieces("short text", 4096) == ["short text"]

    whole = Tokenizer(models.BPE())  # the library's own training on the text as one
    whole.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    whole.decoder = decoders.ByteLevel()
    whole.train_from_iterator([text], trainer=trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    ours = train_bpe([text], 600)
    assert ours.to_str() == whole.to_str()
    want = whole.encode(text, add_special_tokens=False).ids
    got = encode_ids(whole, [text, "tail"], 4096)
    assert got[0].tolist() == want and len(want) > 10_000
    assert got[1].tolist() == whole.encode("tail", add_special_tokens=False).ids


def test_a_bpe_far_below_data_vocab_size_is_warned(tmp_path):
    from pipelines.tokenize import run_tokenize

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):  # the same two words over and over: few pairs to merge
        (corpus / f"{i:02d}.txt").write_text("ab ba " * (60 + 7 * i))
    lines = []
    cfg = tiny_cfg(tmp_path / "run", f"data.source={corpus}", "data.vocab_size=512",
                   "model.vocab_size=600")  # fmt: skip
    store = run_tokenize(cfg, log=lines.append)
    got = store.manifest["vocab_size"]
    assert got < 300
    warn = [x for x in lines if "warning" in x]
    assert len(warn) == 1, lines
    assert f"the trained BPE has {got} tokens of data.vocab_size=512" in warn[0]
    assert "more (or more varied) text" in warn[0] and "set data.vocab_size=" in warn[0]
    lines.clear()  # a corpus with enough text: no warning
    run_tokenize(tiny_cfg(tmp_path / "run2"), log=lines.append)
    assert not [x for x in lines if "warning" in x]


PEAK = textwrap.dedent("""
    import json, resource, sys
    from pipelines.tokenize import run_tokenize
    from preinfer.run.config import load_config
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = load_config("configs/demo.yaml", sys.argv[1:])
    store = run_tokenize(cfg, log=lambda *a: None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mib": (peak - base) / 1024, "vocab": store.manifest["vocab_size"],
                      "tokens": store.manifest["tokens_in_documents"]}))
""")


def _peak(corpus: Path, run: Path) -> dict:
    sets = [f"run.dir={run}", f"data.source={corpus}", "data.vocab_size=512",
            "data.max_documents=null", "data.val_fraction=0.2", "data.split_seed=1"]  # fmt: skip
    p = subprocess.run([sys.executable, "-c", PEAK, *sets], cwd=REPO, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_huge_single_line_document_tokenizes_in_the_memory_of_many_short_ones(tmp_path):
    # one 4 MB line among short files, against the same text as many short files: before,
    # the line alone took ~240 bytes of RSS per character (8.5 MB: 2 GB peak)
    text = _one_line_text(4_000_000)
    huge, many = tmp_path / "huge", tmp_path / "many"
    huge.mkdir()
    many.mkdir()
    (huge / "line.txt").write_text(text)
    for i in range(0, len(text), 20_000):
        (many / f"{i:08d}.txt").write_text(text[i : i + 20_000])
    for d in (huge, many):
        for i in range(8):
            (d / f"small{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    one, short = _peak(huge, tmp_path / "r1"), _peak(many, tmp_path / "r2")
    assert one["vocab"] == short["vocab"] == 512
    assert one["growth_mib"] <= 1.5 * short["growth_mib"] + 64, (one, short)


# ------------------------------------------------------------------------------- minor cases


def test_a_directory_as_config_file_says_it_is_a_directory(tmp_path, capsys):
    code = main(["config", "-c", str(tmp_path)])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and f"config file {tmp_path} is a directory" in line
    assert "YAML file" in line and "does not exist" not in line


def test_a_yaml_key_written_twice_is_refused_naming_it_and_its_lines(tmp_path, capsys):
    twice = tmp_path / "twice.yaml"
    twice.write_text("run:\n  dir: runs/x\ntrain:\n  lr: 0.01\ndata:\n  seq_len: 8\n"
                     "train:\n  rounds: 2\n")  # fmt: skip
    code = main(["config", "-c", str(twice)])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "key train is written twice (lines 3 and 7)" in line
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  lr: 0.01\n  rounds: 1\n  lr: 0.02\n")
    with pytest.raises(ConfigError, match=r"key train\.lr is written twice \(lines 2 and 4\)"):
        load_yaml(nested)
    merged = tmp_path / "merged.yaml"  # a merge key's values may be overridden: no duplicate
    merged.write_text("base: &b {lr: 0.1, rounds: 2}\ntrain:\n  <<: *b\n  lr: 0.3\n")
    assert load_yaml(merged)["train"] == {"lr": 0.3, "rounds": 2}


def test_cache_ls_shows_a_cache_missing_a_shard_file_as_damaged(tmp_path, capsys):
    from storage.cache_tools import list_caches

    root, fp = tmp_path / "cache", "f" * 32
    write_small_cache(root, fp)
    manifest = json.loads((root / fp / "manifest.json").read_text())
    gone = next(iter(manifest["shards"][1]["files"]))
    (root / fp / gone).unlink()
    (row,) = list_caches(root)
    assert not row["complete"] and row["damaged"] == [gone]
    code, out, err = cli(capsys, ["cache", "ls", str(root)], tmp_path / "run")
    assert code == 0 and not err
    table, note = out.strip().splitlines()[:-1], out.strip().splitlines()[-1]
    assert "1 files" in table[-1] and " no " in table[-1]
    assert note.startswith(f"{fp}: damaged: 1 file(s)") and gone in note
    assert f"preinfer cache verify {fp}" in note and "cache build --block 1 --verify" in note
    write_small_cache(root, "e" * 32)  # an intact one: listed as before, no note
    code, out, _ = cli(capsys, ["cache", "ls", str(root)], tmp_path / "run")
    assert out.count("damaged:") == 1 and ("e" * 32) in out


def test_train_names_a_truncated_block_file_not_a_missing_cache(tiny_run, capsys):
    cfg = tiny_run(*FAST)
    block = Checkpoint.open(cfg.run.checkpoint).block_file(1)
    data = block.read_bytes()
    block.write_bytes(data[: len(data) // 2])
    before = files(Path(cfg.run.dir))
    code, _, err = cli(capsys, ["train", "--block", "1", "--mode", "bcd"], cfg.run.dir, *FAST)
    line = one_line(err)
    assert code == 2 and f"block 1's file {block} is damaged" in line, line
    assert "not built" not in line and "preinfer init --force" in line
    assert files(Path(cfg.run.dir)) == before
