"""Peers: BCD with the cache against recompute, full fine-tuning, BAdam and LoRA (#27 item 6).

    python -m bench.peers --quick                       # make bench: 1 lr per arm, 4 steps of
        # batch 4 per block visit, 1 seed: 7.3 min on 2 CPUs at load average 9.7 -> 4.7
        # (bench/results/peers-quick-20261201-163112.json)
    nice -n 19 .venv/bin/python -m bench.peers --work runs/peers   # the full form, by hand: 3 lrs
        # per arm on seed 0, then seeds 1 and 2 at each arm's best lr, 30 steps of batch 8 per
        # block visit (28 arm runs; from the quick run's step times, several hours on 2 CPUs;
        # --work keeps the data, token store and init checkpoint for a rerun)
    python -m bench.peers --quick --model tiny --inline # a tiny random LLaMA, arms in this process
        # (tests/test_peers_bench.py; --inline: peak RSS is then not each arm's own)

Without the real model or the `real` extra (badam, peft) the default run prints why and
returns {"skipped": ...} (`make bench` runs every bench module's --quick form).

A real pretrained model (default models/smollm2-135m-instruct: SmolLM2-135M-Instruct, LLaMA
layout, tied embeddings; `make real-model` makes it) fine-tuned on offline instruction data:
prompt/response pairs built from the Python standard library's docstrings (prompt: the chat
turn "What does `module.name` do?", response: the first paragraph of its docstring; 1,200
pairs in a fixed hash order, deterministic for a Python version; the jsonl's sha256 is
recorded). One token store (configs/finetune.yaml, data.format=prompt_response: the loss
counts response tokens only) and one init checkpoint serve every arm. Arms:

  bcd            preinfer's rotation with the cache: pipelines.bcd.run_bcd (M blocks ascending,
                 train.max_steps steps per visit, 1 pass over each round's rows, AdamW, warmup +
                 cosine per visit, AdamW state kept across rounds: the product's defaults)
  bcd-recompute  the same rotation, the frozen prefix rerun every step (run_bcd mode
                 bcd-recompute), at bcd's lr: the cache's own saving, same visits
  full           plain transformers: AutoModelForCausalLM from the model dir, AdamW on every
                 parameter, one warmup + cosine over the run
  badam-layers   PyPI badam's BlockOptimizer over that HF model with its default block list
                 (one block per layer; embedding and final norm never trained), ascending, one
                 warmup + cosine over the run (BAdam's recipe); it switches block every
                 (M x steps per visit) / L steps, so a round visits every layer once
  badam-blocks   the same with preinfer's M blocks as its block list (the checkpoint's
                 partition: embedding + first layers, ..., last layers + final norm), ascending,
                 steps per visit steps per block: the rotation's blocks and steps
  lora           PyPI peft on that HF model: r 16, alpha 32, every linear layer of the
                 transformer ("all-linear"), AdamW, one warmup + cosine over the run

Every arm reads the same batches: the HF arms read, for visit (round r, block k), the batches
bcd-recompute (and bcd's block 0) reads (preinfer.trainer.TokenBatches over the round's sampled
rows, preinfer.cache_identity.sample_indices / row_order, seeded per visit); bcd's later
blocks read the same rows from the cache. Same steps in every arm (rounds x M x steps per
visit), batch, weight decay 1e-5, gradient clipping 1.0, fp32 (BAdam expects bf16 weights and
keeps fp32 copies of the active block; on an AVX2 CPU bf16 matmuls are ~50x slower, so the
model is fp32 and BAdam's copy duplicates the active block). The HF arms compute the LM head on
response positions only, as preinfer's loss does, so no arm pays the head where no label counts.

Measured: val loss (response tokens only, the first eval_batches x batch val rows, the same in
every arm: preinfer.loss.evaluate_tokens; for the bcd arms through `preinfer eval` of the run's
checkpoint, made in the parent process while the arm waits) after every visit's worth of steps,
against training seconds: everything the arm does (model load, cache builds, visits, commits,
the HF arms' final save_pretrained) less evaluations (the bench's, and the visit's own val
evaluation). Each arm runs in its own subprocess (`--child`): its peak RSS is the kernel's
high-water mark (VmHWM) polled every 10 ms after the imports, paused around the bench's
evaluations (the product resets it at every visit, preinfer.trainer.reset_peak_memory, so it is
polled, not read once). Arms interleave (the order rotates with the seed); the full form sweeps
each arm's lr on the first seed, then runs the other seeds at each arm's best lr (lowest final
val loss). Targets (issue #27): bcd's wall-clock to BAdam's final val loss / BAdam's (<= 0.8);
bcd's val loss at full's wall-clock / full's (stretch <= 1.0); bcd's peak RSS / BAdam's
(<= 1.0). Curve points are visit ends, so "time to reach" is the first visit end at or below.
One torch thread per arm by default (--threads): with other work on the 2 CPUs, two threads
spend their time waiting on each other (a 256x576x1536 matmul at load ~9: 24 GFLOP/s on one
thread, 8 on two).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.harness import headline_table, load_average, results_path, write_results
from pipelines.bcd import load_state, run_bcd
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.cache_identity import row_order, sample_indices, store_budget
from preinfer.checkpoint import Checkpoint
from preinfer.config import load_config
from preinfer.loss import evaluate_tokens, lm_loss
from preinfer.trainer import (
    TokenBatches,
    TrainConfig,
    current_memory_mb,
    endless,
    lr_at,
    peak_memory_mb,
    reset_peak_memory,
)
from preinfer.visit import VisitHooks
from storage.tokens import IGNORE, TokenStore

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "configs" / "finetune.yaml"
REAL_MODEL = ROOT / "models" / "smollm2-135m-instruct"
INSTALL = "run `make real-model` (or pip install -e '.[real]')"
CPU = torch.device("cpu")
ARMS = ("bcd", "bcd-recompute", "full", "badam-layers", "badam-blocks", "lora")
BCD_ARMS = ("bcd", "bcd-recompute")
WEIGHT_DECAY, GRAD_CLIP, BETAS = 1e-5, 1.0, (0.9, 0.999)  # preinfer's AdamW defaults, every arm
LORA_R, LORA_ALPHA = 16, 32
# SmolLM2's chat turns (its chat_template.jinja, without the default system turn); the token
# store ends every pair with <|endoftext|> after the response
PROMPT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
END = "<|im_end|>"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
             "lib2to3", "ensurepip"}  # fmt: skip


@dataclass
class Scale:
    """Sizes of one study."""

    pairs: int = 1200
    """Prompt/response pairs of the instruction set (stdlib docstrings)."""
    seq_len: int = 64
    """S: 95% of the pairs fit in S+1 tokens with SmolLM2's tokenizer (a pair is 36 tokens
    median, prompt + response + EOS; longer ones are dropped by the packer, and counted)."""
    batch_size: int = 8
    val_fraction: float = 0.1
    """Of the pairs, by preinfer's content hash: the val rows are fixed by the data."""
    M: int = 3
    steps_per_visit: int = 30
    """train.max_steps: steps of a bcd visit; every arm takes rounds x M x this many steps."""
    rounds: int = 1
    warmup_steps: int = 5
    """Linear warmup steps (bcd: of each visit; the others: of the run)."""
    eval_batches: int = 4
    """Val batches of every evaluation: the first eval_batches x batch_size val rows."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    lrs: dict[str, list[float]] = field(
        default_factory=lambda: {
            "bcd": [3e-5, 1e-4, 3e-4],
            "full": [1e-5, 3e-5, 1e-4],
            "badam-layers": [3e-5, 1e-4, 3e-4],
            "badam-blocks": [3e-5, 1e-4, 3e-4],
            "lora": [3e-4, 1e-3, 3e-3],
        }
    )
    """Peak lr swept per arm on the first seed (bcd-recompute runs at bcd's)."""


FULL = Scale()
QUICK = Scale(batch_size=4, steps_per_visit=4, warmup_steps=1, eval_batches=2, seeds=[0],
              lrs={"bcd": [1e-4], "full": [3e-5], "badam-layers": [1e-4],
                   "badam-blocks": [1e-4], "lora": [1e-3]})  # fmt: skip
# --model tiny: a random 6-layer LLaMA (H=32) with a BPE trained on the pairs; the test's size
TINY = Scale(pairs=240, seq_len=96, batch_size=4, val_fraction=0.2, steps_per_visit=2,
             warmup_steps=1, eval_batches=1, seeds=[0],
             lrs={"bcd": [3e-3], "full": [3e-3], "badam-layers": [3e-3], "badam-blocks": [3e-3],
                  "lora": [3e-3]})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Data and models


def stdlib_pairs(n: int) -> list[dict]:
    """n prompt/response pairs from the docstrings of the stdlib's public top-level functions and
    classes (read with ast, nothing imported): "What does `mod.name` do?" -> the docstring's
    first paragraph (30-300 characters, no doctest). Ordered by a hash of the name, so the set
    mixes modules and is the same on every run of one Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: dict[str, str] = {}
    for f in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = f.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        if SKIP_DIRS & set(rel.parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or any(p.startswith("_") for p in parts):
            continue
        try:
            tree = ast.parse(f.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            if not isinstance(node, kinds) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            para = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
            if 30 <= len(para) <= 300 and ">>>" not in para:
                found.setdefault(f"{'.'.join(parts)}.{node.name}", para)
    names = sorted(found, key=lambda k: hashlib.sha256(k.encode()).hexdigest())[:n]
    if len(names) < n:
        raise SystemExit(f"the stdlib gave {len(names)} docstring pairs, fewer than {n}")
    return [{"prompt": PROMPT.format(question=f"What does `{k}` do?"), "response": found[k] + END}
            for k in names]  # fmt: skip


def write_pairs(path: Path, pairs: list[dict]) -> str:
    """The jsonl (one pair a line, sorted keys); returns its sha256."""
    text = "".join(json.dumps(p, sort_keys=True, ensure_ascii=False) + "\n" for p in pairs)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


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


def common_overrides(sc: Scale, work: Path, model_dir: Path, jsonl: Path) -> list[str]:
    """configs/finetune.yaml's --set overrides every arm shares (run.dir, seed and lr are the
    run's own)."""
    return [
        "model.arch=llama", f"model.checkpoint={model_dir}", f"data.tokenizer={model_dir}",
        "data.format=prompt_response", f"data.source={jsonl}", "data.max_documents=null",
        f"data.seq_len={sc.seq_len}", f"data.val_fraction={sc.val_fraction}",
        f"data.out_dir={work / 'tokens'}", f"partition.num_blocks={sc.M}", "cache.dtype=bf16",
        f"train.batch_size={sc.batch_size}", f"train.max_steps={sc.steps_per_visit}",
        f"train.rounds={sc.rounds}", "train.epochs=1", f"train.warmup_steps={sc.warmup_steps}",
        "train.eval_every=0", f"train.eval_batches={sc.eval_batches}", "train.workers=0",
        "train.checkpoint_every=0", "run.device=cpu", "run.tensorboard=false",
        "preinfer.executor=local",
    ]  # fmt: skip


def eval_run(overrides: list[str], batches: int) -> float:
    """`preinfer eval` of a run's checkpoint over the first `batches` val batches: the val loss
    over response tokens."""
    return run_eval(load_config(FINETUNE, overrides), max_batches=batches, log=_quiet)["loss"]


# ---------------------------------------------------------------------------------------------
# What an arm measures about itself: training seconds and peak RSS, less evaluations


class Clock:
    """Seconds since start, less the spans spent evaluating."""

    def __init__(self):
        self.t0, self.excluded = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0 - self.excluded


class PeakRss:
    """The process's peak RSS (MiB) from now on: VmHWM polled every 10 ms on a thread (a visit
    resets it when it starts, so a single read at the end would miss earlier visits and cache
    builds), not counting the bench's own evaluations (`paused`)."""

    def __init__(self):
        reset_peak_memory(CPU)  # the imports' transients are not the arm's
        self.baseline = current_memory_mb(CPU)
        self.peak, self.lock, self.stopped = self.baseline, threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        self.peak = max(self.peak, peak_memory_mb(CPU))

    def _poll(self) -> None:
        while not self.stopped.wait(0.01):
            with self.lock:
                self._read()

    @contextlib.contextmanager
    def paused(self):
        """An evaluation: the peak so far is taken, and the high-water mark is reset after it."""
        with self.lock:
            self._read()
            try:
                yield
            finally:
                reset_peak_memory(CPU)

    def stop(self) -> float:
        self.stopped.set()
        self.thread.join()
        self._read()
        return self.peak


@contextlib.contextmanager
def evaluating(clock: Clock, mem: PeakRss):
    """A span of the bench's own evaluation: neither its time nor its memory is the arm's."""
    t = time.perf_counter()
    with mem.paused():
        yield
    clock.excluded += time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
# The arms (one per process, see child_main)


def bcd_arm(spec: dict, clock: Clock, mem: PeakRss, evaluate) -> dict:
    """preinfer's rotation (mode bcd or bcd-recompute) on a copy of the init checkpoint."""
    run = Path(spec["run_dir"])
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(spec["init"], run / "checkpoint")  # setup, before the clock starts
    ov = [*spec["overrides"], f"run.dir={run}", f"train.seed={spec['seed']}",
          f"train.lr={spec['lr']}"]  # fmt: skip
    cfg = load_config(FINETUNE, ov)
    curve = [{"steps": 0, "seconds": 0.0, "loss": spec["initial_loss"]}]
    visit_evals, steps = [], [0]

    def on_eval(_visit, _step: int, val: float, seconds: float) -> None:
        clock.excluded += seconds  # the visit's own val evaluation (from its cache for k > 0)
        visit_evals.append(val)

    def on_visit(r: int, k: int, summary: dict) -> None:
        steps[0] += int(summary["steps"])
        point = {"steps": steps[0], "seconds": clock.now(), "round": r, "block": k}
        with evaluating(clock, mem):
            point["loss"] = evaluate(ov)
        curve.append(point)

    clock.t0, clock.excluded = time.perf_counter(), 0.0
    out = run_bcd(cfg, mode=spec["arm"], log=_quiet, hooks=VisitHooks(on_eval=on_eval),
                  on_visit=on_visit)  # fmt: skip
    seconds = clock.now()
    events = [e for e in load_state(cfg).get("events", []) if e.get("action")]
    visits = out["visits"]
    if not spec.get("keep"):
        shutil.rmtree(run / "checkpoint", ignore_errors=True)  # 0.5 GB a run on the real model
        shutil.rmtree(run / "cache", ignore_errors=True)
    return {
        "seconds": seconds, "curve": curve, "steps": steps[0],
        "cache_seconds": sum(e["seconds"] for e in events),
        "cache_events": [{k: e.get(k) for k in ("action", "boundary", "round", "seconds", "rows")}
                         for e in events],
        "visit_loop_seconds": sum(v.get("seconds", 0.0) for v in visits),
        "visit_peak_mb": [v.get("peak_mem_mb") for v in visits],
        "visit_val_losses": visit_evals,
        "trainable_params": [v.get("trainable_params") for v in visits],
        "schedule": f"AdamW, warmup {cfg.train.warmup_steps} + cosine to "
                    f"{cfg.train.min_lr_ratio:g}x per visit, state kept across rounds",
        "blocks": [list(b) for b in Checkpoint.open(spec["init"]).partition.blocks],
    }  # fmt: skip


def response_loss(lm, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss over the positions that count; x (B, S) ids, labels (B, S) (IGNORE elsewhere).
    The LM head runs on those positions only: hidden (B, S, H) -> (n, H) -> logits (n, V)."""
    hidden = lm.model(input_ids=x, use_cache=False).last_hidden_state
    keep = labels != IGNORE
    return lm_loss(lm.lm_head(hidden[keep])[None], labels[keep][None])


def visit_batches(cfg, store: TokenStore, budget, r: int, k: int) -> TokenBatches:
    """The batches of the rotation's visit (round r, block k) as bcd-recompute reads them
    (preinfer.visit.Visit._data's rule): the round's sampled rows in cache row order, shuffled
    with the visit's seed."""
    rows = sample_indices(cfg, budget, "train", r)
    rows = rows[row_order(cfg, "train", r, len(rows))]
    seed = (cfg.train.seed * 1000 + r) * 1000 + k
    return TokenBatches(store, "train", indices=rows, batch_size=cfg.train.batch_size, seed=seed)


def layer_prefixes(blocks: list[tuple[int, int]]) -> list[list[str]]:
    """preinfer's blocks as BAdam prefix lists of a LLaMA-layout HF model: the embedding joins
    block 0, the final norm (and an untied head) the last block, as preinfer.partition does.
    BAdam matches a prefix as a substring: "model.layers.1." does not match layer 10."""
    out = [[f"model.layers.{i}." for i in range(a, b)] for a, b in blocks]
    out[0].insert(0, "model.embed_tokens.")
    out[-1] += ["model.norm.", "lm_head."]
    return out


def hf_arm(spec: dict, clock: Clock, mem: PeakRss) -> dict:
    """full, badam-layers, badam-blocks or lora over the HF model, same batches as the rotation."""
    arm, lr = spec["arm"], spec["lr"]
    cfg = load_config(FINETUNE, [*spec["overrides"], f"run.dir={spec['run_dir']}",
                                 f"train.seed={spec['seed']}"])  # fmt: skip
    store = TokenStore(cfg.data.out_dir)
    budget = store_budget(cfg, store)
    M, rounds, per_visit = spec["M"], cfg.train.rounds, budget.steps
    total = rounds * M * per_visit
    # one warmup + cosine over the run (preinfer's lr_at, the full mode's shape)
    sched = TrainConfig(lr=lr, warmup_steps=cfg.train.warmup_steps, max_steps=total)
    torch.manual_seed(spec["seed"])  # LoRA's A matrices
    clock.t0, clock.excluded = time.perf_counter(), 0.0
    model = tf.AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    lm, switch_every, opt, info = model, 0, None, {}
    if arm == "full":
        params = list(model.parameters())  # the tied head is the embedding: listed once
        opt = torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        info["blocks"] = "every parameter"
    elif arm.startswith("badam"):
        try:
            from badam import BlockOptimizer
        except ImportError as e:
            raise SystemExit(
                f"the {arm} arm needs the PyPI package badam ({e}); {INSTALL}"
            ) from None
        named = list(model.named_parameters())
        base = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        if arm == "badam-blocks":
            prefixes = layer_prefixes(spec["blocks"])
            switch_every = per_visit  # the rotation's steps per block
        else:
            prefixes = None  # BAdam's default: one block per layer
            switch_every = max(1, M * per_visit // model.config.num_hidden_layers)
        # switch_block_every past the run: BAdam 1.4 switches after step (n+1) % every == 0, so
        # its first block gets one step fewer than the others; the arm switches itself, every
        # switch_every steps, through the public switch_trainable_params
        opt = BlockOptimizer(base_optimizer=base, named_parameters_list=named,
                             block_prefix_list=prefixes, switch_block_every=10**9,
                             switch_mode="ascending", verbose=0)  # fmt: skip
        info["blocks"] = [p[:3] + (["..."] if len(p) > 3 else []) for p in opt.block_prefix_list]
        info["block_count"] = opt.block_num
        info["switch_every"] = switch_every
    elif arm == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as e:
            raise SystemExit(f"the lora arm needs the PyPI package peft ({e}); {INSTALL}") from None
        conf = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                          target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
        model = get_peft_model(model, conf)
        lm = model.get_base_model()  # the LlamaForCausalLM, its linears wrapped with LoRA
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        info["blocks"] = f"LoRA r {LORA_R}, alpha {LORA_ALPHA}, all-linear"
    else:
        raise SystemExit(f"unknown arm {arm!r}")
    model.train()

    def evaluate() -> float:
        model.eval()
        res = evaluate_tokens(lambda ids: model(input_ids=ids, use_cache=False).logits, store,
                              batch_size=cfg.train.batch_size, max_batches=spec["eval_batches"])  # fmt: skip
        model.train()
        return res["loss"]

    with evaluating(clock, mem):
        curve = [{"steps": 0, "seconds": clock.now(), "loss": evaluate()}]
    step, trainable = 0, []
    for r, k in itertools.product(range(rounds), range(M)):
        batches = endless(visit_batches(cfg, store, budget, r, k))
        trainable.append(sum(p.numel() for p in model.parameters() if p.requires_grad))
        for x, labels in itertools.islice(batches, per_visit):
            for g in opt.param_groups:  # BAdam copies group 0's lr to its active groups
                g["lr"] = lr_at(step, sched)
            opt.zero_grad(set_to_none=True)
            loss = response_loss(lm, x, labels)
            loss.backward()
            active = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            torch.nn.utils.clip_grad_norm_(active, GRAD_CLIP)
            opt.step()
            step += 1
            if switch_every and step % switch_every == 0 and step < total:
                opt.switch_trainable_params(verbose=0)  # the next block, fresh Adam state
        point = {"steps": step, "seconds": clock.now(), "round": r, "block": k}
        with evaluating(clock, mem):
            point["loss"] = evaluate()
        curve.append(point)
    t = time.perf_counter()
    out = Path(spec["run_dir"]) / "hf"
    model.save_pretrained(out, safe_serialization=True)  # the fine-tune's output (LoRA: adapter)
    info["save_seconds"] = time.perf_counter() - t
    seconds = clock.now()
    if not spec.get("keep"):
        shutil.rmtree(out, ignore_errors=True)
    return {
        "seconds": seconds, "curve": curve, "steps": step, "trainable_params": trainable,
        "schedule": f"AdamW, warmup {sched.warmup_steps} + cosine to {sched.min_lr_ratio:g}x "
                    f"over the run's {total} steps",
        **info,
    }  # fmt: skip


def run_arm(spec: dict, evaluate) -> dict:
    """One arm in this process: its result with time, memory and load."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    load0, clock, mem = load_average(), Clock(), PeakRss()
    try:
        if spec["arm"] in BCD_ARMS:
            res = bcd_arm(spec, clock, mem, evaluate)
        else:
            res = hf_arm(spec, clock, mem)
    finally:
        peak = mem.stop()
    return {
        **{k: spec[k] for k in ("arm", "lr", "seed")}, **res,
        "final_loss": res["curve"][-1]["loss"], "peak_rss_mb": peak,
        "baseline_rss_mb": mem.baseline, "peak_growth_mb": peak - mem.baseline,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_start": load0, "load_end": load_average(), "torch_threads": torch.get_num_threads(),
        "own_process": not spec.get("inline", False),
    }  # fmt: skip


def child_main(spec_json: str) -> None:
    """`--child SPEC`: one arm in this process. stdout is the protocol with the parent, one JSON
    object a line: {"eval": overrides} asks the parent to evaluate a bcd run's checkpoint (the
    answer comes on stdin: {"loss": x}); {"result": ...} ends. Everything else written to
    stdout (BAdam prints every block switch) goes to stderr."""
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(spec_json)

    def ask_parent(overrides: list[str]) -> float:
        proto.write(json.dumps({"eval": overrides}) + "\n")
        return float(json.loads(sys.stdin.readline())["loss"])

    proto.write(json.dumps({"result": run_arm(spec, ask_parent)}) + "\n")


def spawn_arm(spec: dict, log_path: Path) -> dict:
    """Run one arm as `python -m bench.peers --child SPEC`, answering its evaluation requests
    here (the arm waits: its clock and memory exclude them); its stderr goes to log_path."""
    cmd = [sys.executable, "-m", "bench.peers", "--child", json.dumps(spec)]
    result = None
    with open(log_path, "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, text=True)  # fmt: skip
        for line in p.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "eval" in msg:
                p.stdin.write(json.dumps({"loss": eval_run(msg["eval"], spec["eval_batches"])}))
                p.stdin.write("\n")
                p.stdin.flush()
            elif "result" in msg:
                result = msg["result"]
        rc = p.wait()
    if rc or result is None:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"arm {spec['arm']} (lr {spec['lr']:g}, seed {spec['seed']}) failed "
                           f"(exit {rc}); its log {log_path} ends:\n{tail}")  # fmt: skip
    return result


# ---------------------------------------------------------------------------------------------
# The study


def first_at_or_below(curve: list[dict], loss: float) -> dict | None:
    for p in curve:
        if p["loss"] <= loss:
            return p
    return None


def loss_at(curve: list[dict], seconds: float) -> float:
    """The loss of the last curve point at or before `seconds` (an arm that finished sooner
    stopped there: conservative for it)."""
    return [p for p in curve if p["seconds"] <= seconds][-1]["loss"]


def targets(runs: dict[str, dict]) -> dict:
    """The issue's ratios for one seed's best-lr runs (arm -> run)."""
    bcd, out = runs["bcd"], {}
    for b in ("badam-layers", "badam-blocks"):
        if b not in runs:
            continue
        hit = first_at_or_below(bcd["curve"], runs[b]["final_loss"])
        out[f"bcd_time_to_{b}_loss"] = hit["seconds"] / runs[b]["seconds"] if hit else None
        out[f"bcd_peak_over_{b}"] = bcd["peak_rss_mb"] / runs[b]["peak_rss_mb"]
    if "full" in runs:
        full = runs["full"]
        out["bcd_loss_at_full_time"] = loss_at(bcd["curve"], full["seconds"]) / full["final_loss"]
    if "bcd-recompute" in runs:
        out["bcd_over_recompute_seconds"] = bcd["seconds"] / runs["bcd-recompute"]["seconds"]
    return out


def spread(vals: list[float | None]) -> dict:
    v = [x for x in vals if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0, "of": len(vals)}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v),
            "of": len(vals)}  # fmt: skip


TARGETS = [  # key, what, target, met when
    ("bcd_time_to_badam-layers_loss", "bcd wall-clock to badam-layers' final val loss / "
     "badam-layers'", "<= 0.8", lambda v: v <= 0.8),
    ("bcd_time_to_badam-blocks_loss", "bcd wall-clock to badam-blocks' final val loss / "
     "badam-blocks'", "<= 0.8", lambda v: v <= 0.8),
    ("bcd_loss_at_full_time", "bcd val loss at full's wall-clock / full's final (stretch)",
     "<= 1.0", lambda v: v <= 1.0),
    ("bcd_peak_over_badam-layers", "bcd peak RSS / badam-layers'", "<= 1.0", lambda v: v <= 1.0),
    ("bcd_peak_over_badam-blocks", "bcd peak RSS / badam-blocks'", "<= 1.0", lambda v: v <= 1.0),
    ("bcd_over_recompute_seconds", "bcd seconds / bcd-recompute's (same visits)", "", None),
]  # fmt: skip


def _fmt(v, f="{:.3f}") -> str:
    return "n/a" if v is None else f.format(v)


def render(res: dict) -> str:
    rows = [("arm", "lr", "val loss: start -> final (median [min, max])", "train s (median)",
             "peak RSS MiB (growth)", "trainable params", "steps", "load at start")]  # fmt: skip
    for arm, s in res["arms"].items():
        fl, sec = s["final_loss"], s["seconds"]
        rows.append((arm, f"{s['lr']:g}",
                     f"{s['start_loss']:.4f} -> {fl['median']:.4f} [{fl['min']:.4f}, {fl['max']:.4f}]",
                     f"{sec['median']:.0f} [{sec['min']:.0f}, {sec['max']:.0f}]",
                     f"{s['peak_rss_mb']['median']:.0f} ({s['peak_growth_mb']['median']:.0f})",
                     s["trainable"], str(s["steps"]), str(s["load_start"])))  # fmt: skip
    t = [("target (issue #27)", "median", "[min, max]", "seeds", "target", "met")]
    for key, what, goal, ok in TARGETS:
        s = res["targets"].get(key)
        if s is None:
            continue
        m = s["median"]
        met = "" if ok is None else ("n/a" if m is None else ("yes" if ok(m) else "NO"))
        t.append((what, _fmt(m), f"[{_fmt(s['min'])}, {_fmt(s['max'])}]",
                  f"{s['n']}/{s['of']}", goal, met))  # fmt: skip
    sweep = [("arm", "lr", "seed", "final val loss", "train s", "peak RSS MiB", "load at start")]
    for r in res["runs"]:
        sweep.append((r["arm"], f"{r['lr']:g}", str(r["seed"]), f"{r['final_loss']:.4f}",
                      f"{r['seconds']:.0f}", f"{r['peak_rss_mb']:.0f}", str(r["load_start"])))  # fmt: skip
    return "\n\n".join(headline_table(x) for x in (rows, t, sweep))


def _trainable(run: dict) -> str:
    t = run["trainable_params"]
    return f"{min(t) / 1e6:.2f}M-{max(t) / 1e6:.2f}M" if min(t) != max(t) else f"{t[0] / 1e6:.2f}M"


def summarise(runs: list[dict], best: dict[str, float], seeds: list[int]) -> dict:
    """Per arm at its best lr: medians and spread over seeds; the targets per seed, then their
    medians."""
    at_best = {a: [r for r in runs if r["arm"] == a and r["lr"] == best[a]] for a in best}
    arms = {}
    for a, rs in at_best.items():
        if not rs:
            continue
        arms[a] = {
            "lr": best[a], "seeds": [r["seed"] for r in rs],
            "start_loss": rs[0]["curve"][0]["loss"],
            "final_loss": spread([r["final_loss"] for r in rs]),
            "seconds": spread([r["seconds"] for r in rs]),
            "peak_rss_mb": spread([r["peak_rss_mb"] for r in rs]),
            "peak_growth_mb": spread([r["peak_growth_mb"] for r in rs]),
            "trainable": _trainable(rs[0]), "steps": rs[0]["steps"],
            "load_start": rs[0]["load_start"], "schedule": rs[0]["schedule"],
        }  # fmt: skip
    per_seed = []
    for s in seeds:
        by_arm = {a: next((r for r in rs if r["seed"] == s), None) for a, rs in at_best.items()}
        by_arm = {a: r for a, r in by_arm.items() if r is not None}
        if "bcd" in by_arm:
            per_seed.append({"seed": s, **targets(by_arm)})
    keys = sorted({k for t in per_seed for k in t if k != "seed"})
    return {"arms": arms, "per_seed": per_seed,
            "targets": {k: spread([t.get(k) for t in per_seed]) for k in keys}}  # fmt: skip


def prepare(sc: Scale, work: Path, model: str, log=print) -> dict:
    """The instruction data, the model dir, the token store and the init checkpoint (reused
    when --work already holds them), and the pretrained model's val loss (every arm's start)."""
    work.mkdir(parents=True, exist_ok=True)
    pairs = stdlib_pairs(sc.pairs)
    jsonl = work / "pairs.jsonl"
    sha = write_pairs(jsonl, pairs)
    if model == "tiny":
        model_dir = build_tiny_model(work / "tiny-model", pairs)
    else:
        model_dir = Path(model).resolve()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"no model at {model_dir}: {INSTALL} (it makes "
                             f"{REAL_MODEL.relative_to(ROOT)}), or pass --model DIR / tiny")  # fmt: skip
    common = common_overrides(sc, work, model_dir, jsonl)
    prep = [*common, f"run.dir={work / 'prep'}", f"run.checkpoint={work / 'init'}"]
    cfg = load_config(FINETUNE, prep)
    t = time.perf_counter()
    store = run_tokenize(cfg, log=_quiet)
    if not (work / "init" / "checkpoint.json").is_file():
        run_init(cfg, log=_quiet)
    budget = store_budget(cfg, store)
    need = sc.eval_batches * sc.batch_size
    if budget.n_val < need:
        raise SystemExit(f"{budget.n_val} val rows, fewer than the {need} an evaluation reads")
    initial = eval_run(prep, sc.eval_batches)
    part = Checkpoint.open(work / "init").partition
    log(f"  prepared in {time.perf_counter() - t:.0f}s: {len(pairs)} pairs (sha256 {sha[:12]}), "
        f"{budget.n_train} train / {budget.n_val} val rows of S={sc.seq_len}; blocks "
        f"{part.blocks}; visit: {budget.why}; initial val loss {initial:.4f}")  # fmt: skip
    return {"common": common, "model_dir": str(model_dir), "init": str(work / "init"),
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 lr per arm, 6 steps per visit, 1 seed")
    ap.add_argument("--model", default=str(REAL_MODEL),
                    help="a LLaMA-layout HF model dir (default: the real model), or 'tiny'")  # fmt: skip
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per block visit")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of each arm and of the evaluations (default 1: on a busy "
                         "machine two threads wait on each other; 0 = torch's default)")  # fmt: skip
    ap.add_argument("--inline", action="store_true",
                    help="run the arms in this process (fast; peak RSS is then not each arm's own)")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep every run's checkpoint / weights")
    ap.add_argument("--work", default=None, help="keep data, tokens, init and runs here")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        child_main(a.child)
        return {}
    sc = dataclasses.replace(TINY if a.model == "tiny" else QUICK if a.quick else FULL)
    for name, v in (("seeds", a.seeds), ("steps_per_visit", a.steps), ("rounds", a.rounds)):
        if v is not None:
            setattr(sc, name, v)
    if "bcd" not in a.arms:
        raise SystemExit("--arms must include bcd: every target is a ratio to it")
    missing = missing_parts(a.model, a.arms)
    if missing:  # `make bench` on a machine without the real model or the `real` extra
        print(f"peers: skipped: {missing}")
        return {"skipped": missing}
    if a.threads:
        torch.set_num_threads(a.threads)  # this process's evaluations (the bcd arms' too)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="peers-")
    work = Path(a.work or tmp.name).resolve()
    t0, load0 = time.perf_counter(), load_average()
    print(f"peers: {a.model} ({'quick' if a.quick else 'full'}), arms {' '.join(a.arms)}, "
          f"seeds {sc.seeds}, load average {load0}")  # fmt: skip
    prep = prepare(sc, work, a.model)
    (work / "logs").mkdir(exist_ok=True)
    runs: list[dict] = []

    def one(arm: str, lr: float, seed: int) -> dict:
        spec = {"arm": arm, "lr": lr, "seed": seed, "overrides": prep["common"], "M": sc.M,
                "init": prep["init"], "model_dir": prep["model_dir"],
                "initial_loss": prep["initial_loss"], "blocks": prep["blocks"],
                "eval_batches": sc.eval_batches, "threads": a.threads, "keep": a.keep,
                "inline": a.inline, "run_dir": str(work / "runs" / f"{arm}-lr{lr:g}-s{seed}")}  # fmt: skip
        if a.inline:
            r = run_arm(spec, lambda ov: eval_run(ov, sc.eval_batches))
        else:
            r = spawn_arm(spec, work / "logs" / f"{arm}-lr{lr:g}-s{seed}.log")
        runs.append(r)
        print(f"  {arm:>13} lr {lr:<7g} seed {seed}: val loss {r['curve'][0]['loss']:.4f} -> "
              f"{r['final_loss']:.4f} in {r['seconds']:.0f}s train, peak RSS "
              f"{r['peak_rss_mb']:.0f} MiB, load {r['load_start']}", flush=True)  # fmt: skip
        return r

    def order(i: int) -> list[str]:  # arms interleaved, the order rotated per seed
        arms = [x for x in ARMS if x in a.arms]
        return arms[i % len(arms):] + arms[: i % len(arms)]  # fmt: skip

    # seed 0: every lr of every swept arm, lrs interleaved across arms; then bcd-recompute at
    # bcd's best lr (its role is the same visits without the cache, not its own tuning)
    sweep = [x for x in order(0) if x != "bcd-recompute"]
    for i in range(max(len(sc.lrs[x]) for x in sweep)):
        for arm in sweep:
            if i < len(sc.lrs[arm]):
                one(arm, sc.lrs[arm][i], sc.seeds[0])
    best = {}
    for arm in sweep:
        mine = [r for r in runs if r["arm"] == arm]
        best[arm] = min(mine, key=lambda r: r["final_loss"])["lr"]
    if "bcd-recompute" in a.arms:
        best["bcd-recompute"] = best["bcd"]
        one("bcd-recompute", best["bcd"], sc.seeds[0])
    for i, seed in enumerate(sc.seeds[1:], start=1):
        for arm in order(i):
            one(arm, best[arm], seed)
    summary = summarise(runs, best, sc.seeds)
    res = {"model": a.model, "quick": a.quick, "scale": asdict(sc), "arms_run": a.arms,
           "prep": prep, "runs": runs, "best_lr": best, **summary, "inline": a.inline,
           "load_start": load0, "load_end": load_average(), "seconds": time.perf_counter() - t0,
           "cpus": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": tf.__version__}  # fmt: skip
    res["table"] = render(res)
    print(res["table"])
    print(f"(load average {load0} at start, {res['load_end']} at end; {res['seconds']:.0f}s; "
          f"{os.cpu_count()} CPUs; {'arms in one process' if a.inline else 'one process per arm'})")  # fmt: skip
    name = "peers" + ("-tiny" if a.model == "tiny" else "-quick" if a.quick else "")
    out = Path(a.out) if a.out else results_path(name)
    write_results(out, res)
    print(f"results: {out}")
    if tmp is not None:
        tmp.cleanup()
    return {"headline": {k: v["median"] for k, v in summary["targets"].items()},
            "results": str(out)}  # fmt: skip


def _quiet(*_a, **_k) -> None:
    return None


if __name__ == "__main__":
    main()
