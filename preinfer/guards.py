"""Resource guards run before a stage starts: cache bytes vs free disk, trainer memory vs device.

    check_disk_for_cache(cfg, block)   # `cache build/refresh --block K`: raises DiskSpaceError
    check_disk_for_cache(cfg)          # `bcd`: the rotation's peak (two boundaries, or M-1 kept)
    warn_trainer_memory(cfg)           # `bcd`/`train`: a warning when the estimate exceeds the device
    check_vocab(ckpt, store)           # init/bcd/train/cache build: ids the embedding can look up
    check_same_tokens(recorded, store) # bcd resume: the token store the rotation started on

Sizes are estimates (preinfer.memory.s arithmetic): the cache's uncompressed upper bound
(storage.cache.estimate_cache_bytes) divided by the codec's compression ratio as measured on a
complete cache of the same dtype/codec under cache.root, when there is one. `free_bytes` and
`device_bytes` are injectable for tests.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from core.config import ConfigError
from preinfer.cache_identity import visit_budget
from preinfer.checkpoint import Checkpoint
from preinfer.checkpoint_format import CheckpointError
from preinfer.device import resolve_device
from preinfer.memory import GiB, setup_for, trainer_memory
from preinfer.model_shape import model_shape
from preinfer.partition import partition_layers
from storage import fs
from storage.atomic import human
from storage.layout import (
    CacheError,
    committed_shards,
    estimate_cache_bytes,
    free_disk_bytes,
    rows_per_shard,
)
from storage.tokens import TokenStore
from storage.values import stored_dtype


class DiskSpaceError(CacheError):
    """The activation caches a stage would write do not fit the free disk."""


def measured_ratio(cfg) -> tuple[float, str] | None:
    """(median compression ratio, fingerprint of one cache it came from) over the complete caches
    under cache.root with this config's dtype, codec, shuffle and level; None if there are none."""
    import json

    root, want = Path(cfg.cache.root), cfg.cache
    found = []
    for m in sorted(root.glob("*/manifest.json")) if root.is_dir() else []:
        try:
            man = json.loads(m.read_text())
            codec = man["codec"]
            if man["dtype"] == want.dtype and codec == {
                "codec": want.codec,
                "shuffle": want.shuffle,
                "level": want.level,
            }:
                found.append((float(man["compression_ratio"]), man["fingerprint"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a cache of another layout or a damaged manifest: not a measurement
    if not found:
        return None
    med = statistics.median(r for r, _ in found)
    return med, min(found, key=lambda x: abs(x[0] - med))[1]


def cache_bytes(cfg, *, hidden: int, seq: int, n_train: int, n_val: int) -> dict:
    """Estimated bytes of one boundary's caches (train sample + val): the upper bound and the
    expected size (values / measured codec ratio), per split and in total."""

    ratio = measured_ratio(cfg)
    budget = visit_budget(cfg, n_train, n_val)
    n = {"train": budget.rows, "val": budget.val_rows}
    out = {"samples": sum(n.values()), "n": n, "upper_bound": 0, "expected": 0,
           "ratio": ratio and ratio[0], "ratio_source": ratio and ratio[1]}  # fmt: skip
    for split, k in n.items():
        bound = estimate_cache_bytes(k, seq, hidden, cfg.cache.dtype) if k else 0
        values = k * seq * hidden * stored_dtype(cfg.cache.dtype).itemsize
        out[split] = int(bound if ratio is None else bound - values + values / ratio[0])
        out["upper_bound"] += bound
        out["expected"] += out[split]
    return out


def _dims(cfg) -> tuple[int, int, int, int, int] | None:
    """(hidden, seq, n_train, n_val, M) from the checkpoint and token store; None if absent."""

    if not TokenStore.exists(cfg.data.out_dir):
        return None  # the stage itself reports the missing token store
    store = TokenStore(cfg.data.out_dir)
    try:
        ckpt = Checkpoint.open(cfg.run.checkpoint)
        hidden, M = ckpt.hidden_size, ckpt.num_blocks
    except CheckpointError:
        hidden, M = model_shape(cfg.model).hidden, cfg.partition.num_blocks
    return hidden, store.seq_len, store.num_samples("train"), store.num_samples("val"), M


def check_disk_for_cache(cfg, block: int | None = None, *, mode: str | None = None, plans=None,
                         free_bytes: int | None = None) -> dict | None:  # fmt: skip
    """Raise DiskSpaceError when the caches about to be written exceed the free disk at
    cache.root. block=K: the boundary-K caches; given `plans` (that boundary's CachePlan list
    from pipelines.preinfer, create=False is enough) complete caches and committed shards are
    credited, so a resumed build needs only the rest. block=None: the bcd rotation's peak, two
    boundaries at once (the refresh source and its target), or all M-1 with cache.keep or
    train.order=descending; a mode (default train.mode) other than bcd writes no caches.
    Conservative on a resumed rotation: caches already on disk are not credited. Returns the
    figures, or None when there is nothing to check (no token store yet: the stage itself
    reports that)."""

    dims = _dims(cfg)
    if dims is None:
        return None
    hidden, seq, n_tr, n_val, M = dims
    per = cache_bytes(cfg, hidden=hidden, seq=seq, n_train=n_tr, n_val=n_val)
    if block is None:
        if (mode or cfg.train.mode) != "bcd" or M < 2:
            return None
        # descending order keeps every boundary of a round until its block trains
        # (random may keep any boundary a later visit of its round reuses)
        every = cfg.cache.keep or cfg.train.order in ("descending", "random")
        count = M - 1 if every else min(2, M - 1)
        need, what = count * per["expected"], f"the bcd rotation ({count} boundaries at once)"
    elif plans is not None:  # what is still to write: committed shards (done markers) count
        rps = rows_per_shard(seq, hidden, cfg.cache.dtype, cfg.cache.shard_mb)
        need = 0
        for p in plans:
            total = math.ceil(per["n"][p.split] / max(1, min(rps, per["n"][p.split])))
            if not p.complete and total:
                need += int(per[p.split] * max(0, total - _done(cfg, p)) / total)
        what = f"the unwritten shards of boundary {block}"
    else:
        need, what = per["expected"], f"boundary {block} (train + val)"
    free = free_disk_bytes(cfg.cache.root) if free_bytes is None else int(free_bytes)
    basis = (
        f"codec ratio {per['ratio']:.2f} measured on cache {per['ratio_source'][:12]}"
        if per["ratio"]
        else "uncompressed upper bound: no cache of this codec measured yet"
    )
    out = {"need": need, "free": free, "per_boundary": per, "what": what}
    if need > free:
        raise DiskSpaceError(
            f"{what} needs about {human(need)} ({per['samples']} samples x S={seq} x H={hidden} "
            f"{cfg.cache.dtype}, {basis}) but only {human(free)} is free at {cfg.cache.root}; free "
            "disk, point cache.root at a larger disk, lower preinfer.sample_fraction or raise train.epochs, or store "
            "cache.dtype=int8 / fp8_e4m3 (see `preinfer plan`)"
        )
    return out


def _done(cfg, plan) -> int:
    """Shards of a CachePlan already committed (done markers on disk)."""
    return committed_shards(fs.path(cfg.cache.root) / plan.fingerprint)


def warn_trainer_memory(cfg, *, mode: str | None = None, block: int | None = None,
                        device_bytes: int | None = None, log=None) -> dict:  # fmt: skip
    """Warn (never refuse) when the estimated trainer peak exceeds the device's memory: the
    worst block of the rotation (or `block`) for the bcd modes, the whole model for full.
    Returns that worst estimate (preinfer.memory.trainer_memory's dict + device_bytes)."""
    import warnings

    mode = mode or cfg.train.mode
    device = resolve_device(cfg.run.device)
    dims = _dims(cfg)
    n_tr, n_val = (dims[2], dims[3]) if dims else (None, None)
    sh = model_shape(cfg.model)
    try:  # the checkpoint's own partition when there is one
        part = Checkpoint.open(cfg.run.checkpoint).partition
    except CheckpointError:
        part = partition_layers(list(sh.layers), sh.embed, sh.head, cfg.partition.num_blocks)
    cards = max(1, cfg.train.workers)
    p = setup_for(cfg, sh, target="gpu" if device.type == "cuda" else "cpu", cards=cards,
                  seq=dims[1] if dims else None, n_train=n_tr, n_val=n_val)  # fmt: skip
    if mode == "full":
        rows = [trainer_memory(sh, part, "full", 0, p)]
    else:
        blocks = range(part.num_blocks) if block is None else [block]
        rows = [trainer_memory(sh, part, mode, k, p) for k in blocks]
    worst = max(rows, key=lambda r: r["peak"])
    if device_bytes is None:
        if device.type == "cuda":
            import torch

            device_bytes = torch.cuda.get_device_properties(device).total_memory
        else:
            import psutil

            device_bytes = psutil.virtual_memory().total
    worst = {**worst, "device_bytes": int(device_bytes)}
    if worst["peak"] > device_bytes:
        msg = (f"estimated trainer peak {worst['peak'] / GiB:.1f} GiB ({worst['stage']}, "
               f"{worst['phase']} phase) exceeds the {device.type} device's "
               f"{device_bytes / GiB:.1f} GiB: expect out-of-memory; raise partition.num_blocks "
               "or lower train.batch_size / data.seq_len (`preinfer plan` shows the breakdown)")  # fmt: skip
        (log or (lambda m: warnings.warn(m, ResourceWarning, stacklevel=3)))(msg)
    return worst


def check_vocab(ckpt, store) -> None:
    """Refuse, in the driver, a token store whose ids the checkpoint's embedding cannot look up
    (else an IndexError inside a worker) or whose samples exceed the model's positions."""
    check_dims(ckpt.index["dims"], store, ckpt.path)


def check_dims(dims: dict, store, where) -> None:
    """check_vocab on a checkpoint's "dims" (vocab_size, max_positions), before it is written."""
    vocab, max_pos = dims["vocab_size"], dims.get("max_positions")
    if store.vocab_size > vocab:
        raise ConfigError(
            f"the token store at {store.path} has {store.vocab_size} tokens but the checkpoint "
            f"{where} embeds {vocab}: its ids would index past the embedding. "
            f"Re-tokenize with data.vocab_size <= {vocab} (or the model's own "
            f"tokenizer), or init the model with model.vocab_size >= {store.vocab_size}"
        )
    if max_pos is not None and store.seq_len > max_pos:
        raise ConfigError(
            f"the token store's S={store.seq_len} is larger than the model's {max_pos} positions; "
            "lower data.seq_len and re-tokenize"
        )


# what a token store's identity is made of, as its manifest records it (named when it changes)
_DATA_KEYS = ("source", "text_field", "hf_split", "max_documents", "tokenizer", "vocab_size",
              "seq_len", "val_fraction", "split_seed")  # fmt: skip


def token_record(store) -> dict:
    """What a run keeps of the token store it trains on (state.json's "tokens")."""
    m = store.manifest
    data = (m.get("config") or {}).get("data") or {}
    return {
        "fingerprint": store.fingerprint,
        "path": str(store.path),
        "vocab_size": store.vocab_size,
        "seq_len": store.seq_len,
        "counts": m.get("counts"),
        "tokenizer_sha256": m.get("tokenizer_sha256"),
        "data": {k: data.get(k) for k in _DATA_KEYS},
    }


def token_changes(recorded: dict, store) -> str:
    """What differs between the token store `recorded` (a token_record) names and `store`, as
    their manifests tell it ("data.max_documents 8 -> 6; samples ... -> ...")."""
    now = token_record(store)
    old_data, new_data = recorded.get("data") or {}, now["data"]
    changed = [f"data.{k} {old_data.get(k)!r} -> {new_data[k]!r}" for k in _DATA_KEYS
               if k in old_data and old_data.get(k) != new_data[k]]  # fmt: skip
    for k, what in (("vocab_size", "tokenizer vocab"), ("seq_len", "S"), ("counts", "samples")):
        if recorded.get(k) != now[k]:
            changed.append(f"{what} {recorded.get(k)} -> {now[k]}")
    if recorded.get("tokenizer_sha256") != now["tokenizer_sha256"]:
        changed.append("tokenizer.json differs")
    return "; ".join(changed) or "other corpus text or split"


def check_same_tokens(recorded: dict, store, where: str) -> None:
    """Refuse to go on training over a token store other than the one `recorded` (a
    token_record) names: a re-tokenize since (other corpus, tokenizer or vocab) gives ids that
    mean something else to the weights trained so far. `where`: the file holding the record."""
    if recorded.get("fingerprint") == store.fingerprint:
        return
    raise ConfigError(
        f"the token store changed under this run: {where} says it started on tokens "
        f"{str(recorded.get('fingerprint'))[:12]} ({recorded.get('path')}), but {store.path} now "
        f"holds {store.fingerprint[:12]} ({token_changes(recorded, store)}); "
        "the weights trained so far would read ids that now mean something else. Re-tokenize "
        "back (`preinfer tokenize --force` with the data settings the run started with), or "
        "start over in a fresh run.dir"
    )
