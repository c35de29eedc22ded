"""Nothing a user types loses their run (issue #53): `export` never replaces the run's own
directories nor anything but a previous export, `cache gc --run` never deletes the caches of a
run it could not read, tokenize holds the run.dir lock (and leaves no temp store of a killed
tokenize behind), and the corpus says what it skipped."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import faults
from pipelines.cli import main
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.export import MARKER
from preinfer.run.lock import LOCK_NAME, run_lock
from storage.tokens import TokenStoreWriter, manifest_bytes
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg, write_small_cache

ROOT = Path(__file__).resolve().parents[1]
FEWER = "data.max_documents=6"  # other inputs than the tiny run's store: tokenize would replace


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
    """Every file under root (relative path -> bytes), run locks aside."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}  # fmt: skip


# ------------------------------------------------------------ export: what --out may replace


def _targets(run: Path, tmp: Path) -> dict[str, tuple[Path, str, str]]:
    """--out values that are, lie inside or hold the run's directories: (out, key, relation)."""
    (tmp / "link").symlink_to(run, target_is_directory=True)
    return {
        "run.dir": (run, "run.dir", "is"),
        "checkpoint": (run / "checkpoint", "run.checkpoint", "is"),
        "tokens": (run / "tokens", "data.out_dir", "is"),
        "cache root": (run / "cache", "cache.root", "is"),
        "inside checkpoint": (run / "checkpoint" / "hf", "run.checkpoint", "lies inside"),
        "inside run.dir": (run / "report", "run.dir", "lies inside"),
        "runs/ holding it": (tmp, "run.dir", "holds"),
        "a symlink to it": (tmp / "link", "run.dir", "is"),
        "with ..": (run / "checkpoint" / ".." / "tokens", "data.out_dir", "is"),
    }


@pytest.mark.parametrize("force", [False, True])
def test_export_refuses_the_runs_own_directories(tiny_run, tmp_path, capsys, force):
    """`export --out` = run.dir, the checkpoint, the token store, the cache root, a directory
    inside them or one holding them (a symlink or `..` to them too): one line naming the key,
    exit 2, with or without --force; every file of the run as it was."""
    cfg = tiny_run()
    run = Path(cfg.run.dir)
    (run / "cache").mkdir()
    (run / "cache" / "kept.txt").write_text("a cache")
    targets = _targets(run, tmp_path)
    before = files(tmp_path)
    for name, (out, key, how) in targets.items():
        code, _, err = cli(capsys, ["export", "--out", str(out), *["--force"] * force], run)
        line = one_line(err)
        assert code == 2, (name, err)
        assert f" {how} {key} " in line and "nothing was touched" in line, (name, line)
        assert files(tmp_path) == before, name
    # a checkpoint kept outside run.dir is the run's too (run.checkpoint as the config names it)
    ck = tmp_path / "ck"
    os.rename(run / "checkpoint", ck)
    code, _, err = cli(capsys, ["export", "--out", str(ck), "--force"], run,
                       f"run.checkpoint={ck}")  # fmt: skip
    assert code == 2 and f"is run.checkpoint {ck}" in one_line(err)
    assert (ck / "checkpoint.json").is_file()


def test_export_force_replaces_only_a_previous_export(tiny_run, tmp_path, capsys):
    """--force on a directory that is no export (no marker) is refused and touches nothing; an
    export holds the marker (naming the run and checkpoint), loads in transformers, and is
    what --force replaces. The run's own export directory (<run.dir>/export) is allowed."""
    import transformers as tf

    cfg = tiny_run()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    code, _, err = cli(capsys, ["export", "--out", str(mine), "--force"], cfg.run.dir)
    assert code == 2 and "is not a preinfer export" in one_line(err)
    assert files(mine) == {"notes.txt": b"the user's"}

    out = tmp_path / "hf"
    code, printed, _ = cli(capsys, ["export", "--out", str(out)], cfg.run.dir)
    assert code == 0
    res = json.loads(printed.strip().splitlines()[-1])
    marker = json.loads((out / MARKER).read_text())
    assert marker["run_dir"] == cfg.run.dir and marker["checkpoint"] == cfg.run.checkpoint
    assert marker["checkpoint_hash"] == res["checkpoint"] and MARKER in res["files"]
    model = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "GPT2LMHeadModel"
    (out / "stale.txt").write_text("x")
    code, _, _ = cli(capsys, ["export", "--out", str(out), "--force"], cfg.run.dir)
    assert code == 0 and (out / MARKER).is_file() and not (out / "stale.txt").exists()

    own = Path(cfg.run.dir) / "export"
    for force in ([], ["--force"]):  # the demo's own export, written and then replaced
        code, _, err = cli(capsys, ["export", "--out", str(own), *force], cfg.run.dir)
        assert code == 0, err
    assert (own / MARKER).is_file()


