"""What a stage says and checks before it trains: the training precision, and the planner's
trainer-peak estimate against this machine's device (a warning, never a refusal)."""

from __future__ import annotations

from preinfer.checkpoint.store import Checkpoint
from preinfer.model.shape import model_shape
from preinfer.plan.guards import warn_trainer_memory
from preinfer.plan.memory import setup_for
from preinfer.run.config import Config
from preinfer.runtime.device import resolve_device, training_precision
from preinfer.schedule.rotation import VisitBudget


def precision_line(cfg: Config) -> str:
    """run.precision as resolved on this machine's device, with the reason."""
    name, why = training_precision(resolve_device(cfg.run.device), cfg.run.precision)
    return f"{name} ({why})"


def check_memory(
    cfg: Config, ckpt: Checkpoint, budget: VisitBudget, seq: int, *, mode: str,
    block: int | None = None, log=print,
) -> dict | None:  # fmt: skip
    """Say the training precision, and warn (never refuse) when the planner's trainer-peak
    estimate exceeds this machine's device (guards.warn_trainer_memory): the visit of `block`,
    or (None) the rotation's worst block, over the rows `budget` plans, S=`seq`. An estimate
    that fails is said, never raised: it must not stop a run. Returns the worst estimate."""
    log(f"  training precision: {precision_line(cfg)}")
    try:
        device = resolve_device(cfg.run.device)
        sh = model_shape(cfg.model)
        setup = setup_for(sh, cfg.train, cfg.cache, cfg.preinfer,
                          target="gpu" if device.type == "cuda" else "cpu", seq=seq,
                          token_rows=cfg.data.shard_rows, run_precision=cfg.run.precision,
                          budget=budget, cards=max(1, cfg.train.workers))  # fmt: skip
        return warn_trainer_memory(sh, ckpt.partition, setup, mode=mode, device=str(device),
                                   block=block, log=log)  # fmt: skip
    except Exception as e:  # an estimate must never stop a run
        log(f"  (no trainer memory estimate: {type(e).__name__}: {e})")
        return None
