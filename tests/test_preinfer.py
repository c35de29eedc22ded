"""Pre-inference (in process; on Ray actors where marked `ray`): parity with the model's own
forward, refresh == build, faults, resume."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import ConfigError
from core.faults import DIE_ONCE
from pipelines.cache_build import build_cache, open_sources, open_writers, plan_block, refresh_cache
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks
from preinfer.schedule.rotation import val_indices
from storage.reader import open_cache
from storage.tokens import TokenStore
from tests.pipeline_fixtures import quiet


def reference(cfg, block, split, dtype, round_to=None):
    """The model's own forward to `block`, in the same micro-batches the workers use; with
    round_to, one block at a time, each block's output rounded to round_to (then back to dtype)."""
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load(range(ckpt.num_blocks))
    model.to(dtype).eval()
    store = TokenStore(cfg.data.out_dir)
    fp = plan_block(cfg, block).fingerprints[split]
    cache = open_cache(cfg.cache.root, fp, expected_fingerprint=fp)
    ids = torch.from_numpy(store.read(split, 0, store.num_samples(split))[:, :-1]).long()
    ids = ids[cache.read_labels(0, cache.num_samples)[1]]  # (N, S) in cache row order
    out = []
    mb = cfg.preinfer.micro_batch
    with torch.inference_mode():
        for i in range(cache.num_shards):
            a, b = cache.shard_range(i)
            for s in range(a, b, mb):
                x = ids[s : min(b, s + mb)]
                if round_to is None:
                    out.append(forward_blocks(adapter, ckpt.partition, x, 0, block))
                    continue
                for k in range(block):
                    x = forward_blocks(adapter, ckpt.partition, x, k, k + 1).to(round_to)
                    x = x if k == block - 1 else x.to(dtype)
                out.append(x)
    return cache, torch.cat(out)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_compressing_micro_batches_while_computing_writes_the_same_bytes(tiny_run, tmp_path,
                                                                         dtype):  # fmt: skip
    """preinfer.write_queue > 0 (each micro-batch compressed while the next computes, the
    queue smaller than a shard's micro-batches) writes the bytes of write_queue = 0 (whole
    shards compressed after their compute); a lossy dtype falls back to whole shards."""
    fps, files = None, []
    for q in (0, 1):
        cfg = tiny_run(f"cache.root={tmp_path / str(q)}", f"preinfer.write_queue={q}",
                       "preinfer.micro_batch=4", f"cache.dtype={dtype}", "cache.codec=blosc-zstd",
                       "cache.shuffle=byte", "preinfer.executor=local")  # fmt: skip
        res = build_cache(cfg, 2, log=quiet)
        assert fps in (None, res["fingerprints"])
        fps = res["fingerprints"]
        caches = [open_cache(cfg.cache.root, fp) for fp in fps.values()]
        assert all(c.verify() == [] for c in caches)
        assert caches[0].manifest["header"]["rows_per_shard"] % 4  # a short last micro-batch
        files.append([s["files"] for c in caches for s in c.manifest["shards"]])
    assert files[0] == files[1]  # same checksums and sizes: the same bytes


def test_auto_executor_runs_in_process_on_one_machine_and_on_actors_across_nodes(
    tiny_run, monkeypatch
):
    """preinfer.executor=auto: in process on one machine (actors there only add start-up and
    a copy of the weights per actor), Ray actors for a cluster job (RAY_ADDRESS) or a node
    with several GPUs (one actor per GPU); an explicit choice stands."""
    from pipelines.cache_build import executor

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = tiny_run("preinfer.executor=auto")
    assert executor(cfg) == "local"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert executor(cfg) == "ray" and executor(tiny_run("run.device=cpu")) == "local"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert executor(cfg) == "ray" and executor(tiny_run("preinfer.executor=local")) == "local"


def test_write_queue_must_not_be_negative(tiny_run):
    with pytest.raises(ConfigError, match="preinfer.write_queue must be >= 0"):
        tiny_run("preinfer.write_queue=-1")


