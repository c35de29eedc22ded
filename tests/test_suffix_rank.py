"""train.suffix_rank (issue #41, lever 1): a bcd visit of block K also trains LoRA adapters on the
layer linears of blocks K+1..M-1 in the same backward, merges them at its end and commits those
blocks with block K in its one commit (preinfer/train/suffix.py). Blocks 0..K-1 (every cache's
prefix) never change; the checkpoint and the export stay plain models."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core.config import ConfigError
from pipelines.bcd import run_bcd
from pipelines.cache_build import build_cache, plan_block
from pipelines.export import run_export
from preinfer.checkpoint.init import init_checkpoint
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks, get_adapter
from preinfer.model.modeling import build_model, default_intermediate
from preinfer.model.partition import partition_model
from preinfer.model.shape import model_shape
from preinfer.plan.memory import setup_for, trainer_memory
from preinfer.run.visit import Visit, VisitHooks, VisitSpec, state_path
from preinfer.train.suffix import SuffixAdapters, adapter_linear_dims, suffix_linears
from storage.reader import open_cache
from tests.conftest import ARCHS, tiny_input_ids, tiny_model_config
from tests.pipeline_fixtures import quiet

CPU = torch.device("cpu")
FAST = ("train.eval_every=0", "train.checkpoint_every=0", "train.max_steps=2")
SUFFIX = ("train.suffix_rank=4",)
LLAMA = ("model.arch=llama", "model.tie_embeddings=false", "model.num_kv_heads=1")


def blocks(cfg) -> list[dict[str, torch.Tensor]]:
    """Every block's tensors as the checkpoint holds them now (clones)."""
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load()
    return [
        {n: t.clone() for n, t in ckpt.block_state(model, adapter, b).items()}
        for b in range(ckpt.num_blocks)
    ]


def changed(before: dict, after: dict) -> set[str]:
    assert set(before) == set(after)  # the same tensors: no adapter tensor came in
    return {n for n in before if not torch.equal(before[n], after[n])}


def visit(cfg, block: int, mode: str = "bcd-recompute", fps=None, hooks=None) -> dict:
    spec = VisitSpec(block=block, mode=mode, shuffle=False,
                     cache_train=fps and fps["train"], cache_val=fps and fps["val"])  # fmt: skip
    return Visit(cfg, spec, device=CPU, hooks=hooks).run(log=quiet)


def linear_weights(cfg, block: int, modules: str = "all") -> set[str]:
    """The weight names of the layer linears suffix_linears selects in blocks block+1..M-1."""
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    _, adapter = ckpt.load()
    return {f"{n}.weight" for n, _ in suffix_linears(adapter, ckpt.partition, block, modules)}


def file_keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


@pytest.fixture
def llama_run(tiny_run):
    def make(*extra, blocks: int = 3):
        cfg = tiny_run(*LLAMA, f"partition.num_blocks={blocks}", *extra)
        init_checkpoint(cfg.model, blocks, cfg.run.checkpoint, force=True)
        return cfg

    return make


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_visit_trains_its_suffix_and_leaves_its_prefix_bit_identical(tiny_run, llama_run, arch):
    """Block 1's visit changes block 1 and exactly the layer linears' weights of block 2 (GPT-2:
    Conv1D, LLaMA: nn.Linear); block 0 (the cache's prefix) keeps its file's bytes; biases,
    norms and the head do not move; no adapter tensor reaches the checkpoint."""
    cfg = (tiny_run if arch == "gpt2" else llama_run)(*FAST, *SUFFIX)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    file0, tensors = ckpt.block_file(0).read_bytes(), dict(ckpt.index["blocks"][2]["specs"])
    before = blocks(cfg)
    summary = visit(cfg, 1)
    after = blocks(cfg)
    assert Checkpoint.open(cfg.run.checkpoint).block_file(0).read_bytes() == file0
    assert changed(before[0], after[0]) == set()
    assert changed(before[1], after[1])
    want = linear_weights(cfg, 1)
    assert want and changed(before[2], after[2]) == want
    assert summary["suffix_params"] > 0
    # the memory planner counts the adapters the visit trained (+ their state, activations)
    sh, part = model_shape(cfg.model), Checkpoint.open(cfg.run.checkpoint).partition
    setup = setup_for(
        sh,
        cfg.train,
        cfg.cache,
        cfg.preinfer,
        target="cpu",
        seq=cfg.data.seq_len,
        token_rows=cfg.data.shard_rows,
        run_precision=cfg.run.precision,
    )
    est = trainer_memory(sh, part, "bcd", 1, setup)
    assert est["suffix_params"] == summary["suffix_params"]
    off = dataclasses.replace(setup, suffix_rank=0)
    assert est["peak"] > trainer_memory(sh, part, "bcd", 1, off)["peak"]
    # the checkpoint stays a plain model: block files and kept optimizer state name its tensors
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert ckpt.index["blocks"][2]["specs"] == tensors
    for f in ckpt.path.glob("*.safetensors"):
        assert not [k for k in file_keys(f) if "lora" in k], f.name


