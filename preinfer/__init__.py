"""The library: model adapters and partitioning, the checkpoint, the loss, the block trainer
(a visit), cache identity (which rows, which fingerprint), the memory / cost planner. Plain
torch: no Ray, no I/O beyond the checkpoint and the stores it is handed.

Public surface:

    from preinfer import load_config, plan_visit, visit_budget, Checkpoint, Visit, VisitSpec
    cfg = load_config("configs/demo.yaml", ["train.lr=0.01"])
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    budget = visit_budget(cfg.train, cfg.preinfer.sample_fraction, n_train, n_val)
    plan = plan_visit(cfg.train, budget, ckpt.num_blocks, 0, 1)   # block 1's visit of round 0
    plan.window, plan.cache_window   # its rows; with sources= (cache_identity.Sources): its caches
"""

from preinfer.checkpoint import Checkpoint
from preinfer.config import Config, load_config
from preinfer.rotation import visit_budget
from preinfer.visit import Visit, VisitHooks, VisitSpec
from preinfer.visit_plan import VisitPlan, plan_visit

__all__ = [
    "Checkpoint", "Config", "Visit", "VisitHooks", "VisitPlan", "VisitSpec", "load_config",
    "plan_visit", "visit_budget",
]  # fmt: skip
