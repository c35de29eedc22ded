"""Ray start-up and resource requests shared by the Ray stages.

Locally `ensure_ray()` starts a private Ray instance; under `ray job submit` (RAY_ADDRESS is
set) it joins the cluster the job runs on. The same command works both ways.
"""

from __future__ import annotations

import os

from preinfer.config import Config


def ensure_ray(verbose: bool = False, log=print) -> None:
    """Join the cluster of a Ray job, or start a private instance. verbose (run.verbose):
    worker processes' output and Ray's own log lines reach this terminal; otherwise they stay
    in Ray's session logs, whose directory is said once."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    address = os.environ.get("RAY_ADDRESS")
    kwargs = {"include_dashboard": False, "log_to_driver": verbose, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        # the private instance is this run's own: it reports no usage stats anywhere (read by
        # ray.init and by the processes it starts, so set before it)
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(**kwargs, runtime_env={"worker_process_setup_hook": _quiet_workers()})
    if not verbose:
        log(
            "  Ray's logs: /tmp/ray/session_latest/logs on each node (run.verbose=true shows them here)"
        )


# Ray Train's placement-group cleaner asks the state API whether the train controller is alive;
# the private instance runs without the dashboard that serves it, so it would warn every second
# of a training run (a cluster job has the dashboard, and keeps the warning)
_UNSERVED = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def _quiet_workers():
    """Setup hook of the private instance's worker processes (see _UNSERVED). A closure, so
    Ray ships its code by value: a worker need not import this module (a worker that cannot
    run its setup hook exits, and Ray would start it again and again)."""
    name = _UNSERVED

    def quiet() -> None:
        import logging

        logging.getLogger(name).setLevel(logging.ERROR)

    return quiet


def gpus_available() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def actor_resources(cfg: Config) -> dict:
    """num_gpus per actor when the cluster has GPUs, else fractional CPUs (keeps the read stage fed)."""
    if cfg.run.device != "cpu" and gpus_available():
        return {"num_gpus": cfg.preinfer.gpus_per_actor}
    return {"num_cpus": cfg.preinfer.cpus_per_actor}