def test_the_export_holds_no_adapter_tensor(tiny_run, tmp_path):
    cfg = tiny_run(*FAST, *SUFFIX)
    plain = run_export(cfg, str(tmp_path / "before"), log=quiet)
    visit(cfg, 0)
    run_export(cfg, str(tmp_path / "after"), log=quiet)
    keys = [file_keys(tmp_path / d / "model.safetensors") for d in ("before", "after")]
    assert keys[0] == keys[1] and "model.safetensors" in plain["files"]
    # the merged suffix is what the export holds (block 2's layer 3 trained through block 0's)
    name = "transformer.h.3.mlp.c_fc.weight"
    w = []
    for d in ("before", "after"):
        with safe_open(str(tmp_path / d / "model.safetensors"), framework="pt") as f:
            w.append(f.get_tensor(name))
    assert not torch.equal(w[0], w[1])


def test_suffix_rank_0_leaves_the_suffix_bit_identical(tiny_run):
    cfg = tiny_run(*FAST)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    files = [ckpt.block_file(b).read_bytes() for b in (0, 2)]
    assert visit(cfg, 1)["suffix_params"] == 0
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert [ckpt.block_file(b).read_bytes() for b in (0, 2)] == files


def test_suffix_modules_selects_attention_or_mlp(llama_run):
    cfg = llama_run(*FAST, *SUFFIX, "train.suffix_modules=mlp")
    before = blocks(cfg)
    visit(cfg, 0)
    after = blocks(cfg)
    mlp, attn = linear_weights(cfg, 0, "mlp"), linear_weights(cfg, 0, "attn")
    assert mlp and attn and not mlp & attn
    assert all("mlp" in n for n in mlp) and all("self_attn" in n for n in attn)
    assert changed(before[1], after[1]) | changed(before[2], after[2]) == mlp


def test_the_last_block_has_no_suffix(tiny_run):
    cfg = tiny_run(*FAST, *SUFFIX)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    files = [ckpt.block_file(b).read_bytes() for b in (0, 1)]
    assert visit(cfg, 2)["suffix_params"] == 0
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert [ckpt.block_file(b).read_bytes() for b in (0, 1)] == files


@pytest.mark.parametrize("optimizer, dtype", [("adamw", "fp32"), ("sgd", "fp32"),
                                              ("adamw", "bf16")])  # fmt: skip
