"""The step/FLOP cost model: matmul FLOPs per token of each kind of step, and of a whole run.

Units: FLOPs per token, 2 per multiply-add, backward = 2 x forward (input gradients + weight
gradients, 1 x forward each). A BCD step of block k runs the suffix k..M-1 forward, input
gradients back through it, and weight gradients of block k only; with the cache it starts at
boundary k, recomputing it adds the prefix forward. A round of the rotation pre-infers every
cached row through blocks 0..M-2 once (boundary 1 built from tokens, each later boundary
refreshed from the one before).
"""

from __future__ import annotations

from dataclasses import dataclass

from preinfer.model.shape import ModelShape, model_shape
from preinfer.schedule.rotation import VisitBudget, rotation_steps


@dataclass(kw_only=True)
class Flops:
    """Matmul FLOPs per token (2 per multiply-add; backward = 2 x forward)."""

    sh: ModelShape
    part: object
    seq: int

    def _fwd(self, layers) -> float:
        H, S = self.sh.hidden, self.seq
        return sum(2 * self.sh.layers[j] + 4 * S * H for j in layers)

    def full(self) -> float:
        layers = range(self.part.num_layers)
        return 3 * (self._fwd(layers) + 2 * self.sh.head_matrix)

    def bcd(self, k: int, whole: bool = False, head_trains: bool | None = None) -> float:
        """Suffix forward + input gradients through it + weight gradients of block k only
        (whole: a visit that runs its prefix from tokens, train.prefix_adapters=last: every
        layer's forward and input gradients). head_trains: whether the visit computes the LM-head
        matrix's weight gradient; None = where the matrix's block is k (tied: block 0's, the
        embedding; untied: block M-1's)."""
        M, part = self.part.num_blocks, self.part
        suffix = range(0 if whole else part.blocks[k][0], part.num_layers)
        fwd = self._fwd(suffix) + 2 * self.sh.head_matrix
        matrix_tr = (k == M - 1 and not self.sh.tied) or (k == 0 and self.sh.tied)
        if head_trains is not None:
            matrix_tr = head_trains
        wgrad = self._fwd(part.layers(k)) + (2 * self.sh.head_matrix if matrix_tr else 0)
        return 2 * fwd + wgrad

    def prefix(self, k: int) -> float:
        """Forward of blocks 0..k-1 (what bcd-recompute reruns on every step of block k)."""
        return self._fwd(range(self.part.blocks[k][0])) if k else 0.0

    def preinfer(self, k: int) -> float:
        """Refresh of boundary k: block k-1's forward per cached token."""
        return self._fwd(self.part.layers(k - 1))


def block_step_costs(fl: Flops, train) -> list[float]:
    """Matmul FLOPs per token of each block's bcd step from its boundary, block 0 first (what
    train.visit_steps=cost shares a round's steps by): Flops.bcd, with the LM-head matrix's
    weight gradient where the visit computes it (tied: block 0's, unless train.freeze holds
    embed; untied: block M-1's, and every visit's under train.always_train [head])."""
    M = fl.part.num_blocks
    if fl.sh.tied:
        trains = [k == 0 and "embed" not in train.freeze for k in range(M)]
    else:
        trains = [k == M - 1 or "head" in train.always_train for k in range(M)]
    return [fl.bcd(k, head_trains=t) for k, t in enumerate(trains)]


def visit_steps(cfg, part, budget: VisitBudget, rounds: int | None = None) -> list[list[int]]:
    """rotation.rotation_steps of `cfg` (a run config) over partition `part`: every bcd visit's
    steps, [round][position] (`rounds` of them; None = train.rounds); train.visit_steps=cost
    prices each block's step by block_step_costs at data.seq_len."""
    costs = None
    if cfg.train.visit_steps == "cost":
        fl = Flops(sh=model_shape(cfg.model), part=part, seq=cfg.data.seq_len)
        costs = block_step_costs(fl, cfg.train)
    return rotation_steps(cfg.train, budget, part.num_blocks, costs, rounds=rounds)


def run_flops(
    fl: Flops,
    mode: str,
    visits: list[tuple[int, int]],
    *,
    tokens_per_step: int,
    cached_rows: int = 0,
    val_rows: int = 0,
    whole: frozenset[int] = frozenset(),
) -> dict:
    """Predicted FLOPs of a run: `visits` = [(block, steps)] in order (full: [(0, steps)]);
    bcd: each block-0 visit starts a round, whose rows (train + val) are pre-inferred through
    blocks 0..M-2 once. `whole`: blocks whose visits run from tokens and read no boundary
    (ascending with train.prefix_adapters=last: {M-1}). Returns the total and the
    pre-inference part."""
    S = fl.seq
    train = pre = 0.0
    for k, steps in visits:
        bcd = fl.bcd(k, k in whole)
        per = {
            "full": fl.full(),
            "bcd": bcd,
            "bcd-recompute": bcd + (0 if k in whole else fl.prefix(k)),
        }
        train += steps * tokens_per_step * per[mode]
        # boundary k made current before block k's visit (none for a visit from tokens)
        if mode == "bcd" and k > 0 and k not in whole:
            pre += fl.preinfer(k) * (cached_rows + val_rows) * S
    return {"total": train + pre, "train": train, "preinfer": pre}


# ---------------------------------------------------------------------------- the cache writer

WRITER_MB_PER_CORE_S: dict[str, float] = {
    "none": 547.0,
    "zstd-1": 341.0,
    "zstd-3": 323.0,
    "blosc-zstd-1 byte": 257.0,
    "blosc-zstd-3 byte": 112.0,
}
"""Cache writer throughput, MB (1e6) of stored values per CPU core-second, by codec key
(writer_key): the median "MB per core-second" of bench/writer.py to a local disk, 1 encoder
thread, bf16 H=4096 (docs/writer.md). What one core copies, compresses, checksums and writes."""

WRITER_SOURCE = "bench/writer.py, local disk, 2-CPU Xeon under load (writer-20261201.json)"
"""Where WRITER_MB_PER_CORE_S comes from."""


def writer_key(codec: str, level: int, shuffle: str) -> str:
    """The key of WRITER_MB_PER_CORE_S for a cache codec: none, zstd-<level>, blosc-zstd-<level>
    <shuffle>."""
    if codec == "none":
        return "none"
    return f"zstd-{level}" if codec == "zstd" else f"blosc-zstd-{level} {shuffle}"


def writer_cores(
    tokens_per_s: float, hidden: int, bytes_per_value: float, mb_per_core_s: float
) -> dict:
    """Cores one device's pre-inference output needs: tokens/s x H x bytes per stored value =
    MB/s to encode and write, over what one core writes per second."""
    mb_s = tokens_per_s * hidden * bytes_per_value / 1e6
    return {"tokens_per_s": tokens_per_s, "mb_s": mb_s, "mb_per_core_s": mb_per_core_s,
            "cores": mb_s / mb_per_core_s}  # fmt: skip
