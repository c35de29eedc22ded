"""fp8 against bf16 for a reuser: the example's linear probe trained on one layer's cache in
each dtype (issue #56).

    .venv/bin/python -m bench.fp8_probe --quick       # demo.yaml's tiny model, seconds
    .venv/bin/python -m bench.fp8_probe               # SmolLM2-135M-Instruct, layer 12 (make real-model)

One token store and one checkpoint; per dtype (bf16 with the default lossless codec, fp8_e4m3
with a scale per token row) `cache extract --layers L` of the train split's first --train-rows
rows and of the val split's first --val-rows rows, into a cache root of its own. Then, per
seed, examples/probe_from_cache.py as its user runs it (its main(), on that root, held out on
every extracted val row): a linear probe predicting the next token (the --classes most
frequent next tokens and "other"). Reported per dtype and seed: the held-out cross-entropy and
accuracy; fp8 / bf16 - 1 of the cross-entropy, its median over the seeds (issue #56: within
0.5%); the caches' bytes per stored value and fp8 / bf16. Public APIs only (the stages and the
example's entry point).
"""

from __future__ import annotations

import argparse
import runpy
import shutil
import tempfile
from pathlib import Path

from bench.fp8_visit import COMMON, QUICK, REAL
from bench.harness import headline_table, load_average, publish, quiet, spread
from pipelines.extract import ExtractConfig, run_extract
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.run.config import load_config
from storage.atomic import dir_bytes
from storage.reader import open_cache

DTYPES = ("bf16", "fp8_e4m3")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "probe_from_cache.py"


def extract(cfg, layer: int, split: str, rows: int) -> dict:
    """One layer cache of `split`'s first `rows` rows: its fingerprint, bytes, bytes/value."""
    res = run_extract(cfg, ExtractConfig(layers=(layer,), split=split, max_rows=rows), log=quiet)
    fp = res["layers"][str(layer)]
    with open_cache(cfg.cache.root, fp) as c:
        values = c.num_samples * c.seq_len * c.hidden_size
    nbytes = dir_bytes(Path(cfg.cache.root) / fp)
    return {"fingerprint": fp, "rows": res["rows"], "bytes": nbytes, "values": values,
            "bytes_per_value": nbytes / values}  # fmt: skip


def run(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="fp8-probe-")).resolve()
    base = [*(QUICK if args.quick else REAL), *COMMON, f"data.out_dir={work / 'tokens'}",
            f"run.dir={work / 'run'}", *args.set]  # fmt: skip
    cfg = load_config(args.config, base)
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    probe = runpy.run_path(str(EXAMPLE), run_name="fp8_probe")["main"]
    res = {"bench": "fp8_probe", "config": args.config, "overrides": base, "layer": args.layer,
           "seeds": args.seeds, "steps": args.steps, "load_before": load_average(),
           "caches": {}, "arms": []}  # fmt: skip
    for dtype in DTYPES:
        root = work / f"cache-{dtype}"
        dc = load_config(args.config, [*base, f"cache.root={root}", f"cache.dtype={dtype}"])
        res["caches"][dtype] = {s: extract(dc, args.layer, s, n)
                                for s, n in (("train", args.train_rows), ("val", args.val_rows))}  # fmt: skip
        val_rows = res["caches"][dtype]["val"]["rows"]
        for seed in args.seeds:
            out = probe(["--cache-root", str(root), "--layer", str(args.layer),
                         "--fingerprint", res["caches"][dtype]["train"]["fingerprint"],
                         "--steps", str(args.steps), "--eval-rows", str(val_rows),
                         "--seed", str(seed)])  # fmt: skip
            assert out["held_out"] == res["caches"][dtype]["val"]["fingerprint"], out
            res["arms"].append({"dtype": dtype, "seed": seed, "val_rows": val_rows, **out})
            print(f"  {dtype:9s} seed {seed}: held-out loss {out['after']:.4f}, accuracy "
                  f"{out['accuracy']:.4f}", flush=True)  # fmt: skip
    res["load_after"] = load_average()
    by = {(a["dtype"], a["seed"]): a for a in res["arms"]}
    res["loss_ratio_minus_1"] = spread([by["fp8_e4m3", s]["after"] / by["bf16", s]["after"] - 1
                                        for s in args.seeds])  # fmt: skip
    res["accuracy_minus"] = spread([by["fp8_e4m3", s]["accuracy"] - by["bf16", s]["accuracy"]
                                    for s in args.seeds])  # fmt: skip
    bpv = {d: res["caches"][d]["train"]["bytes_per_value"] for d in DTYPES}
    res["bytes_per_value"] = bpv
    res["bytes_ratio"] = bpv["fp8_e4m3"] / bpv["bf16"]
    res["target"] = {"loss_within": 0.005,
                     "loss_met": abs(res["loss_ratio_minus_1"]["median"]) <= 0.005}  # fmt: skip
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return res


def table(res: dict) -> str:
    rows = [("seed", "bf16 loss", "fp8 loss", "fp8 / bf16 - 1", "bf16 acc", "fp8 acc")]
    by = {(a["dtype"], a["seed"]): a for a in res["arms"]}
    for s in res["seeds"]:
        b, f = by["bf16", s], by["fp8_e4m3", s]
        rows.append((str(s), f"{b['after']:.4f}", f"{f['after']:.4f}",
                     f"{f['after'] / b['after'] - 1:+.3%}", f"{b['accuracy']:.4f}",
                     f"{f['accuracy']:.4f}"))  # fmt: skip
    r, bpv = res["loss_ratio_minus_1"], res["bytes_per_value"]
    return (f"a linear probe on layer {res['layer']} ({res['steps']} steps), held out on "
            f"{res['arms'][0]['val_rows']} val rows; load {res['load_before']} -> "
            f"{res['load_after']}\n\n" + headline_table(rows)
            + f"\n\nmedian fp8 / bf16 - 1 of the held-out loss: {r['median']:+.3%} over {r['of']} "
            f"seeds (target within 0.5%: {'met' if res['target']['loss_met'] else 'missed'})\n"
            f"bytes per stored value (train cache): bf16 {bpv['bf16']:.3f}, fp8 "
            f"{bpv['fp8_e4m3']:.3f}: fp8 / bf16 {res['bytes_ratio']:.3f}")  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="demo.yaml's tiny model (tests)")
    ap.add_argument("--config", default=None, help="default: configs/demo.yaml")
    ap.add_argument("--layer", type=int, default=None, help="default 12 (--quick 2)")
    ap.add_argument("--train-rows", type=int, default=None, help="default 2000 (--quick 200)")
    ap.add_argument("--val-rows", type=int, default=None, help="default 512 (--quick 64)")
    ap.add_argument("--steps", type=int, default=None, help="probe steps (default 300, --quick 40)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", nargs="+", default=[], help="config overrides, after the bench's")
    ap.add_argument("--work", default=None, help="keep the token store and caches here")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    args = ap.parse_args(argv)
    args.config = args.config or "configs/demo.yaml"
    q = args.quick
    args.layer = args.layer if args.layer is not None else (2 if q else 12)
    args.train_rows = args.train_rows or (200 if q else 2000)
    args.val_rows = args.val_rows or (64 if q else 512)
    args.steps = args.steps or (40 if q else 300)
    if not q and not Path("models/smollm2-135m-instruct").is_dir():
        ap.error("the full form reads SmolLM2-135M-Instruct: run `make real-model` first, or "
                 "pass --quick")  # fmt: skip
    res = run(args)
    publish(res, table(res), args.out, "fp8_probe")
    return res


if __name__ == "__main__":
    main()
