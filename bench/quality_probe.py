"""The quality study's memory probes (bench/quality.py is the entry point).

Each (arm kind, block) is re-run for a few steps from its arm's final checkpoint in a FRESH
subprocess (`python -m bench.quality --probe <spec>`, which calls `probe_main`): its peak RSS
growth over the post-import, post-warm-up baseline, next to the exact bytes of parameters +
gradients + optimizer state it holds. `probe_specs` lists the probes, `run_probes` runs them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.quality_arms import ROOT, Arm, Scale, arm_cfg, first_seeds
from bench.quality_train import set_threads

# ---------------------------------------------------------------------------------------------
# Memory probes: each (arm kind, block) in a fresh subprocess


def probe_specs(scale: Scale, arms: list[Arm]) -> list[dict]:
    """One memory probe per distinct (model, mode, optimizer, M, block), re-run from the arm of
    its group's first seed (its final checkpoint; bcd blocks > 0 read that arm's kept caches).
    Block 0 is the same work in bcd and bcd-recompute (tokens in, all blocks loaded, backward
    through everything), so it is probed once, as mode bcd."""
    first = first_seeds(scale)
    specs, seen = [], set()
    for a in arms:
        if a.seed != first.get(a.group):
            continue
        for k in [0] if a.mode == "full" else range(a.M):
            if a.mode == "full":
                key = (a.model, "full", "adamw", 0, 0)
            elif k == 0:
                key = (a.model, "bcd", a.optimizer, a.M, 0)
            else:
                key = (a.model, a.mode, a.optimizer, a.M, k)
            if key in seen:
                continue
            seen.add(key)
            specs.append(
                {
                    "model": a.model,
                    "mode": key[1],
                    "optimizer": a.optimizer,
                    "lr": a.lr,
                    "M": a.M,
                    "seed": a.seed,
                    "block": k,
                    "steps_per_visit": a.steps_per_visit,
                    "arm": asdict(a),
                }
            )
    return specs


def run_probes(scale: Scale, specs: list[dict], work: Path, log=print) -> list:
    out = []
    for s in specs:
        cmd = [
            sys.executable,
            "-m",
            "bench.quality",  # its main runs probe_main (cwd: the repo root)
            "--probe",
            json.dumps({**s, "scale": asdict(scale), "work": str(work)}),
        ]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        res = None
        for line in reversed(p.stdout.splitlines()):
            if line.startswith("PROBE "):
                res = json.loads(line[6:])
                break
        if res is None:
            res = {"error": (p.stderr or p.stdout)[-2000:]}
        res.update(s)
        res["probe_s"] = time.perf_counter() - t0
        out.append(res)
        log(
            f"  probe {s['model']} {s['mode']} {s['optimizer']} M={s['M']} block {s['block']}: "
            + (
                f"RSS growth {res['rss_growth_mb']:.0f} MB, state {res['state_mb']:.1f} MB"
                if "error" not in res
                else "FAILED " + res["error"].strip().splitlines()[-1]
            )
        )
    return out


def _proc_status_mb(field_name: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def probe_main(spec: dict) -> dict:
    """Child process: a few training steps of one (mode, block); peak RSS growth + state bytes."""
    import resource

    import torch

    import pipelines.cache_build  # noqa: F401  (imports the trainer would pull in lazily)
    import storage.reader  # noqa: F401
    from pipelines.train import visit_spec
    from preinfer.trainer import build_optimizer, train_step
    from preinfer.visit import Visit

    scale = Scale(**spec["scale"])
    set_threads(scale)
    work = Path(spec["work"])
    mode, k = spec["mode"], spec["block"]
    arm = Arm(**spec["arm"])
    arm.keep_caches = True  # never drop anything from here
    cfg = arm_cfg(scale, arm, work / "arms" / arm.id, work)
    torch.manual_seed(0)
    # Library warm-up, so the baseline holds what any trainer process holds before it loads a
    # model: the model classes (transformers imports them lazily: ~150 MB of RSS) and the
    # autograd machinery. What stays is the trainer's own: weights, gradients, optimizer
    # state, activations, batches and the reader's buffers.
    from preinfer.checkpoint import Checkpoint
    from preinfer.modeling import build_model

    ck = Checkpoint.open(cfg.run.checkpoint)
    build_model(ck.model_config, device="meta", hf_config=ck.hf_config)
    x = torch.nn.Parameter(torch.randn(8, 8))
    for warm in (torch.optim.AdamW([x]), torch.optim.SGD([x], lr=0.1, momentum=0.9)):
        (x @ x).sum().backward()  # the first optimizer step imports torch._dynamo lazily
        warm.step()
    del x, ck, warm
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark (VmHWM)
        hwm = "VmHWM"
    except OSError:
        hwm = ""
    base = _proc_status_mb("VmRSS")
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the arm's kept caches are its last round's (cache fingerprints carry the round's row order)
    spec_v = visit_spec(cfg, k, max(0, arm.rounds - 1) if mode == "bcd" else 0, mode)
    visit = Visit(cfg, spec_v, device=torch.device("cpu"))
    opt = build_optimizer(visit.params, cfg.train)
    it = iter(visit.batches.epoch(0))
    step_s = []
    for step in range(scale.probe_steps):
        t0 = time.perf_counter()
        train_step(
            visit.loss, visit.params, opt, next(it), cfg.train, step, device=torch.device("cpu")
        )
        step_s.append(time.perf_counter() - t0)
    peak = (
        _proc_status_mb(hwm)
        if hwm
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_maxrss + base
    )
    mb = 2**20
    loaded = {id(p): p for p in visit.model.parameters() if p.device.type != "meta"}
    param_b = sum(p.numel() * p.element_size() for p in loaded.values())
    train_b = sum(p.numel() * p.element_size() for p in visit.params)
    opt_b = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {
        "rss_base_mb": base,
        "rss_peak_mb": peak,
        "rss_growth_mb": peak - base,
        "hwm_reset": bool(hwm),
        "params_loaded_mb": param_b / mb,
        "params_trainable_mb": train_b / mb,
        "grads_mb": train_b / mb,
        "optimizer_state_mb": opt_b / mb,
        "state_mb": (param_b + train_b + opt_b) / mb,
        "step_s": statistics.median(step_s),
    }
