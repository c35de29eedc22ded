"""The root config: one section per stage, loaded from `configs/*.yaml` plus `--set` overrides.

    cfg = load_config("configs/demo.yaml", ["train.lr=0.01"])
    cfg.data.seq_len, cfg.cache.dtype, cfg.paths.checkpoint ...

Paths left null in YAML are resolved under `run.dir`, so the resolved config (what is saved
beside every output) names every path explicitly.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from core.config import ConfigError, apply_override, from_dict, load_yaml, to_dict
from preinfer.data.config import DataConfig
from preinfer.data.tokenization import resolve_objective
from preinfer.model.modeling import ModelConfig
from preinfer.model.partition import PartitionConfig
from preinfer.schedule.cache_identity import PreinferConfig
from preinfer.train.config import TrainConfig
from storage import fs
from storage.config import CacheConfig, StorageConfig
from storage.shard_codec import set_codec_threads


@dataclass(kw_only=True)
class RunConfig:
    name: str = "run"
    """Name of the run (used in reports)."""
    dir: str = "runs/run"
    """Run directory: tokens, checkpoint, caches, metrics and reports live under it by default."""
    checkpoint: str | None = None
    """Checkpoint directory; null = <dir>/checkpoint."""
    seed: int = 0
    """Global seed (model init uses model.init_seed, data order train.seed)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where compute runs; auto = cuda when available."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision; auto = bf16 autocast on CUDA and AMX-BF16 CPUs, fp32 elsewhere."""
    verbose: bool = False
    """Show Ray's own log lines and its workers' output here (else they stay in Ray's session logs)."""
    tensorboard: bool = True
    """Mirror metrics.jsonl to TensorBoard under <run.dir>/tensorboard (when the package is installed)."""

    def __post_init__(self):
        if not self.dir:
            raise ConfigError("run.dir must not be empty")


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Run-wide settings (directory, seed, device)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture or local checkpoint."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and packing."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """How layers are cut into blocks."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """Activation cache storage."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Object-store options (endpoint, credentials) for s3:// paths of tokens/checkpoint/cache."""
    preinfer: PreinferConfig = field(default_factory=PreinferConfig)
    """Pre-inference Ray job."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Block trainer and rotation."""
    # the case defaults config_from_dict filled in (dotted key -> value; not a field: the
    # values are in the sections, so to_dict and every recorded config.json hold them)
    from_case: ClassVar[dict[str, Any]] = {}

    def __post_init__(self):
        # Absolute paths: Ray workers (actors, Train workers) do not share the driver's cwd.
        self.run.dir = _absolute(self.run.dir)
        base = self.run.dir.rstrip("/")
        if self.data.out_dir is None:
            self.data.out_dir = f"{base}/tokens"
        if self.run.checkpoint is None:
            self.run.checkpoint = f"{base}/checkpoint"
        if self.cache.root is None:
            self.cache.root = f"{base}/cache"
        self.data.out_dir = _absolute(self.data.out_dir)
        self.run.checkpoint = _absolute(self.run.checkpoint)
        self.cache.root = _absolute(self.cache.root)

        if self.train.cache_visits is None:  # each visit of a round reads rows of its own
            self.train.cache_visits = float(self.partition.num_blocks)
        resolve_objective(self.data, self.model.arch)  # data.objective null -> by model.arch
        fs.configure(self.storage)  # options of s3:// paths in this process (and Ray workers)
        set_codec_threads(self.cache.codec_threads)
        if self.model.checkpoint is None and self.data.seq_len > self.model.max_positions:
            raise ConfigError(
                f"data.seq_len ({self.data.seq_len}) is larger than model.max_positions "
                f"({self.model.max_positions}); lower data.seq_len or raise model.max_positions"
            )

    def to_dict(self) -> dict:
        """Plain data, credentials masked (core.config.to_dict)."""
        return to_dict(self)

    def to_json(self) -> str:
        """The config as printed and saved: credentials masked."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _absolute(path: str) -> str:
    """Local paths made absolute; URLs (s3://, gs://, ...) and pkg: specs left as they are."""
    if "://" in path or path.startswith("pkg:"):
        return path
    return os.path.abspath(os.path.expanduser(path))


# A run initialised from a pretrained model (model.checkpoint set: a fine-tune, a chat fine-tune)
# gets the fine-tune levers measured best on SmolLM2-135M-Instruct (issue #41, docs/log/2026-12-03.md:
# rank-16 suffix adapters and the frozen embedding, val loss 2.740 against 2.874 without, peak
# RSS below LoRA r16's) unless its config sets them. Pretraining (random init, any data format)
# keeps the dataclass defaults: its own measured settings (issue #42).
FINETUNE_DEFAULTS: dict[str, Any] = {"train.suffix_rank": 16, "train.freeze": ["embed"]}


def case_of(data: dict) -> str:
    """'fine-tune' or 'pretraining', from a config's data as given (YAML + overrides)."""
    model, dat = (d if isinstance(d, dict) else {} for d in (data.get("model"), data.get("data")))
    # chat / prompt_response data on a random init is a pretraining case: the levers were measured
    # on pretrained models, and a frozen random embedding stops a visit learning (tests/test_chat)
    if model.get("checkpoint") is not None:
        return "fine-tune"
    return "pretraining"


def case_defaults(data: dict) -> tuple[dict, dict[str, Any]]:
    """(`data` with its case's defaults filled in where it does not set the key, those defaults).
    A key the config sets, in its YAML or a --set, is never replaced; `data` is not changed."""
    if case_of(data) != "fine-tune":
        return data, {}
    out, applied = dict(data), {}
    for key, value in FINETUNE_DEFAULTS.items():
        section, name = key.split(".")
        sec = out.get(section)
        if sec is None:
            sec = {}
        if not isinstance(sec, dict) or name in sec:
            continue  # not a mapping: from_dict says so; set: the user's
        out[section] = {**sec, name: copy.deepcopy(value)}
        applied[key] = value
    return out, applied


def case_note(cfg: Config) -> str | None:
    """One line naming the settings a run got from its case, or None."""
    if not cfg.from_case:
        return None
    got = ", ".join(f"{k}={json.dumps(v)}" for k, v in cfg.from_case.items())
    return (
        f"fine-tune defaults (model.checkpoint is set): "
        f"{got}; set a key in the config or with --set to choose otherwise"
    )


def config_from_dict(data: dict) -> Config:
    """The root config; the case's defaults (FINETUNE_DEFAULTS) fill what `data` does not set."""
    data, applied = case_defaults(data) if isinstance(data, dict) else (data, {})
    cfg = from_dict(Config, data)
    cfg.from_case = applied
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or defaults when path is None) and apply `section.key=value` overrides."""
    data = load_yaml(path) if path is not None else {}
    for spec in overrides or []:
        apply_override(data, spec)
    return config_from_dict(data)
