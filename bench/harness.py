"""What every benchmark shares: where results go, the machine's load, a markdown table."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def results_path(name: str) -> Path:
    """bench/results/<name>-<YYYYmmdd-HHMMSS>.json"""
    return RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _clean(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def write_results(path: Path, res: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(res), indent=1, default=str))
    return path


def without_paths(res: dict, labels: dict[str, str]) -> dict:
    """res with every occurrence of each machine path replaced by its label ({"/tmp/x": "<work>"}),
    so a results file names no directory of the machine that wrote it. Longer paths first."""
    text = json.dumps(_clean(res), default=str)
    for path, label in sorted(labels.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(json.dumps(path)[1:-1], label)
    return json.loads(text)


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (what else the machine was doing), None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def headline_table(rows: list[tuple]) -> str:
    """A markdown table: the first row is the header."""
    head, *body = rows
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return "\n".join(out)


def spread(xs: list[float]) -> dict:
    """Median, min, max, count and the values of a bench's repeated measurements."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "values": xs}  # fmt: skip
