"""PrefixWorker: the pre-inference worker of `cache build` / `cache refresh` (a Ray actor,
or an object in the driver for a local build; pipelines/cache_build.py drives it).

It runs blocks [first, block) of the checkpoint over whole cache shards and writes them itself:
token ids (build) or the boundary-(block-1) cache (refresh) in, hidden states entering `block`
out, pipelined read / compute / write on two helper threads; with preinfer.write_queue > 0 a
third compresses each micro-batch's rows while the next micro-batch computes (a bounded queue),
so a shard's write is left only its index, checksum, write and commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from core import faults
from pipelines.ray_env import worker_config
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.prefix import forward_prefix
from preinfer.run.config import Config
from preinfer.runtime import hostmem
from preinfer.runtime.device import pin_threads, resolve_device, torch_dtype
from storage.cache import CacheWriter
from storage.reader import open_cache
from storage.values import decode

PHASES = ("read_s", "compute_s", "write_s")  # a shard's seconds: source rows, blocks, write_shard


class PrefixWorker:
    """Ray actor: runs blocks [first, block) of the checkpoint and writes whole cache shards.

    first = 0 (build, input = token ids) or block-1 (refresh, input = the boundary-(block-1)
    cache). Constructed once per actor from plain data (the config as `worker_payload` sends
    it, credentials from the environment; paths; the compute dtype the driver resolved, so
    every actor computes alike), or in this process from the Config itself. on_phase
    (in-process callers only, e.g. a memory benchmark; never sent to Ray): called with "load"
    once the weights are loaded, then per shard "input" when its input is in hand and
    "compute" after its forward.
    """

    def __init__(
        self,
        cfg: Config | dict,
        block: int,
        first: int,
        sources: dict[str, str],
        compute: str,
        round_to: str | None,
        source_rows: dict | None = None,
        pin: bool = True,
        on_phase: Callable[[str], None] | None = None,
    ):
        self.cfg = cfg if isinstance(cfg, Config) else worker_config(cfg)
        pin = pin and self.cfg.preinfer.malloc_mmap_threshold_mb > 0
        if pin:  # a worker process of its own (not the driver): its allocator is ours to set
            # the fp32 weights loaded and cast below go back to the OS when freed
            hostmem.pin_malloc(int(self.cfg.preinfer.malloc_mmap_threshold_mb * 2**20))
        self.block, self.first, self.sources = block, first, sources
        # refresh: fingerprint -> (N,) the source row of each row, where they differ (the
        # target holds fewer windows than its source); absent: row i is the source's row i
        self.source_rows = {k: np.asarray(v) for k, v in (source_rows or {}).items()}
        self.device = resolve_device(self.cfg.run.device)
        if self.device.type == "cpu":
            pin_threads()
        self.dtype = torch_dtype(compute)
        self.round_to = torch_dtype(round_to) if round_to else None
        ckpt = Checkpoint.open(self.cfg.run.checkpoint)
        self.model, self.adapter = ckpt.load(range(first, block), device=self.device)
        self.model.to(self.dtype).eval()
        # compute: glibc's largest (32 MiB) threshold, fixed, so per-micro-batch activations
        # come from the heap (mmap + page faults for each of them halved build throughput)
        if pin and hostmem.pinned() is not None:
            hostmem.pin_malloc(COMPUTE_MMAP_THRESHOLD)
        self.part = ckpt.partition
        self._open_writer = CacheWriter.open
        self._writers: dict[str, CacheWriter] = {}  # by fingerprint of the cache being written
        self._sources: dict = {}  # fingerprint -> open boundary-(block-1) cache (refresh)
        # [0] reads the next shard's input, [1] encodes + writes the last computed shard
        self._lock = threading.Lock()
        # [2] compresses computed micro-batches (write_queue > 0), at most write_queue queued
        names = ("input", "write", "encode")[: 3 if self.cfg.preinfer.write_queue else 2]
        self._helpers = [ThreadPoolExecutor(1, thread_name_prefix=n) for n in names]
        self._queue = threading.BoundedSemaphore(max(1, self.cfg.preinfer.write_queue))
        self.on_phase = on_phase
        if on_phase is not None:
            on_phase("load")

    def close(self) -> None:
        for h in self._helpers:
            h.shutdown(wait=True)

    @torch.inference_mode()
    def _compute(self, x: torch.Tensor, fp: str | None = None) -> tuple[torch.Tensor, list]:
        """(n, S) ids or (n, S, H) hidden -> (n, S, H) hidden entering `block`, in micro-batches,
        one block at a time: with round_to set, each block's output (B, S, H) is rounded to the
        stored dtype, so the hidden entering every block is what a cache of it would hold.
        With write_queue > 0 and `fp` given, also the futures of each micro-batch's compressed
        rows (CacheWriter.encode_rows), in order; the compute waits while write_queue of them
        are not yet compressed (so memory stays bounded when the writer is the slower)."""
        mb = self.cfg.preinfer.micro_batch
        stream = fp is not None and len(self._helpers) > 2
        writer = self._writer(fp) if stream else None
        outs, encoded = [], []
        for i in range(0, len(x), mb):
            xi = forward_prefix(self.adapter, self.part, x[i : i + mb].to(self.device), self.first,
                               self.block, dtype=self.dtype, round_to=self.round_to)  # fmt: skip
            outs.append(xi.cpu())
            if stream:
                self._queue.acquire()  # a slot in the bounded queue
                fut = self._helpers[2].submit(writer.encode_rows, outs[-1])
                fut.add_done_callback(lambda _: self._queue.release())
                encoded.append(fut)
        return torch.cat(outs), encoded

    def __call__(self, batch: dict) -> dict:
        """Compute and write the batch's shards; every one is written and committed (marker
        on disk) before this returns. Pipelined on two helper threads: the next shard's input
        is read (and decompressed) while this one computes, and a computed shard is encoded
        and written while the next computes (one in flight: memory stays ~3 shards)."""
        items = [(fp, int(s)) for fp, s in zip(batch["fingerprint"], batch["shard"], strict=True)]
        out = {k: [] for k in ("fingerprint", "shard", "rows", "seconds", "started", *PHASES)}
        writing: Future | None = None
        try:
            nxt = self._helpers[0].submit(self._input, *items[0])
            for j, (fp, shard) in enumerate(items):
                faults.shard_task_started(fp, shard)
                out["started"].append(time.time())  # wall clock: the driver finds start-up
                t0 = time.perf_counter()
                x, rows, read_s = nxt.result()
                if j + 1 < len(items):
                    nxt = self._helpers[0].submit(self._input, *items[j + 1])
                if self.on_phase is not None:
                    self.on_phase("input")
                t1 = time.perf_counter()
                hidden, encoded = self._compute(x, fp)
                t2 = time.perf_counter()
                if self.on_phase is not None:
                    self.on_phase("compute")
                if writing is not None:
                    out["write_s"].append(writing.result())  # the previous shard is committed
                writing = self._helpers[1].submit(self._write, fp, shard, hidden, encoded)
                out["fingerprint"].append(fp)
                out["shard"].append(shard)
                out["rows"].append(rows)
                out["seconds"].append(t2 - t0)  # + its write, below
                out["read_s"].append(read_s)
                out["compute_s"].append(t2 - t1)
            out["write_s"].append(writing.result())
            writing = None
        finally:
            if writing is not None:
                writing.exception()  # an error elsewhere: let the write finish (or fail) first
        out["seconds"] = [s + w for s, w in zip(out["seconds"], out["write_s"], strict=True)]
        return {k: np.asarray(v) for k, v in out.items()}

    def run(self, batch: dict) -> dict:
        """The actor method: one call of __call__."""
        return self(batch)

    def _writer(self, fp: str):
        with self._lock:  # the helper threads ask too
            if fp not in self._writers:
                self._writers[fp] = self._open_writer(self.cfg.cache.root, fp)
            return self._writers[fp]

    def _input(self, fp: str, shard: int) -> tuple[torch.Tensor, int, float]:
        """(input rows of shard `shard` of cache `fp`, their count, seconds): token ids (n, S)
        long for a build, boundary-(block-1) hidden (n, S, H) for a refresh."""
        t0 = time.perf_counter()
        start, stop = self._writer(fp).shard_range(shard)
        if self.first == 0:
            ids = self._writer(fp).read_input_ids(start, stop)
            x = torch.from_numpy(np.array(ids)).long()  # (n, S)
        else:
            x = self._read_source(fp, start, stop)  # (n, S, H) in the cache dtype
        return x, stop - start, time.perf_counter() - t0

    def _write(self, fp: str, shard: int, hidden: torch.Tensor, encoded: list) -> float:
        """Seconds this thread spent writing the shard (waiting for its last pieces to be
        compressed included); encoded: futures of its micro-batches' compressed rows."""
        t0 = time.perf_counter()
        pieces = [f.result() for f in encoded]
        whole = not pieces or any(p is None for p in pieces)  # a lossy cache: whole shards
        self._writer(fp).write_shard(shard, hidden, encoded=None if whole else pieces)
        return time.perf_counter() - t0

    def _read_source(self, fp: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the boundary-(block-1) cache as (n, S, H) in the cache dtype:
        its stored values only (no labels), a view of them when they are stored in that dtype
        (bf16 bits, fp16, fp32: no decode to fp32 and back)."""
        src = self._source(fp)
        m = self.source_rows.get(fp)
        if m is None:
            stored, scale = src.read_stored(start, stop)
            return decode(stored, scale, src.dtype, self.dtype)
        rows = m[start:stop]
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1  # runs of consecutive source rows
        parts = []
        for run in np.split(rows, cuts):
            stored, scale = src.read_stored(int(run[0]), int(run[-1]) + 1)
            parts.append(decode(stored, scale, src.dtype, self.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _source(self, fp: str):
        src_fp = self.sources[fp]
        if src_fp not in self._sources:
            self._sources[src_fp] = open_cache(
                self.cfg.cache.root, src_fp, expected_fingerprint=src_fp
            )
        return self._sources[src_fp]


COMPUTE_MMAP_THRESHOLD = 32 * 2**20
