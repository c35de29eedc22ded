"""The planner (preinfer/run/plan_report.py) and the resource guards (preinfer/plan/guards.py).

Fast tests: the saved-activation counts against autograd itself, the paper's fit findings on
its model shapes (meta device, arithmetic only), the guards with injected disk/device figures,
the CLI glue. The measured-vs-estimated peak memory check is bench/plan_accuracy.py; the slow
test at the end runs it for the demo config.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core.config import ConfigError
from preinfer.model.partition import partition_layers
from preinfer.model.shape import model_shape
from preinfer.plan import memory
from preinfer.plan.guards import (
    DiskSpaceError,
    check_disk_for_boundary,
    check_disk_for_rotation,
    warn_trainer_memory,
)
from preinfer.run import plan_report as plan
from preinfer.run.config import load_config
from preinfer.schedule.rotation import store_budget, visit_budget
from tests.conftest import tiny_model_config

ROOT = Path(__file__).resolve().parents[1]


def _saved_bytes(model, fn) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `fn` runs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert", "sequential"])
@pytest.mark.parametrize("trainable", [True, False])
def test_layer_activation_count_matches_autograd(arch, trainable):
    from preinfer.model.adapters import get_adapter
    from preinfer.model.modeling import build_model

    cfg = tiny_model_config(arch, hidden_size=64)  # llama: 2 kv heads for 4 query heads (GQA)
    model = build_model(cfg)
    ad = get_adapter(model, arch)
    for p in model.parameters():
        p.requires_grad_(trainable)
    B, S = 2, 16
    h = torch.randn(B, S, cfg.hidden_size, requires_grad=True)
    ctx = ad.context(h)
    got = _saved_bytes(model, lambda: ad.layer(0, h, ctx))
    want = memory.layer_act(model_shape(cfg), trainable) * B * S * 4
    assert got == pytest.approx(want, rel=0.06), (got, want)


def _plan(name: str, tmp_path, card: str, **opts):
    cfg = load_config(ROOT / "configs" / name, [f"run.dir={tmp_path}"])
    return plan.build_plan(cfg, plan.PlanOptions(card=card, free_disk=1000.0, **opts))


@pytest.mark.parametrize("name", ["plan-g7b.yaml", "plan-l7b.yaml"])
def test_paper_7b_full_adam_does_not_fit_80gb_bcd_m3_does(name, tmp_path):
    p = _plan(name, tmp_path, "a800-80")
    assert p["setup"]["optimizer"] == "adam" and p["setup"]["precision"] == "fp32"
    assert not p["full_fits"]
    assert p["partition"]["M"] == 3 and p["bcd_fits"]
    assert p["smallest_m"]["M"] <= 3
    assert p["model"]["params"] > 6.5e9


@pytest.mark.parametrize("name", ["plan-g2b.yaml", "plan-l2b.yaml"])
def test_paper_2b_full_does_not_fit_24gb_bcd_m3_does(name, tmp_path):
    p = _plan(name, tmp_path, "rtx4090")
    assert not p["full_fits"] and p["bcd_fits"]
    assert 1.9e9 < p["model"]["params"] < 2.2e9


def test_plan_configs_load_and_say_plan_only():
    files = sorted((ROOT / "configs").glob("plan-*.yaml"))
    assert len(files) >= 3
    for f in files:
        assert f.read_text().startswith("# PLAN-ONLY"), f
        load_config(f)


def setup(cfg, sh, n_train=None, n_val=None, **kw):
    """memory.setup_for over the config's sections (n_train, n_val: the split's rows)."""
    frac, seq = cfg.preinfer.sample_fraction, kw.pop("seq", cfg.data.seq_len)
    rows = None if n_train is None else visit_budget(cfg.train, frac, n_train, n_val)
    return memory.setup_for(
        sh,
        cfg.train,
        cfg.cache,
        cfg.preinfer,
        seq=seq,
        budget=rows,
        token_rows=cfg.data.shard_rows,
        run_precision=cfg.run.precision,
        **kw,
    )


def test_breakdown_follows_what_each_stage_loads(tmp_path):
    cfg = load_config(ROOT / "configs" / "plan-g7b.yaml", [f"run.dir={tmp_path}"])
    sh = model_shape(cfg.model)
    part = partition_layers(list(sh.layers), sh.embed, sh.head, 3)
    p = setup(cfg, sh, target="gpu")
    full = memory.trainer_memory(sh, part, "full", 0, p)
    rows = [memory.trainer_memory(sh, part, "bcd", k, p) for k in range(3)]
    assert full["active_params"] == sh.params
    assert rows[0]["loaded_params"] == sh.params  # block 0 runs through every block
    assert rows[2]["loaded_params"] == part.block_params[2] + sh.head_matrix  # + the tied head
    assert all(r["peak"] < full["peak"] for r in rows)
    assert [r["active_params"] for r in rows] == part.block_params
    adam, sgd = (setup(cfg, sh, target="gpu", optimizer=o) for o in ("adam", "sgd"))
    static = [memory.trainer_memory(sh, part, "bcd", 1, q)["basis"]["static"] for q in (adam, sgd)]
    assert static[0] - static[1] == 4 * part.block_params[1]  # two fp32 moments vs momentum
    big = setup(cfg, sh, target="gpu", batch=4)
    lean = setup(cfg, sh, target="gpu", batch=4, act_recompute=True)
    peak = lambda q: memory.trainer_memory(sh, part, "bcd", 0, q)["peak"]  # noqa: E731
    assert peak(p) < peak(big) and peak(lean) < peak(big)


def test_cost_keeps_same_device_and_card_change_apart(tmp_path):
    p = _plan("plan-g7b.yaml", tmp_path, "a800-80", compare_card="rtx4090", steps=1000,
              samples=100_000, bf_average=1.39, bf_worst=2.89)  # fmt: skip
    c = p["cost"]
    assert c["full"]["sharded"] and c["full"]["cards"] >= 2 and c["full"]["time_source"] == "flops"
    avg, worst = c["bcd_average"], c["bcd_worst"]
    assert avg["same_device_factor"] == pytest.approx(avg["cost"] / c["full"]["cost"])
    train = worst["hours"] - worst["preinfer_hours"], avg["hours"] - avg["preinfer_hours"]
    assert train[0] / train[1] == pytest.approx(2.89 / 1.39)
    there = c["compare"]["full"]["cost"]
    assert c["compare"]["card_change_factor"] == pytest.approx(c["full"]["cost"] / there)


def _tokens(cfg, n_train: int, n_val: int) -> None:
    from storage.tokens import TokenStoreWriter

    w = TokenStoreWriter(cfg.data.out_dir, seq_len=cfg.data.seq_len, shard_rows=64)
    g = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        w.write_split(split, iter(g.integers(0, 200, (n, cfg.data.seq_len + 1), dtype=np.int32)))
    w.commit({"fingerprint": "test", "vocab_size": 300})


TINY = ["model.vocab_size=300", "model.hidden_size=32", "model.num_layers=4", "model.num_heads=4",
        "model.max_positions=32", "data.seq_len=16", "partition.num_blocks=3",
        "train.batch_size=4"]  # fmt: skip


@pytest.fixture
def tiny_run(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}", *TINY])
    _tokens(cfg, 200, 20)
    return cfg


def _budget(cfg):
    from storage.tokens import TokenStore

    return store_budget(cfg.train, cfg.preinfer.sample_fraction, TokenStore(cfg.data.out_dir))


DIMS = {"hidden": 32, "seq": 16}  # the tiny model's H, the token store's S


def test_disk_guard_refuses_when_the_cache_exceeds_free_disk(tiny_run):
    cfg = tiny_run
    b = _budget(cfg)
    with pytest.raises(DiskSpaceError, match="free at"):
        check_disk_for_boundary(cfg.cache, b, 1, **DIMS, free_bytes=1000)
    ok = check_disk_for_boundary(cfg.cache, b, 1, **DIMS, free_bytes=10**12)
    per = ok["per_boundary"]
    assert per["samples"] == 220 and ok["need"] == per["expected"] > 220 * 16 * 32 * 2
    # the rotation: source + target
    rot = check_disk_for_rotation(cfg.cache, cfg.train, b, **DIMS, M=3, free_bytes=10**12)
    assert rot["need"] == 2 * per["expected"]
    # one block: no boundary, no cache
    assert check_disk_for_rotation(cfg.cache, cfg.train, b, **DIMS, M=1, free_bytes=1) is None
    with pytest.raises(DiskSpaceError):
        check_disk_for_rotation(cfg.cache, cfg.train, b, **DIMS, M=3, free_bytes=rot["need"] - 1)
    plans = [SimpleNamespace(split="train", fingerprint="a", complete=False),
             SimpleNamespace(split="val", fingerprint="b", complete=True)]  # fmt: skip
    part = check_disk_for_boundary(cfg.cache, b, 1, **DIMS, plans=plans, free_bytes=10**12)
    assert part["need"] == per["train"]  # val is complete; train's one shard is still to write
    done = Path(cfg.cache.root, "a", "done")
    done.mkdir(parents=True)
    (done / "00000.json").write_text("{}")  # its shard committed: a resumed build needs nothing
    assert check_disk_for_boundary(cfg.cache, b, 1, **DIMS, plans=plans, free_bytes=1)["need"] == 0


def test_disk_estimate_uses_a_measured_codec_ratio(tiny_run):
    cfg = tiny_run
    b = _budget(cfg)
    before = check_disk_for_boundary(cfg.cache, b, 1, **DIMS, free_bytes=10**12)["per_boundary"]
    man = {"dtype": cfg.cache.dtype, "compression_ratio": 2.0, "fingerprint": "f" * 32,
           "codec": {"codec": cfg.cache.codec, "shuffle": cfg.cache.shuffle,
                     "level": cfg.cache.level}}  # fmt: skip
    d = Path(cfg.cache.root) / ("f" * 32)
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps(man))
    after = check_disk_for_boundary(cfg.cache, b, 1, **DIMS, free_bytes=10**12)["per_boundary"]
    assert after["ratio"] == 2.0 and before["ratio"] is None
    values = 220 * 16 * 32 * 2
    assert before["expected"] - after["expected"] == pytest.approx(values / 2, abs=2)


def test_memory_warning_only_when_the_estimate_exceeds_the_device(tiny_run):
    sh = model_shape(tiny_run.model)
    part = partition_layers(list(sh.layers), sh.embed, sh.head, tiny_run.partition.num_blocks)
    on_cpu = setup(tiny_run, sh, 200, 20, target="cpu", seq=16)

    def warn(mode="bcd", **kw):
        return warn_trainer_memory(sh, part, on_cpu, mode=mode, device="cpu", **kw)

    with pytest.warns(ResourceWarning, match="exceeds"):
        worst = warn(device_bytes=1)
    assert worst["stage"].startswith("bcd block")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn("full", device_bytes=2**50)["stage"] == "full"
    said = []
    warn(device_bytes=1, log=said.append)
    assert said and "partition.num_blocks" in said[0]


def _args(*argv):
    ap = argparse.ArgumentParser()
    plan.add_plan_arguments(ap)
    return ap.parse_args(list(argv))


def test_cli_prints_a_report_and_json(tiny_run, capsys):
    assert plan.run_plan(tiny_run, _args("--card", "rtx4090", "--price", "0.5")) == 0
    text = capsys.readouterr().out
    for want in ("bcd block 2", "pre-inference build -> boundary 1", "smallest M", "cache",
                 "same-device factor", "full-parameter training fits one card: yes"):  # fmt: skip
        assert want in text, want
    assert plan.run_plan(tiny_run, _args("--json", "--card", "cpu", "--blocks", "2")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["partition"]["M"] == 2 and data["setup"]["target"] == "cpu"
    assert data["samples"]["train"] == 200 and data["cache"]["fits"] in (True, False)


@pytest.mark.parametrize("cache_visits", [1, 3])
def test_plan_shows_rows_per_visit_and_what_a_round_reads(tmp_path, capsys, cache_visits):
    """train.cache_visits trades the cache's size for the rows a round's visits read: 1 = every
    visit the same window, M = a window each (train rows allowing), boundary K holding the
    windows of visits K..M-1 (ascending, M = 3: 40 and 20 rows)."""
    cfg = load_config(None, [f"run.dir={tmp_path}", *TINY, "train.max_steps=5", "train.epochs=1",
                             f"train.cache_visits={cache_visits}"])  # fmt: skip
    _tokens(cfg, 200, 20)
    assert plan.run_plan(cfg, _args("--json", "--card", "cpu")) == 0
    use = json.loads(capsys.readouterr().out)["cost"]["cache_use"]
    assert use["visit_rows"] == 20 and use["cache_visits"] == cache_visits  # 5 steps x batch 4
    assert use["distinct_per_round"] == 20 * cache_visits
    held = {"1": 20, "2": 20} if cache_visits == 1 else {"1": 40, "2": 20}
    assert use["cached_by_boundary"] == held and use["cached_per_boundary"] == held["1"]
    assert plan.run_plan(cfg, _args("--card", "cpu")) == 0
    text = capsys.readouterr().out
    rows = "each boundary caches 20" if cache_visits == 1 else "boundaries 1..2 cache 40, 20"
    assert f"{rows} train rows per round" in text
    assert f"read {20 * cache_visits} distinct rows" in text and "note:" not in text


def test_bad_options_are_config_errors(tiny_run):
    with pytest.raises(ConfigError, match="card"):
        plan.build_plan(tiny_run, plan.PlanOptions(card="tpu"))
    with pytest.raises(ConfigError, match="out of range"):
        plan.build_plan(tiny_run, plan.PlanOptions(blocks=9))
    with pytest.raises(ConfigError, match="optimizer"):
        plan.build_plan(tiny_run, plan.PlanOptions(optimizer="lion"))


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,  # an XPASS fails: the mark goes once the planner is fixed
    reason="the planner over-estimates the demo's pre-inference arms (docs/planner.md, "
    "2026-12-03: build -> 1 +20.9%, refresh -> 2 +27.2%, on the safe side): the pipelined "
    "write's fixed part is not fitted yet",
)
def test_estimate_within_15_percent_of_measured_peak_on_demo(tmp_path):
    """The real trainer and pre-inference worker on CPU (bench/plan_accuracy.py, demo config):
    each arm's median peak over 3 fresh processes (one process's peak moves 5-10%)."""
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "-m", "bench.plan_accuracy", "--configs", "demo",
                    "--repeats", "3", "--json", str(out)], check=True, cwd=ROOT)  # fmt: skip
    rows = json.loads(out.read_text())
    assert len(rows) == 7 and all(len(r["samples"]) == 3 for r in rows)
    for r in rows:
        assert abs(r["estimate"] - r["measured"]) <= 0.15 * r["measured"], (r["arm"], r["samples"])


def test_step_times_come_from_metrics_when_the_run_has_them(tiny_run):
    visits = [{"event": "visit", "mode": "full", "block": 0, "tokens_per_s": 1000.0}]
    visits += [{"event": "visit", "mode": "bcd", "block": k, "tokens_per_s": 2000.0}
               for k in range(3)]  # fmt: skip
    Path(tiny_run.run.dir, "metrics.jsonl").write_text("\n".join(map(json.dumps, visits)))
    opts = dict(card="rtx4090", steps=100, free_disk=1.0)
    c = plan.build_plan(tiny_run, plan.PlanOptions(**opts))["cost"]
    tok = 4 * 16  # global batch x S
    assert c["full"]["time_source"] == "measured" and c["full"]["step_s"] == tok / 1000.0
    assert c["bcd_average"]["time_source"] == ["measured"]
    c = plan.build_plan(tiny_run, plan.PlanOptions(flops_only=True, **opts))["cost"]
    assert c["full"]["time_source"] == "flops" and c["bcd_average"]["time_source"] == ["flops"]


def test_cpu_phases_follow_what_the_process_holds(tmp_path):
    """On CPU the eval of a cache-fed block lands on what backward left resident (+ the val
    reader); loading holds the weights alone, and a pre-inference worker's load the fp32
    weights plus, where it computes in bf16, one cast copy of its largest tensor (a bf16 cache
    computed in fp32, as on a CPU without AMX: fp32 weights and work, no copy)."""
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"run.dir={tmp_path}"])
    sh = model_shape(cfg.model)
    part = partition_layers(list(sh.layers), sh.embed, sh.head, 3)
    p = setup(cfg, sh, 11773, 1142, target="cpu")
    r = memory.trainer_memory(sh, part, "bcd", 2, p)
    assert r["phase"] == "eval" and r["basis"]["val_buffer"] > 0
    back = memory.trainer_memory(sh, part, "bcd", 2, memory.Setup(**{**p.__dict__, "val_rows": 0}))
    per = memory.HOST_IO["cache_read"][1]  # the val reader's rows sit on top of backward
    assert r["peak"] - back["peak"] == pytest.approx(
        per * (r["basis"]["val_buffer"] - back["basis"]["val_buffer"])
    )
    assert back["peak"] > back["components"]["activations"] + back["components"]["reader"]
    n = part.block_params[0]
    pre = {}
    for dt in ("bf16", "fp32"):
        c = load_config(ROOT / "configs" / "demo.yaml", [f"preinfer.compute_dtype={dt}"])
        q = setup(c, sh, 11773, 1142, target="cpu")
        assert q.compute_bytes == {"bf16": 2, "fp32": 4}[dt] and q.cache_dtype_bytes == 2
        pre[dt] = memory.preinfer_memory(sh, part, 1, q)
    assert pre["bf16"]["basis"]["load"] == 4 * n + 2 * sh.max_tensor  # a bf16 cast copy
    assert pre["fp32"]["basis"]["load"] == 4 * n
    assert pre["fp32"]["basis"]["weights"] == 2 * pre["bf16"]["basis"]["weights"] == 4 * n
    assert pre["fp32"]["basis"]["work"] == 2 * pre["bf16"]["basis"]["work"]
    assert pre["fp32"]["basis"]["shard"] == pre["bf16"]["basis"]["shard"]  # stored bf16 either way
    gpu = memory.trainer_memory(sh, part, "bcd", 2, setup(cfg, sh, target="gpu"))
    assert gpu["phase"] != "load"


def test_checkpoint_disk_matches_the_files_a_run_writes(tiny_run, capsys):
    """The plan's checkpoint bytes against the files: init's fp32 block files, then the AdamW
    state a visit commits beside its block (train.keep_optimizer_state, the default)."""
    from pipelines.init import run_init
    from preinfer.checkpoint.store import Checkpoint
    from preinfer.run.visit import Visit, VisitSpec

    got = plan.build_plan(tiny_run, plan.PlanOptions(card="cpu"))["checkpoint"]
    ck = run_init(tiny_run, log=lambda *a: None)
    blocks = sum(ck.block_file(b).stat().st_size for b in range(ck.num_blocks))
    assert got["weights"] == pytest.approx(blocks, rel=0.05)
    cfg = load_config(
        None, [f"run.dir={tiny_run.run.dir}", *TINY, "train.max_steps=1", "train.eval_every=0"]
    )
    Visit(cfg, VisitSpec(block=1, mode="bcd-recompute"), device=torch.device("cpu")).run(
        log=lambda *a: None
    )
    ck = Checkpoint.open(cfg.run.checkpoint)
    optim = ck.path / ck.index["blocks"][1]["optim"]["file"]
    share = ck.partition.block_params[1] / sum(ck.partition.block_params)
    assert got["optimizer_state"] * share == pytest.approx(optim.stat().st_size, rel=0.05)
    off = load_config(
        None, [f"run.dir={tiny_run.run.dir}", *TINY, "train.keep_optimizer_state=false"]
    )
    assert plan.build_plan(off, plan.PlanOptions(card="cpu"))["checkpoint"]["optimizer_state"] == 0
    plain_sgd = load_config(
        None, [f"run.dir={tiny_run.run.dir}", *TINY, "train.optimizer=sgd", "train.momentum=0"]
    )  # no momentum buffer: nothing to keep
    assert (
        plan.build_plan(plain_sgd, plan.PlanOptions(card="cpu"))["checkpoint"]["optimizer_state"]
        == 0
    )
    assert plan.run_plan(tiny_run, _args("--card", "cpu")) == 0
    assert "checkpoint" in capsys.readouterr().out


def test_writer_line_gives_the_cores_a_cards_cache_output_needs(tmp_path):
    """7B, H=4096, bf16: 30k tokens/s x 4096 x 2 B = 245.76 MB/s; at 100 MB per core-second
    that is 2.46 cores per card: enough on 8 cores with 4 encoder threads, short on 2."""
    w = _plan("plan-g7b.yaml", tmp_path, "h100-80", forward_tokens_s=30_000, writer_mb_s=100.0,
              host_cores=8)["writer"]  # fmt: skip
    assert w["mb_s"] == pytest.approx(245.76) and w["cores"] == pytest.approx(2.4576)
    assert w["tokens_source"] == "given" and w["codec_threads"] == 4 and w["bound"] is False
    short = _plan("plan-g7b.yaml", tmp_path, "h100-80", forward_tokens_s=30_000,
                  writer_mb_s=100.0, host_cores=2)["writer"]  # fmt: skip
    assert short["bound"] is True and short["writer_tokens_s"] == pytest.approx(2 * 100e6 / 8192)
    assert short["suggest"] and "codec_threads=3" not in " ".join(short["suggest"])  # 2 cores
    # encoder threads below the cores a card has: more threads is the first suggestion
    cfg = load_config(ROOT / "configs/plan-g7b.yaml", [f"run.dir={tmp_path}",
                                                      "cache.codec_threads=1"])  # fmt: skip
    full = plan.build_plan(cfg, plan.PlanOptions(card="h100-80", free_disk=1000.0,
                                                 forward_tokens_s=30_000, writer_mb_s=100.0,
                                                 host_cores=8))  # fmt: skip
    few = full["writer"]
    assert few["bound"] and few["suggest"][0].startswith("cache.codec_threads=3")
    assert "WRITER-BOUND: cache.codec_threads=3" in plan.format_plan(full)


def test_writer_line_without_a_given_rate_uses_the_measured_table(tmp_path):
    """Forward tokens/s from FLOPs when not given; MB per core-second from the table of
    bench/writer.py figures for the config's codec (the default blosc-zstd-3 byte)."""
    from preinfer.plan.costmodel import WRITER_MB_PER_CORE_S

    w = _plan("plan-g7b.yaml", tmp_path, "h100-80", host_cores=64)["writer"]
    assert w["codec"] == "blosc-zstd-3 byte" and w["tokens_source"].startswith("FLOPs")
    assert w["mb_per_core_s"] == WRITER_MB_PER_CORE_S["blosc-zstd-3 byte"]
    assert w["cores"] == pytest.approx(w["tokens_per_s"] * 4096 * 2 / 1e6 / w["mb_per_core_s"])
    cpu = _plan("plan-g7b.yaml", tmp_path, "cpu")["writer"]  # no peak: needs a measured rate
    assert "bound" in cpu and cpu["bound"] is None and "--forward-tokens-s" in cpu[
        "tokens_source"]  # fmt: skip
    with pytest.raises(ConfigError, match="forward-tokens-s must be > 0"):
        _plan("plan-g7b.yaml", tmp_path, "h100-80", forward_tokens_s=-1.0)


