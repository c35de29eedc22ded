"""Stage `preinfer bcd`: rounds x blocks (train.order), each block fed from its cache.

For block K > 0 (mode bcd): reuse the boundary-K cache if its fingerprint matches the
checkpoint as it is now; else refresh it from boundary K-1 when that cache is current (one
block of compute); else build it from tokens. Then train block K and commit it. Boundary K-1's
cache is dropped once boundary K exists unless cache.keep. `<run.dir>/state.json` records
finished visits, so a killed run resumes at the right block (and, through the visit's own
state file, at the right step). It also records the token store the rotation started on: a
re-tokenize since (other corpus, tokenizer, vocab) is refused, not trained on. One run per
run.dir: the rotation holds `<run.dir>/.lock` (preinfer/run/lock.py) throughout.

train.order=random trains a permutation per round drawn from (train.seed, round) and recorded
in state.json ("block_orders"); each visit makes its boundary current as ascending does, and
boundaries below it that a later visit of the round reads are made on the way and kept.

train.order=descending trains blocks M-1..0 in each round. No block before K changes until
block 0 trains, so every boundary cache of the round stays current: the round starts by making
boundaries 1..M-1 current (build 1, refresh 2 from 1, ..., the same compute as ascending's), then
trains M-1..1 from them and block 0 from tokens, dropping each boundary once its block is trained
(unless cache.keep). state.json records the order (and train.schedule): a run.dir keeps them.

--mode full trains every parameter from tokens for rounds x M x max_steps steps (the same
number of optimizer steps as the BCD rotation); --mode bcd-recompute rotates without caches.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path

from core.config import ConfigError
from pipelines.cache_build import (
    build_boundary,
    damaged_shards,
    open_sources,
    refresh_allowed,
    refresh_boundary,
)
from pipelines.train import run_train
from preinfer.checkpoint.format import CheckpointError
from preinfer.checkpoint.store import Checkpoint
from preinfer.plan.costmodel import visit_steps
from preinfer.plan.guards import (
    check_disk_for_rotation,
    check_same_tokens,
    check_vocab,
    token_record,
)
from preinfer.run.config import Config, case_note
from preinfer.run.health import advice, flag_visits, unigram_record
from preinfer.run.lock import run_lock
from preinfer.run.preflight import check_memory
from preinfer.run.provenance import check_settings
from preinfer.run.state import (
    check_run,
    checkpoint_hash,
    checkpoint_record,
    restore_if_untrained,
    save_run_state,
    snapshot_records,
    state_path,
)
from preinfer.run.visit import TrainingDiverged, VisitHooks, finish_committed
from preinfer.runtime import hostmem
from preinfer.runtime.metrics import append_metrics, last_visit_summary, read_metrics
from preinfer.schedule.cache_identity import BoundaryPlan, Sources
from preinfer.schedule.rotation import round_orders, sample_indices, store_budget
from preinfer.schedule.visit_plan import VisitPlan, plan_visit
from storage import fs
from storage.atomic import dir_bytes, write_json
from storage.layout import CacheError, check_fingerprint, is_complete
from storage.lease import describe, remove_unless_used
from storage.tokens import TokenStore, TokenStoreError


def _event(cfg: Config, state: dict, **rec) -> None:
    rec = {"time": time.time(), **rec}
    state["events"].append(rec)
    append_metrics(cfg.run.dir, {"event": "cache", **rec}, tensorboard=cfg.run.tensorboard)


def ensure_cache(
    cfg: Config, state: dict, src: Sources, plan: VisitPlan, bp: BoundaryPlan, log=print
) -> tuple[str, dict[str, str]]:
    """Make boundary bp.boundary's caches current, as `plan` (the visit they are made for)
    planned them: ('reused' | 'repaired' | 'refreshed' | 'built', their fingerprints by split).
    Refreshed from the boundary below (bp.source) when that one is current, else built from
    tokens. src: the checkpoint and token store the plan was made against."""
    t0 = time.perf_counter()
    # a reused cache is re-checksummed (xxh3: cheap next to training on it): a shard damaged
    # on disk since it was written is rewritten here instead of failing the trainer
    bad = damaged_shards(cfg, bp)
    res: dict = {}
    if bp.complete and not bad:
        action = "reused"
    elif bad:
        log(f"  boundary {bp.boundary}: cache shards failed their checksum; rewriting them")
        res = build_boundary(cfg, src, plan, bp, bad=bad, log=log)
        action = "repaired"
    else:
        below = bp.source
        prev_ok = (
            below is not None
            and refresh_allowed(cfg)
            and all(is_complete(cfg.cache.root, p.fingerprint) for p in below.caches)
        )
        res = (refresh_boundary if prev_ok else build_boundary)(cfg, src, plan, bp, log=log)
        action = res["action"]
    fps = bp.fingerprints
    sizes = {s: dir_bytes(fs.path(cfg.cache.root) / fp) for s, fp in fps.items()}
    seconds = time.perf_counter() - t0
    timing = {}
    if res.get("executor"):
        # the fixed part: everything but computing shards (plan, start-up, finalize)
        fixed = seconds - (res["seconds"] - res["startup_s"])
        timing = {k: res[k] for k in ("executor", "startup_s", "finalize_s", "rows", "shards")}
        timing["fixed_s"] = fixed
    _event(
        cfg,
        state,
        action=action,
        boundary=bp.boundary,
        round=bp.round,
        fingerprints=fps,
        bytes=sizes,
        seconds=seconds,
        **timing,
    )
    return action, fps


def drop_stale_caches(cfg: Config, state: dict, keep: set[str], log=print) -> None:
    """Bounded disk: remove complete caches this run made that it no longer needs.

    The fingerprints come from state.json, a file: every one is checked to be a fingerprint
    (hex, nothing that walks out of cache.root) before anything is deleted."""
    if cfg.cache.keep:
        return
    fps = []
    for ev in state["events"]:
        for fp in (ev.get("fingerprints") or {}).values():
            try:
                fps.append(check_fingerprint(fp))
            except ConfigError as e:
                raise ConfigError(
                    f"{state_path(cfg.run.dir)} names a cache that is not a fingerprint ({e}); it "
                    "was edited or damaged: nothing was deleted. Fix or remove that entry (or use "
                    "a fresh run.dir) and rerun"
                ) from None
    for fp in dict.fromkeys(fps):
        if fp not in keep and (fs.path(cfg.cache.root) / fp).is_dir():
            # manifest first (never complete with shards missing); spared while another
            # process (a run sharing cache.root) holds a lease on it: a later drop takes it
            readers = remove_unless_used(cfg.cache.root, fp, mine_ok=True)
            if readers:
                log(f"  kept cache {fp[:12]}: still in use ({describe(readers)})")
                continue
            log(f"  dropped cache {fp[:12]} (no longer needed; cache.keep=false)")


def run_bcd(
    cfg: Config,
    *,
    mode: str | None = None,
    log=print,
    hooks: VisitHooks | None = None,
    on_visit: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """The rotation (or --mode full). hooks: every visit's extension points (in-process visits);
    on_visit(round, block, summary): after each visit is recorded (a benchmark's whole-val
    evaluation, say; its time is the caller's to count)."""
    with run_lock(cfg.run.dir, f"bcd --mode {mode or cfg.train.mode}", log=log):
        before = snapshot_records(cfg.run.dir, cfg.run.checkpoint)
        try:
            return _rotate(cfg, mode or cfg.train.mode, log, hooks, on_visit)
        except REFUSALS as e:
            if not isinstance(e, TrainingDiverged):  # that one trained: its records stay
                restore_if_untrained(cfg.run.dir, cfg.run.checkpoint, before)
            raise


# a user's mistake found by a check: the run's records are put back as they were
REFUSALS = (ConfigError, TokenStoreError, CheckpointError, CacheError)


def _rotate(cfg: Config, mode: str, log, hooks, on_visit) -> dict:
    # refused here, in the driver, before anything is written or a worker starts
    store, ckpt = TokenStore(cfg.data.out_dir), Checkpoint.open(cfg.run.checkpoint)
    state = check_run(cfg.run.dir, ckpt, "bcd")
    where = state_path(cfg.run.dir)
    if state.get("mode", mode) != mode:
        raise ConfigError(
            f"{where} belongs to a --mode {state['mode']} run; use another run.dir for --mode "
            f"{mode}"
        )
    check_vocab(ckpt, store)
    check_settings(cfg, "bcd", tokens=store.manifest, checkpoint=ckpt.index)
    if state.get("tokens"):
        check_same_tokens(state["tokens"], store, str(where))
    else:  # the rotation starts (or a state.json from before the record): tokens from now on
        state["tokens"] = token_record(store)
    M = ckpt.num_blocks
    orders = round_orders(cfg.train, state, mode, M, where)
    budget = store_budget(cfg.train, cfg.preinfer.sample_fraction, store)
    if cfg.train.batch_size > budget.n_train:
        raise ConfigError(
            f"train.batch_size ({cfg.train.batch_size}) is larger than the train split "
            f"({budget.n_train} rows of {store.path}); lower train.batch_size, or tokenize more "
            "data"
        )
    if mode == "bcd":  # refuses before the first cache is written
        check_disk_for_rotation(cfg.cache, cfg.train, budget, hidden=ckpt.hidden_size,
                                seq=store.seq_len, M=M)  # fmt: skip
    # every check passed: from here on the run.dir records this run
    state["mode"] = mode
    if (state.get("unigram") or {}).get("fingerprint") != store.fingerprint:  # once per store
        state["unigram"] = unigram_record(store, sample_indices(budget, "val", 0))
    if mode != "full":
        state["order"], state["schedule"] = cfg.train.order, cfg.train.schedule
        state["cache_visits"] = cfg.train.cache_visits
        state["visit_steps"] = cfg.train.visit_steps
    state.setdefault("checkpoint", checkpoint_record(ckpt))
    save_run_state(cfg.run.dir, state)
    # the resolved config of this run (storage credentials masked)
    write_json(Path(cfg.run.dir) / "config.json", fs.redact(cfg.to_dict()))
    if note := case_note(cfg):  # the levers a fine-tune got without asking (issue #54)
        log(f"  {note}")
    check_memory(cfg, ckpt, budget, store.seq_len, mode=mode, log=log)
    if mode == "full":
        visits = [(0, 0)]
        log(f"  full: {budget.steps * cfg.train.rounds * M} steps over all train rows")
    else:
        visits = [(r, k) for r in range(cfg.train.rounds) for k in orders[r]]
        log(f"  each visit: {budget.why} ({budget.passes:.2f} passes)")
        if cfg.train.visit_steps != "equal":
            steps = visit_steps(cfg, ckpt.partition, budget)
            log(f"  steps of each round's visits (train.visit_steps={cfg.train.visit_steps}): "
                f"{steps[0] if len(set(map(tuple, steps))) == 1 else steps}")  # fmt: skip
        if cfg.train.order == "random":
            log(f"  block order (train.order=random, seed {cfg.train.seed}): {orders}")
    # descending, random: round -> the boundary caches kept for the round's later visits
    ready: dict[int, dict[int, tuple[str, dict[str, str]]]] = {}
    keeping = mode == "bcd" and cfg.train.order in ("descending", "random")
    results = []
    for r, k in visits:
        key = f"r{r}-b{k}"
        if key in state["visits"]:
            results.append(state["visits"][key])
            continue
        pending = state.get("pending")
        if (
            pending
            and pending["key"] == key
            and pending["start_hash"] != checkpoint_hash(cfg.run.checkpoint)
        ):
            # killed after the visit committed its block but before state.json said so
            finish_committed(cfg, r, k, mode)
            state["visits"][key] = {**last_visit_summary(cfg.run.dir), "cache": pending["cache"]}
            state["pending"] = None
            state["checkpoint"] = checkpoint_record(Checkpoint.open(cfg.run.checkpoint))
            save_run_state(cfg.run.dir, state)
            results.append(state["visits"][key])
            if keeping:
                _release(cfg, state, ready, plan_visit(cfg.train, budget, M, r, k), log)
            continue
        if mode == "full":  # as many optimizer steps as the whole rotation, over every train row
            cfg_full = _with_steps(cfg, budget.steps * cfg.train.rounds * M)
            state["pending"] = {
                "key": key,
                "start_hash": checkpoint_hash(cfg.run.checkpoint),
                "cache": "tokens",
            }
            save_run_state(cfg.run.dir, state)
            summary = run_train(cfg_full, 0, r, mode="full", log=log, memory_check=False,
                                hooks=hooks)  # fmt: skip
            action = "tokens"
        else:  # the visit's plan, made once: its rows, and the caches it reads and makes
            src = open_sources(cfg) if mode == "bcd" and k > 0 else None
            plan = plan_visit(cfg.train, budget, M, r, k, mode=mode, sources=src)
            action = _make_current(cfg, state, src, plan, ready, log)
            state["pending"] = {
                "key": key,
                "start_hash": checkpoint_hash(cfg.run.checkpoint),
                "cache": action,
            }
            save_run_state(cfg.run.dir, state)
            summary = run_train(cfg, k, r, mode=mode, log=log, memory_check=False, plan=plan,
                                hooks=hooks)  # fmt: skip
        hostmem.trim()  # the visit's model, optimizer and activations are freed
        summary = {**summary, "cache": action}
        state["visits"][key] = summary
        state["pending"] = None
        state["checkpoint"] = checkpoint_record(Checkpoint.open(cfg.run.checkpoint))
        save_run_state(cfg.run.dir, state)
        results.append(summary)
        if keeping:
            _release(cfg, state, ready, plan, log)
        if on_visit is not None:
            on_visit(r, k, summary)
        log(
            f"  round {r} block {k} [{mode}, input: {action}]: {summary.get('steps')} steps, "
            f"train loss {summary.get('loss', float('nan')):.3f}, "
            f"val ppl {_ppl(summary.get('val_loss')):.1f}{_sample(summary)}"
        )
        for flag in _health(cfg, state, results, mode).get(key, []):
            log(f"  warning: round {r} block {k}: {flag}")
    state["caches_in_use"] = [] if mode != "bcd" else state["caches_in_use"]
    save_run_state(cfg.run.dir, state)
    flags = _health(cfg, state, results, mode)
    if flags:  # the run's summary: visits that committed but did not learn (issue #53)
        log(f"  warning: {advice(flags)}")
    return {"mode": mode, "visits": results, "flags": flags}


def _sample(summary: dict) -> str:
    """' +- 9.3 (32 of 1,142 val rows)' when the visit's val figure is over a sample of the
    split (its standard error, first order in ppl); '' over the whole split."""
    v = summary.get("val_sample") or {}
    if not v or v["rows"] >= v["of"]:
        return ""
    return f" +- {_ppl(summary['val_loss']) * v['se']:.1f} ({v['rows']:,} of {v['of']:,} val rows)"


def _health(cfg: Config, state: dict, results: list[dict], mode: str) -> dict[str, list[str]]:
    """preinfer.run.health's flags of the visits so far (visit key -> phrases); the first
    visit starts from the loss of its first step (metrics.jsonl, read once per call)."""
    rows = [{"key": f"r{v.get('round')}-b{v.get('block')}", "val_loss": v.get("val_loss")}
            for v in results]  # fmt: skip
    if not rows:
        return {}
    first = results[0]
    steps = [m for m in read_metrics(cfg.run.dir) if m.get("event") == "step"
             and m.get("step") == 1 and m.get("mode") == mode
             and (m.get("round"), m.get("block")) == (first.get("round"), first.get("block"))]  # fmt: skip
    rows[0]["first_loss"] = steps[-1].get("loss") if steps else None
    return flag_visits(rows, (state.get("unigram") or {}).get("loss"))


def _make_current(
    cfg: Config, state: dict, src: Sources | None, plan: VisitPlan, ready: dict, log
) -> str:
    """Make the boundaries `plan` reads and makes current (plan.makes, lowest first: each
    refreshes from the one before), record each in state.json as soon as it is made, then keep
    those a later visit of the round reads (plan.keeps, in `ready`) and drop the rest. Returns
    how its own boundary was made ('tokens' where it reads none). train.order=descending makes
    the round's boundaries at its start (or at its first visit left after a kill): they stay
    current until their block trains."""
    if plan.boundary is None:
        return "tokens"
    r, k = plan.round, plan.block
    if cfg.train.order == "descending" and r in ready:
        return ready[r][k][0]
    made: dict[int, tuple[str, dict[str, str]]] = {}
    for bp in plan.makes:
        made[bp.boundary] = ensure_cache(cfg, state, src, plan, bp, log=log)
        state["caches_in_use"] = _fingerprints(made)
        save_run_state(
            cfg.run.dir, state
        )  # each cache made is recorded (to be dropped later) at once
    # only now: a boundary beyond one made here that a killed setup completed survives until
    # it is reused
    kept = {j: made[j] for j in (*plan.keeps, k)}
    if cfg.train.order != "ascending":
        ready[r] = kept
    state["caches_in_use"] = _fingerprints(kept)
    drop_stale_caches(cfg, state, set(state["caches_in_use"]), log=log)
    save_run_state(cfg.run.dir, state)
    return made[k][0]


def _release(cfg: Config, state: dict, ready: dict, plan: VisitPlan, log) -> None:
    """train.order=descending or random: block plan.block is trained; keep only the boundaries
    of its round that a later visit reads while they stay current (plan.keeps; after block 0:
    none), and drop the rest."""
    r = plan.round
    if cfg.train.order == "descending" and plan.block > 0 and r not in ready:
        return  # a visit finished before a kill: the next one's setup drops what is stale
    ready[r] = {j: v for j, v in ready.get(r, {}).items() if j in plan.keeps}
    state["caches_in_use"] = _fingerprints(ready[r])
    drop_stale_caches(cfg, state, set(state["caches_in_use"]), log=log)
    save_run_state(cfg.run.dir, state)


def _fingerprints(caches: dict[int, tuple[str, dict[str, str]]]) -> list[str]:
    return sorted({fp for _, fps in caches.values() for fp in fps.values()})


def _with_steps(cfg: Config, steps: int) -> Config:
    c = copy.deepcopy(cfg)
    c.train.max_steps = steps
    c.train.epochs = None
    return c


def _ppl(loss) -> float:
    return math.exp(min(loss, 50.0)) if isinstance(loss, int | float) else float("nan")