def _fsize(nbytes: int):
    def pre():  # EFBIG instead of the SIGXFSZ that would kill the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return pre


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(tiny_run, tmp_path):
    """A file-size limit (EFBIG, what tests/test_disk_full.py uses where no tmpfs can be
    mounted) below model.safetensors: exit 1, the one disk-full line naming that file, no
    traceback, and neither the export nor its temp sibling left."""
    cfg = tiny_run()
    out = tmp_path / "hf"
    args = [sys.executable, "-m", "pipelines.cli", "export", "--config", "configs/demo.yaml",
            "--out", str(out), *[x for s in [*TINY, f"run.dir={cfg.run.dir}"]
                                 for x in ("--set", s)]]  # fmt: skip
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=_fsize(64 << 10))  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    line = one_line(r.stderr)
    assert line.startswith("preinfer export: error: the disk is full writing "), line
    assert f"{out}/model.safetensors" in line and os.strerror(errno.EFBIG) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no hf, no .hf.export-*


# ------------------------------------------------------- cache gc: a --run it cannot read


def _caches(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize(
    "state, words",
    [
        (None, "is not a run (a typo?)"),
        ('{"visits": {}, "caches_in_use": ["aaaa', "does not parse"),
        ("[1, 2]", "does not parse (not a JSON object)"),
        ('{"caches_in_use": "aaaaaaaa"}', "not a list of cache fingerprints"),
        ('{"caches_in_use": ["../x", 3]}', "not a list of cache fingerprints"),
    ],
    ids=["typo", "cut", "a list", "a string", "not fingerprints"],
)
def test_gc_refuses_a_run_it_cannot_read_and_removes_nothing(tmp_path, capsys, state, words):
    """`cache gc --run D` with no state.json in D (a typo) or one that does not parse or does
    not list fingerprints: exit 2, one line, every cache kept (the real run's included)."""
    root, real = tmp_path / "cache", tmp_path / "run"
    for fp in ("aaaaaaaa", "bbbbbbbb"):
        write_small_cache(root, fp)
    real.mkdir()
    (real / "state.json").write_text(json.dumps({"caches_in_use": ["aaaaaaaa"]}))
    bad = tmp_path / ("rnu" if state is None else "other")
    if state is not None:
        bad.mkdir()
        (bad / "state.json").write_text(state)
    before = files(root)
    for extra in ([], ["--dry-run"]):
        args = ["cache", "gc", "--root", str(root), "--run", str(real), "--run", str(bad)]
        code = main([*args, *extra])
        err = capsys.readouterr().err
        assert code == 2 and words in one_line(err) and "nothing was removed" in err, err
        assert files(root) == before
    # the same runs, read right: only the cache no run uses goes
    (bad / "state.json").parent.mkdir(exist_ok=True)
    (bad / "state.json").write_text(json.dumps({"caches_in_use": []}))
    assert main(["cache", "gc", "--root", str(root), "--run", str(real), "--run", str(bad)]) == 0
    assert _caches(root) == ["aaaaaaaa"]


# --------------------------------------------------------------- tokenize: the run.dir lock

_HOLD = """
import sys, time
from preinfer.run.lock import run_lock
with run_lock(sys.argv[1], "bcd --mode bcd", log=lambda *a: None):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(run_dir) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)  # fmt: skip
    assert p.stdout.readline().strip() == "held"
    return p


def test_tokenize_force_is_refused_while_a_run_holds_the_run_dir(tiny_run, capsys):
    """`tokenize --force` (other inputs: it would replace the store) while a bcd holds the
    run.dir: one line naming the holder, exit 2, the store as it was. Once it is gone the same
    command replaces the store."""
    cfg = tiny_run()
    run = Path(cfg.run.dir)
    before = files(run)
    holder = _holder(run)
    try:
        code, _, err = cli(capsys, ["tokenize", "--force"], run, FEWER)
        line = one_line(err)
        assert code == 2 and f"pid {holder.pid}" in line and "bcd --mode bcd" in line, line
        assert files(run) == before
    finally:
        holder.kill()
        holder.wait()
    code, out, err = cli(capsys, ["tokenize", "--force"], run, FEWER)
    assert code == 0, err
    assert manifest_bytes(run / "tokens") != before["tokens/manifest.json"]


def test_tokenize_force_refused_onto_a_store_a_live_run_made(tmp_path, capsys):
    """data.out_dir outside run.dir, made by run A: `tokenize --force` of run B onto it while a
    bcd holds A is refused, naming data.out_dir, A and the holder; the store is A's still."""
    store = tmp_path / "shared" / "tokens"
    run_tokenize(tiny_cfg(tmp_path / "a", f"data.out_dir={store}"), log=quiet)
    before = files(store)
    holder = _holder(tmp_path / "a")
    try:
        code, _, err = cli(capsys, ["tokenize", "--force"], tmp_path / "b",
                           f"data.out_dir={store}", FEWER)  # fmt: skip
        line = one_line(err)
        assert code == 2 and f"data.out_dir {store} is the token store of run.dir" in line
        assert str(tmp_path / "a") in line and f"pid {holder.pid}" in line, line
        assert files(store) == before
    finally:
        holder.kill()
        holder.wait()


def test_tokenize_inside_the_demos_lock_is_not_refused(tmp_path):
    """The demo holds the run.dir lock and runs tokenize in the same process: re-entrant, held
    once, released (the record emptied) by the outermost exit only."""
    cfg = tiny_cfg(tmp_path / "run")
    with run_lock(cfg.run.dir, "demo", log=quiet) as lock:
        run_tokenize(cfg, log=quiet)
        assert json.loads(lock.read_text())["command"] == "demo"  # not released by tokenize
    assert lock.read_text() == ""


# ------------------------------------------------- tokenize: the temp store of a killed one

_WRITER = """
import os, signal, sys, time
import numpy as np
from storage.tokens import TokenStoreWriter
w = TokenStoreWriter(sys.argv[1], seq_len=16, shard_rows=4)
w.add("train", np.zeros((9, 17), dtype=np.int32))  # two shards written into the temp store
print(w.tmp, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 mid-write
time.sleep(600)
"""


def _writer(out: Path, how: str) -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(out), how], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)  # fmt: skip
    tmp = Path(p.stdout.readline().strip())
    assert tmp.is_dir() and any(tmp.iterdir())
    return p, tmp