def _bf_values(results: dict) -> list[float]:
    """Every bf_multiplier median / max a study results file holds (every layout, variant)."""
    out = []
    for st in results["studies"]:
        for a in st.get("analysis", {}).values():
            bf = a.get("bf_multiplier") if isinstance(a, dict) else None
            if isinstance(bf, dict):
                out += [bf.get("median"), bf.get("max")]
    return [v for v in out if isinstance(v, float)]


def test_planner_prices_bcd_with_our_measured_multipliers():
    """Every (layout, M) of plan.MEASURED_BF names a results file that holds its median and
    worst seed; a measured layout gets them, fine-tuning and unmeasured layouts the paper's,
    and plan.bf_* given by hand win."""
    import json
    from pathlib import Path

    from preinfer.run.plan_report import MEASURED_BF, PAPER_BF, step_multipliers

    root = Path(__file__).resolve().parents[1] / "bench" / "results"
    for (arch, tied, _m), (avg, worst, name) in MEASURED_BF.items():
        vals = _bf_values(json.loads((root / name).read_text()))
        if (arch, tied) == ("gpt2", True):  # a floor: not reached on 2 of 3 seeds
            assert avg == worst == 3.0
            continue
        assert any(round(v, 2) == avg for v in vals), (name, avg, vals)
        assert any(round(v, 2) == worst for v in vals), (name, worst, vals)
    assert step_multipliers("llama", False, 3, False)[:2] == (1.44, 1.97)
    assert step_multipliers("llama", False, 3, True)[:2] == PAPER_BF
    assert step_multipliers("llama", False, 4, False)[:2] == PAPER_BF
    assert "paper" in step_multipliers("gpt2", False, 5, False)[2]


