"""summary.md of `preinfer report` (pipelines/report.py): config, blocks, visits, caches,
evaluations and timings as markdown tables, from pipelines/report_data.collect's data.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from core.config import to_dict
from preinfer.run.config import Config
from preinfer.run.health import advice, flag_visits
from storage.atomic import human, write_bytes

# ---- the markdown summary ----


def _f(x, fmt: str = ".4f") -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return "–"
    return format(x, fmt)


def _human(n) -> str:
    return human(n) if isinstance(n, int | float) else "–"


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _config_rows(cfg: Config, data: dict) -> list[list]:
    """Model and data as the run made them (checkpoint index, token store manifest) when those
    exist; train, cache and run settings from the config the run recorded (`<run.dir>/
    config.json`, written by `bcd`), else as given to the report."""
    ran = data.get("run_config")
    c, given = (ran, "run") if ran is not None else (cfg, "config")
    mc = data.get("model_config") or {}
    dc = data.get("data_config") or {}
    model_src = "checkpoint" if mc else "config"
    mc = mc or to_dict(cfg.model)
    data_src = "token store" if dc else "config"
    dc = dc or to_dict(cfg.data)
    nb = len(data["blocks"]) or cfg.partition.num_blocks
    rows = [
        ["model", model_src, f"{mc.get('arch')}, H={mc.get('hidden_size')}, "
                             f"L={mc.get('num_layers')}, heads={mc.get('num_heads')}, "
                             f"vocab={mc.get('vocab_size')}"
                             + (f", from {mc['checkpoint']}" if mc.get("checkpoint") else "")],
        ["data", data_src, f"{dc.get('source')}, seq_len={dc.get('seq_len')}, "
                           f"tokenizer={dc.get('tokenizer')}, vocab={dc.get('vocab_size')}, "
                           f"val_fraction={dc.get('val_fraction')}"],
        ["partition", "checkpoint" if data["blocks"] else "config", f"num_blocks={nb}"],
        ["train", given, f"mode={c.train.mode}, rounds={c.train.rounds}, "
                            f"max_steps={c.train.max_steps}, batch_size={c.train.batch_size}, "
                            f"optimizer={c.train.optimizer}, lr={c.train.lr}, "
                            f"eval_every={c.train.eval_every}, workers={c.train.workers}"],
        ["cache", given, f"dtype={c.cache.dtype}, codec={c.cache.codec}, "
                            f"shuffle={c.cache.shuffle}, keep={c.cache.keep}, root={c.cache.root}"],
        ["run", given, f"dir={c.run.dir}, device={c.run.device}, precision={c.run.precision}"],
    ]  # fmt: skip
    return rows


def _progress_section(data: dict, plots: dict[str, Path]) -> list[str]:
    """The figures a reader wants first: val ppl at the end of each visit against the tokens
    trained and the wall-clock so far, per block and round."""
    L = ["## Val perplexity by block and round", ""]
    if "progress" in plots:
        L += [f"![progress]({plots['progress'].name})", ""]
    ends = {v["key"]: v for v in data["visits"]}
    pts = [p for p in data["progress"] if p["key"] in ends and p["step"] == ends[p["key"]]["steps"]]
    if not pts:
        return L + ["No finished visits yet.", ""]
    vals = [e for e in data["evals"] if e["split"] == "val" and isinstance(e["ppl"], int | float)]
    rows = []
    if vals and len(vals) > 1:
        rows.append(["initial eval", "–", 0, 0, _f(vals[0]["ppl"], ".2f")])
    for p in pts:
        rows.append([p["round"], p["block"], f"{p['tokens']:,.0f}" if isinstance(p["tokens"],
                     int | float) else "–", _f(p["time"], ".1f"), _f(p["ppl"], ".2f")])  # fmt: skip
    L += _table(["round", "block", "tokens trained", "wall-clock (s)", "val ppl"], rows)
    L += ["", "Val ppl after each visit, on its own input over `train.eval_batches` x batch val "
          "rows spread over the split by `train.seed` (the same rows at every evaluation; the "
          "whole split when 0; docs/preinference.md, 'How val is sampled'); wall-clock counts from the "
          "run's first record, cache builds included.", ""]  # fmt: skip
    return L


def _health_section(data: dict) -> list[str]:
    """Visits that committed but did not learn (preinfer/run/health.py): a val loss above where
    the visit started, or at the unigram level (state.json's, made by `bcd`)."""
    try:
        state = json.loads((Path(data["run_dir"]) / "state.json").read_text())
        unigram = (state.get("unigram") or {}) if isinstance(state, dict) else {}
    except (OSError, ValueError):
        unigram = {}
    rows = []
    for v in data["visits"]:
        first = [s.get("loss") for s in v.get("step_records") or [] if s.get("step") == 1]
        rows.append({"key": v["key"], "val_loss": v.get("val_loss"),
                     "first_loss": first[-1] if first else None})  # fmt: skip
    flags = flag_visits(rows, unigram.get("loss"))
    L = ["## Visits that did not learn", ""]
    if isinstance(unigram.get("loss"), int | float):
        L += [f"Unigram level {unigram['loss']:.4f} (the loss of the train split's token "
              "frequencies on the val rows the visits evaluate; train unigram entropy "
              f"{_f(unigram.get('entropy'))})." , ""]  # fmt: skip
    if not flags:
        return L + ["None: every visit's val loss ended at or below where it started and "
                    "below the unigram level.", ""]  # fmt: skip
    L += _table(["visit", "flag"], [[k, "; ".join(f)] for k, f in flags.items()])
    return L + ["", f"**{advice(flags)}**", ""]


def write_summary(cfg: Config, data: dict, plots: dict[str, Path], path: Path) -> None:
    fin = data["final"]
    L = [f"# preinfer report: {data['name']}", ""]
    L.append(f"Run directory `{data['run_dir']}`, mode `{data['mode']}`; generated "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}.")  # fmt: skip
    L.append("")
    L.append(f"**Final val perplexity: {_f(fin['ppl'], '.2f')}** (val loss {_f(fin['loss'])}; "
             f"from {'the last `preinfer eval`' if fin['source'] == 'eval' else fin['source']})")  # fmt: skip
    L.append("")
    L += _progress_section(data, plots)
    L += _health_section(data)
    L += ["## Plots", ""]
    L += [f"![{k}]({p.name})" for k, p in plots.items() if k != "progress"]
    L += ["", "## Config", ""]
    L += _table(["section", "from", "settings"], _config_rows(cfg, data))
    L += ["", "<details><summary>resolved config (JSON)</summary>", "", "```json",
          cfg.to_json(), "```", "", "</details>"]  # fmt: skip

    L += ["", "## Blocks", ""]
    if data["blocks"]:
        rows = [[b["block"], f"[{b['layers'][0]}, {b['layers'][1]})", f"{b['params']:,}"
                 if isinstance(b["params"], int) else "–", f"`{(b['hash'] or '')[:12]}`",
                 ", ".join(b["trains"]) or "–"] for b in data["blocks"]]  # fmt: skip
        L += _table(["block", "layers", "params", "hash (now)", "trained in"], rows)
    else:
        L.append(f"No checkpoint index at `{cfg.run.checkpoint}`.")

    L += ["", "## Visits", ""]
    if data["visits"]:
        rows = [[v["key"], v["input"], v["steps"], v["stopped"], _f(v["loss"]), _f(v["val_loss"]),
                 _f(v["val_ppl"], ".2f"), _f(v["seconds"], ".2f"), _f(v["tokens_per_s"], ".0f"),
                 _f(v["peak_mem_mb"], ".1f"),
                 f"{v['trainable_params']:,}" if isinstance(v["trainable_params"], int) else "–"]
                for v in data["visits"]]  # fmt: skip
        L += _table(["visit", "input", "steps", "stopped", "train loss", "val loss", "val ppl",
                     "seconds", "tokens/s", "peak MB", "trainable"], rows)  # fmt: skip
        L.append("")
        L.append(f"{data['num_step_records']} step records (a step redone after a resume counts "
                 "once: its later record wins). Val loss of a visit is measured on its own input "
                 "(cache or tokens) over `train.eval_batches` x batch val rows spread over the "
                 "split by `train.seed`, the same rows at every evaluation.")  # fmt: skip
    else:
        L.append("No visits recorded.")

    L += ["", "## Caches", ""]
    if data["caches"]:
        rows = []
        for c in data["caches"]:
            sizes = []
            for split, fp in sorted(c["fingerprints"].items()):
                info = c["sizes"].get(split)
                if info is None:
                    recorded = (c.get("bytes") or {}).get(split)
                    sizes.append(
                        f"{split} `{fp[:12]}`: gone"
                        + (f" (was {_human(recorded)})" if recorded else "")
                    )
                else:
                    ratio = info.get("ratio_vs_bf16")
                    sizes.append(f"{split} `{fp[:12]}`: {info.get('num_samples', '?')} samples, "
                                 f"{_human(info.get('total_bytes'))}, "
                                 f"{_f(info.get('bytes_per_value'), '.3f')} B/value, "
                                 f"{_f(info.get('compression_ratio'), '.2f')}x compressed, "
                                 f"{_f(ratio, '.2f')}x vs bf16")  # fmt: skip
            fixed = c.get("fixed_s")
            share = (
                f"{_f(fixed, '.2f')} ({fixed / c['seconds']:.0%})"
                if fixed and c["seconds"]
                else "–"
            )
            rows.append([c["round"], c["boundary"], c["action"], _f(c["seconds"], ".2f"), share,
                         c.get("rows") or "–", _f(c["start"], ".1f"),
                         "<br>".join(sizes) or "–"])  # fmt: skip
        L += _table(["round", "boundary", "action", "seconds", "fixed s (share)", "rows computed",
                     "at (s)", "caches"], rows)  # fmt: skip
        L.append("")
        L.append("Fixed: everything but computing shards (planning, worker start-up, finalize).")
        L.append("")
        L.append("Sizes come from the cache manifests still on disk; `gone` = removed since "
                 "(cache.keep=false drops caches the rotation no longer needs).")  # fmt: skip
    else:
        L.append("No cache events (block 0 and non-bcd modes read tokens).")

    L += ["", "## Evaluations", ""]
    if data["evals"]:
        rows = [[i, e["split"], _f(e["loss"]), _f(e["ppl"], ".2f"),
                 f"{e['tokens']:,}" if isinstance(e["tokens"], int) else "–",
                 _f(e["seconds"], ".2f"), f"`{(e['checkpoint'] or '')[:12]}`",
                 _f(e["time"], ".1f")] for i, e in enumerate(data["evals"])]  # fmt: skip
        L += _table(["#", "split", "loss", "ppl", "tokens", "seconds", "checkpoint", "at (s)"],
                    rows)  # fmt: skip
    else:
        L.append("No `preinfer eval` records; the final perplexity above is the last visit's.")

    t = data["timings"]
    L += ["", "## Timings", ""]
    rows = [["wall (first record to last)", _f(t["wall_seconds"], ".1f")],
            ["training (sum of visits)", _f(t["train_seconds"], ".1f")],
            ["evaluation", _f(t["eval_seconds"], ".1f")]]  # fmt: skip
    for a, s in t["cache_seconds"].items():
        rows.append([f"cache {a} (x{t['cache_counts'][a]})", _f(s, ".1f")])
    L += _table(["what", "seconds"], rows)
    L.append("")
    write_bytes(path, ("\n".join(L) + "\n").encode())  # temp + rename: an old summary stays whole
