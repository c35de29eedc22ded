"""bench/frontier.py's --quick form end to end: under a budget just below the peak that full
training of the larger tiny shape reached, the RSS watchdog refuses full (killed, its peak
recorded) while every arm of bcd (the cache builds and the visits of blocks 0, 1 and 2) fits;
the peers run when their packages are installed and are skipped cleanly when not."""

from __future__ import annotations

import json
from importlib.util import find_spec

import torch

from bench import frontier


def test_quick_frontier_refuses_full_and_fits_bcd(tmp_path):
    out, threads = tmp_path / "r.json", torch.get_num_threads()
    try:
        got = frontier.main(["--quick", "--sizes", "tiny-l", "--methods", "full", "bcd", "lora",
                             "badam", "--work", str(tmp_path / "w"), "--out", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    res, budget_mb = got["res"], got["res"]["budget_gib"] * 1024
    row = res["sizes"]["tiny-l"]["methods"]
    assert row["full"]["fits"] is False and row["full"]["why"].startswith("full: killed: RSS")
    assert row["full"]["peak_rss_mb"] > budget_mb
    assert row["bcd"]["fits"] is True and 0 < row["bcd"]["peak_rss_mb"] <= budget_mb
    assert set(row["bcd"]["arms"]) == {"bcd build 1", "bcd build 2"} | {
        f"bcd block {k}" for k in range(3)
    }
    for method, package in (("lora", "peft"), ("badam", "badam")):
        if find_spec(package) is None:
            assert row[method]["why"].startswith(f"skipped: {package} not installed")
        else:
            assert row[method]["fits"] is not None and row[method]["peak_rss_mb"] > 0
    assert (
        got["frontier"]["bcd"]["largest"] == "tiny-l" and got["frontier"]["full"]["largest"] is None
    )
    # every bcd arm beside the planner's stage; a visit from the cache held its blocks k..M-1
    assert {r["arm"] for r in res["planner"]} == set(row["bcd"]["arms"])
    (falls,) = [f for f in res["falls_with_k"] if f["mode"] == "bcd"]
    assert [x["k"] for x in falls["rows"]] == [0, 1, 2] and falls["held_as_planned"]
    written = json.loads(out.read_text())
    assert written["table"] == res["table"] and "does not fit" in written["table"]
    assert written["load_start"] is not None and written["budget_gib"] == res["budget_gib"]
