"""The planner turned around (`preinfer plan --fit`): given a card's memory, which precision,
per-card batch and M make a model train, and what a step costs.

The search is the memory model's (preinfer/plan/memory.py) over the settings preinfer's trainer
runs: precision fp32 or amp-bf16 (autocast; fp32 weights and optimizer state), the per-card
batch halved from the planned one down to 1, and M from 1 to one layer per block. For each
precision it keeps the largest batch that fits (more tokens per step, fewer steps) and, at that
batch, the fewest blocks (each block switch costs a cache build and a visit's warm-up); the
best of the precisions is the one with the larger batch, the fewer blocks, the faster step. Where
nothing fits it says what the smallest setting (batch 1, one layer per block) would need.
Step times are FLOP estimates (FLOPs / (card peak x MFU)), as the plan's cost lines are.
"""

from __future__ import annotations

import dataclasses

from preinfer.model.partition import partition_layers
from preinfer.model.shape import ModelShape
from preinfer.plan.costmodel import Flops
from preinfer.plan.memory import Setup, smallest_fitting_m, trainer_memory

GiB = 2**30
FIT_PRECISIONS = ("fp32", "amp-bf16")  # what the trainer runs (pure bf16 is a what-if)


def _batches(batch: int) -> list[int]:
    """batch, batch / 2, ..., 1 (rounded up)."""
    out = [batch]
    while out[-1] > 1:
        out.append((out[-1] + 1) // 2)
    return out


def _step_s(sh: ModelShape, m: int, p: Setup, peak_flops: float | None, mfu: float):
    """FLOP-estimated seconds per step of a BCD rotation (the mean over its M visits) and of
    full training, at p's per-card batch; None without a peak (cpu)."""
    if not peak_flops:
        return None, None
    part = partition_layers(list(sh.layers), sh.embed, sh.head, m)
    fl, tok = Flops(sh=sh, part=part, seq=p.seq), p.batch * p.seq
    bcd = sum(fl.bcd(k) for k in range(m)) / m
    return bcd * tok / (peak_flops * mfu), fl.full() * tok / (peak_flops * mfu)


def fit_search(sh: ModelShape, p: Setup, card_bytes: float, peaks: dict, mfu: float) -> dict:
    """Per precision: the largest per-card batch (<= p.batch) at which BCD fits card_bytes, its
    smallest M, whether full training fits at that batch, and the FLOP-estimated step times.
    `peaks`: precision -> the card's peak FLOP/s in it (or None). With nothing fitting at a
    precision: what batch 1 with one layer per block needs."""
    L, rows = len(sh.layers), []
    whole = partition_layers(list(sh.layers), sh.embed, sh.head, 1)  # full training's one block
    for prec in FIT_PRECISIONS:
        row = {"precision": prec, "fits": False}
        for b in _batches(p.batch):
            q = dataclasses.replace(p, precision=prec, batch=b)
            sm = smallest_fitting_m(sh, q, card_bytes)
            if sm is None:
                continue
            full = trainer_memory(sh, whole, "full", 0, q)["peak"]
            bcd_s, full_s = _step_s(sh, sm["M"], q, peaks.get(prec), mfu)
            row.update(fits=True, batch=b, M=sm["M"], peak=sm["peak"],
                       worst_stage=sm["worst_stage"], full_peak=full,
                       full_fits=full <= card_bytes, bcd_step_s=bcd_s, full_step_s=full_s,
                       tokens_per_step=b * p.seq)  # fmt: skip
            break
        if not row["fits"]:  # the least any setting needs: batch 1, one layer per block
            q = dataclasses.replace(p, precision=prec, batch=1)
            part = partition_layers(list(sh.layers), sh.embed, sh.head, L)
            worst = max((trainer_memory(sh, part, "bcd", k, q) for k in range(L)),
                        key=lambda r: r["peak"])  # fmt: skip
            row.update(needs=worst["peak"], needs_stage=worst["stage"])
        rows.append(row)
    fitting = [r for r in rows if r["fits"]]
    # the best: the largest batch, then the fewest blocks, then the faster step (known on a
    # card with a datasheet peak), then fp32 (listed first: no autocast rounding)
    best = max(fitting, key=lambda r: (r["batch"], -r["M"], -(r["bcd_step_s"] or 0.0)),
               default=None)  # fmt: skip
    return {"card_bytes": card_bytes, "planned_batch": p.batch, "seq": p.seq,
            "optimizer": p.optimizer, "cards": p.world, "rows": rows,
            "best": None if best is None else {k: best[k] for k in ("precision", "batch", "M")}}  # fmt: skip


def format_fit(fit: dict) -> str:
    """The --fit lines of the human report."""
    out = [f"fit    what trains in {fit['card_bytes'] / GiB:.1f} GiB per card ({fit['optimizer']}; "
           f"per-card batch from {fit['planned_batch']} halved to 1, S {fit['seq']}; the largest "
           "batch that fits, then the fewest blocks; step times FLOP-estimated)"]  # fmt: skip
    for r in fit["rows"]:
        if not r["fits"]:
            out.append(f"  {r['precision']:9s} nothing fits: batch 1 with one layer per block "
                       f"needs {r['needs'] / GiB:.1f} GiB ({r['needs_stage']})")  # fmt: skip
            continue
        t = ("" if r["bcd_step_s"] is None else
             f"; ~{r['bcd_step_s']:.2f} s/step ({r['tokens_per_step'] / r['bcd_step_s']:,.0f} "
             f"tokens/s), full ~{r['full_step_s']:.2f} s/step")  # fmt: skip
        full = "fits" if r["full_fits"] else f"does not fit ({r['full_peak'] / GiB:.1f} GiB)"
        out.append(f"  {r['precision']:9s} batch {r['batch']:>3d}: bcd M={r['M']} fits "
                   f"(worst {r['worst_stage']}, {r['peak'] / GiB:.1f} GiB); full {full}{t}")  # fmt: skip
    b = fit["best"]
    if b is None:
        out.append("  best: none; block 0's visit holds every weight of the model (fp32), so "
                   "more cards do not lower it: a card with the memory above, or a smaller model")  # fmt: skip
    else:
        prec = "bf16" if b["precision"] == "amp-bf16" else "fp32"
        out.append(f"  best: --set run.precision={prec} partition.num_blocks={b['M']} "
                   f"train.batch_size={b['batch'] * fit['cards']}")  # fmt: skip
    return "\n".join(out)
