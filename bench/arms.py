"""The one arm runner of study, economics and peers, and the one peak-memory child.

    cfg, store = prepare(config, overrides, init)     # the token store and init checkpoint
    rec = run_arm(spec, log_path=work / "a.log")      # the arm in its own process
    rec = run_arm(spec)                               # in this one (peak memory not its own)
    res = in_child("bench.x:fn", spec)                # fn(spec, ask) in a fresh process
    arm = BlockStep("bcd", cfg, ckpt, block, device)  # one training step, as a visit takes it

An arm is a JSON spec: its runner ("module:function", default preinfer_arm: run_bcd in
spec["mode"]; peers' HF arms are bench/peers_arms.py's hf_arm), config (YAML and overrides),
init checkpoint, run dir, lr, seed, stop rule (Stop) and the val batches of an evaluation. The
runner measures its training seconds (Clock: evaluations excluded), its peak memory
(PeakMemory, paused around evaluations) and the load average, and returns its record: curve,
seconds, peak_rss_mb, final_loss / final_ppl, cache events, visits. A bcd arm's evaluations
(run_eval of its checkpoint after every visit) are made by the parent while the arm waits
(`ask`), so their memory is never the arm's. The child (`python -m bench.arms TARGET`) reads
the spec as a JSON line on stdin and writes {"ask": question} lines (answered on stdin), then
{"result": ...} on its stdout; everything else it prints goes to stderr, the log.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.harness import ROOT, load_average, plateau, quiet
from pipelines.bcd import run_bcd
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks
from preinfer.model.evaluation import evaluate_tokens
from preinfer.model.loss import mode_loss
from preinfer.model.partition import trainable_parameters
from preinfer.run.config import load_config
from preinfer.run.state import load_run_state
from preinfer.run.visit import VisitHooks
from preinfer.runtime.memstats import current_memory_mb, peak_memory_mb, reset_peak_memory
from preinfer.schedule.rotation import store_budget, val_indices
from preinfer.train.batches import CacheBatches, endless
from preinfer.train.step import build_optimizer, train_step
from storage.tokens import TokenStore


@dataclass
class Stop:
    """When a preinfer arm stops (whichever comes first; None = no such rule). bcd modes: at
    the first visit whose val ppl <= target_ppl (once min_visits are done), once cap_steps
    steps are done (train.rounds is set to reach them), after max_visits visits. full: after
    `patience` evaluations without a gain of more than min_rel_delta (harness.plateau), not
    before min_steps."""

    target_ppl: float | None = None
    cap_steps: int | None = None
    max_visits: int | None = None
    min_visits: int = 0
    patience: int | None = None
    min_rel_delta: float = 0.0
    min_steps: int = 0


# ---------------------------------------------------------------------------------------------
# What an arm measures about itself


class Clock:
    """Seconds since (re)start, less the spans spent evaluating."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.t0, self.excluded = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0 - self.excluded


