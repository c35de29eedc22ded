"""Ray start-up, resource requests and worker payloads shared by the Ray stages.

Locally `ensure_ray()` starts a private Ray instance; under `ray job submit` (RAY_ADDRESS is
set) it joins the cluster the job runs on. The same command works both ways.

A worker process (a pre-inference actor, a Ray Train worker) gets the config as plain data
without the storage credentials (`worker_payload`: Ray keeps actor arguments and task payloads
where they can be read back, logged or persisted); the credentials reach it in its environment
(`credentials_env`) and `worker_config` puts them back. The private instance's processes
inherit them from this process when it starts; elsewhere they go as runtime_env env_vars
(`runtime_env_vars`), which Ray's runtime_env agent writes to its log on each node (a cluster
is better given credentials by its nodes: role, AWS_* variables; storage.key/secret null).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Iterator

from preinfer.run.config import Config, config_from_dict
from storage.config import credential_env, with_env_credentials

# the private instance this process started (its node id) and the environment variables its
# processes got from this process at its start
_inherited: dict = {"node": None, "env": {}}


def ensure_ray(verbose: bool = False, log=print, env: dict[str, str] | None = None) -> None:
    """Join the cluster of a Ray job, or start a private instance. verbose (run.verbose):
    worker processes' output and Ray's own log lines reach this terminal; otherwise they stay
    in Ray's session logs, whose directory is said once. env (credentials_env): variables a
    private instance's processes inherit (set in this process only while it starts)."""
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
        # Ray Train's preemption watcher (an observer of cloud nodes going away; a single node
        # has none) is an actor built from object-store references with restarts on, which
        # Ray logs as an error line for every training run
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        inherit = {k: v for k, v in (env or {}).items() if os.environ.get(k, v) == v}
        added = [k for k in inherit if k not in os.environ]
        os.environ.update(inherit)  # the raylet copies this environment, its workers its own
        try:
            ray.init(**kwargs, runtime_env={"worker_process_setup_hook": _quiet_workers()})
        finally:
            for k in added:
                os.environ.pop(k, None)
        _inherited.update(node=ray.get_runtime_context().get_node_id(), env=inherit)
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


def runtime_env_vars(env: dict[str, str]) -> dict[str, str]:
    """What of `env` a worker's runtime_env must carry: what its processes did not inherit
    (everything, on a cluster or a Ray started before these values were known)."""
    import ray

    own = ray.is_initialized() and ray.get_runtime_context().get_node_id() == _inherited["node"]
    got = _inherited["env"] if own else {}
    return {k: v for k, v in env.items() if got.get(k) != v}


def worker_payload(cfg: Config) -> dict:
    """The config as sent to a worker process: plain data, storage credentials masked."""
    return cfg.to_dict()


def credentials_env(cfg: Config) -> dict[str, str]:
    """The environment variables that carry the storage credentials to a worker process."""
    return credential_env(cfg.storage)


def worker_config(payload: dict) -> Config:
    """The Config a worker rebuilds from `worker_payload`'s data: storage credentials from its
    environment (credentials_env), so its s3:// reads and writes sign as the driver's do."""
    return config_from_dict({**payload, "storage": with_env_credentials(payload.get("storage"))})


IN_FLIGHT = 2  # calls queued per actor: the next one starts the moment the last returns


def map_over_actors(
    cls: type, kwargs: dict, calls: list, *, actors: int, method: str, options: dict
) -> Iterator:
    """Every `method(call)` over a pool of `actors` Ray actors of `cls`; yields each call's
    result as it returns (any order).

    Plain actors built from `kwargs` (small plain data): Ray passes such arguments by value, so
    an actor that dies is restarted (options: max_restarts, max_task_retries, runtime_env,
    resources) from its own copy. Ray Data's actor pool hands its actors object-store
    references instead, which a restart may find gone (Ray logs an error line for every such
    actor). A call whose actor died for good (restarts spent) goes to another actor; the error
    is raised once no actor is left. An error a call raised (a full disk in an actor: an
    OSError naming its file) is raised as itself, as the same code in this process would
    raise it, not as Ray's wrapper of it (whose OSError has no errno and whose message is a
    traceback), so callers tell a full disk or a bad input from a bug. The actors are killed
    when the calls are done or fail."""
    import ray

    pool = [ray.remote(cls).options(**options).remote(**kwargs) for _ in range(actors)]
    live = set(range(len(pool)))
    todo = deque(calls)
    pending: dict = {}  # ObjectRef -> (actor index, call)

    def submit(i: int, call) -> None:
        pending[getattr(pool[i], method).remote(call)] = (i, call)

    try:
        for _ in range(IN_FLIGHT):
            for i in range(len(pool)):
                if todo:
                    submit(i, todo.popleft())
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i, call = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, Exception):
                    raise cause from e  # the actor's own error; Ray's (its traceback) chained
                raise
            except ray.exceptions.ActorDiedError:
                live.discard(i)
                if not live:
                    raise
                load = {j: 0 for j in live}
                for j, _ in pending.values():
                    if j in load:
                        load[j] += 1
                submit(min(load, key=load.get), call)
                continue
            yield result
            if todo and i in live:
                submit(i, todo.popleft())
    finally:
        for actor in pool:
            ray.kill(actor)
        _settle(list(pending))


def _settle(refs: list) -> None:
    """Wait (briefly) for the calls still in flight when the pool stops, errors included: an
    error result dropped unread makes Ray print it later with its traceback ("Unhandled
    error"), after the one line the CLI prints for the error that stopped the pool."""
    import ray

    if not refs:
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
    for ref in ready:
        with contextlib.suppress(Exception):
            ray.get(ref)
