"""Visits that commit without diverging but do not learn (issue #53: a pretraining run with a
suffix lr 10x too high sat at the unigram level from its first steps, every visit committed and
nothing said so; the divergence guard catches NaN and inf only).

Two flags per visit, for every lever:
- **rose**: its val loss ends above the loss it started from by more than RISE (the start: the
  previous visit's val loss; the first visit's, the loss of its first step, taken before any
  update of the run);
- **unigram**: its val loss sits within NEAR_UNIGRAM of the unigram level or above it: the
  loss of a model that predicts the train split's token frequencies and ignores the context,
  on the val rows the visits evaluate (`unigram_record`: computed once per token store and kept
  in state.json, with the train split's unigram entropy).

A flag is a warning in the log, the run's summary and the report; nothing is refused (a first
visit of a pretraining run may sit near the unigram level and be fine: the flags say so once,
then it is the later visits' that matter).
"""

from __future__ import annotations

import math

import numpy as np

RISE = 0.01
"""A visit's val loss above its start by more than this fraction of the start: flagged."""
NEAR_UNIGRAM = 0.01
"""A val loss above (1 - this) x the unigram level: flagged. Measured (H4, /tmp/notes/H4-measure.md):
a tiny LLaMA pretraining at suffix_lr 10x sat 0.2-1% above the level in all three visits; the
healthy runs' visits ended 0.5-7% below it, the first visit (40 steps) closest."""
MAX_TOKENS = 1 << 24
"""Train targets the unigram counts read at most: WINDOWS runs of rows evenly spaced over the
split beyond that (a few shards each, not every shard of a large store)."""
WINDOWS = 16


def _targets(store, split: str, start: int, stop: int) -> np.ndarray:
    """Target ids of rows [start, stop): ids[:, 1:] (the next token), or the stored labels
    where the store has them (response-only losses, masked LM); IGNORE (< 0) left out."""
    if store.has_labels:
        t = store.read_with_labels(split, start, stop)[1]
    else:
        t = store.read(split, start, stop)[:, 1:]
    return t[t >= 0].astype(np.int64)


def _target_rows(store, split: str, rows: np.ndarray) -> np.ndarray:
    if store.has_labels:
        t = store.read_indices_with_labels(split, rows)[1]
    else:
        t = store.read_indices(split, rows)[:, 1:]
    return t[t >= 0].astype(np.int64)


def train_counts(store, max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """(V,) int64 counts of the train split's targets (all of them up to max_tokens, else
    WINDOWS evenly spaced runs of rows that hold max_tokens together)."""
    n, S = store.num_samples("train"), max(store.seq_len, 1)
    cap = max(1, max_tokens // S)
    if n <= cap:
        runs = [(0, n)]
    else:
        w = max(1, cap // WINDOWS)
        runs = [(a, a + w) for a in np.linspace(0, n - w, WINDOWS).astype(np.int64).tolist()]
    counts = np.zeros(store.vocab_size, dtype=np.int64)
    for a, b in runs:
        for i in range(a, b, 4096):
            t = _targets(store, "train", i, min(b, i + 4096))
            counts += np.bincount(t, minlength=len(counts))[: len(counts)]
    return counts


def unigram_record(store, val_rows: np.ndarray) -> dict:
    """What state.json keeps, once per token store:
    entropy: nats of the train split's target unigram distribution;
    loss: the loss that distribution (counts + 0.5: a token train never holds is not infinite)
    scores on `val_rows`, the val rows a visit's evaluation reads: the level its val loss is
    compared with (the same rows, so a harder val subset is no false flag)."""
    counts = train_counts(store)
    total = int(counts.sum())
    if not total:
        return {"fingerprint": store.fingerprint, "entropy": None, "loss": None, "val_rows": 0}
    p = counts[counts > 0] / total
    logq = np.log((counts + 0.5) / (total + 0.5 * len(counts)))
    t = _target_rows(store, "val", np.asarray(val_rows, dtype=np.int64))
    loss = float(-logq[t].mean()) if len(t) else None
    return {"fingerprint": store.fingerprint, "entropy": float(-(p * np.log(p)).sum()),
            "loss": loss, "val_rows": int(len(val_rows))}  # fmt: skip


def _num(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def visit_flags(val_loss, start_loss, unigram) -> list[str]:
    """The flags of one visit, as phrases ([] = none)."""
    out = []
    if _num(val_loss) and _num(start_loss) and val_loss > start_loss * (1 + RISE):
        out.append(f"val loss rose from {start_loss:.3f} to {val_loss:.3f}")
    if _num(val_loss) and _num(unigram) and val_loss > unigram * (1 - NEAR_UNIGRAM):
        out.append(
            f"val loss {val_loss:.3f} is at or above the unigram level ({unigram:.3f}: token "
            "frequencies, no context)"
        )
    return out


def flag_visits(visits: list[dict], unigram) -> dict[str, list[str]]:
    """visit key -> its flags, for the visits that have any. visits: in training order, each
    {"key", "val_loss", "first_loss"} (first_loss: the loss of the visit's first step)."""
    out, prev = {}, None
    for i, v in enumerate(visits):
        start = prev if i else v.get("first_loss")
        if flags := visit_flags(v.get("val_loss"), start, unigram):
            out[v["key"]] = flags
        if _num(v.get("val_loss")):
            prev = v["val_loss"]
    return out


def advice(flags: dict[str, list[str]]) -> str:
    """One line for the end of a run whose visits have flags."""
    keys = ", ".join(flags)
    return (
        f"{len(flags)} visit(s) did not learn ({keys}): their val loss rose or sits at the "
        "unigram level (a short pretraining's first visit may, and recover). If later visits do "
        "too, lower train.lr or train.suffix_lr (try half) and rerun in a fresh run.dir"
    )
