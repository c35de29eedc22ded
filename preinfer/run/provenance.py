"""The one rule of every stage that reads a token store or a checkpoint (bcd, train, cache
build / refresh, eval, report, export): what the config asks for is what the artifact was made
with, or the stage refuses before it reads or writes anything, naming each difference and the
command that fixes it. So a setting is never asked for and silently ignored, and
`<run.dir>/config.json` records what ran.

    check_settings(cfg, "bcd", tokens=store.manifest, checkpoint=ckpt.index)

Token store (the config its manifest records): data source, format and fields (prompt,
response, messages; pairs_as_chat), template, tokenizer (and a trained BPE's vocab size),
seq_len, objective, mask settings, split, max_documents; only the settings its format,
tokenizer and objective use. Checkpoint
(checkpoint.json): every model setting and partition.num_blocks. Exempt, as they change where
things are written, not what is computed: data.out_dir, data.shard_rows, and data.on_bad_rows
(whether tokenize refuses, not what a store holds). Local paths compare as absolute paths.
"""

from __future__ import annotations

import os
from dataclasses import fields

from core.config import ConfigError, to_dict
from preinfer.data.config import DataConfig
from preinfer.data.tokenization import check_objective
from preinfer.model.modeling import ModelConfig
from preinfer.run.config import Config

_DATA_ORDER = [f.name for f in fields(DataConfig)]
_MODEL_ORDER = [f.name for f in fields(ModelConfig)]


def _where(spec, *, keep: tuple[str, ...]) -> object:
    """A local path as an absolute, normalised one (comma-separated lists element-wise); the
    `keep` names and URL-like specs (hf:, pkg:, s3://) as they are."""
    if not isinstance(spec, str):
        return spec
    parts = []
    for s in spec.split(","):
        local = s and s not in keep and ":" not in s
        parts.append(os.path.abspath(os.path.expanduser(s)) if local else s)
    return ",".join(parts)


def _data_keys(d: dict) -> set[str]:
    """The data settings a store made with `d` depends on."""
    keys = {"source", "format", "max_documents", "tokenizer", "seq_len", "val_fraction",
            "split_seed"}  # fmt: skip
    if str(d.get("source")).startswith("hf:"):
        keys.add("hf_split")
    if d.get("tokenizer") == "bpe":
        keys.add("vocab_size")
    if d.get("format") == "prompt_response":
        keys |= {"prompt_template", "response_field", "split_pairs", "pairs_as_chat"}
        if d.get("prompt_template") is None:
            keys.add("prompt_field")
    elif d.get("format") == "chat":
        keys |= {"messages_field", "split_pairs"}
    elif d.get("source") != "builtin":
        keys.add("text_field")
    if d.get("objective") == "mlm":
        keys |= {"mask_fraction", "mask_seed"}
    return keys


def _norm(section: str, key: str, value):
    if (section, key) == ("data", "source"):
        return _where(value, keep=("builtin",))
    if (section, key) == ("data", "tokenizer"):
        return _where(value, keep=("bpe",))
    if (section, key) == ("model", "checkpoint"):
        return _where(value, keep=())
    return value


def _diff(section: str, keys, recorded: dict, asked: dict) -> list[str]:
    out = []
    for k in keys:
        old, new = recorded.get(k), asked.get(k)
        if _norm(section, k, old) != _norm(section, k, new):
            out.append(f"{section}.{k} {old!r} -> {new!r}")
    return out


def data_changes(cfg: Config, manifest: dict) -> list[str]:
    """'data.K recorded -> asked' for each data setting the token store of `manifest` was made
    with otherwise than cfg asks (objective apart: check_settings names it first)."""
    rec = (manifest.get("config") or {}).get("data")
    if not isinstance(rec, dict):
        return []  # a manifest without its config: nothing to compare
    recorded = {**to_dict(DataConfig()), **rec}  # settings added since read as their defaults
    asked = to_dict(cfg.data)
    keys = _data_keys(recorded) | _data_keys(asked)
    return _diff("data", [k for k in _DATA_ORDER if k in keys], recorded, asked)


def model_changes(cfg: Config, index: dict) -> list[str]:
    """'model.K recorded -> asked' (and partition.num_blocks) for each setting the checkpoint
    of `index` (checkpoint.json) was made with otherwise than cfg asks."""
    rec = index.get("model_config")
    if not isinstance(rec, dict):
        return []
    recorded = {**to_dict(ModelConfig()), **rec}
    out = _diff("model", _MODEL_ORDER, recorded, to_dict(cfg.model))
    blocks = index.get("blocks")
    if isinstance(blocks, list) and len(blocks) != cfg.partition.num_blocks:
        out.append(f"partition.num_blocks {len(blocks)} -> {cfg.partition.num_blocks}")
    return out


def check_settings(cfg: Config, stage: str, *, tokens: dict | None = None,
                   checkpoint: dict | None = None) -> None:  # fmt: skip
    """Refuse (ConfigError) when the token store (`tokens`: its manifest) or the checkpoint
    (`checkpoint`: its checkpoint.json) at the config's paths was made with other data or model
    settings than `cfg` asks for. None: the stage does not read it, or there is none."""
    if tokens is not None:
        check_objective(cfg.data, tokens.get("objective", "causal"), cfg.data.out_dir)
        if diff := data_changes(cfg, tokens):
            raise ConfigError(
                f"the token store {cfg.data.out_dir} was made with other data settings than "
                f"this config asks for (store -> config: {'; '.join(diff)}); `preinfer {stage}` "
                "would read the store as it is and ignore them. Set them back, or remake the "
                "store with `preinfer tokenize --force` and this config (then train in a fresh "
                "run.dir if a run already trained on the old store)"
            )
    if checkpoint is not None and (diff := model_changes(cfg, checkpoint)):
        raise ConfigError(
            f"the checkpoint {cfg.run.checkpoint} was made with other model settings than this "
            f"config asks for (checkpoint -> config: {'; '.join(diff)}); `preinfer {stage}` "
            "would use the checkpoint as it is and ignore them. Set them back, or make a "
            "checkpoint of this config in a fresh run.dir (`preinfer init --force` replaces "
            "this one, trained weights included)"
        )