def test_fp32_cache_equals_model_forward_and_is_reused(tiny_run):
    cfg = tiny_run()
    res = build_cache(cfg, 2, log=quiet)
    assert res["action"] == "built" and res["shards"] >= 4
    for split in ("train", "val"):
        cache, ref = reference(cfg, 2, split, torch.float32)
        hidden, labels = cache.read_rows(0, cache.num_samples)[:2]
        torch.testing.assert_close(hidden, ref, atol=1e-6, rtol=1e-6)
        assert cache.verify() == []
    again = build_cache(cfg, 2, log=quiet)
    assert again["action"] == "reused" and again["fingerprints"] == res["fingerprints"]


def test_bf16_cache_equals_bf16_forward(tiny_run):
    cfg = tiny_run("cache.dtype=bf16", "preinfer.compute_dtype=bf16")
    build_cache(cfg, 2, log=quiet)
    cache, ref = reference(cfg, 2, "val", torch.bfloat16)
    hidden = cache.read_rows(0, cache.num_samples, dtype=torch.bfloat16)[0]
    assert hidden.dtype == torch.bfloat16
    assert torch.equal(hidden, ref)
    assert cache.manifest["meta"]["compute_dtype"] == "bf16"


def test_bf16_cache_from_fp32_compute_equals_per_block_rounded_forward(tiny_run):
    """Where bf16 is not native (forced here on any machine): each block computes in fp32 and
    its output is rounded to bf16, so the hidden entering every block is what a cache holds."""
    cfg = tiny_run("cache.dtype=bf16", "preinfer.compute_dtype=fp32")
    res = build_cache(cfg, 2, log=quiet)
    cache, ref = reference(cfg, 2, "val", torch.float32, round_to=torch.bfloat16)
    hidden = cache.read_rows(0, cache.num_samples, dtype=torch.bfloat16)[0]
    assert torch.equal(hidden, ref)
    assert cache.manifest["meta"]["compute_dtype"] == "fp32"
    _, whole = reference(cfg, 2, "val", torch.float32)  # rounding only at the end differs
    assert not torch.equal(hidden, whole.to(torch.bfloat16))
    # a compute dtype other than the stored one enters the fingerprint; the stored dtype's own
    # does not (caches written before compute_dtype existed keep theirs)
    bf = plan_block(tiny_run("cache.dtype=bf16", "preinfer.compute_dtype=bf16"), 2).fingerprints
    assert bf != res["fingerprints"]
    fp32 = tiny_run("preinfer.compute_dtype=fp32")
    auto = tiny_run()
    assert plan_block(fp32, 2).fingerprints == plan_block(auto, 2).fingerprints


def test_auto_compute_dtype_follows_the_hardware(monkeypatch):
    from preinfer.runtime import device

    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: False)
    # AVX2; AVX512-BF16 without AMX (bf16 slower than fp32 there); AMX-BF16
    cases = ((False, False, ("fp32", "bf16")), (True, False, ("fp32", "bf16")),
             (True, True, ("bf16", None)))  # fmt: skip
    for native, amx, want in cases:
        monkeypatch.setattr(device, "cpu_native_bf16", lambda n=native: (n, "TEST"))
        monkeypatch.setattr(device, "cpu_amx_bf16", lambda a=amx: a)
        c = device.compute_dtype("auto", "bf16")
        assert (c.compute, c.round_to) == want and "TEST" in c.reason
    assert device.compute_dtype("auto", "bf16", "cuda").compute == "bf16"
    assert device.compute_dtype("auto", "int8").compute == "fp32"
    assert device.compute_dtype("fp32", "fp16").round_to == "fp16"
    with pytest.raises(ConfigError, match="compute_dtype"):
        device.compute_dtype("fp8", "bf16")


