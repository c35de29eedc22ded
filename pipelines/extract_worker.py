"""LayerWorker: the worker of `preinfer cache extract` (a Ray actor, or an object in the driver
for a local extract; pipelines/extract.py drives it).

It loads the embedding and layers 0..max(L)-1 of the checkpoint once, runs them over whole
shards of the token rows, ONE forward per shard for every layer, and writes each shard of every
layer cache that lacks it itself (the caches the driver created: CacheWriter.open). A shard's
write runs on a helper thread while the next shard computes (one in flight), and a shard's
record is given back only once its done marker is on disk, so a killed worker loses no
committed shard and a rerun recomputes only the shards without a marker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pipelines.ray_env import worker_config
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import Adapter
from preinfer.run.config import Config
from preinfer.runtime.device import pin_threads, resolve_device, torch_dtype
from storage.cache import CacheWriter

RECORD = ("shard", "rows", "forward_s", "write_s", "wait_s")  # per shard: rows, seconds


@torch.inference_mode()
def layer_states(adapter: Adapter, ids: torch.Tensor, layers: tuple[int, ...]) -> list:
    """(B, S) ids -> [hidden (B, S, H) entering layer L for L in layers], one pass through
    embed and layers 0..max(layers)-1 (the later layers and the head never run)."""
    adapter.require_loaded("embed")
    x = adapter.embed(ids)  # (B, S, H): entering layer 0
    out = {0: x}
    top = max(layers)
    ctx = adapter.context(x) if top > 0 else {}
    for i in range(top):
        adapter.require_loaded("layers", i)
        x = adapter.layer(i, x, ctx)  # (B, S, H): entering layer i + 1
        if i + 1 in layers:
            out[i + 1] = x
    return [out[L] for L in layers]


def load_layers(ckpt: Checkpoint, top: int, device, dtype) -> Adapter:
    """The model with only the blocks holding embed and layers 0..top-1 loaded."""
    part = ckpt.partition
    last = part.block_of_layer(top - 1) if top > 0 else 0
    model, adapter = ckpt.load(range(last + 1), device=device)
    model.to(dtype).eval()
    return adapter


class LayerWorker:
    """Runs the forward to the deepest of `fingerprints`' layers over whole shards and writes
    each layer's shard. Built from plain data (the config as ray_env.worker_payload sends it;
    fingerprints: layer -> the fingerprint of its cache, created by the driver; the compute
    dtype the driver resolved, so every worker computes alike), or from the Config itself."""

    def __init__(self, cfg: Config | dict, fingerprints: dict[int, str], compute: str):
        self.cfg = cfg if isinstance(cfg, Config) else worker_config(cfg)
        self.device = resolve_device(self.cfg.run.device)
        if self.device.type == "cpu":
            pin_threads()
        self.layers = tuple(sorted(int(x) for x in fingerprints))
        ckpt = Checkpoint.open(self.cfg.run.checkpoint)
        self.adapter = load_layers(ckpt, max(self.layers), self.device, torch_dtype(compute))
        root = self.cfg.cache.root
        self.writers = {x: CacheWriter.open(root, fingerprints[x]) for x in self.layers}
        self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="extract-write")

    def close(self) -> None:
        self._write_pool.shutdown(wait=True)

    def stream(self, shards, lacks) -> Iterator[dict]:
        """Compute and write shards in order; yields each shard's record (RECORD) once all its
        layers' shards are committed. lacks: (n_shards, n_layers) bool, which layers (in
        self.layers' order) lack each shard (only those are written)."""
        first = self.writers[self.layers[0]]  # every writer has the same rows and shard size
        mb = self.cfg.preinfer.micro_batch
        pending: tuple[Future, dict] | None = None
        try:
            for shard, lack in zip(shards, lacks, strict=True):
                a, b = first.shard_range(int(shard))
                x = torch.from_numpy(np.array(first.read_input_ids(a, b))).long()  # (n, S)
                t0 = time.perf_counter()
                parts = [layer_states(self.adapter, x[j : j + mb].to(self.device), self.layers)
                         for j in range(0, len(x), mb)]  # fmt: skip
                hidden = [torch.cat([p[k].cpu() for p in parts]) for k in range(len(self.layers))]
                del parts
                rec = {"shard": int(shard), "rows": b - a, "forward_s": time.perf_counter() - t0}
                todo = [(self.writers[x], h)
                        for x, h, w in zip(self.layers, hidden, lack, strict=True) if w]  # fmt: skip
                if pending is not None:
                    yield _done(*pending)  # the previous shard is committed
                pending = (self._write_pool.submit(_write, int(shard), todo), rec)
            if pending is not None:
                last, pending = pending, None
                yield _done(*last)
        finally:
            if pending is not None:
                pending[0].exception()  # an error elsewhere: let the write finish (or fail) first

    def __call__(self, call: dict) -> dict:
        """One call (a Ray task): {"shard": (n,), "lacks": (n, n_layers)} -> RECORD arrays, one
        entry per shard, every shard committed before this returns."""
        recs = list(self.stream(call["shard"], call["lacks"]))
        return {k: np.asarray([r[k] for r in recs]) for k in RECORD}

    def run(self, call: dict) -> dict:
        """The actor method: one call of __call__."""
        return self(call)


def _done(future: Future, rec: dict) -> dict:
    """The record of a shard whose write was submitted, once it is committed; wait_s: the time
    the compute stood waiting for that write (0 while the writer keeps up)."""
    t0 = time.perf_counter()
    write_s = future.result()
    return {**rec, "write_s": write_s, "wait_s": time.perf_counter() - t0}


def _write(shard: int, todo: list) -> float:
    t0 = time.perf_counter()
    for writer, hidden in todo:
        writer.write_shard(shard, hidden)
    return time.perf_counter() - t0
