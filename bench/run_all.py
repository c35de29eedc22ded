"""`make bench`: run every benchmark module in bench/, collect the results, write a table.

    python -m bench.run_all                    # every benchmark (its --quick form where it has one)
    python -m bench.run_all --only cache_io trainer_step --timeout 1800

A benchmark is a module of the bench package with a top-level `def main(argv)` returning a dict.
Each runs in a fresh subprocess from the repo root, with `--quick` where its source declares
that flag. The dicts go to bench/results/<timestamp>.json and a markdown table beside it; a
benchmark that fails, times out or returns no dict is recorded as such, and the others run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import ROOT, clean, headline_table, rel, write_results

BENCH = Path(__file__).resolve().parent
NOT_IN_SUITE = ("run_all.py", "gpu_check.py")  # gpu_check: bench/gpu_check.sh

# The child (argv: module, result path, main's argv) writes its record to the result path
_CHILD = r"""
import importlib, inspect, json, sys, traceback
module, out, *argv = sys.argv[1:]
sys.argv = [module, *argv]
try:
    main = importlib.import_module(module).main
    res = main(argv) if inspect.signature(main).parameters else main()
    rec = {"status": "ok", "result": res} if isinstance(res, dict) else {"status": "failed",
           "error": f"main() returned {type(res).__name__} ({repr(res)[:500]}), not a dict"}
except BaseException as e:
    rec = {"status": "failed", "error": f"{type(e).__name__}: {e}",
           "traceback": traceback.format_exc()[-4000:]}
with open(out, "w") as f:
    json.dump(rec, f, default=str)
