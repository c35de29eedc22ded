"""`python -m bench.check_results`: every figure of README.md's Results tables is in the results
file its row names (issue #42). Run by `make test` (tests/test_check_results.py).

A table's columns: measure | result | seeds | target | status | doc, results, where a table may
hold several result columns (each header starting "result", e.g. one per data set); at most
MAX_ROWS rows in all the tables. Each row
- names its doc (`docs/X.md` or a dated log `docs/log/X.md`, an `#anchor` one of its headings) and its results files
  (`bench/results/X`): they exist, and the doc names each results file;
- holds one number in each result cell (or "not reached"), which one of its files holds at the
  printed precision: a JSON as any numeric value that rounds to it, a text file (.md, .log, .txt)
  as a number in its text that rounds to it (a "%" figure also as a fraction);
- says "n of N reached" where seeds can miss: a file holds that count (a summary with n and
  of, or reached and seeds, or the text "n/N"), and the median over all N seeds, the
  not-reached counted as not reached, exists only if n > N/2;
- reads "met" when every result meets the target (<=, <, >=, >), "missed" when none does,
  else "met K of N" (K of its N result cells meet it).
Exit 0 when every row agrees, else 1 with one line per mismatch, naming the row.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench.harness import ROOT

MAX_ROWS = 8  # issue #43: the front page's headline table
NUM = re.compile(r"(?<![\w.])[-+\u2212]?\d+(?:\.\d+)?%?")
FILE = re.compile(r"bench/results/([\w.\-]+)")
DOC = re.compile(r"docs/((?:log/)?[\w.\-]+\.md)(?:#([\w\-]+))?")
REACHED = re.compile(r"(\d+) of (\d+)")
TARGET = re.compile(r"(<=|>=|≤|≥|<|>)\s*([-+]?\d+(?:\.\d+)?)")
MEETS = {"<=": float.__le__, "≤": float.__le__, "<": float.__lt__,
         ">=": float.__ge__, "≥": float.__ge__, ">": float.__gt__}  # fmt: skip


def rows(readme: str) -> list[dict[str, str]]:
    """The rows of every table in the Results section, as {lowercased header: cell}."""
    section = (readme.split("\n## Results", 1) + [""])[1].split("\n## ", 1)[0]
    out, head = [], None
    for ln in (x.strip() for x in section.splitlines()):
        if not ln.startswith("|"):
            head = None  # a table ends at its first line that is not a row
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln.strip("|"))]
        if head is None:
            head = [h.lower() for h in cells]
        elif not set(ln) <= set("|-: "):  # not the header's rule
            out.append(dict(zip(head, cells, strict=False)))
    return out


def column(row: dict[str, str], word: str) -> str:
    return next((v for k, v in row.items() if k.startswith(word)), "")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def number(text: str) -> tuple[float, int, bool]:
    """(value, decimals, is a percentage) of a printed figure."""
    s = text.replace("\u2212", "-").lstrip("+").rstrip("%")
    return float(s), len(s.partition(".")[2]), text.endswith("%")


def rounds_to(v: float, figure: str) -> bool:
    x, d, pct = number(figure)
    tol = 0.5 * 10**-d + 1e-12
    return abs(v - x) <= tol or (pct and abs(100 * v - x) <= tol)


def walk(o: object):
    """Every value inside a parsed JSON, containers included."""
    yield o
    for v in o.values() if isinstance(o, dict) else o if isinstance(o, list) else ():
        yield from walk(v)


def values(path: Path) -> tuple[list[float], str, object]:
    """The file's numbers, its text, and its parsed JSON (None for a text file)."""
    text = path.read_text(errors="replace")
    if path.suffix != ".json":
        return [number(m)[0] for m in NUM.findall(text)], text, None
    data = json.loads(text)  # NaN and Infinity stay: they round to no printed figure
    nums = [float(o) for o in walk(data) if isinstance(o, int | float) and not isinstance(o, bool)]
    return nums, text, data


