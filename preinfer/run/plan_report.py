"""`preinfer plan`: will it fit, how big is the cache, what will it cost — before anything runs.

The memory arithmetic is preinfer.plan.memory's; this module adds the options, the cache sizes
against free disk, the cost (steps x time per step x cards x price, time from metrics.jsonl
throughput when the run has one, else FLOPs / (peak x MFU), labelled as such) and the report.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, field_docs, finite_float
from preinfer.model.partition import partition_layers
from preinfer.model.shape import model_shape
from preinfer.plan.costmodel import Flops, block_step_costs
from preinfer.plan.fit import FIT_PRECISIONS, fit_search, format_fit
from preinfer.plan.guards import cache_bytes
from preinfer.plan.memory import (
    CARDS,
    OPT_STATE,
    PRECISIONS,
    GiB,
    optimizer_state_bytes,
    preinfer_memory,
    setup_for,
    sharded_full_cards,
    smallest_fitting_m,
    trainer_memory,
)
from preinfer.plan.writer_budget import format_writer, writer_plan
from preinfer.run.config import Config
from preinfer.runtime.metrics import read_metrics
from preinfer.schedule.rotation import rotation_steps, visit_budget
from preinfer.schedule.visit_plan import plan_visit
from storage.layout import free_disk_bytes
from storage.tokens import TokenStore

# BCD/full step multipliers (BCD steps to full's best val ppl / full's), measured by bench.study
# when pretraining from a config with 48-step visits, the head in every visit, schedule run and
# cache_visits M (docs/quality.md, "visit steps"): (arch, tied head, M) -> (median, worst seed
# of 5, results file). A tied GPT-2 reached full's best on 1 of 3 seeds within 3x: 3.0 is a
# floor there, not a figure. Other layouts, other M and fine-tuning: the paper's (PAPER_BF).
MEASURED_BF = {
    # the whole val split, 5 seeds (the other rows: the first 32 val rows, where llama M=3 read
    # 1.18 / 1.33)
    ("llama", False, 3): (
        1.44,
        1.97,
        "study-small-20261204-llama-visit-steps-48-wholeval-5seeds.json",
    ),
    ("llama", False, 6): (1.19, 1.38, "study-small-20261202-llama-M6-visit-steps-48-idle.json"),
    ("gpt2", False, 3): (1.33, 1.76, "study-small-20261202-gpt2-untied-visit-steps-48-idle.json"),
    ("gpt2", False, 6): (
        1.16,
        2.12,
        "study-small-20261202-gpt2-untied-M6-visit-steps-48-idle.json",
    ),
    ("gpt2", True, 3): (3.0, 3.0, "study-small-20261202-gpt2-tied-visit-steps-48.json"),
}
PAPER_BF = (1.39, 2.89)
# The memory estimates against the peaks bench.plan_accuracy measured on CPU, out of sample (the
# demo and gpt2-small configs; the constants were fitted on llama-small; docs/planner.md):
# kind -> (lowest, highest estimate / measured - 1, results file)
MEMORY_ACCURACY = {
    "trainer": (-0.110, 0.106, "plan_accuracy-20261202.json"),
    "pre-inference": (0.090, 0.331, "plan_accuracy-preinfer-20261203.json"),
}


def step_multipliers(arch: str, tied: bool, M: int, finetune: bool) -> tuple[float, float, str]:
    """(average, worst, where from) of the BCD/full step multiplier the planner prices BCD with:
    ours where bench.study measured this (arch, tied, M) from scratch, else the paper's."""
    got = None if finetune else MEASURED_BF.get((arch, bool(tied), M))
    if got is None:
        why = "fine-tuning" if finetune else f"{arch} {'tied' if tied else 'untied'} M={M}"
        return *PAPER_BF, f"the paper's Adam figures (no measurement of ours for {why})"
    return got[0], got[1], f"measured, bench/results/{got[2]} (docs/quality.md)"


# ---------------------------------------------------------------------------- the plan


