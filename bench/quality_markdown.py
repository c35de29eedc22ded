"""The quality study's markdown report, docs/quality.md (bench/quality.py is the entry point).

`findings` (bullets with the measured numbers) and `write_markdown` (setup, tables, findings,
side studies, figures), from the raw results and bench/quality_analysis.analyse's summary.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from bench.quality_arms import LR
from bench.quality_figures import ARM_STYLE

# ---------------------------------------------------------------------------------------------
# Report: markdown


def _fmt(m: float, s: float | None = None, n: int | None = None, digits: int = 1) -> str:
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "—"
    txt = f"{m:.{digits}f}"
    if s is not None and n and n > 1:
        txt += f" ± {s:.{digits}f}"
    return txt


def _mult_txt(ms, censored: int, bound) -> str:
    m, s, n = ms
    if n == 0:
        return f"> {bound:.2f} (not reached)" if bound else "—"
    txt = _fmt(m, s, n, 2)
    if censored:
        txt += f" ({censored} seed(s) not reached by {bound:.2f})"
    return txt


def _mem_txt(mem: dict) -> str:
    vals = mem.get("per_block") or []
    if not vals:
        return "—"
    return " / ".join("—" if v is None else f"{v:.0f}" for v in vals)


def _load_range(results: dict) -> str:
    loads = [x for a in results["arms"] for x in a.get("loadavg", [])]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"


def findings(results: dict, summary: dict) -> list[str]:
    """Bullets with the measured numbers (worse and better alike)."""
    sc = results["scale"]
    M, S = sc["M"], sc["steps_per_visit"]
    full_steps = sc["full_rounds"] * M * S
    out = []

    def f(ms, d=2):
        return _fmt(*ms, digits=d) if isinstance(ms, list | tuple) else _fmt(ms, digits=d)

    for model, ms in summary["models"].items():
        a = ms["arms"]
        full, bcd = a.get("full"), a.get("bcd")
        if not full or not bcd:
            continue
        cens = bcd["multiplier_censored"]
        mult = f(bcd["multiplier"])
        if cens:
            mult += f" ({cens} of {bcd['n']} seeds did not reach it within {bcd['multiplier_bound']:.1f}x)"
        worst = bcd["multiplier_worst"]
        share = bcd["cache_s"][0] / bcd["wall_s"][0] if bcd["wall_s"][0] else float("nan")
        out.append(
            f"- **{model}**: at full's budget ({full_steps} steps) BCD-cache's whole-val ppl is "
            f"{f(bcd['ppl_at_full_steps_whole'], 1)} vs full's {f(full['final_ppl'], 1)} "
            f"({f(bcd['ppl_ratio_at_full_steps'])}x, curve subset): **worse**. With "
            f"{bcd['steps']} steps it ends at {f(bcd['final_ppl'], 1)}. B-F multiplier "
            f"(steps to full's final ppl) {mult}, worst "
            + ("not reached" if math.isinf(worst) else f"{worst:.2f}")
            + f" (paper: 1.39 average, 2.89 worst); to 1.05x of it {f(bcd['multiplier_close'])}."
        )
        out.append(
            f"  Wall-clock to 1.05x full's final ppl: {f(bcd['time_ratio_close'])}x full's "
            f"(robust clock {f(bcd['robust_ratio_close'])}x); cache builds are "
            f"{share:.0%} of BCD's training time ({f(bcd['cache_s'], 0)} s of "
            f"{f(bcd['wall_s'], 0)} s). Same steps, recompute over cache time: "
            f"{f(ms['recompute_over_cache_time'])}x (whole arm, builds included); per step of "
            "blocks 1.., recompute/cache: "
            + " / ".join(f"{v:.2f}" for v in ms.get("later_block_step_speedup") or [] if v)
            + "."
        )
        gap = ms.get("cache_over_recompute_ppl")
        if gap and gap[2]:
            out.append(
                f"  Same init, same steps, cache vs recompute whole-val ppl: {f(gap)}x "
                "(they differ only in where block K's input comes from and in batch order; see "
                "'Cache batch order')."
            )
        mem = bcd.get("mem_ratio_max")
        out.append(
            f"  Trainer memory (RSS growth) vs full: BCD peak {f(mem)}x (max over blocks, "
            f"block 0 needs the whole backward), blocks >= 1 {f(bcd.get('mem_ratio_later'))}x; "
            f"exact params+grads+optimizer state: {f(bcd.get('state_ratio_max'))}x peak, "
            f"{f(bcd.get('state_ratio_later'))}x blocks >= 1. At this size activations, the "
            "reader's shard buffer and the runtime dominate the RSS, not the state."
        )
    if summary["sweep"]:
        parts = []
        for r in summary["sweep"]:
            m = r["multiplier"]
            mt = f"{m[0]:.2f}" if m[2] else f">{r['bound']:.1f}"
            st = r["mem_state"]
            parts.append(
                f"M={r['M']}: multiplier {mt}, state max {_fmt(st['max'])} MB"
                + (f" (blocks >= 1: {st['later_max']:.1f})" if st.get("later_max") else "")
            )
        out.append(
            f"- Block count ({sc['models'][0]}, seeds {sc['sweep_seeds']}, equal steps per "
            "round): " + "; ".join(parts) + "."
        )
    if {"adamw", "sgd"} <= set(summary["sgd"]):
        a, g = summary["sgd"]["adamw"], summary["sgd"]["sgd"]
        out.append(
            f"- SGD inside BCD (lr {g['lr']:g}, momentum 0.9) vs AdamW: whole-val ppl "
            f"{f(g['final_ppl'], 1)} vs {f(a['final_ppl'], 1)} after the same steps; B-F multiplier "
            + (f"{g['multiplier'][0]:.2f}" if g["multiplier"][2] else f">{g['bound']:.1f}")
            + " vs "
            + (f"{a['multiplier'][0]:.2f}" if a["multiplier"][2] else f">{a['bound']:.1f}")
            + f"; params+grads+optimizer state per block {_mem_txt(g['mem_state'])} vs "
            f"{_mem_txt(a['mem_state'])} MB."
        )
    order = results.get("order")
    if order:
        by = {}
        for r in order["rows"]:
            by.setdefault(r["arm"], []).append(r["ppl"])
        means = {k: statistics.fmean(v) for k, v in by.items()}
        out.append(
            f"- Cache batch order ({order['rows'][0]['model']}, one round, mean whole-val ppl over seeds): "
            + "; ".join(f"{k}: {v:.1f}" for k, v in means.items())
            + f". Diagnostic run of {order.get('started', '?')}, before train caches were "
            "written in a shuffled row order: read in a global order the cache matched "
            "recompute, so the gap was the reader's shard-local batches, not bf16 and not BCD. "
            "Since the fix the main comparison's 'cache vs recompute' ratio measures the same."
        )
    return out


def write_markdown(results: dict, summary: dict, docs: Path, figures: list[Path]) -> Path:
    sc = results["scale"]
    prep = results["prep"]
    M, S = sc["M"], sc["steps_per_visit"]
    full_steps = sc["full_rounds"] * M * S
    L = []
    L.append("# Quality study: BCD (with the activation cache) vs full-parameter training\n")
    L.append(
        f"Produced by `{results['command']}` on {results['host']['cpus']} CPUs "
        f"({results['started']}; study wall time {results['study_s'] / 60:.1f} min; "
        f"load average {results['host']['loadavg_start']:.1f} at start, "
        f"{results['host']['loadavg_end']:.1f} at end, {_load_range(results)} at the arms' "
        f"starts and ends; trainer torch threads: {results['host'].get('torch_threads')} — "
        "the machine is shared, so raw "
        "wall-clock is noisy; the 'robust' clock replaces each step by its visit's median step "
        f"time). Raw numbers: `{results['json_path']}`.\n"
    )
    L.append("## Setup\n")
    L.append(
        f"- Corpus: the built-in one (Python stdlib sources), first {sc['documents']} files, "
        f"byte-level BPE {sc['vocab']}, S={sc['seq_len']}: {prep['train_samples']} train / "
        f"{prep['val_samples']} val samples (split by document)."
    )
    models = []
    for m in sc["models"]:
        size = ", ".join(o.removeprefix("model.") for o in sc["model_sets"][m])
        n = prep.get("params", {}).get(m)
        models.append(f"`{m}` ({size}; {n:,} params)" if n else f"`{m}` ({size})")
    L.append("- Models (random init from the seed): " + "; ".join(models) + ".")
    L.append(
        f"- Batch {sc['batch_size']} x {sc['seq_len']} tokens; every arm of a seed starts from "
        "the same init checkpoint and token store; data order seed = train.seed = the seed."
    )
    L.append(
        f"- full: all parameters, AdamW lr {LR['adamw']:g}, {full_steps} steps, warmup "
        f"{sc['warmup']} + cosine to 0.1x. BCD: M={M} blocks, {S} steps per block visit "
        f"(warmup {sc['warmup']} + cosine per visit, same family), ascending rotation; "
        f"{sc['full_rounds']} round = full's step budget; the cache arm runs {sc['bcd_rounds']} "
        f"rounds ({sc['bcd_rounds'] * M * S} steps) so the B-F multiplier is measurable up to "
        f"{sc['bcd_rounds'] / sc['full_rounds']:.1f}; bcd-recompute runs "
        f"{sc['recompute_rounds']} round(s). Seeds {sc['seeds']}."
    )
    L.append(
        f"- Val ppl on the curves: the first {sc['eval_batches']} val batches every "
        f"{sc['eval_every']} steps (BCD blocks > 0 evaluate from the bf16 val cache); 'whole "
        "val' = `run_eval` over the whole val split. Target = full's final curve ppl (same "
        "seed). B-F multiplier = BCD steps at the first eval point at or below the target / "
        "full's steps (resolution: one eval interval)."
    )
    L.append(
        "- Wall-clock = training time of the arm with every evaluation's measured time "
        "subtracted; BCD's includes its cache builds (Ray Data actors; Ray itself was started "
        f"once before the arms, {results['ray_start_s']:.1f} s, not charged to any arm)."
    )
    L.append(
        "- Memory: each (arm, block) re-run for "
        f"{sc['probe_steps']} steps in a fresh subprocess; 'RSS growth' = peak RSS (VmHWM, "
        "reset after imports) minus the post-import RSS: weights loaded, gradients, optimizer "
        "state, activations, batches. 'State' = exact bytes of loaded parameters + gradients + "
        "optimizer state. BCD peak = max over the rotation's blocks.\n"
    )

    L.append("## Findings (numbers from this run)\n")
    L += findings(results, summary)
    L.append("")
    L.append("## Main comparison\n")
    L.append(
        "| model | arm | steps | val ppl at full's budget (whole val) | final whole-val ppl | "
        "B-F multiplier | steps to 1.05x target | train wall-clock (s) | robust (s) | "
        "cache builds (s) | time to 1.05x target / full | trainer RSS growth per block (MB) | "
        "peak vs full | state per block (MB) |"
    )
    L.append("|" + "---|" * 14)
    for model, ms in summary["models"].items():
        for mode, row in ms["arms"].items():
            mult = (
                "1 (reference)"
                if mode == "full"
                else _mult_txt(
                    row["multiplier"], row["multiplier_censored"], row["multiplier_bound"]
                )
            )
            close = (
                "—"
                if mode == "full"
                else _mult_txt(row["multiplier_close"], 0, row["multiplier_bound"])
            )
            tr = "1.00" if mode == "full" else _fmt(*row["time_ratio_close"], digits=2)
            ratio = "1.00" if mode == "full" else _fmt(row.get("mem_ratio_max"), digits=2)
            L.append(
                f"| {model} | {ARM_STYLE[mode][0]} | {row['steps']} | "
                f"{_fmt(*row['ppl_at_full_steps_whole'])} | {_fmt(*row['final_ppl'])} | {mult} | "
                f"{close} | {_fmt(*row['wall_s'], digits=0)} | {_fmt(*row['robust_s'], digits=0)} | "
                f"{_fmt(*row['cache_s'], digits=0)} | {tr} | {_mem_txt(row['mem_rss'])} | {ratio} | "
                f"{_mem_txt(row['mem_state'])} |"
            )
    L.append("")
    L.append("Cache vs recompute (same steps, same rotation):\n")
    L.append(
        "| model | recompute time / cache time (whole arm, incl. cache builds) | robust | "
        "later-block step speed-up (recompute step / cache step), blocks 1.. |"
    )
    L.append("|---|---|---|---|")
    for model, ms in summary["models"].items():
        sp = ms.get("later_block_step_speedup") or []
        L.append(
            f"| {model} | {_fmt(*ms['recompute_over_cache_time'], digits=2)} | "
            f"{_fmt(*ms['recompute_over_cache_robust'], digits=2)} | "
            + " / ".join(f"{v:.2f}" if v else "—" for v in sp)
            + " |"
        )
    L.append("")
    L.append("## Targets (measured; a miss is reported, not hidden)\n")
    L.append("| model | target | limit | measured | met |")
    L.append("|---|---|---|---|---|")
    names = {
        "ppl_within_5pct": "BCD-cache val ppl at full's step budget / full's final",
        "ppl_within_5pct_any": "BCD-cache steps to 1.05x full's final ppl / full's steps (≤ the extended budget)",
        "time_to_close_le_full": "BCD-cache wall-clock to 1.05x full's final ppl / full's wall-clock",
        "faster_than_recompute_1p5x": "recompute time / cache time, same steps (≥)",
        "peak_mem_le_half_full": "BCD trainer peak RSS growth (max over blocks) / full",
        "later_block_mem_le_half_full": "BCD trainer RSS growth, blocks ≥ 1 / full",
    }
    for model, tg in summary["targets"].items():
        for key, t in tg.items():
            v = "—" if t["value"] is None else f"{t['value']:.2f}"
            met = "yes" if t["met"] else "**no**"
            L.append(f"| {model} | {names[key]} | {t['limit']} | {v} | {met} |")
    L.append("")
    if summary["sweep"]:
        L.append(f"## Block-count sweep ({sc['models'][0]}, seeds {sc['sweep_seeds']})\n")
        L.append(f"Same steps per round ({M * S}) for every M: {M * S}/M steps per visit.\n")
        L.append(
            "| M | steps/visit | val ppl at full's budget (curve) | whole-val ppl at the sweep's budget | "
            "B-F multiplier | to 1.05x | train wall-clock (s) | cache builds (s) | "
            "RSS growth per block (MB) | state per block (MB) |"
        )
        L.append("|" + "---|" * 10)
        for r in summary["sweep"]:
            L.append(
                f"| {r['M']} | {r['steps_per_visit']} | {_fmt(*r['ppl_at_full_steps'])} | "
                f"{_fmt(*r['final_ppl'])} | {_mult_txt(r['multiplier'], r['censored'], r['bound'])} | "
                f"{_mult_txt(r['multiplier_close'], 0, r['bound'])} | {_fmt(*r['wall_s'], digits=0)} | "
                f"{_fmt(*r['cache_s'], digits=0)} | {_mem_txt(r['mem_rss'])} | {_mem_txt(r['mem_state'])} |"
            )
        L.append("")
    if summary["sgd"]:
        L.append(
            f"## SGD vs AdamW inside BCD ({sc['models'][0]}, M={M}, seeds {sc['sgd_seeds']})\n"
        )
        L.append(
            "| optimizer | lr | val ppl at full's budget (curve) | final ppl (whole val) | B-F multiplier | "
            "RSS growth per block (MB) | state per block (MB) |"
        )
        L.append("|---|---|---|---|---|---|---|")
        for opt, r in summary["sgd"].items():
            L.append(
                f"| {opt} | {r['lr']:g} | {_fmt(*r['ppl_at_full_steps'])} | {_fmt(*r['final_ppl'])} | "
                f"{_mult_txt(r['multiplier'], r['censored'], r['bound'])} | {_mem_txt(r['mem_rss'])} | "
                f"{_mem_txt(r['mem_state'])} |"
            )
        L.append("")
    order = results.get("order")
    if order:
        L.append("## Cache batch order (diagnostic, before the row-order fix)\n")
        L.append(
            "Since commit fd8893a pre-inference writes train caches in a seeded random row "
            "order and the reader shuffles a buffer of several shards, so cache-fed batches "
            "mix the corpus like token batches (the main comparison's 'cache vs recompute' "
            "ratio above shows the effect). The table below is the diagnostic that found the "
            "defect, run on the code before that fix.\n"
        )
        L.append(
            f"From `{order.get('command')}` ({order.get('started', '')}): one BCD round "
            f"(M={M}, {M * S} steps, AdamW) from the same init per seed; whole-val ppl. The "
            "pipeline's cache reader (`storage.reader.CacheDataset` via "
            "`preinfer.trainer.CacheBatches`) permutes shards and shuffles rows inside a "
            "one-shard buffer, and the token store packs documents in order, so each batch "
            "comes from a few neighbouring documents; recompute reads token batches in a "
            "global random order. 'cache, global order' = the same bf16 cache read in "
            "TokenBatches' global order (a diagnostic stand-in for the reader, in this script "
            "only).\n"
        )
        seeds = sorted({r["seed"] for r in order["rows"]})
        kinds = list(dict.fromkeys(r["arm"] for r in order["rows"]))
        L.append("| model | arm | " + " | ".join(f"seed {x}" for x in seeds) + " | mean |")
        L.append("|---|---|" + "---|" * (len(seeds) + 1))
        for kind in kinds:
            rs = [r for r in order["rows"] if r["arm"] == kind]
            vals = {r["seed"]: r["ppl"] for r in rs}
            L.append(
                f"| {rs[0]['model']} | {kind} | "
                + " | ".join(f"{vals[x]:.1f}" if x in vals else "—" for x in seeds)
                + f" | {statistics.fmean(vals.values()):.1f} |"
            )
        L.append("")
    sweep = results.get("lr_sweep")
    L.append("## lr tuning\n")
    if sweep:
        L.append(
            f"From `{sweep.get('command', 'python bench/quality.py --lr-sweep')}` "
            f"({sweep.get('started', '')}): val ppl at the end of each short run.\n"
        )
        L.append("| optimizer | arm | lr | steps | val ppl |")
        L.append("|---|---|---|---|---|")
        for r in sweep["rows"]:
            L.append(
                f"| {r['optimizer']} | {r['mode']} | {r['lr']:g} | {r['steps']} | {r['ppl']:.1f} |"
            )
        L.append("")
    L.append(
        f"Used: AdamW lr {LR['adamw']:g} (best for full; BCD reuses it), SGD lr {LR['sgd']:g} "
        "(momentum 0.9, best for BCD), weight decay 1e-5, grad clip 1.0.\n"
    )
    L.append("## Figures\n")
    for f in figures:
        L.append(f"![{f.stem}]({f.name})\n")
    path = docs / "quality.md"
    path.write_text("\n".join(L))
    return path
