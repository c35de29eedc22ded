"""examples/: the scripts a user copies run on a cache the pipeline built."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipelines.cache_build import build_cache
from storage import IdentityMismatch
from tests.pipeline_fixtures import quiet

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    """An example as a module, loaded from its file: examples/ is scripts, not a package."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_example_lowers_its_loss_on_a_built_cache(tiny_run, capsys):
    cfg = tiny_run("preinfer.executor=local", "cache.dtype=bf16")
    build_cache(cfg, 1, log=quiet)
    probe = _load("probe")
    out = probe.main(["--cache-root", str(cfg.cache.root), "--steps", "30", "--batch-size", "4"])
    assert out["steps"] == 30
    assert out["after"] < out["before"] - 0.2, out  # from log(vocab): the probe learned
    meta_split = {r["fingerprint"]: r["split"] for r in probe.list_caches(cfg.cache.root)}
    assert meta_split[out["fingerprint"]] == "train"  # the train cache, not the val one
    assert "probe loss after 30 steps" in capsys.readouterr().out


def test_probe_from_cache_example_learns_from_an_extracted_layer(tiny_run, capsys):
    from pipelines.extract import ExtractConfig, model_hash, run_extract
    from preinfer.checkpoint.store import Checkpoint

    cfg = tiny_run("cache.dtype=bf16")
    for split in ("train", "val"):
        run_extract(cfg, ExtractConfig(layers=(1, 3), split=split), log=quiet)
    probe = _load("probe_from_cache")
    model = model_hash(Checkpoint.open(cfg.run.checkpoint))
    argv = ["--cache-root", str(cfg.cache.root), "--layer", "3", "--model", model]
    out = probe.main([*argv, "--steps", "40", "--classes", "31", "--lr", "0.03"])
    assert out["steps"] == 40 and out["layer"] == 3 and out["held_out"] is not None
    assert out["after"] < out["before"] - 0.2, out  # from log(32): the probe learned
    assert "held out: val cache" in capsys.readouterr().out
    # a cache of another model is refused, in one line, before any training
    with pytest.raises(IdentityMismatch, match="model: expected 'f+', found '[0-9a-f]{64}'"):
        probe.main(["--cache-root", str(cfg.cache.root), "--layer", "3", "--model", "f" * 64])