@dataclass(kw_only=True)
class PlanOptions:
    """`preinfer plan` options (command line only; the config supplies everything else)."""

    card: str = "rtx4090"
    """Card type: rtx4090, a100-80, a800-80, h100-80 (memory, peak FLOPS, price), or cpu."""
    gpu_mem: float | None = None
    """Memory per card in GiB; null = the card's (cpu: this machine's RAM)."""
    cards: int = 1
    """Cards training data-parallel (the global batch is split over them)."""
    price: float | None = None
    """USD per card-hour; null = the card's (the paper's rental prices)."""
    peak_tflops: float | None = None
    """Card peak TFLOPS in the planned precision; null = the card's datasheet figure."""
    mfu: float = 0.4
    """Fraction of the peak a step reaches, for FLOP-estimated step times (an assumption)."""
    precision: str | None = None
    """fp32, amp-bf16 (autocast: fp32 weights) or bf16 (what-if); null = from run.precision."""
    optimizer: str | None = None
    """sgd, adam or adamw; null = train.optimizer."""
    batch: int | None = None
    """Global batch in sequences; null = train.batch_size."""
    seq: int | None = None
    """Sequence length S; null = data.seq_len."""
    blocks: int | None = None
    """M, the number of BCD blocks; null = partition.num_blocks."""
    act_recompute: bool = False
    """What-if: activation recomputation (keep layer inputs only; preinfer does not do this)."""
    steps: int | None = None
    """Full-training steps to the target loss; null = train.max_steps x rounds x M."""
    bf_average: float | None = None
    """BCD/full step multiplier, average; null = our measured median for this layout and M
    (MEASURED_BF), else the paper's Adam figure 1.39."""
    bf_worst: float | None = None
    """BCD/full step multiplier, worst case; null = our measured worst seed for this layout and M
    (MEASURED_BF), else the paper's Adam figure 2.89."""
    samples: int | None = None
    """Train samples (for cache size and pre-inference time); null = the token store's."""
    tokens: float | None = None
    """Train tokens instead of samples (samples = tokens / S)."""
    free_disk: float | None = None
    """Free disk in GiB at cache.root; null = measured."""
    flops_only: bool = False
    """Ignore step times measured in <run.dir>/metrics.jsonl (they assume the same hardware)."""
    compare_card: str | None = None
    """Also cost full training on this card type: the card-change factor, reported apart."""
    compare_price: float | None = None
    """USD per card-hour of the compare card; null = its listed price."""
    forward_tokens_s: float | None = None
    """Pre-inference forward tokens/s per card (measured: bench/preinfer_throughput.py's bare forward); null = FLOPs / (peak x MFU) of the lightest boundary refresh."""
    writer_mb_s: float | None = None
    """Cache writer MB per core-second for cache.codec (measured: bench/writer.py); null = the figure preinfer/plan/costmodel.py holds."""
    host_cores: int | None = None
    """CPU cores per card that encode and write the cache; null = this machine's CPUs / cards."""
    fit: bool = False
    """Turn it around: search run.precision, the per-card batch and M for what trains in the card's memory (--gpu-mem), with FLOP-estimated step times (preinfer/plan/fit.py)."""
    json: bool = False
    """Print the plan as JSON."""


def add_plan_arguments(parser) -> None:
    """One --option per PlanOptions field (help = the field's docstring)."""
    import dataclasses
    import typing

    docs, hints = field_docs(PlanOptions), typing.get_type_hints(PlanOptions)
    for f in dataclasses.fields(PlanOptions):
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            parser.add_argument(flag, action="store_true", help=docs[f.name])
            continue
        tp = next(
            t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)
        )
        tp = finite_float if tp is float else tp  # --gpu-mem nan: one line, not a traceback
        parser.add_argument(flag, type=tp, default=f.default, help=docs[f.name])


