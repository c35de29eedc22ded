"""bench/check_results.py (issue #42): every figure of README's Results table is in the results
file its row names. On the real README it must pass; a wrong figure, a missing file, a "met"
that the figure misses and a median over too few seeds must each fail, naming the row."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from bench import check_results

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
HEAD = "| measure | result | seeds / runs | target | status | doc, results |\n|---|---|---|---|---|---|\n"
PEERS = "peers-20261203-suffix16-s0.json"  # a peers JSON: its "targets" and "runs"


def _table(*rows: str) -> str:
    return "# x\n\n## Results\n\nintro\n\n" + HEAD + "".join(r + "\n" for r in rows) + "\n## Next\n"


def _row(measure: str, result: str, seeds: str, target: str, status: str, src: str) -> str:
    return f"| {measure} | {result} | {seeds} | {target} | {status} | {src} |"


def _peers_root(root: Path) -> str:
    """A repo root holding PEERS and a doc that names it; the row's doc and results cell."""
    (root / "docs").mkdir()
    (root / "bench" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "results" / PEERS, root / "bench" / "results" / PEERS)
    (root / "docs" / "economics.md").write_text(f"# E\n\n## Issue #41: the lever\n\n{PEERS}\n")
    return f"[economics.md](docs/economics.md#issue-41-the-lever), [json](bench/results/{PEERS})"


def test_the_readme_results_agree_with_their_files(capsys):
    assert check_results.check(README) == []
    assert check_results.run([]) == 0
    assert "is in its results file" in capsys.readouterr().out
    rows = check_results.rows(README)
    assert 1 <= len(rows) <= check_results.MAX_ROWS


def test_a_wrong_figure_fails_naming_its_row():
    first = check_results.rows(README)[0]
    result = next(k for k in first if k.startswith("result"))  # "result" or "result, <set>"
    figure = check_results.NUM.findall(first[result].replace("*", ""))[0]
    op, _ = check_results.TARGET.search(first["target"]).groups()
    # 1.2% off, on the side that keeps the row's met / missed as it reads
    up = (op in ("<=", "≤", "<")) != (first["status"] == "met")
    bad = f"{float(figure) * (1.0123 if up else 0.9877):.4f}"
    wrong = README.replace(f"| **{figure}** |", f"| **{bad}** |", 1)
    assert wrong != README
    problems = check_results.check(wrong)
    assert len(problems) == 1, problems
    assert problems[0].startswith("row 1 (") and f"{bad} is in none of" in problems[0]


def test_a_missing_results_file_fails_naming_its_row(tmp_path):
    name = check_results.FILE.findall(" ".join(check_results.rows(README)[0].values()))[0]
    gone = README.replace(name, "no-such-run-20990101.json")
    problems = check_results.check(gone)
    named = re.compile(r"row \d+ \(.*\): results file bench/results/no-such-run")
    assert any(named.match(p) for p in problems), problems
    # and the CLI says so with a non-zero exit
    readme = tmp_path / "README.md"
    readme.write_text(gone)
    assert check_results.run(["--readme", str(readme)]) == 1


def test_a_peers_row_met_missed_and_seed_counts(tmp_path):
    """A row on a peers JSON (the #41 row's kind); the status must follow the figure and the
    target; a median over fewer than half the seeds reached is 'not reached'."""
    src = _peers_root(tmp_path)
    lora = "bcd val loss at LoRA's wall-clock / LoRA's final"
    good = _row(lora, "**1.134**", "1 of 1 reached", "≤ 1.0", "missed", src)
    assert check_results.check(_table(good), tmp_path) == []
    rss = _row("bcd peak RSS / LoRA's", "1.233", "1 seed", "≤ 1.0", "missed", src)
    assert check_results.check(_table(good, rss), tmp_path) == []

    bad = [
        _row(lora, "1.134", "1 of 1 reached", "≤ 1.0", "met", src),  # 1.134 misses <= 1.0
        _row(lora, "1.13", "2 of 2 reached", "≤ 1.0", "missed", src),  # no 2-of-2 summary
        _row(lora, "1.134", "1 of 2 reached", "≤ 1.2", "met", src),  # median not reached
        _row(lora, "1.134; 1.233", "1 seed", "≤ 1.0", "missed", src),  # two numbers in a cell
        _row(lora, "1.134", "1 seed", "≤ 1.0", "missed", src.replace("the-lever", "nope")),
    ]
    problems = check_results.check(_table(good, *bad), tmp_path)
    by_row = {int(p.split()[1]): p for p in problems}
    assert sorted(by_row) == [2, 3, 4, 5, 6], problems
    assert "status 'met', but 1.134 ≤ 1.0 is missed" in by_row[2]
    assert "'2 of 2' is in none of" in by_row[3]
    assert "median over all seeds is 'not reached'" in by_row[4]
    assert "one number" in by_row[5]
    assert "no heading #issue-41-nope" in by_row[6]

    (tmp_path / "docs" / "economics.md").write_text("# E\n\n## Issue #41: the lever\n")
    assert any("does not name " + PEERS in p for p in check_results.check(_table(good), tmp_path))


def test_too_many_rows_fail():
    row = check_results.rows(README)[0]
    line = "| " + " | ".join(row.values()) + " |"
    problems = check_results.check(_table(*[line] * (check_results.MAX_ROWS + 1)))
    assert f"at most {check_results.MAX_ROWS}" in problems[0]


def test_a_second_table_with_a_result_per_data_set(tmp_path):
    """A table may hold one result column per data set: each cell one number in the row's
    files, and the status "met K of N" where some meet the target; every table's rows count
    towards MAX_ROWS."""
    src = _peers_root(tmp_path)
    head = "| measure | result, set a | result, set b | seeds | target | status | doc |\n"
    head += "|---|---|---|---|---|---|---|\n"

    def readme(*rows: str) -> str:
        first = _row("bcd peak RSS / LoRA's", "1.233", "1 seed", "≤ 1.0", "missed", src)
        second = head + "".join(r + "\n" for r in rows)
        return _table(first).replace("\n## Next\n", "\n" + second + "\n## Next\n")

    def row(a: str, b: str, status: str) -> str:
        return f"| two sets | {a} | {b} | 1 seed | ≤ 1.2 | {status} | {src} |"

    assert check_results.check(readme(row("1.134", "1.233", "met 1 of 2")), tmp_path) == []
    assert len(check_results.rows(readme(row("1.134", "1.233", "met 1 of 2")))) == 2
    problems = check_results.check(readme(row("1.134", "1.233", "met")), tmp_path)
    assert len(problems) == 1 and "is met 1 of 2" in problems[0] and problems[0].startswith("row 2")
    problems = check_results.check(readme(row("1.134", "1.777", "met 1 of 2")), tmp_path)
    assert len(problems) == 1 and "1.777 is in none of" in problems[0]
