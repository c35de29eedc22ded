"""fp8 against bf16: a cache's bytes, and the last block's visit trained from each (issue #56).

    .venv/bin/python -m bench.fp8_visit --quick              # demo.yaml's tiny model, seconds
    .venv/bin/python -m bench.fp8_visit                      # SmolLM2-135M-Instruct (make real-model)

For each cache dtype (bf16 with the default lossless codec, fp8_e4m3 with a scale per token
row) and each seed: a fresh checkpoint of the same model (`init`), boundary M-1's train and val
caches built from the same token store (`cache build`), the last block's visit from them (`train
--block M-1`, the same steps, the same rows: train.seed sets the batch order), then the whole
val split evaluated from tokens (`eval`: the model's own forward, no cache). Reported: the
caches' bytes per stored value and fp8 / bf16; per seed the val loss after the fp8 visit /
after the bf16 visit - 1, its median over the seeds (issue #56's target: within 0.5%, and at
most 0.55x the bytes of bf16 lossless). Public APIs only (the pipelines' stage functions).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from bench.harness import headline_table, load_average, publish, quiet, spread
from pipelines.cache_build import build_cache
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from pipelines.train import run_train
from preinfer.run.config import load_config
from storage.atomic import dir_bytes
from storage.reader import open_cache

DTYPES = ("bf16", "fp8_e4m3")
REAL = ["model.checkpoint=models/smollm2-135m-instruct", "model.arch=llama",
        "data.tokenizer=models/smollm2-135m-instruct", "data.format=text", "data.source=builtin",
        "data.max_documents=200", "data.seq_len=128", "data.val_fraction=0.1",
        "partition.num_blocks=3", "train.optimizer=adamw", "train.lr=0.0003",
        "train.batch_size=8", "train.max_steps=60", "train.warmup_steps=5"]  # fmt: skip
QUICK = ["data.max_documents=40", "data.seq_len=32", "data.val_fraction=0.2",
         "partition.num_blocks=3", "train.batch_size=8", "train.max_steps=20",
         "train.warmup_steps=2", "run.tensorboard=false"]  # fmt: skip
COMMON = ["train.eval_every=0", "train.eval_batches=0", "train.workers=0", "train.epochs=null",
          "train.checkpoint_every=0", "preinfer.executor=local"]  # fmt: skip


def cache_stats(cfg, fps: dict[str, str]) -> dict:
    """Bytes on disk of a boundary's caches and bytes per stored value (rows x S x H)."""
    nbytes = values = 0
    for fp in fps.values():
        nbytes += dir_bytes(Path(cfg.cache.root) / fp)
        with open_cache(cfg.cache.root, fp) as c:
            values += c.num_samples * c.seq_len * c.hidden_size
    return {"bytes": nbytes, "values": values, "bytes_per_value": nbytes / values}


def arm(config: str, base: list[str], work: Path, dtype: str, seed: int, block: int) -> dict:
    """One dtype and seed: fresh checkpoint, boundary `block`'s caches, the visit, the eval."""
    run = work / f"{dtype}-s{seed}"
    shutil.rmtree(run, ignore_errors=True)
    cfg = load_config(config, [*base, f"run.dir={run}", f"cache.dtype={dtype}",
                               f"train.seed={seed}"])  # fmt: skip
    run_init(cfg, log=quiet)
    built = build_cache(cfg, block, log=quiet)
    visit = run_train(cfg, block, log=quiet)
    after = run_eval(cfg, log=quiet)  # the whole val split, from tokens
    shutil.rmtree(run, ignore_errors=True)  # the checkpoint (the caches stay in the shared root)
    return {"dtype": dtype, "seed": seed, "cache": cache_stats(cfg, built["fingerprints"]),
            "visit_val_loss": visit.get("val_loss"), "val_loss": after["loss"],
            "val_rows": after.get("rows")}  # fmt: skip