def _card(name: str, mem=None, peak=None, price=None, precision="fp32"):
    """(memory bytes, {"train", "infer"}: peak FLOP/s or None, price or None) of a card name
    with overrides; training runs at the planned precision, pre-inference in bf16."""

    if name == "cpu":
        import psutil

        m, fp32, bf16, pr = psutil.virtual_memory().total / GiB, None, None, None
    elif name in CARDS:
        m, fp32, bf16, pr = CARDS[name]
    else:
        raise ConfigError(f"--card {name!r} is unknown; choose one of cpu, {', '.join(CARDS)}")
    train = peak if peak is not None else (fp32 if precision == "fp32" else bf16)
    peaks = {"train": train and train * 1e12, "infer": bf16 and bf16 * 1e12}
    return (mem if mem is not None else m) * GiB, peaks, (price if price is not None else pr)


def measured_times(run_dir: str) -> dict:
    """Seconds per global token of the latest visits in <run.dir>/metrics.jsonl, per stage."""
    out = {}
    for rec in read_metrics(run_dir):
        if (
            rec.get("event") == "visit"
            and rec.get("tokens_per_s")
            and rec.get("mode") in ("full", "bcd")
        ):
            key = "full" if rec["mode"] == "full" else f"bcd {rec['block']}"
            out[key] = 1.0 / rec["tokens_per_s"]
    return out


