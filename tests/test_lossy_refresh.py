"""Lossy caches (int8, fp8_e4m3) are never refreshed: a refresh would run block K-1 on the
dequantized boundary K-1 and quantize again, so its bytes would differ from a build's while
carrying the build's fingerprint. `cache refresh` refuses them; the rotation builds them."""

import json
from pathlib import Path

import pytest

from core.config import ConfigError
from pipelines.bcd import run_bcd
from pipelines.cache_build import build_cache, open_sources, plan_block, refresh_cache
from pipelines.cli import main
from pipelines.prefix_worker import PrefixWorker
from storage.reader import open_cache
from storage.values import encode
from tests.pipeline_fixtures import quiet

LOSSY = ["int8", "fp8_e4m3"]


@pytest.mark.parametrize("dtype", LOSSY)
def test_refresh_from_a_lossy_cache_is_refused_before_anything_is_written(tiny_run, dtype, capsys):
    cfg = tiny_run(f"cache.dtype={dtype}")
    build_cache(cfg, 1, log=quiet)
    root = Path(cfg.cache.root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(ConfigError, match=rf"cache.dtype={dtype} is lossy.*cache build --block 2"):
        refresh_cache(cfg, 2, log=quiet)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    # the command line: one line, exit 2
    code = main(["cache", "refresh", "--block", "2", "--set", f"run.dir={cfg.run.dir}",
                 *[a for s in _sets(cfg) for a in ("--set", s)]])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "is lossy" in err and "Traceback" not in err
    # a build of boundary 2 works and is what its fingerprint names
    built = build_cache(cfg, 2, log=quiet)
    assert built["action"] == "built"
    for fp in built["fingerprints"].values():
        assert open_cache(cfg.cache.root, fp, expected_fingerprint=fp).verify() == []


def _sets(cfg) -> list[str]:
    from tests.pipeline_fixtures import TINY

    return [*TINY, f"cache.dtype={cfg.cache.dtype}"]


@pytest.mark.slow
@pytest.mark.functional
@pytest.mark.parametrize("dtype", LOSSY)
def test_a_refresh_would_not_hold_the_build_bytes(tiny_run, tmp_path, dtype):
    """Why the refusal: what a refresh would store (block 1 run on the dequantized boundary 1,
    quantized again) is not what the build of boundary 2 stored (blocks 0-1 in fp32, quantized
    once) under the fingerprint both would claim. A lossless dtype stores the same bytes."""
    stored = {}
    for d in (dtype, "fp32"):
        cfg = tiny_run(f"cache.dtype={d}", f"cache.root={tmp_path / d}")
        build_cache(cfg, 1, log=quiet)
        fp = build_cache(cfg, 2, log=quiet)["fingerprints"]["train"]
        src = plan_block(cfg, 1).fingerprints["train"]
        choice = open_sources(cfg).compute
        w = PrefixWorker(cfg, 2, 1, {fp: src}, choice.compute, choice.round_to)
        try:
            built = open_cache(cfg.cache.root, fp)
            hidden = w._compute(w._read_source(fp, 0, built.num_samples))[0]  # (n, S, H)
        finally:
            w.close()
        stored[d] = (encode(hidden, d)[0], built.read_stored(0, built.num_samples)[0])
    assert stored["fp32"][0].tobytes() == stored["fp32"][1].tobytes()
    refreshed, build = stored[dtype]
    assert refreshed.shape == build.shape and refreshed.tobytes() != build.tobytes()


@pytest.mark.parametrize("dtype", LOSSY)
def test_rotation_builds_lossy_boundaries_from_tokens(tiny_run, dtype):
    cfg = tiny_run(f"cache.dtype={dtype}", "train.max_steps=2", "train.eval_every=0")
    res = run_bcd(cfg, log=quiet)
    assert [v["cache"] for v in res["visits"]] == ["tokens", "built", "built"]
    events = json.loads((Path(cfg.run.dir) / "state.json").read_text())["events"]
    assert [e["action"] for e in events if e.get("boundary") == 2] == ["built"]
