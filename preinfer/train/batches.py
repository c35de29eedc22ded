"""Training batches of a visit: from the token store (TokenBatches) or from an activation cache
(CacheBatches, over a whole cache or a visit's CacheWindow of it), in an order fixed by (seed,
round, block, epoch) and the same from either source where the cache fits its shuffle buffer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from core import faults
from core.config import ConfigError
from preinfer.model.loss import split_sample
from preinfer.train.config import TrainConfig
from storage.dataset import CacheDataset, reads_whole
from storage.values import decode, stored_dtype


def epoch_order(n: int, seed: int, e: int, shuffle: bool) -> np.ndarray:
    """Positions 0..n-1 in epoch e's order: a permutation drawn from (seed, e), or as they are.
    Token and whole-cache batches both draw it, so a visit reads the same batches from either."""
    return np.random.default_rng([seed, e]).permutation(n) if shuffle else np.arange(n)


def rank_rows(order: np.ndarray, step: int, batch_size: int, rank: int, world: int) -> np.ndarray:
    """(batch_size / world,) this rank's entries of global batch `step` of `order`, as drawn."""
    return order[step * batch_size : (step + 1) * batch_size][rank::world]


class TokenBatches:
    """Batches of (input_ids (b, S), labels (b, S)) from a token store split; labels[:, t] is
    position t's target (loss.split_sample: the next token, or an mlm store's unshifted labels)."""

    def __init__(
        self,
        store,
        split: str,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        indices: np.ndarray | None = None,
    ):
        self.store, self.split = store, split
        self.rows = np.arange(store.num_samples(split)) if indices is None else np.asarray(indices)
        if len(self.rows) < batch_size:
            raise ConfigError(
                f"train.batch_size ({batch_size}) is larger than the {split} split "
                f"({len(self.rows)} samples); lower train.batch_size or use more data"
            )
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.shuffle = shuffle
        self.steps_per_epoch = len(self.rows) // batch_size

    def epoch(self, e: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.rows[epoch_order(len(self.rows), self.seed, e, self.shuffle)]
        for s in range(self.steps_per_epoch):
            mine = rank_rows(order, s, self.batch_size, self.rank, self.world)
            srt = np.argsort(mine, kind="stable")  # the store reads ascending rows
            rows = np.empty((len(mine), self.store.seq_len + 1), np.int32)
            labels = np.empty((len(mine), self.store.seq_len), np.int32)  # IGNORE where masked
            rows[srt], labels[srt] = self.store.read_indices_with_labels(self.split, mine[srt])
            yield split_sample(rows, labels)


class CacheBatches:
    """Batches of (hidden (b, S, H) fp32, labels (b, S)) from an activation cache split (the
    labels the cache build copied from the token store, aligned as TokenBatches').

    A shuffled epoch of a cache whose stored values fit the shuffle buffer (`buffer_mb`) reads
    it whole once and draws TokenBatches' batches (epoch_order, rank_rows): a visit from its
    cache then trains on the batches that recomputing its prefix would, step for step. A larger
    cache streams through storage.dataset.CacheDataset (shard order, then a buffer shuffle),
    and an unshuffled one (evaluation) reads in row order either way. Under DDP each rank
    reads and holds the whole window (it fits the buffer) and decodes only its own rows."""

    def __init__(
        self,
        cache,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        dtype: torch.dtype = torch.float32,
        buffer_mb: float = TrainConfig.shuffle_buffer_mb,
    ):
        n = cache.num_samples
        if n < batch_size:
            raise ConfigError(
                f"train.batch_size ({batch_size}) is larger than the cache ({n} samples); "
                "lower train.batch_size"
            )
        self.cache, self.batch_size, self.seed = cache, batch_size, seed
        self.rank, self.world, self.shuffle, self.dtype = rank, world, shuffle, dtype
        self.buffer_mb = buffer_mb  # the shuffle buffer, see storage.reader.CacheDataset
        self.steps_per_epoch = n // batch_size
        row_bytes = cache.seq_len * cache.hidden_size * stored_dtype(cache.dtype).itemsize
        self.fits = reads_whole(n, row_bytes, buffer_mb)  # then every rank holds all n rows
        self._whole = None  # (values (n, S, H) stored, scale (n, S) | None, labels (n, S))

    def epoch(self, e: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.shuffle and self.fits:
            yield from self._drawn(e)
            return

        ds = CacheDataset(
            self.cache,
            batch_size=self.batch_size // self.world,
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world,
            dtype=self.dtype,
            buffer_mb=self.buffer_mb,
            drop_last=True,
        )
        ds.set_epoch(e)
        for i, (hidden, labels) in enumerate(ds):
            if i >= self.steps_per_epoch:
                break
            yield hidden, labels

    def _drawn(self, e: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._whole is None:  # kept for the visit's later epochs
            n = self.cache.num_samples
            values, scale = self.cache.read_stored(0, n)
            self._whole = values, scale, self.cache.read_labels(0, n)[0]
        values, scale, labels = self._whole
        order = epoch_order(len(labels), self.seed, e, True)
        for s in range(self.steps_per_epoch):
            ix = rank_rows(order, s, self.batch_size, self.rank, self.world)
            faults.read_gate()
            sc = None if scale is None else scale[ix]
            yield decode(values[ix], sc, self.cache.dtype, self.dtype), labels[torch.from_numpy(ix)]


class CacheWindow:
    """Rows [start, start + n) of a Cache, wrapping at its end (a visit's window of its round's
    rows, rotation.visit_window), with the reads CacheDataset makes. Its shards are the
    cache's shards cut at the window's ends, so a shard read is never more than one of the
    cache's; a read spanning them is joined."""

    def __init__(self, cache, start: int, n: int):
        N = cache.num_samples
        if not (0 <= start < N and 0 < n <= N):
            raise ConfigError(f"window [{start}, +{n}) does not fit a cache of {N} rows")
        self.cache, self.num_samples = cache, n
        self.seq_len, self.hidden_size, self.dtype = cache.seq_len, cache.hidden_size, cache.dtype
        self.rows_per_shard = cache.rows_per_shard
        runs = [(start, min(N, start + n))] + ([(0, start + n - N)] if start + n > N else [])
        self._runs = []  # (window row, cache row, rows): the contiguous pieces of the window
        self._shards = []  # (window start, window stop) of each shard piece
        w = 0
        for a, b in runs:
            self._runs.append((w, a, b - a))
            s = a
            while s < b:
                e = min(b, (s // self.rows_per_shard + 1) * self.rows_per_shard)
                self._shards.append((w + s - a, w + e - a))
                s = e
            w += b - a
        self.num_shards = len(self._shards)

    def shard_range(self, i: int) -> tuple[int, int]:
        return self._shards[i]

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        out = []
        for w, a, n in self._runs:
            lo, hi = max(start, w), min(stop, w + n)
            if lo < hi:
                out.append((a + lo - w, a + hi - w))
        return out

    def read_stored(self, start: int, stop: int):
        got = [self.cache.read_stored(a, b) for a, b in self._pieces(start, stop)]
        if len(got) == 1:
            return got[0]
        sc = [g[1] for g in got]
        return np.concatenate([g[0] for g in got]), (None if sc[0] is None else np.concatenate(sc))

    def read_labels(self, start: int, stop: int):
        got = [self.cache.read_labels(a, b) for a, b in self._pieces(start, stop)]
        return torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])


def endless(batches, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Cycle epochs forever, skipping the first `start_step` batches (for a resumed visit)."""
    e, skip = divmod(start_step, batches.steps_per_epoch)
    while True:
        for i, b in enumerate(batches.epoch(e)):
            if i >= skip:
                yield b
        e, skip = e + 1, 0