def run(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="fp8-visit-")).resolve()
    base = [*(QUICK if args.quick else REAL), *COMMON, f"data.out_dir={work / 'tokens'}",
            f"cache.root={work / 'cache'}", *args.set]  # fmt: skip
    cfg = load_config(args.config, [*base, f"run.dir={work / 'tokenize'}"])
    run_tokenize(cfg, log=quiet)
    block = cfg.partition.num_blocks - 1
    res = {"bench": "fp8_visit", "config": args.config, "overrides": base, "block": block,
           "seeds": args.seeds, "load_before": load_average(), "arms": []}  # fmt: skip
    for seed in args.seeds:
        for dtype in DTYPES:
            res["arms"].append(arm(args.config, base, work, dtype, seed, block))
            a = res["arms"][-1]
            print(f"  {dtype:9s} seed {seed}: val loss {a['val_loss']:.4f} (visit's own "
                  f"{a['visit_val_loss']:.4f}), cache {a['cache']['bytes_per_value']:.3f} "
                  "bytes/value", flush=True)  # fmt: skip
    res["load_after"] = load_average()
    by = {(a["dtype"], a["seed"]): a for a in res["arms"]}
    res["loss_ratio_minus_1"] = spread([by["fp8_e4m3", s]["val_loss"] / by["bf16", s]["val_loss"]
                                        - 1 for s in args.seeds])  # fmt: skip
    bpv = {d: spread([by[d, s]["cache"]["bytes_per_value"] for s in args.seeds]) for d in DTYPES}
    res["bytes_per_value"] = bpv
    res["bytes_ratio"] = bpv["fp8_e4m3"]["median"] / bpv["bf16"]["median"]
    res["target"] = {"bytes_ratio_at_most": 0.55, "loss_within": 0.005,
                     "bytes_met": res["bytes_ratio"] <= 0.55,
                     "loss_met": abs(res["loss_ratio_minus_1"]["median"]) <= 0.005}  # fmt: skip
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return res


def table(res: dict) -> str:
    rows = [("seed", "bf16 val loss", "fp8 val loss", "fp8 / bf16 - 1")]
    by = {(a["dtype"], a["seed"]): a for a in res["arms"]}
    for s in res["seeds"]:
        b, f = by["bf16", s]["val_loss"], by["fp8_e4m3", s]["val_loss"]
        rows.append((str(s), f"{b:.4f}", f"{f:.4f}", f"{f / b - 1:+.3%}"))
    r, t, bpv = res["loss_ratio_minus_1"], res["target"], res["bytes_per_value"]
    return (f"block {res['block']}'s visit from boundary {res['block']}'s cache, val loss on the "
            f"whole val split ({res['arms'][0]['val_rows']} rows) after it; load "
            f"{res['load_before']} -> {res['load_after']}\n\n" + headline_table(rows)
            + f"\n\nmedian fp8 / bf16 - 1: {r['median']:+.3%} over {r['of']} seeds (target within "
            f"0.5%: {'met' if t['loss_met'] else 'missed'})\nbytes per stored value: bf16 "
            f"{bpv['bf16']['median']:.3f}, fp8 {bpv['fp8_e4m3']['median']:.3f}: fp8 / bf16 "
            f"{res['bytes_ratio']:.3f} (target <= 0.55: {'met' if t['bytes_met'] else 'missed'})")  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="demo.yaml's tiny model (tests)")
    ap.add_argument("--config", default=None, help="default: configs/demo.yaml")
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick 0 1)"
    )
    ap.add_argument("--set", nargs="+", default=[], help="config overrides, after the bench's")
    ap.add_argument("--work", default=None, help="keep the token store and caches here")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/...)")
    args = ap.parse_args(argv)
    args.config = args.config or "configs/demo.yaml"
    args.seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2])
    if not args.quick and not Path("models/smollm2-135m-instruct").is_dir():
        ap.error("the full form trains SmolLM2-135M-Instruct: run `make real-model` first, or "
                 "pass --quick")  # fmt: skip
    res = run(args)
    publish(res, table(res), args.out, "fp8_visit")
    return res


if __name__ == "__main__":
    main()
