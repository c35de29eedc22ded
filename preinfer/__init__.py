"""The library: plain torch, no Ray, no I/O beyond the checkpoint and the stores it is handed.
Its sub-packages, bottom to top (each imports only those before it; tests/test_layers.py):

    runtime/     the process and its device (dtype, host memory, memory stats, metrics)
    model/       the model and its blocks: HF adapters, partition, shapes, prefix forward, loss
    data/        text to token rows: corpus readers, tokenization, packing, chat template
    checkpoint/  the checkpoint's store and format, the initial checkpoint, optimizer state, export
    train/       how one block is trained: train.*, the optimizer step, batches, suffix adapters
    schedule/    which block reads which rows when: the rotation, VisitPlan, the cache identity
    plan/        what a run costs and whether it fits: memory, cost model, guards, writer budget
    run/         a run: the root config, a visit's loop and its state, the run dir's lock and
                 state, the `preinfer plan` report

Public surface:

    from preinfer import load_config, plan_visit, visit_budget, Checkpoint, Visit, VisitSpec
    cfg = load_config("configs/demo.yaml", ["train.lr=0.01"])
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    budget = visit_budget(cfg.train, cfg.preinfer.sample_fraction, n_train, n_val)
    plan = plan_visit(cfg.train, budget, ckpt.num_blocks, 0, 1)   # block 1's visit of round 0
    plan.window, plan.cache_window   # its rows; with sources= (cache_identity.Sources): its caches
"""

from preinfer.checkpoint.store import Checkpoint
from preinfer.run.config import Config, load_config
from preinfer.run.visit import Visit, VisitHooks, VisitSpec
from preinfer.schedule.rotation import visit_budget
from preinfer.schedule.visit_plan import VisitPlan, plan_visit

__all__ = [
    "Checkpoint", "Config", "Visit", "VisitHooks", "VisitPlan", "VisitSpec", "load_config",
    "plan_visit", "visit_budget",
]  # fmt: skip