def has_count(data: object, text: str, n: int, of: int) -> bool:
    pairs = [((o.get("n"), o.get("of")), (o.get("reached"), o.get("seeds")))
             for o in walk(data) if isinstance(o, dict)]  # fmt: skip
    return f"{n}/{of}" in text or any((n, of) in p for p in pairs)


def check_row(row: dict[str, str], root: Path) -> list[str]:
    whole = " | ".join(row.values())
    out: list[str] = []
    files = list(dict.fromkeys(FILE.findall(whole)))
    docs = list(dict.fromkeys(DOC.findall(whole)))
    if not files:
        out.append("names no results file (bench/results/...)")
    if not docs:
        out.append("names no doc (docs/*.md)")
    for name, anchor in docs:
        doc = root / "docs" / name
        if not doc.is_file():
            out.append(f"doc docs/{name} does not exist")
            continue
        text = doc.read_text()
        heads = {slug(ln.lstrip("#")) for ln in text.splitlines() if ln.startswith("#")}
        if anchor and anchor not in heads:
            out.append(f"docs/{name} has no heading #{anchor}")
        out += [f"docs/{name} does not name {f}" for f in files if f not in text]
    there = [f for f in files if (root / "bench" / "results" / f).is_file()]
    out += [f"results file bench/results/{f} does not exist" for f in files if f not in there]
    loaded = [values(root / "bench" / "results" / f) for f in there]
    figures = []
    for key in (k for k in row if k.startswith("result")):
        result = row[key].replace("*", "")
        found = NUM.findall(result)
        figures += found
        if len(found) > 1 or not (found or "not reached" in result):
            out.append(f"result cell {result!r}: one number (or 'not reached') per cell")
    for fig in figures:
        if loaded and not any(rounds_to(v, fig) for vs, _, _ in loaded for v in vs):
            out.append(f"{fig} is in none of {', '.join(files)}")
    reached = REACHED.search(column(row, "seeds"))
    if reached:
        n, of = int(reached[1]), int(reached[2])
        if loaded and not any(has_count(data, text, n, of) for _, text, data in loaded):
            out.append(f"'{n} of {of}' is in none of {', '.join(files)}")
        if figures and 2 * n <= of:
            out.append(f"{n} of {of} reached: the median over all seeds is 'not reached'")
    target, status = TARGET.search(column(row, "target")), column(row, "status").lower()
    if not target:
        out.append(f"target {column(row, 'target')!r} has no comparison (<=, <, >=, >)")
    elif figures:
        met = sum(MEETS[target[1]](number(f)[0], float(target[2])) for f in figures)
        says = {len(figures): "met", 0: "missed"}.get(met, f"met {met} of {len(figures)}")
        if status.strip("* ") != says:
            out.append(f"status {status!r}, but {', '.join(figures)} {target[0]} is {says}")
    elif not figures and "missed" not in status:
        out.append(f"status {status!r}, but nothing reached: missed")
    return out


def check(readme: str, root: Path = ROOT) -> list[str]:
    """One line per mismatch, each naming its row; empty when the table agrees."""
    table = rows(readme)
    out = [] if table else ["README.md has no Results table"]
    if len(table) > MAX_ROWS:
        out.append(f"Results has {len(table)} rows in its tables, at most {MAX_ROWS}")
    for i, row in enumerate(table, 1):
        name = re.sub(r"\s+", " ", column(row, "measure").replace("*", ""))[:70]
        out += [f"row {i} ({name}): {p}" for p in check_row(row, root)]
    return out


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--root", type=Path, default=ROOT, help="where docs/ and bench/results/ are")
    a = ap.parse_args(argv)
    problems = check(a.readme.read_text(), a.root)
    print("\n".join(problems) or "every figure of the Results table is in its results file")
    return 1 if problems else 0


if __name__ == "__main__":  # not `main`: bench.run_all runs modules with a main as benchmarks
    sys.exit(run())