"""


def discover(bench_dir: Path = BENCH) -> list[dict]:
    """Modules of the package bench_dir with a top-level `def main`: name (the file's stem),
    module (`<package>.<name>`), path, and quick (the source declares --quick)."""
    found = []
    for path in sorted(bench_dir.glob("[!_]*.py")):
        src = path.read_text()
        if path.name not in NOT_IN_SUITE and re.search(r"^def main\(", src, re.MULTILINE):
            quick = re.search(r"""["']--quick["']""", src) is not None
            module = f"{bench_dir.name}.{path.stem}"
            found.append({"name": path.stem, "module": module, "path": path, "quick": quick})
    return found


def run_script(script: dict, *, timeout: float, log_dir: Path) -> dict:
    """Run one benchmark's main in a fresh subprocess; returns its record (never raises)."""
    argv = ["--quick"] if script["quick"] else []
    log_dir.mkdir(parents=True, exist_ok=True)
    log, out = log_dir / f"{script['name']}.log", log_dir / f"{script['name']}.result.json"
    out.unlink(missing_ok=True)
    t0, rec = time.perf_counter(), {"argv": argv, "log": rel(log)}
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-c", _CHILD, script["module"], str(out), *argv],
                                cwd=script["path"].parent.parent, stdout=f, timeout=timeout,
                                stderr=subprocess.STDOUT).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    rec["seconds"] = time.perf_counter() - t0
    if rc is None:
        rec.update(status="timeout", error=f"no result within {timeout:.0f} s")
    elif out.is_file():
        rec.update(json.loads(out.read_text()))
    else:
        rec.update(status="failed", error=f"the process exited with {rc} before main returned")
    if rec["status"] == "ok":
        rec["result"] = clean(rec["result"])
    else:
        rec["log_tail"] = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    return rec


def flatten(obj, prefix: str = "", out: dict | None = None) -> dict:
    """Scalar leaves of nested dicts/lists as {"a.b.0.c": value}, over 16 scalars "[n values]"."""
    out = {} if out is None else out
    flat = isinstance(obj, list | tuple) and not any(isinstance(v, dict | list) for v in obj)
    if flat and len(obj) > 16:
        out[prefix] = f"[{len(obj)} values]"
    elif isinstance(obj, dict | list | tuple):
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = obj
    return out


def fmt(v) -> str:
    if isinstance(v, bool) or v is None or (isinstance(v, float) and not math.isfinite(v)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return "0" if v == 0 else f"{v:.3g}" if abs(v) >= 1e5 or abs(v) < 1e-3 else f"{v:.4g}"
    s = str(v).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= 80 else s[:77] + "..."


def headline(result: dict, n: int = 6) -> str:
    """A few key numbers: the result's 'headline' or 'summary' dict if any, else its leaves."""
    leaves = flatten(next((result[k] for k in ("headline", "summary")
                           if isinstance(result.get(k), dict)), result))  # fmt: skip
    txt = "; ".join(f"{k}={fmt(v)}" for k, v in list(leaves.items())[:n])
    return txt + (f"; … (+{len(leaves) - n})" if len(leaves) > n else "")


def markdown(run: dict, max_rows: int = 60) -> str:
    rows = [("script", "status", "args", "time (s)", "key results")]
    rows += [(f"`{name}`", rec["status"], " ".join(rec["argv"]) or "(defaults)",
              f"{rec['seconds']:.0f}",
              headline(rec["result"]) if rec["status"] == "ok" else fmt(rec.get("error", "")))
             for name, rec in run["scripts"].items()]  # fmt: skip
    h = run["host"]
    L = [f"# Benchmarks ({run['started']})", "",
         f"`{run['command']}` on {h['cpus']} CPUs ({h['machine']}, Python {h['python']}, load "
         f"average {h['loadavg_start']:.1f} at start); commit `{run['commit']}`; total "
         f"{run['seconds'] / 60:.1f} min. Raw: `{run['json']}`.", "", headline_table(rows)]  # fmt: skip
    for name, rec in run["scripts"].items():
        L += ["", f"## {name}", ""]
        if rec["status"] != "ok":
            L.append(f"**{rec['status']}**: {fmt(rec.get('error', ''))} (log: `{rec.get('log')}`)")
            continue
        leaves = list(flatten(rec["result"]).items())
        L += ["| metric | value |", "|---|---|", *(f"| {fmt(k)} | {fmt(v)} |" for k, v in
              leaves[:max_rows])]  # fmt: skip
        if len(leaves) > max_rows:
            L.append(f"| … | {len(leaves) - max_rows} more in the JSON |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="run only these benchmarks (names)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    ap.add_argument("--results-dir", default=str(BENCH / "results"))
    ap.add_argument("--bench-dir", default=str(BENCH), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    scripts = discover(Path(args.bench_dir))
    unknown = set(args.only or []) - {s["name"] for s in scripts}
    if unknown:
        ap.error(f"no benchmark named {', '.join(sorted(unknown))}")
    scripts = [s for s in scripts if s["name"] in (args.only or [s["name"]])]
    results_dir, stamp = Path(args.results_dir), time.strftime("%Y%m%d-%H%M%S")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    run = {"command": "python -m bench.run_all" + (" " + " ".join(argv) if argv else ""),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit or "unknown",
           "scripts": {}, "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                   "python": platform.python_version(),
                                   "loadavg_start": os.getloadavg()[0]}}  # fmt: skip
    t0 = time.perf_counter()
    for s in scripts:
        print(f"bench: {s['name']} ...", flush=True)
        rec = run_script(s, timeout=args.timeout, log_dir=results_dir / f"{stamp}-logs")
        run["scripts"][s["name"]] = rec
        print(f"bench: {s['name']}: {rec['status']} in {rec['seconds']:.0f} s", flush=True)
    run["seconds"] = time.perf_counter() - t0
    run["host"]["loadavg_end"] = os.getloadavg()[0]
    json_path, md_path = results_dir / f"{stamp}.json", results_dir / f"{stamp}.md"
    run["json"], run["markdown"] = rel(json_path), rel(md_path)
    write_results(json_path, run)
    md_path.write_text(markdown(run))
    ok = sum(r["status"] == "ok" for r in run["scripts"].values())
    print(f"bench: {ok}/{len(run['scripts'])} ok; wrote {run['json']} and {run['markdown']}")
    return run


if __name__ == "__main__":
    main(sys.argv[1:])
