"""GPU check: what only a GPU machine can show, in one short run and one JSON file.

    bash bench/gpu_check.sh [OUT_DIR [STEP ...]]   # from the source tree; <= 8 min on 1 GPU

Steps (each recorded; a failure does not stop the others):
  imports    every package the project needs, by name (the GPU machine's own torch and Python)
  parity     the exactness tests on CUDA (cache == forward, refresh == build, a step from the
             cache == the same step recomputed)
  demo       the demo with bf16 autocast training from the cache (run.device=cuda)
  memory     peak CUDA memory of a build and of a cache-fed visit (last block), beside the
             planner's estimates
  throughput a cache build against the bare forward of the same compute, on the GPU
             (bench/preinfer_throughput.py --quick, in process, 3 paired repeats)
  writer     the cache writer alone on this host's CPUs (bench/writer.py, local disk, 1-8
             encoder threads): MB per core-second beside the GPU's output rate
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.harness import ROOT, quiet, write_results

NEEDED = ["torch", "ray", "zarr", "numcodecs", "pyarrow", "datasets", "transformers",
          "tokenizers", "safetensors", "yaml", "tqdm", "numpy", "psutil", "pytest"]  # fmt: skip
PARITY = "cache_equals or refresh_equals or recomputed or bf16_cache"


def step_imports() -> dict:
    missing, versions = [], {}
    for name in NEEDED:
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001 -- any import failure is a finding
            missing.append(f"{name}: {type(e).__name__}: {e}")
    import torch

    return {"ok": not missing, "missing": missing, "versions": versions,
            "cuda": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": sys.version.split()[0]}  # fmt: skip


def _run(out: Path, name: str, argv: list[str], timeout: int) -> dict:
    """`python -m argv` from the repo root, its output in OUT/<name>.log."""
    cmd = [sys.executable, "-m", *argv]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    (out / f"{name}.log").write_text(r.stdout + r.stderr)
    return {"ok": r.returncode == 0, "tail": (r.stdout + r.stderr)[-2500:]}


def step_parity(out: Path) -> dict:
    tests = ["tests/test_preinfer.py", "tests/test_train.py", "-k", PARITY]
    return _run(out, "parity", ["pytest", "-q", "-p", "no:cacheprovider", *tests], 360)


def step_demo(out: Path) -> dict:
    from pipelines.demo import run_demo
    from preinfer.run.config import load_config

    cfg = load_config(ROOT / "configs/demo.yaml", [f"run.dir={out / 'demo'}", "run.device=cuda",
                                                   "run.precision=bf16"])  # fmt: skip
    lines: list[str] = []
    res = run_demo(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    (out / "demo.log").write_text("\n".join(lines))
    return {"ok": True, "ppl_before": res["before"]["ppl"], "ppl_after": res["after"]["ppl"]}


def step_memory(out: Path) -> dict:
    import torch

    from bench.arms import PeakMemory
    from pipelines.cache_build import build_cache, plan_block
    from preinfer.checkpoint.store import Checkpoint
    from preinfer.model.shape import model_shape
    from preinfer.plan.memory import preinfer_memory, setup_for
    from preinfer.run.config import load_config
    from preinfer.run.preflight import check_memory
    from preinfer.run.visit import Visit, VisitSpec
    from preinfer.schedule.rotation import store_budget
    from storage.tokens import TokenStore

    cfg = load_config(ROOT / "configs/demo.yaml", [f"run.dir={out / 'demo'}", "run.device=cuda",
                                                   "preinfer.executor=local"])  # fmt: skip
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    M = ckpt.num_blocks
    res, mem = {"ok": True}, PeakMemory("cuda")  # bytes: max_memory_allocated over the baseline
    build_cache(cfg, M - 1, round_=9, log=quiet)  # a round the demo never made
    res["build_measured"] = (mem.stop() - mem.baseline) * 2**20
    sh = model_shape(cfg.model)
    p = setup_for(sh, cfg.train, cfg.cache, cfg.preinfer, target="gpu", seq=cfg.data.seq_len,
                  token_rows=cfg.data.shard_rows, run_precision=cfg.run.precision)  # fmt: skip
    res["build_estimate"] = preinfer_memory(sh, ckpt.partition, M - 1, p)["peak"]
    plans = plan_block(cfg, M - 1, 9).fingerprints
    torch.cuda.empty_cache()
    mem = PeakMemory("cuda")
    spec = VisitSpec(block=M - 1, round=9, cache_train=plans["train"], cache_val=plans["val"])
    cfg.train.max_steps = 10
    Visit(cfg, spec, device=torch.device("cuda")).run(log=quiet)
    res["trainer_measured"] = (mem.stop() - mem.baseline) * 2**20
    store = TokenStore(cfg.data.out_dir)
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, store)
    worst = check_memory(cfg, ckpt, budget, store.seq_len, mode="bcd", block=M - 1, log=quiet)
    res["trainer_estimate"] = worst["peak"]
    for k in ("build", "trainer"):
        res[f"{k}_error"] = res[f"{k}_estimate"] / max(res[f"{k}_measured"], 1) - 1
    return res


def _bench(out: Path, name: str, args: list[str], timeout: int) -> dict:
    return _run(out, name, [f"bench.{name}", *args, "--out", str(out / f"{name}.json")], timeout)


def step_throughput(out: Path) -> dict:
    return _bench(out, "preinfer_throughput", ["--quick", "--repeats", "3", "--work",
                  str(out / "throughput"), "--set", "run.device=cuda"], 240)  # fmt: skip


def step_writer(out: Path) -> dict:
    return _bench(out, "writer", ["--quick", "--targets", "local", "--threads", "1", "2", "4",
                                  "8", "--dir", str(out)], 150)  # fmt: skip


def main(argv=None) -> dict:
    steps = {"parity": step_parity, "demo": step_demo, "memory": step_memory,
             "throughput": step_throughput, "writer": step_writer}  # fmt: skip
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="runs/gpu_check", help="where the JSON and logs go")
    ap.add_argument("steps", nargs="*", help=f"of {', '.join(steps)} (default: every step)")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.steps) - set(steps))
    if unknown:
        ap.error(f"unknown step(s) {unknown}; choose from {', '.join(steps)}")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "imports": step_imports()}
    for name in a.steps or steps:  # e.g. OUT throughput writer
        t0 = time.perf_counter()
        try:
            res[name] = steps[name](out)
        except Exception as e:  # noqa: BLE001 -- record and go on to the next step
            res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        res[name]["seconds"] = time.perf_counter() - t0
        print(f"gpu_check {name}: {'ok' if res[name].get('ok') else 'FAILED'} "
              f"({res[name]['seconds']:.0f}s)", flush=True)  # fmt: skip
    path = out / "gpu_check.json"
    write_results(path, res)
    print(f"gpu_check: {path}")
    return res


if __name__ == "__main__":
    main()
