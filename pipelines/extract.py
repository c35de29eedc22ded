"""Stage `preinfer cache extract --layers 6,12`: the hidden states at chosen layers of the
model over a token store, each layer a cache of its own, all of them from ONE forward.

    token rows --(embed, layers 0..max(L)-1, one pass)--> hidden entering each layer L

Layer L is the hidden state entering layer L, i.e. the output of layer L-1; layer 0 is the
embedding output (GPT-2: token + position embeddings); layer num_layers is the last layer's
output BEFORE the final norm (Hugging Face's `output_hidden_states` gives hidden_states[L] for
L < num_layers equal to these, and its last entry with the final norm applied). The model runs
in eval mode (no dropout), in preinfer.compute_dtype, without rounding between layers.

Each layer's cache is the ordinary activation cache (storage/cache.py: the same writer, shards,
done markers, manifest, `cache ls/inspect/verify/gc`), under a fingerprint of everything that
decides its bytes, so rerunning the command resumes (shards with a valid marker are kept) and a
finished cache is reused. Its manifest's `identity` (storage/identity.py) records what a reuser
must match: the model (content hash of every block, and its source), the tokenizer (sha256 of
tokenizer.json), the token store, the chat template (sha256, where rows were rendered with one),
split, rows, layer, compute dtype, stored dtype and codec, seq_len, format version. Rows are the
split's first `max_rows` token-store rows in store order; sample_id is the row's index in the
split, and input_ids / labels stay with every row (samples.parquet).

The extracted fingerprints are recorded in <run.dir>/extracts.json (their `caches_in_use`).
The forward and the writes are LayerWorker's (pipelines/extract_worker.py): in this process,
or over a pool of Ray actors (preinfer.executor=ray, or auto under a Ray job: the same choice
and actor settings as a cache build); either way a shard's write runs on a helper thread while
the next shard computes, and the manifest is written last, by this process.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from core.config import ConfigError
from core.fingerprint import CACHE_FORMAT_VERSION, SHORT, chain
from pipelines.cache_build import executor, shards_over_actors
from pipelines.extract_worker import LayerWorker
from pipelines.ray_env import worker_payload
from preinfer.checkpoint.store import Checkpoint
from preinfer.plan.guards import check_vocab
from preinfer.run.config import Config
from preinfer.run.provenance import check_settings
from preinfer.schedule.cache_identity import codec_spec, compute_choice
from storage import atomic, fs
from storage.atomic import dir_bytes, human
from storage.cache import CacheWriter
from storage.identity import LAYER_SEMANTICS, ExtractSpec
from storage.layout import CacheError, estimate_cache_bytes, free_disk_bytes, is_complete
from storage.tokens import SPLITS, TokenStore

RECORD = "extracts.json"  # under run.dir: the fingerprints extracted, for `cache gc --run`


@dataclass(kw_only=True)
class ExtractConfig:
    """What `preinfer cache extract` caches (the rest comes from the project config)."""

    layers: tuple[int, ...]
    """Layers L whose input hidden state is cached (0 = embeddings .. num_layers = last layer's output, before the final norm)."""
    split: Literal["train", "val"] = "train"
    """Token-store split the rows come from."""
    max_rows: int | None = None
    """At most this many rows (the split's first, in store order); null = every row."""

    def __post_init__(self):
        layers = tuple(self.layers)
        if not layers or any(
            not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers
        ):
            raise ConfigError(
                f"--layers {','.join(map(str, layers)) or '(none)'}: give one or more layer ids "
                ">= 0, comma-separated, e.g. --layers 6,12"
            )
        self.layers = tuple(sorted(set(layers)))
        if self.split not in SPLITS:
            raise ConfigError(f"--split {self.split!r}: choose one of {', '.join(SPLITS)}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ConfigError(
                f"--max-rows {self.max_rows}: give a row count >= 1 (or leave it out)"
            )

    @staticmethod
    def parse_layers(text: str) -> tuple[int, ...]:
        """'6,12' -> (6, 12); one ConfigError line for anything else."""
        try:
            return tuple(int(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise ConfigError(
                f"--layers {text!r}: give layer ids as comma-separated integers, e.g. --layers 6,12"
            ) from None


# ------------------------------------------------------------------------------- identity


def model_hash(ckpt: Checkpoint) -> str:
    """The model's content hash: every block's tensor hash, chained (changes with any weight)."""
    return ckpt.prefix_hash(ckpt.num_blocks)


def model_source(ckpt: Checkpoint) -> str:
    """Where the weights came from: 'pretrained:<HF checkpoint dir name>' or 'random'."""
    init = ckpt.index.get("init") or {}
    if init.get("checkpoint"):
        return f"pretrained:{Path(str(init['checkpoint'])).name}"
    return str(init.get("source", "random"))


def chat_template_hash(cfg: Config) -> str | None:
    """sha256 of the chat template the store's rows were rendered with (None: no template)."""
    if not cfg.data.renders_chat:
        return None
    from preinfer.data.chat import ChatTemplate
    from preinfer.data.tokenization import load_tokenizer, tokenizer_file

    tok = load_tokenizer(tokenizer_file(cfg.data.tokenizer))
    return ChatTemplate.load(cfg.data.tokenizer, tok).describe()["template_sha256"]


def base_identity(cfg: Config, ckpt: Checkpoint, store: TokenStore, split: str, rows: int) -> dict:
    """The identity fields every layer of one extract shares (storage/identity.py FIELDS)."""
    return {
        "kind": "layers",
        "model": model_hash(ckpt),
        "model_source": model_source(ckpt),
        "arch": ckpt.index["arch"],
        "num_layers": ckpt.num_layers,
        "tokenizer": store.manifest.get("tokenizer_sha256") or "unknown",
        "tokens": store.fingerprint,
        "chat_template": chat_template_hash(cfg),
        "split": split,
        "rows": rows,
        "layer_semantics": LAYER_SEMANTICS,
        "compute_dtype": compute_choice(cfg.preinfer, cfg.cache, cfg.run.device).compute,
    }


def layer_fingerprint(cfg: Config, ckpt: Checkpoint, base: dict, layer: int) -> str:
    """The cache name of one layer: a hash of its identity, the architecture, the stored dtype
    and how it is compressed (the chained-hash scheme of core/fingerprint.py)."""
    return chain(
        "layer_cache",
        identity={**base, "layer": layer},
        model_config=ckpt.model_config_dict,
        dtype=cfg.cache.dtype,
        codec=codec_spec(cfg.cache),
        format_version=CACHE_FORMAT_VERSION,
    )[: 2 * SHORT]


def spec_for(cfg: Config, layer: int, split: str = "train") -> ExtractSpec:
    """What a cache of `layer` extracted under `cfg` must be (for `expect=` of a reader): the
    model and tokenizer as they are now at the config's paths."""
    ckpt, store = Checkpoint.open(cfg.run.checkpoint), TokenStore(cfg.data.out_dir)
    base = base_identity(cfg, ckpt, store, split, 0)
    keep = ("model", "tokenizer", "tokens", "split", "compute_dtype")
    return ExtractSpec(**{k: base[k] for k in keep}, layer=layer, dtype=cfg.cache.dtype,
                       codec=cfg.cache.codec, seq_len=store.seq_len,
                       hidden_size=ckpt.hidden_size, format_version=CACHE_FORMAT_VERSION)  # fmt: skip


# ---------------------------------------------------------------------------------- stage


def run_extract(cfg: Config, ec: ExtractConfig, *, log=print) -> dict:
    """`preinfer cache extract`: one cache per layer of `ec.layers` over `ec.split`; resumes
    an interrupted extract, reuses finished caches. Returns the fingerprints and timings."""
    t0 = time.perf_counter()
    ckpt, store = Checkpoint.open(cfg.run.checkpoint), TokenStore(cfg.data.out_dir)
    check_vocab(ckpt, store)
    check_settings(cfg, "cache extract", tokens=store.manifest, checkpoint=ckpt.index)
    L = ckpt.num_layers
    bad = [x for x in ec.layers if x > L]
    if bad:
        raise ConfigError(
            f"--layers {','.join(map(str, bad))}: the model has {L} layers, so a layer id is "
            f"0..{L} (0 = the embedding output, {L} = the last layer's output before the final "
            "norm)"
        )
    n = store.num_samples(ec.split)
    n = n if ec.max_rows is None else min(n, ec.max_rows)
    if n == 0:
        raise ConfigError(f"the token store's {ec.split} split has no rows; tokenize more data")
    base = base_identity(cfg, ckpt, store, ec.split, n)
    fps = {x: layer_fingerprint(cfg, ckpt, base, x) for x in ec.layers}
    root = cfg.cache.root
    todo = [x for x in ec.layers if not is_complete(root, fps[x])]
    result = {"split": ec.split, "rows": n, "layers": {str(x): fps[x] for x in ec.layers}}
    if not todo:
        _record(cfg, fps.values())
        log(f"cache extract: layers {_names(ec.layers)} of {ec.split} are current; nothing to do")
        return {"action": "reused", **result}
    _check_disk(root, fps, todo, n, store.seq_len, ckpt.hidden_size, cfg.cache.dtype)
    ids, labels = store.read_with_labels(ec.split, 0, n)  # (n, S+1), (n, S) int32
    samples = {"sample_id": np.arange(n, dtype=np.int64), "input_ids": ids[:, :-1],
               "labels": labels}  # fmt: skip
    del ids
    meta = {"kind": "layers", "split": ec.split, "tokens": store.fingerprint,
            "model": ckpt.model_config_dict, "checkpoint": str(ckpt.path),
            "config": cfg.to_dict()}  # fmt: skip
    writers = {
        x: CacheWriter.create(
            root,
            fps[x],
            samples=samples,
            seq_len=store.seq_len,
            hidden_size=ckpt.hidden_size,
            cache_cfg=cfg.cache,
            meta={**meta, "layer": x},
            identity={**base, "layer": x},
        )  # fmt: skip
        for x in todo
    }
    del samples
    missing = {x: set(w.missing_shards()) for x, w in writers.items()}
    stats = _compute(cfg, {x: fps[x] for x in todo}, missing, base["compute_dtype"], log)
    for w in writers.values():
        w.finalize()
    _record(cfg, fps.values())
    stats["seconds"] = time.perf_counter() - t0
    tok_s = stats["rows_computed"] * store.seq_len / max(stats["loop_s"], 1e-9)
    log(
        f"cache extract: layers {_names(todo)} of {ec.split}: {stats['shards']} shards, "
        f"{stats['rows_computed']} rows in {stats['loop_s']:.1f}s ({tok_s:,.0f} tok/s; forward "
        f"{stats['forward_s']:.1f}s, write {stats['write_s']:.1f}s on a helper thread, waited "
        f"{stats['wait_s']:.1f}s for it; executor {stats['executor']}) -> "
        + ", ".join(f"L{x} {fps[x][:12]}" for x in todo)
    )
    return {"action": "extracted", **result, **stats}


def _compute(cfg: Config, fps: dict, missing: dict, compute: str, log) -> dict:
    """Every shard some layer lacks: its rows' forward once, then each lacking layer's shard
    written, by LayerWorkers in this process or over a Ray actor pool (preinfer.executor, as
    a cache build chooses: cache_build.executor)."""
    layers = tuple(sorted(fps))  # fps: layer -> fingerprint of each cache being written
    shards = sorted(set().union(*missing.values()))
    lacks = np.array([[s in missing[x] for x in layers] for s in shards], dtype=bool)
    where = executor(cfg)
    log(f"  compute dtype {compute}; executor {where}")
    stats = {"shards": 0, "rows_computed": 0, "forward_s": 0.0, "write_s": 0.0, "wait_s": 0.0,
             "executor": where}  # fmt: skip
    t_loop = time.perf_counter()
    if not shards:  # every shard has its marker (a crash before the manifest): finalize only
        records = iter(())
    elif where == "local":
        records = _local_records(cfg, fps, compute, shards, lacks)
    else:
        records = _ray_records(cfg, fps, compute, shards, lacks)
    with tqdm(total=len(shards), desc="extract", unit="shard", disable=None) as bar:
        for rec in records:
            stats["shards"] += 1
            stats["rows_computed"] += int(rec["rows"])
            for k in ("forward_s", "write_s", "wait_s"):
                stats[k] += float(rec[k])
            bar.update(1)
    stats["loop_s"] = time.perf_counter() - t_loop
    return stats


def _local_records(cfg: Config, fps: dict, compute: str, shards: list, lacks: np.ndarray):
    """One LayerWorker in this process over every shard, pipelined across all of them."""
    worker = LayerWorker(cfg, fps, compute)
    try:
        yield from worker.stream(shards, lacks)
    finally:
        worker.close()


def _ray_records(cfg: Config, fps: dict, compute: str, shards: list, lacks: np.ndarray):
    """The shards over a pool of LayerWorker actors, with a cache build's actor settings
    (cache_build.shards_over_actors); a record per shard as calls return (any order)."""
    kwargs = {"cfg": worker_payload(cfg), "fingerprints": fps, "compute": compute}

    def call(a: int, b: int) -> dict:
        return {"shard": np.asarray(shards[a:b]), "lacks": lacks[a:b]}

    yield from shards_over_actors(cfg, LayerWorker, kwargs, len(shards), call)


def _check_disk(root, fps: dict, todo: list, n: int, seq: int, hidden: int, dtype: str) -> None:
    """Refuse before anything is written when the layers' caches cannot fit the free disk
    together (what resumed caches hold already is credited)."""
    base = fs.path(root)
    need = sum(
        max(0, estimate_cache_bytes(n, seq, hidden, dtype) - dir_bytes(base / fps[x])) for x in todo
    )
    free = free_disk_bytes(root)
    if need > free:
        raise CacheError(
            f"cache extract of {len(todo)} layer(s) x {n} rows needs up to {need} bytes "
            f"({human(need)}) but only {free} bytes ({human(free)}) are free at {root}; free "
            "space (`preinfer cache gc`), extract fewer layers or rows (--max-rows), or store "
            "a smaller cache.dtype (fp8_e4m3: about half of bf16)"
        )


def _record(cfg: Config, fps) -> None:
    """Add the fingerprints to <run.dir>/extracts.json's caches_in_use (what gc keeps)."""
    path = Path(cfg.run.dir) / RECORD
    try:
        held = json.loads(path.read_text()).get("caches_in_use", [])
    except (FileNotFoundError, ValueError, AttributeError):
        held = []
    keep = sorted(set(held) | set(fps))
    if keep != held:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, {"caches_in_use": keep})


def _names(layers) -> str:
    return ",".join(map(str, layers))
