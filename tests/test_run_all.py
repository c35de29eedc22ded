"""bench/run_all.py (`make bench`): discovery, a subprocess per benchmark, failures recorded
(on throwaway benchmark modules)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from bench import run_all


def _write(path: Path, body: str) -> None:
    path.write_text(textwrap.dedent(body))


def test_run_all_collects_results_and_records_failures(tmp_path):
    bench = tmp_path / "bench"  # a package of throwaway benchmarks, run as bench.<name>
    bench.mkdir()
    _write(bench / "__init__.py", "")
    _write(
        bench / "good.py",
        """
        import argparse
        from dataclasses import dataclass

        @dataclass
        class Knob:  # a dataclass needs its module in sys.modules
            quick: bool = False

        def main(argv=None):
            ap = argparse.ArgumentParser()
            ap.add_argument("--quick", action="store_true")
            a = ap.parse_args(argv)
            return {"quick": Knob(a.quick).quick, "speed": {"tok_s": 1234.5}, "nan": float("nan")}
        """,
    )
    _write(bench / "noargs.py", "def main():\n    return {'x': 1}\n")
    _write(bench / "broken.py", "def main(argv=None):\n    raise RuntimeError('kaput')\n")
    _write(bench / "nodict.py", "def main(argv=None):\n    return 0\n")
    _write(bench / "exits.py", "import os\ndef main(argv=None):\n    os._exit(3)\n")
    _write(bench / "helper.py", "X = 1\n")  # no main: not a benchmark
    _write(bench / "run_all.py", "def main(argv=None):\n    raise SystemExit('self')\n")
    out = tmp_path / "results"
    run = run_all.main(["--bench-dir", str(bench), "--results-dir", str(out), "--timeout", "60"])
    st = {k: v["status"] for k, v in run["scripts"].items()}
    assert st == {
        "broken": "failed",
        "exits": "failed",
        "good": "ok",
        "nodict": "failed",
        "noargs": "ok",
    }
    good = run["scripts"]["good"]
    assert good["argv"] == ["--quick"] and good["result"]["quick"] is True
    assert good["result"]["nan"] == "nan"  # non-finite floats survive JSON as strings
    assert "kaput" in run["scripts"]["broken"]["error"]
    assert "not a dict" in run["scripts"]["nodict"]["error"]
    js = sorted(out.glob("*.json"))
    md = sorted(out.glob("*.md"))
    assert len(js) == 1 and len(md) == 1
    saved = json.loads(js[0].read_text())
    assert saved["scripts"]["good"]["result"]["speed"]["tok_s"] == 1234.5
    text = md[0].read_text()
    assert "| `good` | ok | --quick |" in text and "speed.tok_s=1234" in text
    assert "| `broken` | failed |" in text


def test_run_all_discovers_the_repo_benchmarks():
    found = {s["name"]: s for s in run_all.discover()}
    assert {"study", "economics", "cache_io", "plan_accuracy"} <= set(found)
    # no main: not benchmarks
    assert not {"run_all", "harness", "__init__", "arms", "peers_arms"} & set(found)
    assert found["study"]["module"] == "bench.study" and found["study"]["quick"] is True
    assert found["economics"]["quick"] is True