class PeakMemory:
    """This process's peak memory (MiB) from now on: the RSS high-water mark (VmHWM; CUDA:
    max_memory_allocated), reset here and polled every 10 ms on a thread (the product resets
    it at every visit, so one read at the end would miss earlier visits and cache builds),
    not counting `paused` spans. `mark(name)` ends a phase: `phases[name]` is its peak over
    the baseline, and the high-water mark starts again."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        gc.collect()
        reset_peak_memory(self.device)  # the imports' transients are not the arm's
        self.baseline = current_memory_mb(self.device)
        self.peak = self.phase = self.baseline
        self.phases: dict[str, float] = {}
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        now = peak_memory_mb(self.device)
        self.peak, self.phase = max(self.peak, now), max(self.phase, now)

    def _poll(self) -> None:
        while not self.stopped.wait(0.01):
            with self.lock:
                self._read()

    def mark(self, name: str) -> None:
        with self.lock:
            self._read()
            self.phases[name] = max(self.phases.get(name, 0.0), self.phase - self.baseline)
            reset_peak_memory(self.device)
            self.phase = current_memory_mb(self.device)

    @contextlib.contextmanager
    def paused(self):
        """The peak so far is taken; the high-water mark is reset after the span."""
        with self.lock:
            self._read()
            try:
                yield
            finally:
                reset_peak_memory(self.device)
                self.phase = current_memory_mb(self.device)

    def stop(self) -> float:
        self.stopped.set()
        self.thread.join()
        self._read()
        return self.peak


@contextlib.contextmanager
def evaluating(clock: Clock, mem: PeakMemory):
    """A span of the bench's own evaluation: neither its time nor its memory is the arm's."""
    t = time.perf_counter()
    with mem.paused():
        yield
    clock.excluded += time.perf_counter() - t


class BlockStep:
    """One way of taking a trainer step of block K, as a visit takes it (train_step over
    mode_loss, preinfer's optimizer): bcd (blocks K.. loaded; its batches from `cache`, or
    given), bcd-recompute (the frozen prefix rerun without grad) or full (every block trained).
    `chunk`: the loss's train.loss_chunk (default the config's)."""

    def __init__(self, mode, cfg, ckpt, block, device, *, cache=None, chunk=None):
        self.mode, self.cfg, self.block, self.device = mode, cfg, block, device
        self.chunk = cfg.train.loss_chunk if chunk is None else chunk
        M, self.part = ckpt.num_blocks, ckpt.partition
        self.model, self.adapter = ckpt.load(range(block if mode == "bcd" else 0, M), device=device)
        blocks = range(M) if mode == "full" else [block]
        keep = {id(p): p for b in blocks
                for p in trainable_parameters(self.model, self.adapter, self.part, b)}  # fmt: skip
        for p in self.model.parameters():
            p.requires_grad_(id(p) in keep)
        self.params = list(keep.values())
        self.opt = build_optimizer(self.params, cfg.train)
        B = cfg.train.batch_size
        bcd_cache = cache is not None and mode == "bcd"  # the other modes read token ids
        self.cached = endless(CacheBatches(cache, batch_size=B, seed=0)) if bcd_cache else None
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, ckpt.vocab_size, (B, cfg.data.seq_len + 1), generator=g)
        self.step_i = 0

    def loss(self, x, labels):  # the trainer's own (preinfer.run.visit.Visit.loss)
        if self.mode == "bcd-recompute" and self.block > 0:  # the frozen prefix, without grad
            with torch.no_grad():
                x = forward_blocks(self.adapter, self.part, x, 0, self.block)
        return mode_loss(self.adapter, self.part, x, labels, mode=self.mode, block=self.block,
                         chunk=self.chunk)  # fmt: skip

    def batch(self):
        return next(self.cached) if self.cached else (self.ids[:, :-1], self.ids[:, 1:])

    def step(self, batch=None, precision: str = "auto") -> float:
        """Seconds of one step of `batch` (default: the arm's next)."""
        t0 = time.perf_counter()
        train_step(self.loss, self.params, self.opt, batch or self.batch(), self.cfg.train,
                   self.step_i, device=self.device, precision=precision)  # fmt: skip
        self.step_i += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# A function in a fresh process


def _target(name: str):
    module, fn = name.split(":")
    return getattr(importlib.import_module(module), fn)


def in_child(target: str, spec: dict, *, answer=None, log_path: Path | None = None,
             env: dict | None = None) -> dict:  # fmt: skip
    """target(spec, ask) in a fresh `python -m bench.arms TARGET` process, its result. The
    child's ask(question) waits for answer(question), made here; its stderr (and anything it
    prints) goes to log_path (default: kept only to say why it failed)."""
    cmd = [sys.executable, "-m", "bench.arms", target]
    with open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, text=True,
                             stdout=subprocess.PIPE, stderr=err)  # fmt: skip
        p.stdin.write(json.dumps(spec) + "\n")
        p.stdin.flush()
        result = None
        for line in p.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "ask" in msg:
                p.stdin.write(json.dumps(answer(msg["ask"])) + "\n")
                p.stdin.flush()
            elif "result" in msg:
                result = msg["result"]
        rc = p.wait()
        if rc or result is None:
            err.seek(0)
            raise RuntimeError(f"{target} ({spec.get('arm', '')} lr {spec.get('lr', '')} seed "
                               f"{spec.get('seed', '')}) failed (exit {rc}); its log "
                               f"{log_path or ''} ends:\n{err.read()[-3000:]}")  # fmt: skip
    return result


