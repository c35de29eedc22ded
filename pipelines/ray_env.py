"""Ray start-up and resource requests shared by the Ray stages.

Locally `ensure_ray()` starts a private Ray instance; under `ray job submit` (RAY_ADDRESS is
set) it joins the cluster the job runs on. The same command works both ways.
"""

from __future__ import annotations

import os

from preinfer.config import Config


def ensure_ray() -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    address = os.environ.get("RAY_ADDRESS")
    kwargs = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(**kwargs)


def gpus_available() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def actor_resources(cfg: Config) -> dict:
    """num_gpus per actor when the cluster has GPUs, else fractional CPUs (keeps the read stage fed)."""
    if cfg.run.device != "cpu" and gpus_available():
        return {"num_gpus": cfg.preinfer.gpus_per_actor}
    return {"num_cpus": cfg.preinfer.cpus_per_actor}
