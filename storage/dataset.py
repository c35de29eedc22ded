"""`CacheDataset`: a complete cache as a torch IterableDataset (shard-ordered reads, a
byte-budgeted shuffle buffer, DDP rank / DataLoader worker splits with equal step counts).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from core import faults
from storage.identity import ExtractSpec, check_identity
from storage.layout import CacheError
from storage.values import decode, stored_dtype

if TYPE_CHECKING:
    from storage.reader import Cache


def rank_pieces(n: int, order: list[tuple[int, int]], begin: int, end: int):
    """Row ranges of stream positions [begin, end); the stream = `order`'s ranges, wrapped."""
    out, bounds, acc = [], [], 0
    for a, b in order:
        bounds.append((acc, a, b))
        acc += b - a
    for lap in range(begin // n, (end - 1) // n + 1 if end > begin else 0):
        for p0, a, b in bounds:
            lo, hi = max(begin, lap * n + p0), min(end, lap * n + p0 + b - a)
            if lo < hi:
                out.append((a + lo - lap * n - p0, a + hi - lap * n - p0))
    return out


DEFAULT_BUFFER_MB = 64.0


class CacheDataset(torch.utils.data.IterableDataset):
    """Batches (hidden [B, S, H] in `dtype`, labels [B, S] long) from a Cache, DDP-aware.

    Each epoch the shard order is permuted with (seed, epoch) — identically on every rank —
    giving a stream of N rows. Rank r takes the contiguous stream slice [r*L, (r+1)*L):
      drop_last=True : L = N // world_size, and only whole batches (the tail is dropped);
      drop_last=False: L = ceil(N / world_size); the stream wraps to its start to pad, so up
                       to world_size-1 rows repeat; the last batch may be short.
    Every rank therefore yields the same number of batches (len(self)). Within a rank, the
    batches are split contiguously between DataLoader workers.

    Shuffling: rows fill a buffer of `buffer_mb` MB of *stored* values (bf16 stays 2 bytes a
    value; only each batch is decoded to `dtype`), at least one shard and one batch, at most
    the rank's rows. When it is full it is permuted with a (seed, epoch, rank, worker) seed
    and emptied batch by batch, so a batch mixes rows of every shard the buffer holds (the
    whole split when it fits: a global shuffle). Pre-inference writes train caches in a
    seeded random row order, so even one shard mixes the whole corpus; a cache in document
    order read through a one-shard buffer gives batches of neighbouring documents, which
    train measurably worse (docs/quality.md, 'Cache batch order'). `buffer_size` (rows)
    overrides `buffer_mb`;
    without shuffle the buffer is one shard (the order does not depend on it). The next shard
    range is read on a helper thread while the last one is buffered and decoded (`prefetched`).
    expect: the identity the caller expects (storage/identity.py); a cache that differs is
    refused. Call set_epoch before iterating; DataLoader workers copy the dataset when they start, so
    use persistent_workers=False (the default) or the epoch will not reach them.
    """

    def __init__(
        self,
        cache: Cache,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        buffer_size: int | None = None,
        buffer_mb: float = DEFAULT_BUFFER_MB,
        dtype=torch.float32,
        drop_last: bool = False,
        expect: ExtractSpec | dict | None = None,
    ):
        if expect is not None:  # IdentityMismatch: one line (a CacheWindow has no manifest)
            check_identity(cache.manifest, expect, str(cache.dir))
        if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise CacheError(f"bad batch_size/rank/world_size {batch_size}/{rank}/{world_size}")
        if buffer_size is not None and buffer_size <= 0 or buffer_mb <= 0:
            raise CacheError(f"bad shuffle buffer: {buffer_size} rows / {buffer_mb} MB")
        self.cache, self.batch_size, self.shuffle, self.seed = cache, batch_size, shuffle, seed
        self.rank, self.world_size, self.dtype, self.drop_last = rank, world_size, dtype, drop_last
        self.epoch = 0
        n = cache.num_samples
        self.rows_per_rank = n // world_size if drop_last else math.ceil(n / world_size)
        self.num_batches = (
            self.rows_per_rank // batch_size
            if drop_last
            else math.ceil(self.rows_per_rank / batch_size)
        )
        if self.num_batches == 0:
            raise CacheError(
                f"{n} samples cannot make one batch of {batch_size} on each of {world_size} "
                "ranks with drop_last=True; lower batch_size or set drop_last=False"
            )
        row_bytes = cache.seq_len * cache.hidden_size * stored_dtype(cache.dtype).itemsize
        self.buffer_size = buffer_rows(
            row_bytes, cache.rows_per_shard, batch_size, self.rows_per_rank, buffer_size, buffer_mb
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_batches

    def plan(self, worker: int = 0, num_workers: int = 1) -> list[tuple[int, int]]:
        """Row ranges (in stream order) this rank's `worker` reads this epoch."""
        c, b = self.cache, self.batch_size
        shards = list(range(c.num_shards))
        if self.shuffle:
            shards = np.random.default_rng([self.seed, self.epoch]).permutation(shards).tolist()
        b0 = worker * self.num_batches // num_workers
        b1 = (worker + 1) * self.num_batches // num_workers
        rows = min(b1 * b, self.rows_per_rank) if not self.drop_last else b1 * b
        base = self.rank * self.rows_per_rank
        order = [c.shard_range(i) for i in shards]
        return rank_pieces(c.num_samples, order, base + b0 * b, base + rows)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        seed = np.random.SeedSequence([self.seed, self.epoch, self.rank, wid]).generate_state(1)
        rng = torch.Generator().manual_seed(int(seed[0]))
        plan = self.plan(wid, nw)
        c, rps = self.cache, self.cache.rows_per_shard
        cap = min(self.buffer_size, max(1, sum(b - a for a, b in plan)))  # this worker's rows
        buf: list | None = None  # [values (cap, S, H) stored dtype, scale (cap, S) | None]
        labels = torch.empty((cap, c.seq_len), dtype=torch.long)  # (cap, S) paired with buf
        held = 0
        reads = [(s, min(b, (s // rps + 1) * rps)) for a, b in plan for s in _cuts(a, b, rps)]
        for v, sc, lab in prefetched(c, reads):  # each range within one shard, read ahead
            off = 0
            while off < len(v):  # into the buffer's free rows
                k = min(len(v) - off, cap - held)
                if buf is None:
                    buf = [np.empty((cap, *v.shape[1:]), v.dtype), None]
                    if sc is not None:
                        buf[1] = np.empty((cap, *sc.shape[1:]), sc.dtype)
                buf[0][held : held + k] = v[off : off + k]
                if sc is not None:
                    buf[1][held : held + k] = sc[off : off + k]
                labels[held : held + k] = lab[off : off + k]
                held, off = held + k, off + k
                if held == cap:
                    held = yield from self._flush(buf, labels, held, rng, final=False)
            del v, sc, lab
        if held:
            yield from self._flush(buf, labels, held, rng, final=True)

    def _flush(self, buf, labels, held: int, rng, *, final: bool):
        """Yield batches of the buffer's first `held` rows; move the remainder to the front."""
        order = torch.randperm(held, generator=rng) if self.shuffle else torch.arange(held)
        full = held if final else held // self.batch_size * self.batch_size
        for s in range(0, full, self.batch_size):
            idx = order[s : s + self.batch_size]
            if self.shuffle:  # a gather: fresh arrays
                ix = idx.numpy()
                v, lbl = buf[0][ix], labels[idx]
                sc = buf[1][ix] if buf[1] is not None else None
            else:  # contiguous rows: copies, never views of the buffer (it is refilled)
                rows = slice(s, s + len(idx))
                v, lbl = buf[0][rows].copy(), labels[rows].clone()
                sc = buf[1][rows].copy() if buf[1] is not None else None
            faults.read_gate()
            yield decode(v, sc, self.cache.dtype, self.dtype), lbl
        rest = order[full:held]
        if len(rest):
            ix = rest.numpy()
            buf[0][: len(ix)] = buf[0][ix]
            if buf[1] is not None:
                buf[1][: len(ix)] = buf[1][ix]
            labels[: len(ix)] = labels[rest]
        return len(rest)


def _cuts(a: int, b: int, rps: int) -> range:
    """Starts of the pieces of rows [a, b) cut at shard boundaries (shards of rps rows)."""
    return range(a, b, rps) if a % rps == 0 else [a, *range((a // rps + 1) * rps, b, rps)]


def prefetched(cache: Cache, reads: list[tuple[int, int]]):
    """(stored values, scale | None, labels [n, S] long) of each row range, in order. The next
    range is read on a helper thread while the caller works on this one, so the disk (or the
    object store) reads while the buffer is filled and batches are decoded; one read is in
    flight at a time, so the Cache is never read by two threads at once. Memory: two ranges."""
    if not reads:
        return

    def read(s: int, e: int):
        return (*cache.read_stored(s, e), cache.read_labels(s, e)[0])

    with ThreadPoolExecutor(1, thread_name_prefix="cache-read") as pool:
        nxt = pool.submit(read, *reads[0])
        try:
            for j in range(len(reads)):
                cur = nxt.result()
                nxt = pool.submit(read, *reads[j + 1]) if j + 1 < len(reads) else None
                yield cur
                del cur
        finally:
            if nxt is not None:
                nxt.cancel() or nxt.exception()  # a stopped reader: let the read end first


def reads_whole(rows: int, row_bytes: int, mb: float) -> bool:
    """Whether `rows` stored rows of `row_bytes` fit a shuffle buffer of `mb` MB: a reader
    then holds them all (preinfer.train.batches.CacheBatches draws its batches from them)."""
    return rows * row_bytes <= mb * 2**20


def buffer_rows(
    row_bytes: int,
    rows_per_shard: int,
    batch_size: int,
    rows_per_rank: int | None,
    rows: int | None,
    mb: float,
) -> int:
    """Rows of a CacheDataset's shuffle buffer (also the planner's estimate of it): `rows`,
    else `mb` of stored values (`row_bytes` a row) but never below one shard (a shard is read
    whole); never below one batch, never above the rank's rows (None: not known)."""
    if rows is None:
        rows = max(int(mb * 2**20 // row_bytes), rows_per_shard)
    if rows_per_rank is not None:
        rows = min(rows, rows_per_rank)
    return max(batch_size, rows)