def test_step_from_cache_equals_step_with_prefix_recomputed(tiny_run, tmp_path, optimizer, dtype):
    """As tests/test_train.py's parity test, with suffix adapters: two steps (the second one
    runs through adapters whose B moved) from the boundary-1 cache and with the prefix rerun
    end in the same block 1 and block 2, bit for bit (bf16: cache, prefix and autocast, the
    adapters' matmuls in bf16 too)."""
    over = (*SUFFIX, "train.max_steps=2", "train.eval_every=0", "train.warmup_steps=0",
            f"train.optimizer={optimizer}", f"cache.dtype={dtype}",
            f"preinfer.compute_dtype={dtype}", f"run.precision={dtype}")  # fmt: skip
    other = tmp_path / "recompute"
    shutil.copytree(tmp_path / "run", other)  # tokens + checkpoint, before either step
    cached = tiny_run(*over)
    before = blocks(cached)
    fps = build_cache(cached, 1, log=quiet)["fingerprints"]
    visit(cached, 1, "bcd", fps)
    recompute = tiny_run(*over, f"run.dir={other}")
    visit(recompute, 1, "bcd-recompute")
    a, b = blocks(cached), blocks(recompute)
    for k in (1, 2):
        for name, t in a[k].items():
            assert torch.equal(t, b[k][name]), (k, name)
    assert changed(before[2], a[2]) == linear_weights(cached, 1)
    assert changed(before[0], a[0]) == set()


