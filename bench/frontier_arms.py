"""The arms of bench/frontier.py, each run in a process of its own under the RSS budget: the
shapes, one Scale, and the children (token store + checkpoint prep, a boundary cache build, a
preinfer visit, an HF-model arm: full, LoRA or BAdam) with the watchdog that kills an arm past
the budget (`run_child`). The orchestration, the planner beside it and the table are
bench/frontier.py's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch
import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer step: preloaded)
import transformers  # noqa: F401
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from bench import harness as h
from bench.arms import PeakMemory
from pipelines.cache_build import build_cache, plan_block
from pipelines.init import run_init
from pipelines.train import visit_spec
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.modeling import build_model
from preinfer.run.config import load_config
from preinfer.run.visit import Visit, VisitHooks
from preinfer.runtime.device import autocast
from preinfer.train.batches import TokenBatches, endless
from storage import reader  # noqa: F401  (the cache reader's libraries: preloaded)
from storage.atomic import dir_bytes
from storage.tokens import TokenStoreWriter

GiB, MiB = 2**30, 2**20
# name -> hidden, layers, heads, kv heads, MLP width, vocab, tied (the public configs' shapes)
SHAPES = {
    "tiny-s": (256, 6, 4, 2, 688, 8192, False),
    "tiny-l": (512, 12, 8, 2, 1376, 16384, False),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True),
    "smollm2-360m": (960, 32, 15, 5, 2560, 49152, True),
    "tinyllama-1.1b": (2048, 22, 32, 4, 5632, 32000, False),
    "smollm2-1.7b": (2048, 24, 32, 32, 8192, 49152, True),
    "smollm2-1.7b-l32": (2048, 32, 32, 32, 8192, 49152, True),  # 2.25B: 2x TinyLlama's size
    "llama3.2-3b": (3072, 28, 24, 8, 8192, 128256, True),
}
METHODS = ("full", "lora", "badam", "bcd", "bcd-recompute")
NEEDS = {"lora": "peft", "badam": "badam"}  # the `real` extra (pip install -e '.[real]')
LORA_R, LORA_ALPHA = 16, 32


@dataclass
class Scale:
    sizes: list[str]
    budget_gib: float | None  # None: --quick's, 90% of full's unbudgeted peak
    seq: int = 64
    batch: int = 2
    steps: int = 4  # per visit kind (the first is warm-up; s/step: the median of the rest)
    M: int = 3
    threads: int = 2
    arm_timeout_s: float = 900.0
    time_cap_s: float | None = None  # arms not started once the bench has run this long
    precision: str = "auto"  # run.precision (auto: bf16 autocast where the CPU has AMX-BF16)


# M=4: at M=3 block 0's visit of the 2.25B shape (its embedding, 10 layers and their AdamW
# state, beside the frozen rest in fp32) would pass 20 GiB (1.7B at M=3: 15.7 GiB measured)
FULL = Scale(sizes=["smollm2-135m", "smollm2-360m", "tinyllama-1.1b", "smollm2-1.7b",
                    "smollm2-1.7b-l32"], budget_gib=20.0, M=4, time_cap_s=40 * 60)  # fmt: skip
QUICK = Scale(sizes=["tiny-s", "tiny-l"], budget_gib=None, seq=32, steps=2, arm_timeout_s=180)


def overrides(sc: Scale, size: str, work: Path) -> list[str]:
    H, L, A, KV, F, V, tied = SHAPES[size]
    return [
        "model.arch=llama", f"model.hidden_size={H}", f"model.num_layers={L}",
        f"model.num_heads={A}", f"model.num_kv_heads={KV}", f"model.intermediate_size={F}",
        f"model.vocab_size={V}", f"model.tie_embeddings={str(tied).lower()}",
        f"model.max_positions={max(128, sc.seq)}", f"data.seq_len={sc.seq}",
        f"data.out_dir={work / 'tokens'}", f"run.dir={work / 'run'}",
        f"run.checkpoint={work / 'run' / 'checkpoint'}", f"cache.root={work / 'cache'}",
        f"partition.num_blocks={sc.M}", f"train.batch_size={sc.batch}",
        f"train.max_steps={sc.steps}", "train.epochs=1", "train.warmup_steps=0",
        "train.eval_every=0", "train.eval_batches=1", "train.workers=0",
        "train.checkpoint_every=0", "train.lr=1e-5", "run.device=cpu", f"run.precision={sc.precision}",
        "run.tensorboard=false", "preinfer.executor=local",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The arms (in a forked child; `mem` started after the imports: its baseline is theirs)


def _prep(spec: dict, mem) -> dict:
    """The token store (random ids: train rows for M visits, one val batch) and the init
    checkpoint (`preinfer init`'s code)."""
    cfg = load_config(None, spec["overrides"])
    B, S, V, M = cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size, spec["M"]
    g, n = np.random.default_rng(0), {"train": M * cfg.train.max_steps * B, "val": B}
    w = TokenStoreWriter(cfg.data.out_dir, seq_len=S, shard_rows=4096)
    for split, rows in n.items():
        w.write_split(split, iter(g.integers(0, V, (rows, S + 1), dtype=np.int32)))
    w.commit({"fingerprint": f"frontier-{n['train']}-{n['val']}-{V}-{S}", "vocab_size": V})
    t = time.perf_counter()
    run_init(cfg, log=h.quiet)
    return {
        "init_s": time.perf_counter() - t,
        "checkpoint_bytes": dir_bytes(Path(cfg.run.checkpoint)),
    }


def _build(spec: dict, mem) -> dict:
    """Boundary K's train and val caches from tokens through blocks 0..K-1."""
    cfg = load_config(None, spec["overrides"])
    t = time.perf_counter()
    res = build_cache(cfg, spec["block"], 0, log=h.quiet)
    fps = res["fingerprints"]
    fps = list(fps.values()) if isinstance(fps, dict) else list(fps)
    return {"build_s": time.perf_counter() - t, "rows": res.get("rows"),
            "cache_bytes": sum(dir_bytes(Path(cfg.cache.root) / fp) for fp in fps)}  # fmt: skip


def _held(model) -> dict:
    """What a model holds materialised (not on meta): parameters and bytes, by dtype."""
    seen, n, by = set(), 0, {}
    for p in model.parameters():
        if id(p) in seen or p.device.type == "meta":
            continue
        seen.add(id(p))
        n += p.numel()
        by[str(p.dtype)] = by.get(str(p.dtype), 0) + p.numel() * p.element_size()
    return {"params": n, "bytes": by}


class _Timed:
    """A visit's batches, each handed out at a time recorded in `marks` (its step starts)."""

    def __init__(self, inner, marks: list[float]):
        self.inner, self.marks, self.steps_per_epoch = inner, marks, inner.steps_per_epoch

    def epoch(self, e: int):
        for b in self.inner.epoch(e):
            self.marks.append(time.perf_counter())
            yield b


def _visit(spec: dict, mem) -> dict:
    """One visit as `preinfer train --block K` runs it (Visit.run: load, steps, eval, commit)."""
    cfg = load_config(None, spec["overrides"])
    plan = plan_block(cfg, spec["block"], 0, mode=spec["mode"])
    marks, ends, held = [], [], {}

    def batches(visit, default):  # blocks loaded, data opened
        mem.mark("load")
        held["model"] = _held(visit.model)
        held["prefix"] = _held(visit.prefix[0]) if visit.prefix else None
        return _Timed(default, marks)

    def on_eval(visit, step, val, seconds):  # the last step ended `seconds` ago
        ends.append(time.perf_counter() - seconds)
        mem.mark("eval")

    # the phases' peaks over the baseline, as bench.plan_accuracy marks them
    register_optimizer_step_pre_hook(lambda *a: mem.mark("backward"))
    register_optimizer_step_post_hook(lambda *a: mem.mark("step"))
    hooks = VisitHooks(on_eval=on_eval, batches=batches)
    summary = Visit(cfg, visit_spec(plan), plan=plan, device=torch.device("cpu"), hooks=hooks).run(
        log=h.quiet
    )
    mem.mark("commit")
    steps = [b - a for a, b in zip(marks, [*marks[1:], ends[0]], strict=True)]
    return {"step_s": steps, "loaded": summary["spec"], "held": held,
            "trainable_params": summary["trainable_params"], "tokens_per_step": summary["tokens"] / len(steps)}  # fmt: skip


def _hf(spec: dict, mem) -> dict:
    """LoRA or BAdam over the HF model of the same init checkpoint, preinfer's batches, loss and
    precision (autocast as train_step's); BAdam: steps on block 0, a middle block, the last."""
    from bench.peers_arms import ADAMW, badam, response_loss

    cfg = load_config(None, spec["overrides"])
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    M, dev = ckpt.num_blocks, torch.device("cpu")
    model, _ = ckpt.load(range(M))  # a transformers LlamaForCausalLM, fp32
    lm = model
    if spec["method"] == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))  # fmt: skip
        lm = model.get_base_model()
        opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-5, **ADAMW
        )
        phases = [None]
    else:
        opt = badam(model, 1e-5, [tuple(b) for b in ckpt.partition.blocks])
        phases = sorted({0, M // 2, M - 1})
    mem.mark("load")
    model.train()
    data = endless(TokenBatches(ckpt_store(cfg), "train", batch_size=cfg.train.batch_size, seed=0))
    at, out, trainable = 0, {}, {}
    for k in phases:
        while k is not None and at < k:  # BAdam: ascending, one switch a block
            opt.switch_trainable_params(verbose=0)
            at += 1
        trainable[str(k)] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        times = []
        for _ in range(cfg.train.max_steps):
            x, labels = next(data)
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast(dev, cfg.run.precision):
                loss = response_loss(lm, x, labels)
            loss.backward()
            active = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            torch.nn.utils.clip_grad_norm_(active, cfg.train.grad_clip)
            opt.step()
            times.append(time.perf_counter() - t)
        out[str(k)] = times
    return {"phase_step_s": out, "trainable_params": trainable,
            "tokens_per_step": cfg.train.batch_size * cfg.data.seq_len}  # fmt: skip


def ckpt_store(cfg):
    from storage.tokens import TokenStore

    return TokenStore(cfg.data.out_dir)


KINDS = {"prep": _prep, "build": _build, "visit": _visit, "hf": _hf}


def _entry(spec: dict, conn, budget: int, log: str) -> None:
    """The child: RLIMIT_DATA, output to the log, the arm; its result (or why it failed) and
    its peak RSS (VmHWM since the baseline) sent to the parent."""
    # a backstop only: the data segment counts private file maps (the checkpoint's), oneDNN's
    # reservations and a forked child's ~1 GiB from the start, so it runs far ahead of the RSS
    limit = int(psutil.Process().memory_info().data + 2 * budget)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(spec["threads"])
    build_model(load_config(None, spec["overrides"]).model, device="meta")  # the model classes
    mem = PeakMemory()
    out: dict = {}
    try:
        out = KINDS[spec["kind"]](spec, mem)
    except MemoryError as e:
        out = {"oom": f"MemoryError: {e}"}
    except RuntimeError as e:
        if "alloc" not in str(e).lower() and "memory" not in str(e).lower():
            out = {"error": traceback.format_exc()[-3000:]}
        else:
            out = {"oom": str(e).splitlines()[0][:300]}
    except Exception:
        out = {"error": traceback.format_exc()[-3000:]}
    peak = mem.stop()
    out.update(baseline_mb=mem.baseline, peak_mb=peak, growth_mb=peak - mem.baseline,
               phases_mb=mem.phases)  # fmt: skip
    conn.send(out)
    conn.close()
    sys.stdout.flush()


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["bench.frontier_arms"])
        # every child re-imports the parent's __main__ (bench.frontier, preloaded: runpy warns)
        opts, sys.warnoptions[:] = (
            list(sys.warnoptions),
            [*sys.warnoptions, "ignore::RuntimeWarning:runpy"],
        )
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()  # the server gets this process's -W options
        finally:
            sys.warnoptions[:] = opts
    return _CTX


def run_child(spec: dict, budget: int, log: Path, timeout_s: float) -> dict:
    """spec's arm forked from the server, RSS watched: killed past `budget` bytes (fits False),
    when the machine has under 512 MiB left (fits None), or past timeout_s."""
    ctx = _context()
    rx, tx = ctx.Pipe(duplex=False)
    # _entry pickles by its module's name (bench.frontier_arms): never __main__'s
    p = ctx.Process(target=_entry, args=(spec, tx, budget, str(log)))
    t0, load0 = time.perf_counter(), h.load_average()
    p.start()
    tx.close()
    proc, peak_rss, peak_data, why, i = psutil.Process(p.pid), 0, 0, None, 0
    while not rx.poll(0.02):
        try:
            m = proc.memory_info()
        except psutil.NoSuchProcess:
            break
        peak_rss, peak_data = max(peak_rss, m.rss), max(peak_data, m.data)
        i += 1
        if m.rss > budget:
            why = f"killed: RSS {m.rss / GiB:.2f} GiB passed the {budget / GiB:.2f} GiB budget"
        elif i % 10 == 0 and psutil.virtual_memory().available < 512 * MiB:
            why = "inconclusive: the machine ran short of memory (other processes)"
        elif time.perf_counter() - t0 > timeout_s:
            why = f"inconclusive: timed out after {timeout_s:.0f}s"
        if why:
            p.kill()
            break
        if not p.is_alive():
            break
    res = rx.recv() if why is None and rx.poll(1.0) else {}
    p.join()
    rec = {**res, "wall_s": time.perf_counter() - t0, "load_start": load0,
           "watch_peak_rss_mb": peak_rss / MiB, "watch_peak_data_mb": peak_data / MiB}  # fmt: skip
    if why is None and "oom" in res:
        why = f"refused: an allocation passed RLIMIT_DATA ({res['oom']})"
    if why is None and not res:
        why = f"error: the arm died (exit {p.exitcode}); see {log.name}"
    if why is None and "error" in res:
        why = "error: " + res["error"].strip().splitlines()[-1][:200]
    rec["peak_rss_mb"] = max(res.get("peak_mb", 0.0), peak_rss / MiB)
    rec["fits"] = (
        True if why is None else (False if why.startswith(("killed", "refused")) else None)
    )
    rec["why"] = why
    return rec
