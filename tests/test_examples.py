"""examples/: the scripts a user copies run on a cache the pipeline built."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipelines.cache_build import build_cache
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
