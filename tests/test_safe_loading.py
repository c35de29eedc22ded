"""Safe loading audit: nothing on a load path can run code, and no name escapes its root.

1. A scan of the source tree (preinfer/, pipelines/, storage/, bench/, tools/): no pickle-family
   module, no `torch.load` without `weights_only=True`, no `np.load(..., allow_pickle=True)`,
   no `yaml.load` without a SafeLoader, no `eval`/`exec`, no `trust_remote_code=True`.
2. Names that reach a path (cache fingerprints on the CLI, block files named by a checkpoint
   index, caches a run says it uses) cannot walk out of their root.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model_config
from core.config import ConfigError
from pipelines.cli import main
from preinfer.model.modeling import build_model, resolve_checkpoint_path
from storage.layout import check_fingerprint

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("preinfer", "pipelines", "storage", "bench", "tools")
BANNED_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "dill",
    "cloudpickle",
    "shelve",
    "marshal",
    "joblib",
}
UNSAFE_CALLS = {
    "yaml.unsafe_load",
    "yaml.unsafe_load_all",
    "yaml.full_load",
    "yaml.full_load_all",
    "pandas.read_pickle",
    "numpy.lib.format.read_array",  # allow_pickle=True by default
}


# ------------------------------------------------------------------------------ the scan


def _dotted(node: ast.AST, alias: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(alias.get(node.id, node.id))
    return ".".join(reversed(parts))


def _const(node: ast.AST | None):
    return node.value if isinstance(node, ast.Constant) else "<expr>"


def findings(source: str, where: str = "<src>") -> list[str]:
    """Unsafe-loading findings in one module's source: 'where:line: what'."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in BANNED_MODULES:
                    out.append(f"{where}:{node.lineno}: import {a.name}")
                alias[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in BANNED_MODULES:
                out.append(f"{where}:{node.lineno}: from {mod} import ...")
            for a in node.names:
                alias[a.asname or a.name] = f"{mod}.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, alias) or ""
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        at = f"{where}:{node.lineno}: {name}"
        if name == "torch.load" and _const(kw.get("weights_only")) is not True:
            out.append(f"{at} without weights_only=True")
        if (
            name == "numpy.load"
            and _const(kw.get("allow_pickle", ast.Constant(False))) is not False
        ):
            out.append(f"{at} with allow_pickle")
        if name in ("yaml.load", "yaml.load_all"):
            loader = kw.get("Loader", node.args[1] if len(node.args) > 1 else None)
            if not (_dotted(loader, alias) or "").endswith("SafeLoader"):
                out.append(f"{at} without a SafeLoader")
        if name in UNSAFE_CALLS or name in ("eval", "exec"):
            out.append(at)
        if _const(kw.get("trust_remote_code", ast.Constant(False))) is not False:
            out.append(f"{at} with trust_remote_code")
        if "weights_only" in kw and _const(kw["weights_only"]) is not True:
            out.append(f"{at} with weights_only not True")
    return out


def source_files() -> list[Path]:
    return sorted(p for d in SOURCES for p in (REPO / d).rglob("*.py"))


def test_the_source_tree_has_no_unsafe_loading():
    files = source_files()
    assert len(files) > 30 and any(p.name == "store.py" for p in files)
    found = [f for p in files for f in findings(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle\npickle.load(f)",
        "from pickle import loads\nloads(b)",
        "import cloudpickle as cp",
        "import torch\ntorch.load(p)",
        "import torch\ntorch.load(p, weights_only=False)",
        "import torch as T\nT.load(p, map_location='cpu')",
        "from torch import load\nload(p)",
        "import numpy as np\nnp.load(p, allow_pickle=True)",
        "import numpy\nnumpy.load(p, allow_pickle=flag)",
        "import yaml\nyaml.load(s)",
        "import yaml\nyaml.load(s, Loader=yaml.Loader)",
        "import yaml\nyaml.load(s, yaml.FullLoader)",
        "import yaml\nyaml.unsafe_load(s)",
        "import yaml\nyaml.full_load(s)",
        "import pandas as pd\npd.read_pickle(p)",
        "eval(text)",
        "exec(code)",
        "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
        "import datasets\ndatasets.load_dataset(n, trust_remote_code=True)",
    ],
)
def test_the_scan_catches_unsafe_loading(snippet):
    assert findings(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load(p, map_location='cpu', weights_only=True)",
        "import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=False)",
        "import yaml\nyaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)",
        "import yaml\nfrom yaml import CSafeLoader\nyaml.load(s, CSafeLoader)",
        "model.eval()",
        "from transformers import AutoModel\nAutoModel.from_pretrained(p)",
    ],
)
def test_the_scan_passes_safe_loading(snippet):
    assert findings(snippet) == [], snippet


# ------------------------------------------------------------------- names and their roots

ESCAPES = [
    "..",
    "../x",
    "../../etc",
    "/etc",
    "/abs/path",
    "abcdef12/..",
    "abcdef12/../..",
    "abcdef12/",
    "./abcdef12",
    "abcdef12\n",
    " abcdef12",
    "abcdef12\x00",
    "abcdef12\\..\\..",
    "~/abcdef12",
    "١٢٣٤٥٦٧٨",  # Arabic-Indic digits: \d would take them
    "ABCDEF12",
    "a" * 65,
    "abc",
    "",
]