def _child(target: str) -> None:
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else is printed (BAdam prints every block switch) goes to the log
    spec = json.loads(sys.stdin.readline())

    def ask(question):
        proto.write(json.dumps({"ask": question}) + "\n")
        return json.loads(sys.stdin.readline())

    proto.write(json.dumps({"result": _target(target)(spec, ask)}, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# Data, init, an arm


def prepare(config: str | None, overrides: list[str], init: Path):
    """The token store (made once, shared by every arm; refused if it holds other data) and the
    init checkpoint `init` (made once) of a config; returns (cfg, store)."""
    cfg = load_config(config, [*overrides, f"run.checkpoint={init}"])
    store = run_tokenize(cfg, log=quiet)
    if not (Path(init) / "checkpoint.json").is_file():
        run_init(cfg, log=quiet)
    return cfg, store


def eval_run(config: str | None, overrides: list[str], batches: int, per_row: bool = False) -> dict:
    """`preinfer eval` of a run's checkpoint over `batches` x batch val rows spread over the split
    (rotation.val_indices; 0 = all); per_row: with each row's summed loss ("row_sums", for an
    error paired over rows between arms, evaluation.paired_ratio)."""
    res = run_eval(load_config(config, overrides), max_batches=batches, log=quiet, per_row=per_row)
    return {k: res[k] for k in ("loss", "ppl", *(("row_sums",) if per_row else ()))}


@torch.inference_mode()
def model_eval(visit, store: TokenStore, batch_size: int, batches: int) -> dict:
    """The rows run_eval reads, through a visit's in-memory model (full: every block)."""
    was = visit.model.training
    visit.model.eval()
    M = visit.part.num_blocks
    rows = val_indices(store.num_samples("val"), batches * batch_size, visit.cfg.train.seed)
    res = evaluate_tokens(lambda ids: forward_blocks(visit.adapter, visit.part, ids, 0, M), store,
                          batch_size=batch_size, rows=rows)  # fmt: skip
    visit.model.train(was)
    return {"loss": res["loss"], "ppl": res["ppl"]}


class _Stop(Exception):
    """Raised by an arm's callbacks when a stop rule fires."""


def preinfer_arm(spec: dict, clock: Clock, mem: PeakMemory, evaluate) -> dict:
    """preinfer's own training, run_bcd in spec["mode"], on a copy of the init checkpoint until
    a Stop rule fires or the run ends. Curve: evaluate(overrides) of the run's checkpoint after
    every visit (bcd modes), the in-memory model every train.eval_every steps (full)."""
    run, mode, stop = Path(spec["run_dir"]), spec["mode"], Stop(**spec.get("stop") or {})
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(spec["init"], run / "checkpoint")  # setup, before the clock starts
    ov = [*spec["overrides"], f"run.dir={run}", f"run.checkpoint={run / 'checkpoint'}",
          f"train.seed={spec['seed']}", f"train.lr={spec['lr']}"]  # fmt: skip
    cfg = load_config(spec.get("config"), ov)
    store = TokenStore(cfg.data.out_dir)
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, store)
    M, full = cfg.partition.num_blocks, mode == "full"
    if not full and (stop.cap_steps or stop.max_visits):
        cap = stop.cap_steps or stop.max_visits * budget.steps
        ov.append(f"train.rounds={max(1, math.ceil(cap / (M * budget.steps)))}")
        cfg = load_config(spec.get("config"), ov)
    curve = [dict(spec["start"])] if spec.get("start") else []
    summaries, visit_evals, done = [], [], [0]

    def stop_now() -> bool:
        if full:
            return bool(stop.patience) and plateau(curve, stop.patience, stop.min_rel_delta,
                                                   stop.min_steps)["plateaued"]  # fmt: skip
        n, ppl = len(summaries), curve[-1]["ppl"]
        hit = stop.target_ppl is not None and ppl <= stop.target_ppl and n >= stop.min_visits
        capped = stop.cap_steps is not None and done[0] >= stop.cap_steps
        return hit or capped or (stop.max_visits is not None and n >= stop.max_visits)

    def on_visit(r: int, k: int, summary: dict) -> None:
        summaries.append(summary)
        if full:
            return
        done[0] += int(summary["steps"])
        p = {"steps": done[0], "seconds": clock.now(), "round": r, "block": k}
        with evaluating(clock, mem):
            p.update(evaluate(ov))
        curve.append(p)
        if stop_now():
            raise _Stop

    def on_eval(visit, step: int, val: float, seconds: float) -> None:
        clock.excluded += seconds  # the visit's own val evaluation (from its cache for k > 0)
        visit_evals.append(val)
        if not full or (curve and curve[-1]["steps"] == step):
            return  # full's last step can be both an eval_every step and the end
        p = {"steps": step, "seconds": clock.now()}
        with evaluating(clock, mem):
            p.update(model_eval(visit, store, cfg.train.batch_size, spec.get("eval_batches", 0)))
        curve.append(p)
        if stop_now():
            raise _Stop

    clock.restart()
    with contextlib.suppress(_Stop):
        run_bcd(cfg, mode=mode, log=quiet, hooks=VisitHooks(on_eval=on_eval), on_visit=on_visit)
    seconds = clock.now()
    events = [e for e in load_run_state(cfg.run.dir).get("events", []) if e.get("action")]
    builds = [e for e in events if e.get("executor")]
    cache_s = sum(e["seconds"] for e in events)
    prev = [0] + [c["steps"] for c in curve]  # (block, steps) of each visit, from the curve
    visits = [(p["block"], p["steps"] - q) for p, q in zip(curve, prev, strict=False) if "block" in p]  # fmt: skip
    if full:
        visits = [(0, curve[-1]["steps"])] if curve else []
    for done in ("checkpoint", "cache"):  # not needed after the curve
        shutil.rmtree(run / done, ignore_errors=True)
    pick = lambda e, keys: {k: e.get(k) for k in ("action", "boundary", "round", "seconds", *keys)}  # noqa: E731
    return {
        "mode": mode, "seconds": seconds, "curve": curve, "steps": curve[-1]["steps"] if curve else 0,
        "cache_seconds": cache_s, "cache_share": cache_s / seconds if seconds else 0.0,
        "cache_events": [pick(e, ("rows",)) for e in events],
        "builds": [pick(e, ("fixed_s", "rows", "executor")) for e in builds],
        "fixed_share": sum(e["fixed_s"] for e in builds) / sum(e["seconds"] for e in builds)
        if builds else None,
        "visits": visits, "budget": budget.why, "passes": budget.passes, "rows": budget.rows,
        "val_rows": budget.val_rows, "tokens_per_step": cfg.train.batch_size * cfg.data.seq_len,
        "visit_loop_seconds": sum(v.get("seconds", 0.0) for v in summaries),
        "visit_peak_mb": [v.get("peak_mem_mb") for v in summaries],
        "visit_val_losses": visit_evals,
        "trainable_params": [v.get("trainable_params") for v in summaries],
        "schedule": f"AdamW, warmup {cfg.train.warmup_steps} + cosine to "
                    f"{cfg.train.min_lr_ratio:g}x "
                    + ("over the rotation" if cfg.train.schedule == "run" else "per visit")
                    + ", state kept across rounds",
        "blocks": [list(b) for b in Checkpoint.open(spec["init"]).partition.blocks],
    }  # fmt: skip


def measured(spec: dict, evaluate) -> dict:
    """spec's runner in this process, with its seconds, peak memory and load."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    fn = _target(spec.get("runner") or "bench.arms:preinfer_arm")
    load0, clock, mem = load_average(), Clock(), PeakMemory()
    try:
        res = fn(spec, clock, mem, evaluate)
    finally:
        peak = mem.stop()
    last = res["curve"][-1] if res["curve"] else {}
    return {
        **{k: spec[k] for k in ("arm", "lr", "seed") if k in spec}, **res,
        "final_loss": last.get("loss"), "final_ppl": last.get("ppl"), "peak_rss_mb": peak,
        "baseline_rss_mb": mem.baseline, "peak_growth_mb": peak - mem.baseline,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_start": load0, "load_end": load_average(), "torch_threads": torch.get_num_threads(),
        "own_process": bool(spec.get("own_process")),
    }  # fmt: skip


def host() -> dict:
    """What a results file says of the machine's CPUs and this process's torch threads."""
    return {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip


def run_arm(spec: dict, *, log_path: Path | None = None) -> dict:
    """One arm (spec: see the module doc; spec["stop"] a Stop or its dict) in its own process,
    its stderr to log_path, or, without log_path, in this one; its record."""
    spec = {**spec, "stop": asdict(spec["stop"]) if isinstance(spec.get("stop"), Stop)
            else spec.get("stop"), "own_process": log_path is not None}  # fmt: skip

    def evaluate(overrides: list[str]) -> dict:
        return eval_run(spec.get("config"), overrides, spec.get("eval_batches", 0),
                        bool(spec.get("per_row")))  # fmt: skip

    if log_path is None:
        return measured(spec, evaluate)
    return in_child("bench.arms:measured", spec, answer=evaluate, log_path=log_path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="The child: fn(spec, ask), the spec read on stdin")
    ap.add_argument("target", help="module:function")
    _child(ap.parse_args().target)
