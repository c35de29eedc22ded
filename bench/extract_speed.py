"""Extract speed: `cache extract --layers ...` end to end vs the bare forward of the same compute.

    .venv/bin/python -m bench.extract_speed --quick                    # tiny, seconds
    .venv/bin/python -m bench.extract_speed --repeats 5                # 600 documents, S=128
    .venv/bin/python -m bench.extract_speed --layers 2,4,6 --set run.device=cuda

Issue #56's target: one forward writes k layers at >= 0.9x the bare forward's speed for k = 1,
and the per-layer cost of writing is stated for k > 1. Arms: the bare forward (the blocks
through the deepest requested layer over the extract's own rows, in its micro-batches per
shard, the requested layers' states collected and joined per shard, then dropped) with 1 and
with k layers collected; run_extract of the deepest layer alone (k = 1) and of every requested
layer (same deepest layer, so the same forward), each into a cache root emptied before the
timing (a rerun into a finished cache writes nothing). Arms alternate after one untimed run
(harness.interleaved); the ratio bare seconds / arm seconds per repeat, its median reported.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from bench.harness import (
    add_omp_wait,
    headline_table,
    interleaved,
    load_average,
    omp_wait_policy,
    publish,
    quiet,
    show,
    spread,
)
from core.config import ConfigError
from pipelines.extract import ExtractConfig, run_extract
from pipelines.extract_worker import layer_states, load_layers
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.config import load_config
from preinfer.runtime.device import pin_threads, resolve_device, torch_dtype
from preinfer.schedule.cache_identity import compute_choice
from storage.reader import open_cache
from storage.tokens import TokenStore

# run_extract's own timings; setup_s = seconds - loop_s: checks, weights, writers (samples)
# before the first shard, and the manifests after the last
STATS = ("setup_s", "forward_s", "write_s", "wait_s", "loop_s", "seconds")


class BareForward:
    """layer_states over the extract's micro-batches, shard by shard, as the extract's worker
    (pipelines/extract_worker.py) runs them: each layer's micro-batch outputs moved to the host and joined per shard."""

    def __init__(self, cfg, layers: tuple[int, ...], shards: list[torch.Tensor]):
        self.layers, self.shards, self.mb = layers, shards, cfg.preinfer.micro_batch
        self.device = resolve_device(cfg.run.device)
        dtype = torch_dtype(compute_choice(cfg.preinfer, cfg.cache, cfg.run.device).compute)
        self.adapter = load_layers(Checkpoint.open(cfg.run.checkpoint), max(layers), self.device,
                                   dtype)  # fmt: skip

    def __call__(self) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        for x in self.shards:  # (n, S) token ids of one shard
            parts = [layer_states(self.adapter, x[j : j + self.mb].to(self.device), self.layers)
                     for j in range(0, len(x), self.mb)]  # fmt: skip
            hidden = [torch.cat([p[k].cpu() for p in parts]) for k in range(len(self.layers))]
            del parts, hidden  # (n, S, H) per layer: computed, then dropped
        return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}


def timed_extract(cfg, layers: tuple[int, ...], max_rows: int, root: Path) -> dict:
    """One extract of `layers` into `root`, emptied first (untimed): its wall and CPU seconds
    and run_extract's own phase timings."""
    shutil.rmtree(root, ignore_errors=True)
    ec = ExtractConfig(layers=layers, max_rows=max_rows)
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_extract(cfg, ec, log=quiet)
    out = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    assert res["action"] == "extracted", res
    return {**out, "setup_s": res["seconds"] - res["loop_s"], **{k: res[k] for k in STATS[1:]}}


def shard_inputs(cfg, root: str, fp: str, rows: int) -> list[torch.Tensor]:
    """The (n, S) token ids of each shard of the extracted cache `fp`, in its order (the rows
    the extract reads: the train split's first `rows`)."""
    ids, _ = TokenStore(cfg.data.out_dir).read_with_labels("train", 0, rows)  # (rows, S+1)
    x = torch.from_numpy(ids[:, :-1]).long()
    with open_cache(root, fp) as c:
        assert c.num_samples == rows, (c.num_samples, rows)
        return [x[a:b] for a, b in map(c.shard_range, range(c.num_shards))]