@pytest.mark.parametrize("name", ESCAPES)
def test_cache_fingerprints_cannot_name_anything_but_a_cache(name):
    with pytest.raises(ConfigError, match="not a cache fingerprint"):
        check_fingerprint(name)


def test_cli_cache_names_cannot_escape_the_root(capsys, tmp_path):
    root = tmp_path / "root"
    (tmp_path / "etc").mkdir()  # something a walk out of the root could find
    for name in ["../etc", str(tmp_path / "etc"), "..", "abcdef12/../../etc"]:
        for cmd in ("inspect", "verify"):
            code = main(["cache", cmd, name, "--root", str(root)])
            err = capsys.readouterr().err
            assert code == 2 and "not a cache fingerprint" in err and "Traceback" not in err
    assert check_fingerprint("abcdef12") == "abcdef12"
    assert not root.exists()  # nothing was created on the way


def test_config_names_that_reach_paths_are_closed_sets(capsys, tmp_path):
    """train.mode names the visit state file (train_state/r{round}-b{block}-{mode}.pt)."""
    code = main(["config", "--set", f"run.dir={tmp_path}", "--set", "train.mode=../../x"])
    err = capsys.readouterr().err
    assert code == 2 and "choose one of" in err
    assert not any(tmp_path.iterdir())


def test_gc_never_removes_anything_outside_the_root(capsys, tmp_path):
    """A symlink in the cache root, and a run's state naming '../x' caches, stay harmless."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    victim = outside / "abcdef12"
    (victim / "done").mkdir(parents=True)
    (victim / "manifest.json").write_text("{}")
    root.mkdir()
    (root / "fedcba98").symlink_to(victim, target_is_directory=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "state.json").write_text(json.dumps({"caches_in_use": ["../outside/abcdef12", "/"]}))
    outside_before = sorted(p.relative_to(tmp_path) for p in outside.rglob("*"))
    # names that are no fingerprints: refused, nothing removed (the link included)
    assert main(["cache", "gc", "--root", str(root), "--run", str(run)]) == 2
    assert "not a list of cache fingerprints" in capsys.readouterr().err
    assert os.path.lexists(root / "fedcba98")
    (run / "state.json").write_text(json.dumps({"caches_in_use": ["abcdef12"]}))
    code = main(["cache", "gc", "--root", str(root), "--run", str(run)])
    out = capsys.readouterr().out
    assert code == 0, out
    # the link was the root's entry: it is removed as an entry (the link itself, nothing it
    # points at); the names in state.json only keep things, they never reach a path
    assert "removed fedcba98" in out
    assert not os.path.lexists(root / "fedcba98")
    assert sorted(p.relative_to(tmp_path) for p in outside.rglob("*")) == outside_before
    assert (victim / "manifest.json").read_text() == "{}" and (victim / "done").is_dir()


# ------------------------------------------------------ a checkpoint index naming its files


def test_checkpoint_block_files_cannot_point_outside_the_checkpoint(tmp_path):
    """checkpoint.json names each block file; a hand-edited name like ../other/block.safetensors
    would be read, and, on the next commit of that block, deleted (the old file of a commit is
    unlinked). Opening such a checkpoint is refused."""
    from conftest import tiny_model_config
    from preinfer.checkpoint.format import INDEX, CheckpointError
    from preinfer.checkpoint.init import init_checkpoint
    from preinfer.checkpoint.store import Checkpoint

    ck = init_checkpoint(tiny_model_config("gpt2"), 2, tmp_path / "ck")
    other = tmp_path / "other"
    other.mkdir()
    name = ck.block_file(1).name
    shutil.copy(ck.block_file(1), other / name)  # same bytes, same hash: it would verify
    good = json.loads((ck.path / INDEX).read_text())
    for bad in [f"../other/{name}", str(other / name), f"sub/{name}", "..", "", 7, None]:
        idx = json.loads(json.dumps(good))
        idx["blocks"][1]["file"] = bad
        (ck.path / INDEX).write_text(json.dumps(idx))
        with pytest.raises(CheckpointError, match="not a plain block_/optim_"):
            Checkpoint.open(ck.path)
    (ck.path / INDEX).write_text(json.dumps(good))
    assert Checkpoint.open(ck.path).block_file(1) == ck.block_file(1)
    assert (other / name).is_file() and os.path.getsize(other / name) > 0


# ------------------------------------------------------------- a pretrained checkpoint dir


def test_a_pretrained_checkpoint_with_only_pickled_weights_is_refused(tmp_path):
    """model.checkpoint loads safetensors only: a directory whose weights are a pickle
    (pytorch_model.bin, what save_pretrained(safe_serialization=False) wrote) is refused with
    what to do, before anything is unpickled; the converted directory loads."""
    src = build_model(tiny_model_config("gpt2"))
    safe, pickled = tmp_path / "safe", tmp_path / "pickled"
    src.save_pretrained(safe)  # transformers >= 5 always writes model.safetensors
    shutil.copytree(safe, pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"only PyTorch pickle weights \(pytorch_model\.bin\)"):
        build_model(tiny_model_config("gpt2", checkpoint=str(pickled)))
    with pytest.raises(ConfigError, match="convert the checkpoint to safetensors"):
        resolve_checkpoint_path(str(pickled))
    (pickled / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match=r"has no \*\.safetensors weights"):
        build_model(tiny_model_config("gpt2", checkpoint=str(pickled)))
    loaded = build_model(tiny_model_config("gpt2", checkpoint=str(safe)))
    for (n, a), (_, b) in zip(src.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