def _n_samples(cfg: Config, o: PlanOptions, seq: int) -> tuple[int | None, int | None, str]:
    """(train, val) samples and where they came from: --samples/--tokens, else the token store."""

    if o.samples or o.tokens:
        n = o.samples or max(1, int(o.tokens // seq))
        return n, max(1, round(n * cfg.data.val_fraction)), "given"
    if TokenStore.exists(cfg.data.out_dir):
        st = TokenStore(cfg.data.out_dir)
        scale = st.seq_len / seq  # same tokens, repacked at the planned S
        return (round(st.num_samples("train") * scale), round(st.num_samples("val") * scale),
                f"token store {cfg.data.out_dir}")  # fmt: skip
    return None, None, "unknown (tokenize first, or pass --samples / --tokens)"


def build_plan(cfg: Config, o: PlanOptions) -> dict:
    """The whole plan as plain data (what --json prints)."""

    if o.cards < 1 or o.mfu <= 0 or (o.precision and o.precision not in PRECISIONS):
        raise ConfigError(f"plan: need --cards >= 1, --mfu > 0, --precision in {list(PRECISIONS)}")
    if o.optimizer and o.optimizer not in OPT_STATE:
        raise ConfigError(f"plan: --optimizer must be one of {', '.join(OPT_STATE)}")
    target = "cpu" if o.card == "cpu" else "gpu"
    sh = model_shape(cfg.model)
    S = o.seq or cfg.data.seq_len
    M = o.blocks or cfg.partition.num_blocks
    if not 1 <= M <= len(sh.layers):
        raise ConfigError(f"plan: M={M} blocks is out of range 1..{len(sh.layers)} layers")
    part = partition_layers(list(sh.layers), sh.embed, sh.head, M)
    n_tr, n_val, n_src = _n_samples(cfg, o, S)
    rows = None if n_tr is None else visit_budget(cfg.train, cfg.preinfer.sample_fraction, n_tr,
                                                  n_val or 0)  # fmt: skip
    p = setup_for(sh, cfg.train, cfg.cache, cfg.preinfer, target=target, seq=S,
                  token_rows=cfg.data.shard_rows, run_precision=cfg.run.precision, budget=rows,
                  batch=o.batch, cards=o.cards, precision=o.precision, optimizer=o.optimizer,
                  act_recompute=o.act_recompute)  # fmt: skip
    mem, peak, price = _card(o.card, o.gpu_mem, o.peak_tflops, o.price, p.precision)
    stages = [trainer_memory(sh, part, "full", 0, p)]
    stages += [trainer_memory(sh, part, "bcd", k, p) for k in range(M)]
    stages += [preinfer_memory(sh, part, k, p) for k in range(1, M)]
    stages += [preinfer_memory(sh, part, k, p, refresh=True) for k in range(2, M)]
    for s in stages:
        s["fits"] = s["peak"] <= mem
    bcd = [s for s in stages if s.get("mode") == "bcd"]
    plan = {
        "model": {"arch": sh.arch, "layers": len(sh.layers), "hidden": sh.hidden,
                  "vocab": sh.vocab, "params": sh.params, "tied": sh.tied},
        "partition": {"M": M, "blocks": [list(b) for b in part.blocks],
                      "block_params": part.block_params},
        "setup": {**p.__dict__, "global_batch": p.batch * o.cards,
                  "card": o.card, "card_bytes": mem, "cards": o.cards},
        "stages": stages,
        "full_fits": stages[0]["fits"], "bcd_fits": all(s["fits"] for s in bcd),
        "smallest_m": smallest_fitting_m(sh, p, mem),
        "samples": {"train": n_tr, "val": n_val, "source": n_src},
    }  # fmt: skip
    plan["cache"] = _cache(cfg, o, sh, S, M, n_tr, n_val)
    # fp32 block files; with train.keep_optimizer_state every trained block's state beside them
    weights = 4 * sh.params
    kept = optimizer_state_bytes(p) * sh.params if cfg.train.keep_optimizer_state else 0
    plan["checkpoint"] = {"weights": weights, "optimizer_state": kept, "total": weights + kept}
    plan["cost"] = _cost(cfg, o, sh, part, p, plan, peak, price, n_tr, n_val)
    plan["writer"] = writer_plan(cfg.cache, o, sh, part, S, peak["infer"])
    if o.fit:
        peaks = {x: _card(o.card, o.gpu_mem, o.peak_tflops, o.price, x)[1]["train"]
                 for x in FIT_PRECISIONS}  # fmt: skip
        plan["fit"] = fit_search(sh, p, mem, peaks, o.mfu)
    return plan


def _cache(cfg: Config, o: PlanOptions, sh, S, M, n_tr, n_val) -> dict:

    free = o.free_disk * GiB if o.free_disk is not None else free_disk_bytes(cfg.cache.root)
    if n_tr is None:
        rows = visit_budget(cfg.train, cfg.preinfer.sample_fraction, 1000, 0)
        one = cache_bytes(cfg.cache, rows, hidden=sh.hidden, seq=S)
        return {"per_1000_samples": one, "free": free, "boundaries_at_once": None}
    rows = visit_budget(cfg.train, cfg.preinfer.sample_fraction, n_tr, n_val)
    per = cache_bytes(cfg.cache, rows, hidden=sh.hidden, seq=S)
    alive = 0 if M < 2 else (M - 1 if cfg.cache.keep else min(2, M - 1))
    return {"per_boundary": per, "boundaries_at_once": alive, "peak_disk": alive * per["expected"],
            "free": free, "fits": alive * per["expected"] <= free}  # fmt: skip


def _cost(cfg: Config, o: PlanOptions, sh, part, p, plan, peak, price, n_tr, n_val) -> dict:
    """steps x time per step x cards x price, full vs BCD, same card; optionally full on another."""
    M, tok = part.num_blocks, p.batch * o.cards * p.seq  # tokens per global step
    fl = Flops(sh=sh, part=part, seq=p.seq)
    measured = {} if o.flops_only else measured_times(cfg.run.dir)
    steps = o.steps or cfg.train.max_steps * cfg.train.rounds * M

    def step_time(key, flops, cards, peak_):
        if key in measured:
            return tok * measured[key], "measured"
        return (None, "n/a") if not peak_ else (flops * tok / (cards * peak_ * o.mfu), "flops")

    def full_on(mem_, peak_, price_):  # preinfer's DDP replica if it fits, else sharded
        fits = trainer_memory(sh, part, "full", 0, p)["peak"] <= mem_
        n = o.cards if fits else sharded_full_cards(sh, part, p, mem_, p.batch * o.cards)
        t, src = step_time("full", fl.full(), n or 1, peak_["train"])
        hours = None if t is None or n is None else steps * t / 3600
        return {"cards": n, "sharded": not fits, "step_s": t, "time_source": src, "hours": hours,
                "cost": None if hours is None or price_ is None else hours * n * price_}  # fmt: skip

    out = {"steps_full": steps, "mfu": o.mfu, "price": price,
           "full": full_on(plan["setup"]["card_bytes"], peak, price)}  # fmt: skip
    frac = cfg.preinfer.sample_fraction
    budget = visit_budget(cfg.train, frac, n_tr, n_val or 0) if n_tr else None
    plans = [plan_visit(cfg.train, budget, M, 0, k) for k in range(M)] if budget else []
    whole = [q.adapts_prefix for q in plans] or [False] * M
    times = [step_time(f"bcd {k}", fl.bcd(k, whole[k]), o.cards, peak["train"]) for k in range(M)]
    pre = None
    # train rows each boundary of round 0 holds: the windows of the visits it serves (none
    # for a visit that reads tokens: train.prefix_adapters=last)
    held = {q.block: q.cache_rows for q in plans if q.boundary is not None}
    # none held: M = 1, or M = 2 with the lever (block 1's visit reads tokens: nothing cached)
    cached = max(held.values()) if held else (0 if any(whole) else budget.rows if budget else None)
    if held and peak["infer"]:  # per round: each boundary refreshed once, in bf16
        pre = sum(fl.preinfer(k) * rows for k, rows in held.items()) * p.seq
        pre /= o.cards * peak["infer"] * o.mfu
    read = steps / M / cfg.train.rounds * p.batch * o.cards  # samples one block visit reads
    out["cache_use"] = {
        "cached_per_boundary": cached, "cached_by_boundary": held or None,
        "read_per_visit": round(read),
        "visit_rows": budget.visit_rows if budget else None,
        "cache_visits": cfg.train.cache_visits,
        # rows a round's M visits read between them: train.cache_visits trades cache size
        # against data diversity (1 = every visit the same rows)
        "distinct_per_round": min(budget.rows, M * budget.visit_rows) if budget else None,
        # train.visit_steps other than equal: the steps of round 0's visits, in its block order
        "steps_per_visit": (budget.steps if cfg.train.visit_steps == "equal" else
                            rotation_steps(cfg.train, budget, M, block_step_costs(fl, cfg.train))[0])
        if budget else None,
        "why": budget.why if budget else None,
    }  # fmt: skip
    avg, worst, src = step_multipliers(sh.arch, sh.tied, M, cfg.model.checkpoint is not None)
    for name, bf, given in (("bcd_average", avg, o.bf_average), ("bcd_worst", worst, o.bf_worst)):
        bf, why = (bf, src) if given is None else (given, "given (plan.bf_*)")
        if any(t is None for t, _ in times):
            out[name] = {"multiplier": bf, "multiplier_source": why, "hours": None, "cost": None}
            continue
        rounds = cfg.train.rounds * bf
        secs = steps * bf / M * sum(t for t, _ in times) + (pre or 0) * rounds
        hours = secs / 3600
        out[name] = {"multiplier": bf, "multiplier_source": why, "cards": o.cards, "hours": hours,
                     "time_source": sorted({s for _, s in times}),
                     "preinfer_hours": None if pre is None else pre * rounds / 3600,
                     "cost": None if price is None else hours * o.cards * price}  # fmt: skip
        f = out["full"]["cost"]
        out[name]["same_device_factor"] = out[name]["cost"] / f if f and out[name]["cost"] else None
    if o.compare_card:
        m2, pk2, pr2 = _card(o.compare_card, price=o.compare_price, precision=p.precision)
        other = full_on(m2, pk2, pr2)
        here, there = out["full"]["cost"], other["cost"]
        out["compare"] = {"card": o.compare_card, "full": other,
                          "card_change_factor": here / there if here and there else None}  # fmt: skip
    return out


def _usd(x) -> str:
    return "-" if x is None else f"${x:,.2f}" if x < 100 else f"${x:,.0f}"


def _gib(b) -> str:
    return "-" if b is None else f"{b / GiB:.2f}" if b < 10 * GiB else f"{b / GiB:.1f}"


def format_plan(plan: dict) -> str:
    """The human report: model, per-stage memory table, smallest M, cache vs disk, cost."""
    m, st, c = plan["model"], plan["setup"], plan["cost"]
    part = plan["partition"]
    blocks = " | ".join(f"{a}-{b - 1}" for a, b in part["blocks"])
    where = (
        "CPU runtime constants measured" if st["target"] == "cpu" else "GPU, CUDA context assumed"
    )
    out = [
        f"model  {m['arch']} L={m['layers']} H={m['hidden']} V={m['vocab']}: "
        f"{m['params'] / 1e9:.3g} B params{' (tied head)' if m['tied'] else ''}; "
        f"M={part['M']} blocks, layers {blocks}",
        f"card   {st['card']} {st['card_bytes'] / GiB:.1f} GiB x {st['cards']}; precision "
        f"{st['precision']}, {st['optimizer']}; {st['batch']} x {st['seq']} tokens per card "
        f"(global batch {st['global_batch']}); activation recompute "
        f"{'on (what-if)' if st['act_recompute'] else 'off'}",
        f"memory estimated per card, GiB ({where}; see preinfer/run/plan_report.py)",
        "",
        f"{'stage':36s} {'weights':>8s} {'grads':>7s} {'optim':>7s} {'activ':>7s} "
        f"{'host io':>8s} {'runtime':>8s} {'PEAK':>8s}  phase     fits",
    ]
    for s in plan["stages"]:
        cp = s["components"]
        io = cp.get("reader", 0) + cp.get("shard", 0)
        out.append(
            f"{s['stage']:36s} {_gib(cp['weights']):>8s} {_gib(cp.get('grads')):>7s} "
            f"{_gib(cp.get('optimizer')):>7s} {_gib(cp['activations']):>7s} {_gib(io):>8s} "
            f"{_gib(cp['runtime']):>8s} {_gib(s['peak']):>8s}  {s['phase']:9s} "
            f"{'yes' if s['fits'] else 'NO'}"
        )
    sm = plan["smallest_m"]
    out += ["", f"full-parameter training fits one card: {'yes' if plan['full_fits'] else 'NO'}; "
            f"BCD with M={part['M']} fits: {'yes' if plan['bcd_fits'] else 'NO'}; smallest M that "
            "fits: " + (f"{sm['M']} (worst: {sm['worst_stage']}, {_gib(sm['peak'])} GiB)" if sm
                        else "none (block 0 holds every weight and the whole model's activations: "
                        "lower the batch or S)")]  # fmt: skip
    ca, n = plan["cache"], plan["samples"]
    if "per_boundary" in ca:
        per = ca["per_boundary"]
        basis = (
            f"codec ratio {per['ratio']:.2f} measured on cache {per['ratio_source'][:12]}"
            if per["ratio"]
            else "uncompressed upper bound (no cache of this codec yet)"
        )
        out += ["", f"cache  per boundary {_gib(per['expected'])} GiB for {per['samples']} samples "
                f"({n['source']}; {basis}); {ca['boundaries_at_once']} boundaries on disk at once "
                f"= {_gib(ca['peak_disk'])} GiB; free {_gib(ca['free'])} GiB: "
                f"{'ok' if ca['fits'] else 'DOES NOT FIT'}"]  # fmt: skip
    else:
        out += ["", f"cache  {_gib(ca['per_1000_samples']['expected'])} GiB per 1000 samples; "
                f"sample count {n['source']}"]  # fmt: skip
    out.append(format_writer(plan["writer"]))
    ck = plan["checkpoint"]
    out += [f"checkpoint  {_gib(ck['total'])} GiB on disk at run.dir: {_gib(ck['weights'])} GiB "
            f"weights + {_gib(ck['optimizer_state'])} GiB optimizer state "
            "(train.keep_optimizer_state: each block's, once it has trained)"]  # fmt: skip
    price = "-" if c["price"] is None else f"${c['price']:.2f}"
    out += ["", f"cost   {c['steps_full']} full-training steps; {price}/card-hour; step times: "
            "measured (metrics.jsonl) where present, else FLOPs / (card peak x MFU "
            f"{c['mfu']}): an estimate that ignores communication"]  # fmt: skip
    rows = [("full", c["full"])] + [
        (k.replace("_", " "), c[k]) for k in ("bcd_average", "bcd_worst")
    ]
    if "compare" in c:
        rows.append((f"full on {c['compare']['card']}", c["compare"]["full"]))
    for name, r in rows:
        h, cost = r.get("hours"), r.get("cost")
        src = r.get("time_source")
        extra = f" x{r['multiplier']} steps" if "multiplier" in r else ""
        extra += f" [time: {'+'.join(src) if isinstance(src, list) else src}]" if src else ""
        extra += " (states sharded, ZeRO-3 idealisation)" if r.get("sharded") else ""
        if r.get("preinfer_hours"):
            extra += f", of which pre-inference {r['preinfer_hours']:,.1f} h"
        extra += (f", same-device factor {r['same_device_factor']:.2f}"
                  if r.get("same_device_factor") else "")  # fmt: skip
        out.append(f"  {name:22s} cards {r.get('cards') or '-'}  hours "
                   f"{'-' if h is None else f'{h:,.1f}'}  cost {_usd(cost)}{extra}")  # fmt: skip
    out.append(f"  bcd step multipliers: {c['bcd_average'].get('multiplier_source')}")
    acc = ", ".join(f"{k} {lo:+.0%} to {hi:+.0%}" for k, (lo, hi, _) in MEMORY_ACCURACY.items())
    out.append(f"  memory estimates against measured CPU peaks, out of sample (demo, gpt2-small): "
               f"{acc} (docs/planner.md)")  # fmt: skip
    use = c["cache_use"]
    if use["visit_rows"]:
        by = list((use["cached_by_boundary"] or {}).values()) or [use["cached_per_boundary"]]
        held = (f"each boundary caches {by[0]:,} train rows per round" if len(set(by)) <= 1
                else f"boundaries 1..{len(by)} cache {', '.join(f'{n:,}' for n in by)} train "
                "rows per round (the windows of the visits each serves)")  # fmt: skip
        out.append(f"  rows: {held} "
                   f"(train.cache_visits {use['cache_visits']:g}); each visit reads a window "
                   f"of {use['visit_rows']:,} ({use['steps_per_visit']} steps); a round's visits "
                   f"read {use['distinct_per_round']:,} distinct rows")  # fmt: skip
    meant = max(
        use["read_per_visit"], use["distinct_per_round"] or 0
    )  # a larger cache is on purpose
    if use["cached_per_boundary"] and use["cached_per_boundary"] > 2 * meant:
        frac = use["read_per_visit"] / use["cached_per_boundary"]
        out.append(f"  note: each round caches {use['cached_per_boundary']:,} samples per boundary "
                   f"but a block visit reads ~{use['read_per_visit']:,}: "
                   f"preinfer.sample_fraction ~ {frac:.2g} would cut pre-inference accordingly")  # fmt: skip
    if c.get("compare", {}).get("card_change_factor"):
        out.append(
            f"  card-change factor (full here / full on {c['compare']['card']}): "
            f"{c['compare']['card_change_factor']:.2f}; BCD here vs full there = "
            "same-device factor x card-change factor"
        )
    if "fit" in plan:
        out += ["", format_fit(plan["fit"])]
    return "\n".join(out)


def run_plan(cfg: Config, args) -> int:
    """`preinfer plan`: options from argparse (see add_plan_arguments), print, exit code 0."""
    import dataclasses
    import json

    o = PlanOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PlanOptions)})
    plan = build_plan(cfg, o)
    print(json.dumps(plan, indent=1, default=str) if o.json else format_plan(plan))
    return 0