def run(args) -> dict:
    layers = tuple(sorted(set(ExtractConfig.parse_layers(args.layers))))
    one = (max(layers),)
    tag = f"docs{args.documents}"  # one token set (and checkpoint) per workload
    if args.set:
        tag += "-" + hashlib.sha256(" ".join(args.set).encode()).hexdigest()[:8]
    work = Path(args.work) / tag
    over = [f"run.dir={work}", f"data.max_documents={args.documents}",
            f"preinfer.micro_batch={args.micro_batch}", "cache.dtype=bf16",
            f"cache.root={work / 'caches'}", *args.set]  # fmt: skip
    cfg = load_config(args.config, over)
    store = run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    rows = min(args.rows or store.num_samples("train"), store.num_samples("train"))
    ntok = rows * store.seq_len
    threads = pin_threads()  # as the extract pins them (CPU): the bare forward on the same
    # the shards' rows, from a first extract (untimed; the arms' warm-up runs again)
    scratch = work / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    sc = load_config(args.config, [*over, f"cache.root={scratch}"])
    fp = run_extract(sc, ExtractConfig(layers=layers, max_rows=rows), log=quiet)["layers"]
    shards = shard_inputs(sc, str(scratch), fp[str(max(layers))], rows)
    shutil.rmtree(scratch, ignore_errors=True)
    k = len(layers)
    roots = {n: work / f"root-{n}" for n in ("k1", f"k{k}")}
    cfgs = {n: load_config(args.config, [*over, f"cache.root={r}"]) for n, r in roots.items()}
    arms = {
        "bare, 1 layer": BareForward(cfg, one, shards),
        f"bare, {k} layers": BareForward(cfg, layers, shards),
        "extract k=1": functools.partial(timed_extract, cfgs["k1"], one, rows, roots["k1"]),
        f"extract k={k}": functools.partial(
            timed_extract, cfgs[f"k{k}"], layers, rows, roots[f"k{k}"]
        ),  # fmt: skip
    }
    res: dict = {"bench": "extract_speed", "tokens": ntok, "rows": rows,
                 "seq_len": store.seq_len, "layers": list(layers), "k": k,
                 "shards": len(shards), "micro_batch": args.micro_batch,
                 "dtype": cfg.cache.dtype, "codec": cfg.cache.codec,
                 "compute": compute_choice(cfg.preinfer, cfg.cache, cfg.run.device).compute,
                 "device": str(resolve_device(cfg.run.device)), "threads": threads,
                 "documents": args.documents, "set": args.set, "repeats": args.repeats,
                 "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                 "load_before": load_average()}  # fmt: skip
    got = interleaved(arms, args.repeats)
    for r in roots.values():
        shutil.rmtree(r, ignore_errors=True)
    res["load_after"] = load_average()
    res["seconds"] = {a: spread([v["wall"] for v in vs]) for a, vs in got.items()}
    res["cpu_seconds"] = {a: spread([v["cpu"] for v in vs]) for a, vs in got.items()}
    res["extract_stats"] = {a: {s: spread([v[s] for v in got[a]]) for s in STATS}
                            for a in arms if a.startswith("extract")}  # fmt: skip
    w = {a: [v["wall"] for v in vs] for a, vs in got.items()}
    c = {a: [v["cpu"] for v in vs] for a, vs in got.items()}
    pairs = {"extract k=1": "bare, 1 layer", f"extract k={k}": f"bare, {k} layers"}
    # speed vs the bare forward collecting the same layers, per repeat (and the 1-layer bare)
    res["ratio"] = {a: spread([b / x for b, x in zip(w[bare], w[a], strict=True)])
                    for a, bare in pairs.items()}  # fmt: skip
    res["ratio_vs_bare_1_layer"] = {a: spread([b / x for b, x in zip(w["bare, 1 layer"], w[a],
                                                                      strict=True)])
                                    for a in pairs}  # fmt: skip
    res["cpu_ratio"] = {a: spread([b / x for b, x in zip(c[bare], c[a], strict=True)])
                        for a, bare in pairs.items()}  # fmt: skip
    # writing cost per layer, as a share of the bare forward: (t_k - t_bare) / k / t_bare, and
    # the marginal one, (t_k - t_1) / (k - 1) / t_bare (what one more layer in the same forward
    # adds on top of the first one's)
    b1, bk, e1, ek = (w[a] for a in ("bare, 1 layer", f"bare, {k} layers", "extract k=1",
                                     f"extract k={k}"))  # fmt: skip
    res["per_layer_cost"] = {
        "per_layer": spread([(t - b) / k / b for t, b in zip(ek, bk, strict=True)]),
        "per_layer_vs_bare_1_layer": spread([(t - b) / k / b for t, b in zip(ek, b1, strict=True)]),
        "marginal": (spread([(t - t1) / (k - 1) / b for t, t1, b in zip(ek, e1, b1, strict=True)])
                     if k > 1 else None),
        "k1": spread([(t - b) / b for t, b in zip(e1, b1, strict=True)]),
    }  # fmt: skip
    res["target"] = {"k1_ratio_at_least": 0.9,
                     "met": res["ratio"]["extract k=1"]["median"] >= 0.9}  # fmt: skip
    return res


def table(res: dict) -> str:
    k = res["k"]
    rows = [("arm", "seconds median [min, max]", "tokens/s", "bare / arm median [min, max]",
             "CPU seconds", "bare / arm by CPU seconds",
             "extract: setup / forward / write (helper) / waited for it / whole s")]  # fmt: skip
    for arm, s in res["seconds"].items():
        st = res["extract_stats"].get(arm)
        ph = " / ".join(f"{st[x]['median']:.2f}" for x in STATS if x != "loop_s") if st else ""
        rows.append((arm, show(s), f"{res['tokens'] / s['median']:,.0f}",
                     show(res["ratio"][arm]) if arm in res["ratio"] else "1 (reference)",
                     f"{res['cpu_seconds'][arm]['median']:.2f}",
                     show(res["cpu_ratio"][arm]) if arm in res["cpu_ratio"] else "1 (reference)",
                     ph))  # fmt: skip
    pc = res["per_layer_cost"]
    pct = functools.partial(show, fmt="{:.1%}")
    cost = (
        f"writing cost, share of the bare forward: k=1 {pct(pc['k1'])}; k={k}: per layer "
        f"(t_k{k} - t_bare) / {k} = {pct(pc['per_layer'])}"
    )
    if pc["marginal"] is not None:
        cost += f", each layer after the first (t_k{k} - t_k1) / {k - 1} = {pct(pc['marginal'])}"
    met = "met" if res["target"]["met"] else "missed"
    return (f"workload: {res['rows']} rows x S={res['seq_len']} = {res['tokens']:,} tokens in "
            f"{res['shards']} shard(s), layers {res['layers']}, cache {res['dtype']} "
            f"{res['codec']}, compute {res['compute']} on {res['device']}, micro-batch "
            f"{res['micro_batch']}, {res['threads']} threads, {res['repeats']} interleaved "
            f"repeats after one warm-up; OMP_WAIT_POLICY {res['omp_wait_policy']}; load average "
            f"before {res['load_before']}, after {res['load_after']}"
            + (f"; overrides: {' '.join(res['set'])}" if res.get("set") else "")
            + "\n\n" + headline_table(rows) + f"\n\n{cost}\ntarget k=1 >= 0.9x the bare "
            f"forward: {met} ({res['ratio']['extract k=1']['median']:.3f})")  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--documents", type=int, default=600)
    ap.add_argument("--rows", type=int, default=4096,
                    help="train rows extracted (the split's first; 0 = all): a pass of seconds")  # fmt: skip
    ap.add_argument("--layers", default="2,4,6",
                    help="the k > 1 arm's layers; the k = 1 arm extracts the deepest alone")  # fmt: skip
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default="/tmp/preinfer-bench-extract")
    ap.add_argument("--out", default=None, help="JSON path; default bench/results/<name>-<time>")
    ap.add_argument(
        "--quick", action="store_true", help="20 documents, 256 rows, 2 repeats (make bench)"
    )
    ap.add_argument("--set", nargs="+", default=[], help="config overrides (e.g. run.device=cuda)")
    add_omp_wait(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    omp_wait_policy(
        args.omp_wait, "bench.extract_speed", argv
    )  # both arms' threads wait the same way
    if args.quick:
        args.documents, args.repeats = min(args.documents, 20), min(args.repeats, 2)
        args.rows = min(args.rows or 256, 256)
    try:
        layers = set(ExtractConfig.parse_layers(args.layers))
    except ConfigError as e:
        ap.error(str(e))
    if len(layers) < 2:
        ap.error(f"--layers {args.layers}: give two or more layers (the k > 1 arm), e.g. 2,4,6")
    res = run(args)
    publish(res, table(res), args.out, "extract_speed")
    return res


if __name__ == "__main__":
    main()