def test_the_next_tokenize_removes_a_killed_tokenizes_temp_store_only(tiny_run, capsys):
    """A writer killed with SIGKILL leaves its temp store: the next tokenize that writes removes
    it (and says so), and a legacy-named one untouched for hours; a live writer's temp store and
    a recent legacy one are kept."""
    cfg = tiny_run()
    out = Path(cfg.data.out_dir)
    dead, dead_tmp = _writer(out, "kill")
    assert dead.wait() == -signal.SIGKILL and dead_tmp.is_dir()
    live, live_tmp = _writer(out, "live")
    old_legacy, new_legacy = (
        out.with_name("tokens.partial-0123abcd"),
        out.with_name("tokens.partial-89abcdef"),
    )
    for d in (old_legacy, new_legacy):
        d.mkdir()
        (d / "train-00000.parquet").write_bytes(b"x")
    hours_ago = time.time() - 5 * 3600
    for f in (old_legacy / "train-00000.parquet", old_legacy):
        os.utime(f, (hours_ago, hours_ago))
    try:
        code, printed, err = cli(capsys, ["tokenize", "--force"], cfg.run.dir, FEWER)
        assert code == 0, err
        assert not dead_tmp.exists() and not old_legacy.exists()
        assert live_tmp.is_dir() and new_legacy.is_dir()
        assert f"removed {dead_tmp}" in printed and f"removed {old_legacy}" in printed
        assert manifest_bytes(out) is not None
    finally:
        live.kill()
        live.wait()
    assert socket.gethostname().replace(".", "_") in dead_tmp.name  # whose it was: in the name


