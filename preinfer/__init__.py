"""The library: model adapters and partitioning, the checkpoint, the loss, the block trainer
(a visit), cache identity (which rows, which fingerprint), the memory / cost planner. Plain
torch: no Ray, no I/O beyond the checkpoint and the stores it is handed.

Public surface:

    from preinfer import load_config, Checkpoint, Visit, VisitSpec, VisitHooks
    cfg = load_config("configs/demo.yaml", ["train.lr=0.01"])
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    plans = plan_caches(cfg, block=1, create=False)   # the boundary-1 caches' fingerprints
"""

from preinfer.cache_identity import plan_caches, visit_budget
from preinfer.checkpoint import Checkpoint
from preinfer.config import Config, load_config
from preinfer.visit import Visit, VisitHooks, VisitSpec

__all__ = [
    "Checkpoint", "Config", "Visit", "VisitHooks", "VisitSpec", "load_config", "plan_caches",
    "visit_budget",
]  # fmt: skip
