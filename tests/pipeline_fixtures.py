"""A tiny run (tokens + checkpoint) built once per session and copied per test."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from preinfer.checkpoint.store import Checkpoint
from preinfer.run.config import load_config
from storage.cache import CacheWriter
from storage.config import CacheConfig

TINY = [
    "model.arch=gpt2",
    "model.vocab_size=320",
    "model.hidden_size=32",
    "model.num_layers=4",
    "model.num_heads=2",
    "model.max_positions=64",
    # the tied GPT-2 these tests were written on (demo.yaml unties it since #42); tests of the
    # untied layout set model.tie_embeddings=false
    "model.tie_embeddings=true",
    # the settings these tests were written on (the defaults since #42 are tested in
    # tests/test_defaults.py, test_always_train.py and test_visit_rows.py)
    "train.always_train=[]",
    "train.cache_visits=1",
    "data.max_documents=8",
    "data.vocab_size=300",
    "data.seq_len=16",
    "data.val_fraction=0.25",
    "data.shard_rows=500",
    "partition.num_blocks=3",
    "cache.dtype=fp32",
    "cache.shard_mb=0.05",
    "cache.codec=zstd",
    "cache.shuffle=none",
    "preinfer.actors=2",
    "preinfer.micro_batch=32",
    "train.batch_size=8",
    "train.max_steps=6",
    "train.warmup_steps=2",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.workers=0",
    "train.lr=0.003",
    "train.checkpoint_every=2",
    "train.epochs=null",  # every train row cached (tests of the epochs budget set it)
    # run.precision=auto is bf16 on an AVX512-BF16 CPU, fp32 on AVX2: the trained bytes these
    # tests compare must not depend on the machine (tests/test_precision.py runs bf16)
    "run.precision=fp32",
]


def tiny_cfg(run_dir, *extra):
    return load_config("configs/demo.yaml", [f"run.dir={run_dir}", *TINY, *extra])


def quiet(*a, **k):
    pass


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    from pipelines.init import run_init
    from pipelines.tokenize import run_tokenize

    base = tmp_path_factory.mktemp("tiny_base")
    cfg = tiny_cfg(base)
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    return base


@pytest.fixture
def tiny_run(tiny_base, tmp_path):
    """A fresh copy of the tiny run's tokens + checkpoint; returns a factory of configs."""
    run = tmp_path / "run"
    shutil.copytree(tiny_base, run)

    def make(*extra):
        return tiny_cfg(run, *extra)

    return make


def write_small_cache(
    root, fp: str, N: int = 24, S: int = 8, H: int = 16, row_labels: bool = False
) -> None:
    """A complete 3-shard bf16 cache <root>/<fp> (root local or s3://) of seeded values; with
    row_labels, row i's labels are all i (a batch's labels name its rows), else zeros."""
    c = CacheConfig(dtype="bf16", codec="zstd", shuffle="none", shard_mb=8 * S * H * 2 / 2**20)
    ids = np.repeat(np.arange(N)[:, None], S, 1) if row_labels else np.zeros((N, S), int)
    w = CacheWriter.create(
        root, fp, samples=(np.arange(N), ids, ids), seq_len=S, hidden_size=H, cache_cfg=c,
        meta={"boundary": 1, "split": "train"},
    )  # fmt: skip
    x = torch.randn(N, S, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    w.finalize()


def assert_same_weights(a_dir, b_dir, atol: float = 1e-4, share: float = 0.01) -> None:
    """Two checkpoints trained alike by different processes hold the same weights: bit for bit
    where the processes computed alike; else at most `share` of each block's values more than
    atol apart. On an Intel CPU with MKL about 1 fresh process in 30 computes its first products
    an ulp or two apart (docs/failures.md); Adam turns that into ~1e-6, and where a gradient
    is near zero and flips sign, into one lr-sized step (seen: 1 value in 1,024). A step
    trained twice or skipped, or other data, moves nearly every value by ~lr (1e-3)."""
    a, b = Checkpoint.open(a_dir), Checkpoint.open(b_dir)
    assert a.num_blocks == b.num_blocks
    for i in range(a.num_blocks):
        if a.block_hash(i) == b.block_hash(i):
            continue
        (ma, ada), (mb, adb) = a.load([i]), b.load([i])
        sa, sb = a.block_state(ma, ada, i), b.block_state(mb, adb, i)
        assert sorted(sa) == sorted(sb), i
        assert all(sa[n].shape == sb[n].shape for n in sa), i
        far = sum(int(((sa[n] - sb[n]).abs() > atol).sum()) for n in sa)
        total = sum(sa[n].numel() for n in sa)
        assert far <= share * total, f"block {i}: {far} of {total} values differ by > {atol}"