@pytest.mark.parametrize("arch", ARCHS)
def test_merging_the_adapters_keeps_the_models_output(arch):
    """The forward with adapters attached equals the merged model's (fp32), and differs from
    the model without them; the planner's per-layer shapes are the linears attached."""
    torch.manual_seed(0)
    cfg = tiny_model_config(arch)
    model = build_model(cfg)
    adapter = get_adapter(model, arch)
    part = partition_model(adapter, 2)
    ids = tiny_input_ids(vocab=cfg.vocab_size)
    with torch.no_grad():
        plain = forward_blocks(adapter, part, ids, 0, 2)
    suffix = SuffixAdapters.attach(adapter, part, 0, rank=3, alpha=5.0, seed=(1,))
    assert suffix is not None and suffix.blocks == [1]
    with torch.no_grad():
        attached = forward_blocks(adapter, part, ids, 0, 2)
        torch.testing.assert_close(attached, plain, rtol=0, atol=0)  # B = 0: W x exactly
        for p in suffix.parameters()[1::2]:  # B: as after some training
            p.normal_(0, 0.2)
        attached = forward_blocks(adapter, part, ids, 0, 2)
        suffix.merge()
        merged = forward_blocks(adapter, part, ids, 0, 2)
    assert (attached - plain).abs().max() > 1e-3
    torch.testing.assert_close(merged, attached, rtol=1e-5, atol=1e-5)
    # the memory planner's (in, out) of one layer's adapted linears: those attached here
    first = f"{adapter.layer_prefix(part.layers(1)[0])}."
    shapes = [
        tuple(m.weight.shape) for n, m in suffix_linears(adapter, part, 0) if n.startswith(first)
    ]
    got = [s if arch == "gpt2" else s[::-1] for s in shapes]  # Conv1D (in, out), Linear (out, in)
    hf, H = getattr(model, "config", None), cfg.hidden_size
    inter = default_intermediate(cfg)
    kv = (getattr(hf, "num_key_value_heads", None) or cfg.num_heads) * (H // cfg.num_heads)
    assert sorted(got) == sorted(adapter_linear_dims(arch, H, inter, kv))


def _hash(cfg) -> list[str]:
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    return [ckpt.block_hash(b) for b in range(ckpt.num_blocks)]


class Stop(Exception):
    pass


def test_a_killed_visit_resumes_to_the_uninterrupted_weights(tiny_run, tmp_path):
    """A visit stopped after step 3 (its state saved at step 2, adapters included) and rerun
    ends with the blocks of an uninterrupted visit, bit for bit."""
    over = (*SUFFIX, "train.max_steps=5", "train.eval_every=3", "train.checkpoint_every=2")
    clean_dir = tmp_path / "clean"
    shutil.copytree(tmp_path / "run", clean_dir)
    cfg, clean = tiny_run(*over), tiny_run(*over, f"run.dir={clean_dir}")
    before = _hash(cfg)
    visit(clean, 1)

    def stop(v, step, val, seconds):
        if step == 3:
            raise Stop

    with pytest.raises(Stop):
        visit(cfg, 1, hooks=VisitHooks(on_eval=stop))
    assert _hash(cfg) == before  # nothing committed
    state = torch.load(state_path(cfg, VisitSpec(block=1, mode="bcd-recompute")),
                       weights_only=True)  # fmt: skip
    assert state["step"] == 2 and state["suffix"]["rank"] == 4
    n_suffix = len(linear_weights(cfg, 1)) * 2  # A (r, in) and B (out, r) per linear
    shapes = [t.shape for t in state["params"][-n_suffix:]]
    assert all(a[0] == b[1] == 4 for a, b in zip(shapes[::2], shapes[1::2], strict=True))
    with pytest.raises(ConfigError, match="train.suffix_rank=4"):
        visit(tiny_run(*over[1:], "train.suffix_rank=2"), 1)
    said = []
    spec = VisitSpec(block=1, mode="bcd-recompute", shuffle=False)
    Visit(cfg, spec, device=CPU).run(log=said.append)
    assert any("resumed bcd-recompute block 1 round 0 at step 2" in s for s in said)
    assert _hash(cfg) == _hash(clean)
    assert _hash(cfg)[2] != before[2]


@pytest.mark.parametrize("order, seed", [("descending", 0), ("random", 2)])
def test_a_rotation_reads_only_current_caches(llama_run, order, seed):
    """M=4, 2 rounds (random seed 2: [0, 3, 1, 2] then [3, 2, 1, 0]; descending keeps every
    boundary of its round): each visit's suffix changes blocks > K and never one below; every
    cache a visit reads is the one planned for the checkpoint as it is then, its prefix the
    checkpoint's current blocks 0..K-1."""
    cfg = llama_run(*FAST, *SUFFIX, f"train.order={order}", f"train.seed={seed}",
                    "train.rounds=2", blocks=4)  # fmt: skip
    read, starts = [], {}

    def check(v, default):
        starts[(v.spec.round, v.K)] = _hash(cfg)
        if v.from_cache:
            ckpt = Checkpoint.open(cfg.run.checkpoint)
            plans = plan_block(cfg, v.K, v.spec.round).fingerprints
            assert (v.spec.cache_train, v.spec.cache_val) == (plans["train"], plans["val"])
            for fp in (v.spec.cache_train, v.spec.cache_val):
                meta = open_cache(cfg.cache.root, fp).manifest["meta"]
                assert meta["prefix"] == ckpt.prefix_hash(v.K), (v.spec.round, v.K)
            read.append(v.K)
        return default

    def after(r, k, summary):
        was, now = starts[(r, k)], _hash(cfg)
        assert was[:k] == now[:k], (r, k)  # the prefix of block k: untouched
        assert all(a != b for a, b in zip(was[k:], now[k:], strict=True)), (r, k)
        assert (summary["suffix_params"] > 0) == (k < 3)

    res = run_bcd(cfg, log=quiet, hooks=VisitHooks(batches=check), on_visit=after)
    assert len(res["visits"]) == 8 and len(read) == 6  # block 0 reads tokens


@pytest.mark.parametrize(
    ("lr", "want"),
    [(3e-4, 3e-3),  # a fine-tune's lr: 10x, the measured best there
     (2e-3, 3e-3),  # a pretraining's: capped (10x = 2e-2 diverged to the unigram level, #53)
     (1e-2, 1e-2),  # above the cap: never below the block's own
     (1e-5, 1e-4)],
)  # fmt: skip
def test_the_null_suffix_lr_rule_holds_from_finetune_to_pretraining_lrs(lr, want):
    from preinfer.train.config import TrainConfig
    from preinfer.train.step import build_optimizer

    block, suffix = [torch.nn.Parameter(torch.zeros(2))], [torch.nn.Parameter(torch.zeros(2))]
    opt = build_optimizer(block, TrainConfig(lr=lr, suffix_rank=4), suffix)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr)
    assert opt.param_groups[1]["lr"] == pytest.approx(want)
    assert opt.param_groups[1]["lr_scale"] == pytest.approx(want / lr)
    # a set train.suffix_lr is the user's, whatever the block's lr
    opt = build_optimizer(block, TrainConfig(lr=lr, suffix_rank=4, suffix_lr=0.02), suffix)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.02)
