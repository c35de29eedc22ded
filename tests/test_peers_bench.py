"""bench/peers.py on a tiny random LLaMA (`--model tiny`): every arm runs, reads the same val
rows, and the ratios and tables come out. The real-model run is `python -m bench.peers --quick`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import peers

pytest.importorskip("badam", reason="the badam arms need the `real` extra")
pytest.importorskip("peft", reason="the lora arm needs the `real` extra")


def test_every_arm_on_a_tiny_model_in_one_process(tmp_path, capsys):
    out = tmp_path / "res.json"
    threads = torch.get_num_threads()
    try:  # one torch thread (the bench's default; tiny ops run slower on two), restored after
        ret = peers.main(["--quick", "--model", "tiny", "--inline", "--work", str(tmp_path / "w"),
                          "--out", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert ret["results"] == str(out)
    assert str(tmp_path) not in out.read_text()  # no machine path: <work>, <repo>
    sc, start = res["scale"], res["prep"]["initial_loss"]
    visits = sc["rounds"] * sc["M"]
    assert {r["arm"] for r in res["runs"]} == set(peers.ARMS)
    for r in res["runs"]:
        assert r["steps"] == visits * sc["steps_per_visit"], r["arm"]
        assert len(r["curve"]) == visits + 1, r["arm"]  # step 0, then every visit's end
        # the HF arms' own evaluation of the pretrained model is preinfer's (same val rows,
        # same response-token mean): the bcd arms' start point is preinfer eval's
        assert math.isclose(r["curve"][0]["loss"], start, rel_tol=1e-4), r["arm"]
        assert r["final_loss"] < start, r["arm"]  # every arm trained
        assert r["seconds"] > 0 and r["peak_rss_mb"] >= r["baseline_rss_mb"] > 0
    by = {r["arm"]: r for r in res["runs"]}
    # BAdam over preinfer's 3 blocks: the embedding in the first, the final norm in the last
    blocks = by["badam-blocks"]["blocks"]
    assert by["badam-blocks"]["block_count"] == 3 and blocks[0][0] == "model.embed_tokens."
    assert by["badam-layers"]["block_count"] == 6  # BAdam's default: one block per layer
    assert by["lora"]["trainable_params"][0] < by["full"]["trainable_params"][0]
    assert set(res["targets"]) >= {"bcd_loss_at_full_time", "bcd_peak_over_badam-blocks",
                                   "bcd_time_to_badam-layers_loss"}  # fmt: skip
    assert "bcd peak RSS / badam-blocks'" in res["table"]
    # issue #58: every evaluation after the start keeps its per-row losses (the same rows in
    # every arm), and the ratios carry their error paired over those rows
    n_rows = len(by["lora"]["curve"][0]["row_sums"])
    assert n_rows > 1 and all(len(p["row_sums"]) == n_rows for r in res["runs"]
                              for p in r["curve"][1:])  # fmt: skip
    for p in by["lora"]["curve"]:  # the loss is the rows' summed loss over their targets
        assert sum(p["row_sums"]) > 0 and p["loss"] > 0
    e = res["errors"]["bcd_loss_at_full_time"]
    seed = res["per_seed"][0]
    assert e["rows_se"] == [seed["bcd_loss_at_full_time_se"]] and e["rows_se"][0] > 0
    assert e["mean"] == pytest.approx(seed["bcd_loss_at_full_time"])
    assert "bcd_loss_at_full_time_se" not in res["targets"]  # a noise figure, not a target
    assert "+-" in res["table"]

    # --resume: every run's record is reused (nothing reruns), the figures are the same; a
    # record made by other settings (another eval_batches) is not
    capsys.readouterr()
    again = tmp_path / "again.json"
    try:
        peers.main(["--quick", "--model", "tiny", "--inline", "--work", str(tmp_path / "w"),
                    "--out", str(again), "--resume"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    said = capsys.readouterr().out
    assert said.count("(--resume)") == len(res["runs"]), said
    res2 = json.loads(again.read_text())
    assert [(r["arm"], r["final_loss"]) for r in res2["runs"]] == [
        (r["arm"], r["final_loss"]) for r in res["runs"]
    ]
    rec = tmp_path / "w" / "runs" / "lora-lr0.003-s0.json"
    r = json.loads(rec.read_text())
    r["made_by"]["eval_batches"] += 1
    rec.write_text(json.dumps(r))
    try:
        peers.main(["--quick", "--model", "tiny", "--inline", "--work", str(tmp_path / "w"),
                    "--out", str(again), "--resume", "--arms", "bcd", "lora"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    said = capsys.readouterr().out
    assert "lora-lr0.003-s0.json was made by other settings: rerun" in said
    assert said.count("(--resume)") == 1  # bcd's


def test_bcd_set_unties_the_bcd_arms_head_and_trains_it_in_every_visit(tmp_path):
    """--bcd-set model.tie_embeddings=false --bcd-set train.always_train=[head]: the bcd arm gets
    an init checkpoint of its own (the tiny model is tied: its head becomes a copy of the
    embedding, the same function, so the same start loss) and trains the head in every visit;
    the full arm runs the tied model as before."""
    out, threads = tmp_path / "res.json", torch.get_num_threads()
    try:
        peers.main(["--quick", "--model", "tiny", "--inline", "--work", str(tmp_path / "w"),
                    "--out", str(out), "--arms", "bcd", "full",
                    "--bcd-set", "model.tie_embeddings=false",
                    "--bcd-set", "train.always_train=[head]",
                    # without configs/finetune.yaml's levers: the count below is the head's
                    "--bcd-set", "train.suffix_rank=0", "--bcd-set", "train.freeze=[]"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    prep = res["prep"]
    assert prep["bcd_set"][:2] == ["model.tie_embeddings=false", "train.always_train=[head]"]
    assert prep["bcd_init"] != prep["init"]
    assert math.isclose(prep["bcd_initial_loss"], prep["initial_loss"], rel_tol=1e-5)
    by = {r["arm"]: r for r in res["runs"]}
    assert "model.tie_embeddings=false" in by["bcd"]["made_by"]["overrides"]
    assert "model.tie_embeddings=false" not in by["full"]["made_by"]["overrides"]
    V, H = 400, 32  # the tiny model's vocabulary and width: the untied head's V x H matrix
    full_params = by["full"]["trainable_params"][0]
    # every visit trains its block and the head; the three visits together train the whole
    # tied model once plus the head's own copy three times (and the final norm twice more)
    assert sum(by["bcd"]["trainable_params"]) == full_params + 3 * V * H + 2 * H
    assert by["bcd"]["final_loss"] < by["bcd"]["curve"][0]["loss"]


def test_blocks_sets_the_rotation_and_badam_blocks_block_list(tmp_path):
    """--blocks 4: bcd rotates over 4 blocks (4 visits, a curve point after each) and
    badam-blocks switches over the same 4 blocks, in the same steps."""
    out, threads = tmp_path / "res.json", torch.get_num_threads()
    try:
        peers.main(["--quick", "--model", "tiny", "--inline", "--work", str(tmp_path / "w"),
                    "--out", str(out), "--arms", "bcd", "badam-blocks", "--blocks", "4"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert res["scale"]["M"] == 4 and len(res["prep"]["blocks"]) == 4
    by = {r["arm"]: r for r in res["runs"]}
    steps = 4 * res["scale"]["steps_per_visit"]
    for arm in ("bcd", "badam-blocks"):
        assert by[arm]["steps"] == steps and len(by[arm]["curve"]) == 4 + 1, arm
    assert len(by["badam-blocks"]["blocks"]) == 4


@pytest.mark.parametrize(
    "args, says",
    [
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--jobs", "2", "--inline"], "drop --inline or --jobs"),
        (["--resume"], "give --work"),
        (["--blocks", "0"], "--blocks must be >= 1"),
        (["--bcd-set", "train.always_train"], "give KEY=VALUE"),
    ],
)
def test_bad_run_options_are_refused(args, says, capsys):
    with pytest.raises(SystemExit):
        peers.main(["--quick", "--model", "tiny", *args])
    assert says in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.functional
def test_arms_two_at_a_time_in_processes_of_their_own(tmp_path):
    """--jobs 2: arms run two at a time, each its own process (its own peak RSS), the parent
    answering both's evaluations; every run and its record land, in one table."""
    out = tmp_path / "res.json"
    peers.main(["--quick", "--model", "tiny", "--jobs", "2", "--arms", "bcd", "full", "lora",
                "--work", str(tmp_path / "w"), "--out", str(out)])  # fmt: skip
    res = json.loads(out.read_text())
    assert [r["arm"] for r in res["runs"]] == ["bcd", "full", "lora"]
    for r in res["runs"]:
        assert r["own_process"] and r["final_loss"] < r["curve"][0]["loss"], r["arm"]
        assert (tmp_path / "w" / "runs" / f"{r['arm']}-lr{r['lr']:g}-s0.json").is_file()
    assert "bcd_loss_at_full_time" in res["targets"]
    bcd, full = res["runs"][0], res["runs"][1]
    best = min(p["loss"] for p in bcd["curve"]) / min(p["loss"] for p in full["curve"])
    assert res["targets"]["bcd_best_over_full_best"]["median"] == pytest.approx(best)