def test_the_reported_memory_accuracy_is_what_its_results_files_hold():
    """plan.MEMORY_ACCURACY's ranges are the lowest and highest estimate / measured - 1 of its
    files' rows of that kind, none of them on llama-small (the configs fitted on)."""
    import json
    from pathlib import Path

    from preinfer.run.plan_report import MEMORY_ACCURACY

    root = Path(__file__).resolve().parents[1] / "bench" / "results"
    for kind, (lo, hi, name) in MEMORY_ACCURACY.items():
        rows = [r for r in json.loads((root / name).read_text()) if r["arm"].startswith(kind)]
        assert rows and all(r["config"] != "llama-small" for r in rows), name
        errs = [r["estimate"] / r["measured"] - 1 for r in rows]
        assert (round(min(errs), 3), round(max(errs), 3)) == (lo, hi), (kind, errs)


def test_plan_report_names_where_its_multipliers_come_from(tmp_path):
    from preinfer.run.config import load_config
    from preinfer.run.plan_report import PlanOptions, build_plan, format_plan

    cfg = load_config("configs/demo.yaml", [f"run.dir={tmp_path}/run", "partition.num_blocks=3"])
    c = build_plan(cfg, PlanOptions(samples=1000))["cost"]
    assert c["bcd_average"]["multiplier"] == 1.33 and c["bcd_worst"]["multiplier"] == 1.76
    assert "measured" in c["bcd_average"]["multiplier_source"]
    c = build_plan(cfg, PlanOptions(samples=1000, bf_average=2.0))["cost"]
    assert c["bcd_average"]["multiplier"] == 2.0 and c["bcd_worst"]["multiplier"] == 1.76
    text = format_plan(build_plan(cfg, PlanOptions(samples=1000, card="cpu")))
    assert (
        "out of sample (demo, gpt2-small): trainer -11% to +11%, pre-inference +9% to +33%" in text
    )
