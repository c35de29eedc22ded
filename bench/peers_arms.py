"""The peers bench's arms, one per process: preinfer's rotation (bcd, bcd-recompute) and the HF
arms (full, BAdam, LoRA), each measuring its own training seconds and peak RSS (bench/peers.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import transformers as tf

from bench.harness import load_average
from bench.peers_data import FINETUNE, INSTALL, ROOT, eval_run, quiet
from pipelines.bcd import load_state, run_bcd
from preinfer.batches import TokenBatches, endless
from preinfer.cache_identity import store_budget, visit_data_seed, visit_train_rows
from preinfer.checkpoint import Checkpoint
from preinfer.config import load_config
from preinfer.loss import evaluate_tokens, lm_loss
from preinfer.trainer import (
    TrainConfig,
    current_memory_mb,
    lr_at,
    peak_memory_mb,
    reset_peak_memory,
    visit_position,
)
from preinfer.visit import VisitHooks
from storage.tokens import IGNORE, TokenStore

CPU = torch.device("cpu")
ARMS = ("bcd", "bcd-recompute", "full", "badam-layers", "badam-blocks", "lora")
BCD_ARMS = ("bcd", "bcd-recompute")
WEIGHT_DECAY, GRAD_CLIP, BETAS = 1e-5, 1.0, (0.9, 0.999)  # preinfer's AdamW defaults, every arm
# every arm's AdamW: preinfer's settings and its kernel (fused: preinfer.trainer.build_optimizer)
ADAMW = {"betas": BETAS, "weight_decay": WEIGHT_DECAY, "fused": True}
LORA_R, LORA_ALPHA = 16, 32


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
    out = run_bcd(cfg, mode=spec["arm"], log=quiet, hooks=VisitHooks(on_eval=on_eval),
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
                    f"{cfg.train.min_lr_ratio:g}x "
                    + ("over the rotation" if cfg.train.schedule == "run" else "per visit")
                    + ", state kept across rounds",
        "blocks": [list(b) for b in Checkpoint.open(spec["init"]).partition.blocks],
    }  # fmt: skip


def response_loss(lm, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss over the positions that count; x (B, S) ids, labels (B, S) (IGNORE elsewhere).
    The LM head runs on those positions only: hidden (B, S, H) -> (n, H) -> logits (n, V)."""
    hidden = lm.model(input_ids=x, use_cache=False).last_hidden_state
    keep = labels != IGNORE
    return lm_loss(lm.lm_head(hidden[keep])[None], labels[keep][None])


def visit_batches(cfg, store: TokenStore, budget, r: int, k: int, M: int) -> TokenBatches:
    """The batches of the rotation's visit (round r, block k) as bcd-recompute reads them: the
    visit's rows (preinfer.cache_identity.visit_train_rows: the round's sampled rows in cache
    row order, the window of the visit's place in its round), shuffled with the visit's seed."""
    rows = visit_train_rows(cfg, budget, r, visit_position(cfg.train, M, r, k))
    return TokenBatches(
        store,
        "train",
        indices=rows,
        batch_size=cfg.train.batch_size,
        seed=visit_data_seed(cfg, r, k),
    )


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
        opt = torch.optim.AdamW(params, lr=lr, **ADAMW)
        info["blocks"] = "every parameter"
    elif arm.startswith("badam"):
        try:
            from badam import BlockOptimizer
        except ImportError as e:
            raise SystemExit(
                f"the {arm} arm needs the PyPI package badam ({e}); {INSTALL}"
            ) from None
        named = list(model.named_parameters())
        base = torch.optim.AdamW(model.parameters(), lr=lr, **ADAMW)
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
        opt = torch.optim.AdamW(params, lr=lr, **ADAMW)
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
        batches = endless(visit_batches(cfg, store, budget, r, k, M))
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