def test_native_bf16_detection_matches_the_cpus_own_flags():
    """The real detection (no patch): native bf16 iff the kernel lists a bf16 matmul flag for
    this CPU (x86: avx512_bf16 / amx_bf16; Arm: bf16 / svebf16); auto computes in bf16 iff
    it lists amx_bf16."""
    from preinfer.runtime import device

    text = Path("/proc/cpuinfo").read_text()
    flags = set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags |= set(val.split())
    assert flags, "no CPU flags in /proc/cpuinfo"
    want = bool(flags & {"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
    native, name = device.cpu_native_bf16()
    assert native == want, (name, sorted(flags & {"avx512_bf16", "amx_bf16", "bf16", "svebf16"}))
    choice = device.compute_dtype("auto", "bf16", "cpu")
    amx = "amx_bf16" in flags
    assert (choice.compute, choice.round_to) == (("bf16", None) if amx else ("fp32", "bf16"))


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_bf16_refresh_equals_build_bit_exact(tiny_run, tmp_path, compute):
    cfg = tiny_run("cache.dtype=bf16", f"preinfer.compute_dtype={compute}")
    build_cache(cfg, 1, log=quiet)
    res = refresh_cache(cfg, 2, log=quiet)
    other = tiny_run(
        "cache.dtype=bf16", f"preinfer.compute_dtype={compute}", f"cache.root={tmp_path / 'o'}"
    )
    built = build_cache(other, 2, log=quiet)
    assert built["fingerprints"] == res["fingerprints"]
    for fp in res["fingerprints"].values():
        a = open_cache(cfg.cache.root, fp).read_rows(
            0, open_cache(cfg.cache.root, fp).num_samples, dtype=torch.bfloat16
        )[0]
        b = open_cache(other.cache.root, fp).read_rows(0, len(a), dtype=torch.bfloat16)[0]
        assert torch.equal(a, b)


def test_refresh_equals_build_bit_exact(tiny_run, tmp_path):
    cfg = tiny_run()
    with pytest.raises(ConfigError, match="no current boundary-1 cache"):
        refresh_cache(cfg, 2, log=quiet)
    build_cache(cfg, 1, log=quiet)
    res = refresh_cache(cfg, 2, log=quiet)
    assert res["action"] == "refreshed"
    other = tiny_run(f"cache.root={tmp_path / 'other_cache'}")
    built = build_cache(other, 2, log=quiet)
    assert built["fingerprints"] == res["fingerprints"]
    for split, fp in res["fingerprints"].items():
        src = open_cache(cfg.cache.root, fp)
        a = src.read_rows(0, src.num_samples)[0]
        b = open_cache(other.cache.root, fp).read_rows(0, a.shape[0])[0]
        assert torch.equal(a, b), split


@pytest.mark.ray
def test_actor_dying_on_first_shard_gives_identical_cache(tiny_run, tmp_path, monkeypatch):
    clean = tiny_run(f"cache.root={tmp_path / 'clean'}")
    build_cache(clean, 1, log=quiet)
    marker = tmp_path / "died"
    monkeypatch.setenv(DIE_ONCE, str(marker))
    faulty = tiny_run(f"cache.root={tmp_path / 'faulty'}", "preinfer.executor=ray")
    res = build_cache(faulty, 1, log=quiet)
    assert marker.exists(), "the fault switch did not fire"
    for fp in res["fingerprints"].values():
        a = open_cache(clean.cache.root, fp)
        b = open_cache(faulty.cache.root, fp)
        assert a.verify() == [] and b.verify() == []
        assert a.manifest["shards"] == b.manifest["shards"]  # same checksums: same bytes


def test_interrupted_build_recomputes_only_missing_shards(tiny_run):
    cfg = tiny_run()
    full = build_cache(cfg, 2, log=quiet)
    fp = full["fingerprints"]["train"]
    cdir = os.path.join(cfg.cache.root, fp)
    # the state a killed driver leaves: no manifest, some shards without done markers
    os.remove(os.path.join(cdir, "manifest.json"))
    markers = sorted(os.listdir(os.path.join(cdir, "done")))
    for name in markers[1::2]:
        os.remove(os.path.join(cdir, "done", name))
    with pytest.raises(Exception, match="manifest"):
        open_cache(cfg.cache.root, fp)
    res = build_cache(cfg, 2, log=quiet)
    assert res["action"] == "built"
    assert res["shards"] == len(markers[1::2])
    cache = open_cache(cfg.cache.root, fp, expected_fingerprint=fp)
    assert cache.verify() == []


def test_sampling_is_deterministic_and_fingerprinted(tiny_run):
    cfg = tiny_run("preinfer.sample_fraction=0.5")
    p0 = {p.split: p for p in plan_block(cfg, 1, 0).caches}
    p0b = {p.split: p for p in plan_block(cfg, 1, 0).caches}
    p1 = {p.split: p for p in plan_block(cfg, 1, 1).caches}
    n = TokenStore(cfg.data.out_dir).num_samples("train")
    assert len(p0["train"].indices) == round(n * 0.5)
    np.testing.assert_array_equal(p0["train"].indices, p0b["train"].indices)
    assert not np.array_equal(p0["train"].indices, p1["train"].indices)
    assert p0["train"].fingerprint != p1["train"].fingerprint
    assert p0["val"].fingerprint == p1["val"].fingerprint  # val is never sampled
    full = {p.split: p for p in plan_block(tiny_run(), 1, 0).caches}
    assert full["train"].fingerprint != p0["train"].fingerprint


def test_train_rows_are_stored_in_a_seeded_shuffled_order(tiny_run):
    """Train caches mix the corpus in every shard (val stays in token order); the order is
    part of the fingerprint and shared by every boundary of a round."""
    cfg = tiny_run()
    build_cache(cfg, 1, log=quiet)
    build_cache(cfg, 2, log=quiet)
    store = TokenStore(cfg.data.out_dir)
    fps = {b: plan_block(cfg, b).fingerprints for b in (1, 2)}
    ids = {}
    for b in (1, 2):
        for split in ("train", "val"):
            c = open_cache(cfg.cache.root, fps[b][split])
            labels, sids = c.read_labels(0, c.num_samples)
            ids[b, split] = sids.numpy()
            rows = store.read_indices(split, np.sort(sids.numpy()))
            want = torch.from_numpy(rows[np.argsort(np.argsort(sids.numpy())), 1:]).long()
            assert torch.equal(labels, want)  # each row's labels are its sample's
    n = store.num_samples("train")
    assert sorted(ids[1, "train"]) == list(range(n))
    assert not np.array_equal(ids[1, "train"], np.arange(n))  # shuffled ...
    assert np.array_equal(ids[1, "train"], ids[2, "train"])  # ... the same at every boundary
    # val: the rows the evaluations read (eval_batches x batch_size spread over val by
    # train.seed, issue #58), in token order
    nv, k = store.num_samples("val"), cfg.train.eval_batches * cfg.train.batch_size
    assert nv > k and np.array_equal(ids[1, "val"], val_indices(nv, k, cfg.train.seed))
    other = plan_block(tiny_run("train.seed=5"), 1).fingerprints
    assert other["train"] != fps[1]["train"] and other["val"] != fps[1]["val"]


def _worker_run(cfg, block, first):
    """Every missing shard of boundary `block` written by ONE in-process PrefixWorker call
    per cache (the pipelined path: prefetch + background write), then finalized."""
    from pipelines.prefix_worker import PrefixWorker
    from storage.cache import CacheWriter

    src = open_sources(cfg)
    plan = plan_block(cfg, block, src=src)
    work = open_writers(cfg, src, plan, plan.reads, {})  # (cache, its missing shards)
    prev = plan.reads.source.caches if first else plan.caches
    w = PrefixWorker(
        cfg.to_dict(),
        block,
        first,
        {p.fingerprint: q.fingerprint for p, q in zip(plan.caches, prev, strict=True)},
        src.compute.compute,
        src.compute.round_to,
    )
    for p, missing in work:
        out = w({"fingerprint": np.array([p.fingerprint] * len(missing)),
                 "shard": np.array(missing)})  # fmt: skip
        assert list(out["shard"]) == missing and (out["write_s"] > 0).all()
        CacheWriter.open(cfg.cache.root, p.fingerprint).finalize()
    return plan.fingerprints


@pytest.mark.ray
def test_worker_call_of_several_shards_equals_ray_build(tiny_run, tmp_path, monkeypatch):
    from pipelines.cache_build import shards_per_task
    from storage.cache import CacheWriter

    assert [shards_per_task(tiny_run(), n, 2) for n in (1, 3, 4, 8, 39)] == [1, 1, 1, 2, 2]
    ref = tiny_run(f"cache.root={tmp_path / 'ray'}", "preinfer.executor=ray")
    build_cache(ref, 1, log=quiet)
    fps = build_cache(ref, 2, log=quiet)["fingerprints"]
    cfg = tiny_run(f"cache.root={tmp_path / 'inproc'}")
    _worker_run(cfg, 1, 0)  # build, boundary 1
    assert _worker_run(cfg, 2, 1) == fps  # refresh of boundary 2 from it
    for fp in fps.values():
        a, b = open_cache(ref.cache.root, fp), open_cache(cfg.cache.root, fp)
        assert a.verify() == [] and b.verify() == []
        assert a.manifest["shards"] == b.manifest["shards"]  # same checksums: same bytes
    # a write failing mid-call: the call raises, shards before it stay committed, no partials
    bad = tiny_run(f"cache.root={tmp_path / 'bad'}")
    real = CacheWriter.write_shard

    def fail_second(self, i, hidden, **kw):
        if i == 1:
            raise OSError(28, "No space left on device")
        return real(self, i, hidden, **kw)

    monkeypatch.setattr(CacheWriter, "write_shard", fail_second)
    with pytest.raises(OSError, match="No space"):
        _worker_run(bad, 1, 0)
    monkeypatch.setattr(CacheWriter, "write_shard", real)
    src = open_sources(bad)
    plan = plan_block(bad, 1, src=src)
    train, missing = open_writers(bad, src, plan, plan.reads, {})[0]
    assert train.split == "train" and 0 not in missing and 1 in missing
    assert not list((tmp_path / "bad").rglob("*.partial"))


def test_a_visit_caches_exactly_the_rows_it_reads_and_refresh_keeps_them(tiny_run):
    """train.epochs=2 with 6 steps of 8: the round's cache holds the 24 rows the visit reads
    twice (not the whole split), boundary 2 (refreshed) holds the same rows in the same order,
    val holds the rows the evaluations read, and block 0 reads those rows from tokens."""
    from preinfer.run.visit import Visit, VisitSpec
    from preinfer.schedule.rotation import sample_indices, store_budget

    cfg = tiny_run("train.epochs=2")
    store = TokenStore(cfg.data.out_dir)
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, store)
    assert (budget.rows, budget.steps, budget.val_rows) == (24, 6, 16)
    assert store.num_samples("train") > 24 and store.num_samples("val") > 16
    assert budget.passes == 2.0 and "max_steps 6 x batch 8 / epochs 2" in budget.why
    rows = sample_indices(budget, "train", 0)
    build_cache(cfg, 1, log=quiet)
    assert refresh_cache(cfg, 2, log=quiet)["action"] == "refreshed"
    ids = {}
    for b in (1, 2):
        for p in plan_block(cfg, b).caches:
            c = open_cache(cfg.cache.root, p.fingerprint)
            ids[b, p.split] = c.read_labels(0, c.num_samples)[1].numpy()
    assert np.array_equal(np.sort(ids[1, "train"]), rows)
    assert np.array_equal(ids[1, "train"], ids[2, "train"])  # refresh keeps rows and order
    assert np.array_equal(ids[2, "val"], val_indices(store.num_samples("val"), 16, 0))
    v0 = Visit(cfg, VisitSpec(block=0), device=torch.device("cpu"))
    assert np.array_equal(np.sort(v0.batches.rows), rows) and v0.tc.max_steps == 6
    # a budget that is not the old rule's gets its own fingerprint; the old rule keeps its own
    legacy = plan_block(tiny_run(), 1).fingerprints
    assert legacy["train"] != plan_block(cfg, 1).fingerprints["train"]
