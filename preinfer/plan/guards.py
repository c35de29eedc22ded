"""Resource guards run before a stage starts: cache bytes vs free disk, trainer memory vs device.

    check_disk_for_rotation(cache, train, budget, ...)  # `bcd`: the rotation's peak
    check_disk_for_boundary(cache, budget, K, ...)      # `cache build/refresh --block K`
    warn_trainer_memory(sh, part, setup, ...)          # `bcd`/`train`: a warning past the device
    check_init_memory(model_cfg)       # `init`: refused when the model does not fit in memory
    check_vocab(ckpt, store)           # init/bcd/train/cache build: ids the embedding can look up
    check_same_tokens(recorded, store) # bcd resume: the token store the rotation started on

Each takes the sections it reads and what the stage has open (the rows of a round: a
VisitBudget; hidden and S: the checkpoint's and the token store's). Sizes are estimates
(preinfer.plan.memory's arithmetic): the cache's uncompressed upper bound
(storage.layout.estimate_cache_bytes) divided by the codec's compression ratio as measured on a
complete cache of the same dtype/codec under cache.root, when there is one. `free_bytes` and
`device_bytes` are injectable for tests.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from core.config import ConfigError
from preinfer.model.partition import Partition
from preinfer.model.shape import ModelShape
from preinfer.plan.memory import GiB, Setup, trainer_memory
from preinfer.schedule.cache_identity import CachePlan
from preinfer.schedule.rotation import VisitBudget
from preinfer.train.config import TrainConfig
from storage import fs
from storage.atomic import human
from storage.config import CacheConfig
from storage.layout import (
    CacheError,
    committed_shards,
    estimate_cache_bytes,
    free_disk_bytes,
    rows_per_shard,
)
from storage.values import stored_dtype


class DiskSpaceError(CacheError):
    """The activation caches a stage would write do not fit the free disk."""


def measured_ratio(cache: CacheConfig) -> tuple[float, str] | None:
    """(median compression ratio, fingerprint of one cache it came from) over the complete caches
    under cache.root with this dtype, codec, shuffle and level; None if there are none."""
    root = Path(cache.root)
    found = []
    for m in sorted(root.glob("*/manifest.json")) if root.is_dir() else []:
        try:
            man = json.loads(m.read_text())
            codec = man["codec"]
            if man["dtype"] == cache.dtype and codec == {
                "codec": cache.codec,
                "shuffle": cache.shuffle,
                "level": cache.level,
            }:
                found.append((float(man["compression_ratio"]), man["fingerprint"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a cache of another layout or a damaged manifest: not a measurement
    if not found:
        return None
    med = statistics.median(r for r, _ in found)
    return med, min(found, key=lambda x: abs(x[0] - med))[1]


def cache_bytes(cache: CacheConfig, budget: VisitBudget, *, hidden: int, seq: int) -> dict:
    """Estimated bytes of one boundary's caches (the round's train rows + the val rows the
    evaluations read): the upper bound and the expected size (values / measured codec ratio),
    per split and in total."""
    ratio = measured_ratio(cache)
    n = {"train": budget.rows, "val": budget.val_rows}
    out = {"samples": sum(n.values()), "n": n, "upper_bound": 0, "expected": 0,
           "ratio": ratio and ratio[0], "ratio_source": ratio and ratio[1]}  # fmt: skip
    for split, k in n.items():
        bound = estimate_cache_bytes(k, seq, hidden, cache.dtype) if k else 0
        values = k * seq * hidden * stored_dtype(cache.dtype).itemsize
        out[split] = int(bound if ratio is None else bound - values + values / ratio[0])
        out["upper_bound"] += bound
        out["expected"] += out[split]
    return out


def check_disk_for_rotation(
    cache: CacheConfig, train: TrainConfig, budget: VisitBudget, *, hidden: int, seq: int,
    M: int, free_bytes: int | None = None,
) -> dict | None:  # fmt: skip
    """Raise DiskSpaceError when the bcd rotation's caches at their peak exceed the free disk
    at cache.root: two boundaries at once (a refresh's source and its target), or all M-1 with
    cache.keep or train.order descending (a round keeps every boundary until its block trains)
    or random (it may keep any a later visit of its round reads). Conservative on a resumed
    rotation: caches already on disk are not credited. Returns the figures; None where no
    boundary is built (M < 2; M = 2 ascending with train.prefix_adapters=last)."""
    # ascending with train.prefix_adapters=last: block M-1's visit reads tokens, no boundary M-1
    built = M - 1 - train.last_block_from_tokens
    if built < 1:
        return None
    per = cache_bytes(cache, budget, hidden=hidden, seq=seq)
    every = cache.keep or train.order in ("descending", "random")
    count = built if every else min(2, built)
    what = f"the bcd rotation ({count} boundaries at once)"
    return _check_free(cache, per, count * per["expected"], what, hidden, seq, free_bytes)


def check_disk_for_boundary(
    cache: CacheConfig, budget: VisitBudget, block: int, *, hidden: int, seq: int,
    plans: Sequence[CachePlan] | None = None, free_bytes: int | None = None,
) -> dict:  # fmt: skip
    """Raise DiskSpaceError when boundary `block`'s caches exceed the free disk at cache.root.
    Given `plans` (that boundary's cache plans), complete caches and committed shards are
    credited, so a resumed build needs only the rest. Returns the figures."""
    per = cache_bytes(cache, budget, hidden=hidden, seq=seq)
    need, what = per["expected"], f"boundary {block} (train + val)"
    if plans is not None:  # what is still to write: committed shards (done markers) count
        rps = rows_per_shard(seq, hidden, cache.dtype, cache.shard_mb)
        need = 0
        for p in plans:
            total = math.ceil(per["n"][p.split] / max(1, min(rps, per["n"][p.split])))
            if not p.complete and total:
                need += int(per[p.split] * max(0, total - _done(cache, p)) / total)
        what = f"the unwritten shards of boundary {block}"
    return _check_free(cache, per, need, what, hidden, seq, free_bytes)


def _check_free(cache: CacheConfig, per: dict, need: float, what: str, hidden: int, seq: int,
                free_bytes: int | None) -> dict:  # fmt: skip
    free = free_disk_bytes(cache.root) if free_bytes is None else int(free_bytes)
    basis = (
        f"codec ratio {per['ratio']:.2f} measured on cache {per['ratio_source'][:12]}"
        if per["ratio"]
        else "uncompressed upper bound: no cache of this codec measured yet"
    )
    out = {"need": need, "free": free, "per_boundary": per, "what": what}
    if need > free:
        raise DiskSpaceError(
            f"{what} needs about {human(need)} ({per['samples']} samples x S={seq} x H={hidden} "
            f"{cache.dtype}, {basis}) but only {human(free)} is free at {cache.root}; free "
            "disk, point cache.root at a larger disk, lower preinfer.sample_fraction or raise train.epochs, or store "
            "cache.dtype=int8 / fp8_e4m3 (see `preinfer plan`)"
        )
    return out


def _done(cache: CacheConfig, plan: CachePlan) -> int:
    """Shards of a cache plan already committed (done markers on disk)."""
    return committed_shards(fs.path(cache.root) / plan.fingerprint)


def warn_trainer_memory(
    sh: ModelShape, part: Partition, setup: Setup, *, mode: str, device: str,
    block: int | None = None, device_bytes: int | None = None, log=None,
) -> dict:  # fmt: skip
    """Warn (never refuse) when the estimated trainer peak of `setup` (preinfer.plan.memory.setup_for)
    exceeds the memory of `device` ("cuda:0", "cpu", ...): the worst block of the rotation (or
    `block`) for the bcd modes, the whole model for full. Returns that worst estimate
    (preinfer.plan.memory.trainer_memory's dict + device_bytes)."""
    import warnings

    if mode == "full":
        rows = [trainer_memory(sh, part, "full", 0, setup)]
    else:
        blocks = range(part.num_blocks) if block is None else [block]
        rows = [trainer_memory(sh, part, mode, k, setup) for k in blocks]
    worst = max(rows, key=lambda r: r["peak"])
    kind = device.split(":")[0]
    if device_bytes is None:
        if kind == "cuda":
            import torch

            device_bytes = torch.cuda.get_device_properties(device).total_memory
        else:
            import psutil

            device_bytes = psutil.virtual_memory().total
    worst = {**worst, "device_bytes": int(device_bytes)}
    if worst["peak"] > device_bytes:
        msg = (f"estimated trainer peak {worst['peak'] / GiB:.1f} GiB ({worst['stage']}, "
               f"{worst['phase']} phase) exceeds the {kind} device's "
               f"{device_bytes / GiB:.1f} GiB: expect out-of-memory; raise partition.num_blocks "
               "or lower train.batch_size / data.seq_len (`preinfer plan` shows the breakdown)")  # fmt: skip
        (log or (lambda m: warnings.warn(m, ResourceWarning, stacklevel=3)))(msg)
    return worst


def check_init_memory(model_cfg, *, available_bytes: int | None = None) -> dict:
    """Refuse (ConfigError, one line) a model `preinfer init` cannot build in the memory this
    process may allocate (hostmem.available), before it allocates: the planner's shape of it
    (a meta build) in fp32, as build_model makes it, plus its largest tensor once more (the
    peak measured while a tensor is initialised: 4 x (params + largest tensor) bytes).
    Returns {"need", "available", "params"}."""
    import torch

    from preinfer.model.shape import model_shape
    from preinfer.runtime import hostmem

    with torch.device("meta"):  # model_shape's meta build makes each parameter real first
        sh = model_shape(model_cfg)
    need = 4 * (sh.params + sh.max_tensor)
    free = hostmem.available() if available_bytes is None else int(available_bytes)
    out = {"need": need, "available": free, "params": sh.params}
    if need > free:
        raise ConfigError(
            f"model of {sh.params:,} parameters (model.vocab_size={sh.vocab:,}, hidden "
            f"{sh.hidden}, {len(sh.layers)} layers) needs about {need / GiB:.1f} GiB to "
            f"initialise (fp32), but only {free / GiB:.1f} GiB of memory is available here; "
            "lower model.vocab_size, hidden_size or num_layers (`preinfer plan` shows the sizes)"
        )
    return out


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