def test_a_writers_temp_store_carries_its_pid(tmp_path):
    w = TokenStoreWriter(tmp_path / "tokens", seq_len=4, shard_rows=4)
    try:
        assert f".{os.getpid()}." in w.tmp.name and w.tmp.name.startswith("tokens.")
    finally:
        w.abort()


# --------------------------------------------------------------------- the corpus: notes


def test_a_skipped_file_in_a_corpus_folder_is_logged(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    (corpus / "weights.bin").write_bytes(b"\0\1\2" * 100)
    os.mkfifo(corpus / "pipe.txt")
    lines = []
    cfg = tiny_cfg(tmp_path / "run", f"data.source={corpus}")
    store = run_tokenize(cfg, log=lines.append)
    (said,) = [x for x in lines if "skipped 2 file(s)" in x]
    assert f"{corpus / 'weights.bin'} (type .bin is not read)" in said
    assert f"{corpus / 'pipe.txt'} (not a regular file)" in said and ".jsonl" in said
    assert len(store.manifest["rows"]["skipped_files"]) == 2


def test_a_device_as_the_source_is_not_a_regular_file(tmp_path, capsys):
    code, _, err = cli(capsys, ["tokenize"], tmp_path / "run", "data.source=/dev/zero")
    line = one_line(err)
    assert code == 2 and "/dev/zero is not a regular file" in line and "does not exist" not in line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------- the concurrent case: real CLI processes


def _lock_record(run: Path) -> dict:
    try:
        return json.loads((run / LOCK_NAME).read_text())
    except (OSError, ValueError):  # no lock file yet, an empty (released) or half-written one
        return {}


@pytest.mark.slow
@pytest.mark.functional
# a tiny rotation and a tokenize, each its own process: ~20-40 s on 2 busy CPUs
def test_tokenize_force_beside_a_live_bcd_is_refused_and_the_bcd_ends_on_its_store(tiny_run):
    """`preinfer tokenize --force` (other inputs) while `preinfer bcd` runs on the same
    run.dir: one line naming the bcd's pid, exit 2; the bcd ends (exit 0) on the store it
    began with, which is unchanged."""
    cfg = tiny_run()
    run = Path(cfg.run.dir)
    store = manifest_bytes(run / "tokens")
    sets = [*TINY, f"run.dir={run}", "preinfer.executor=local", "train.max_steps=4"]

    def preinfer(*args: str, extra: tuple[str, ...] = ()) -> list[str]:
        cmd = [sys.executable, "-m", "pipelines.cli", *args, "--config", "configs/demo.yaml"]
        return cmd + [x for s in [*sets, *extra] for x in ("--set", s)]

    env = {**os.environ, faults.SHARD_DELAY_S: "0.5"}  # a build slow enough to meet
    env.pop("RAY_ADDRESS", None)
    bcd = subprocess.Popen(preinfer("bcd"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while _lock_record(run).get("pid") != bcd.pid:  # the bcd holds the run.dir
            assert bcd.poll() is None and time.monotonic() < deadline, bcd.communicate()
            time.sleep(0.05)
        r = subprocess.run(preinfer("tokenize", "--force", extra=(FEWER,)), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        line = one_line(r.stderr)
        assert r.returncode == 2 and f"pid {bcd.pid}" in line and "bcd" in line, line
        assert bcd.poll() is None, "the bcd ended before the tokenize ran: nothing was tested"
        assert manifest_bytes(run / "tokens") == store
        out, err = bcd.communicate(timeout=600)
    finally:
        if bcd.poll() is None:
            bcd.kill()
            bcd.communicate()
    assert bcd.returncode == 0, err[-3000:]
    assert manifest_bytes(run / "tokens") == store
    state = json.loads((run / "state.json").read_text())
    assert len(state["visits"]) == 3 and not state.get("pending")
