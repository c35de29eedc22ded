"""Model configs and builders: HF GPT-2 / LLaMA / BERT or a plain nn.Sequential, from config
(random init with a seed) or from a local HF checkpoint directory. No I/O beyond reading a
local checkpoint, no Ray."""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from core.config import ConfigError

# Largest vocabulary (model.vocab_size, data.vocab_size) taken: 4x the largest in use (Gemma's
# 262,144). Beyond it a typo allocates before any check can say so: model.vocab_size=3e8 is a
# 38 GB embedding, a BPE of data.vocab_size=1e9 reserves ~70 GB up front and aborts.
MAX_VOCAB = 2**20


@dataclass(kw_only=True)
class ModelConfig:
    arch: Literal["gpt2", "llama", "bert", "sequential"] = "gpt2"
    """Model family; decides the adapter (embed -> layers -> head)."""
    checkpoint: str | None = None
    """Local HF checkpoint dir (or `pkg:<module>/<subdir>` inside an installed package); null = random init."""
    vocab_size: int = 4096
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    hidden_size: int = 128
    """Width H of the hidden state (the cached tensor is [N, S, H])."""
    num_layers: int = 6
    """Number of transformer layers L (blocks are cut on layer boundaries)."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (llama); null = num_heads."""
    intermediate_size: int | None = None
    """MLP width; null = 4 * hidden_size (gpt2, bert) or 8/3 * hidden_size rounded (llama)."""
    max_positions: int = 512
    """Longest sequence the model accepts (learned positions or rotary limit)."""
    rope_theta: float = 10000.0
    """Rotary base (llama)."""
    tie_embeddings: bool = True
    """Tie the LM head to the token embedding (block 0's); false on a tied checkpoint unties it."""
    dropout: float = 0.0
    """Dropout in embeddings/attention/MLP (0 keeps cached and recomputed paths identical)."""
    init_seed: int = 0
    """Seed of the random initialisation."""

    def __post_init__(self):
        if self.checkpoint is None:
            for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_positions"):
                if getattr(self, name) < 1:
                    raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
            if self.vocab_size > MAX_VOCAB:
                raise ConfigError(
                    f"model.vocab_size must be <= {MAX_VOCAB:,} (4x the largest vocabularies in "
                    f"use), got {self.vocab_size:,}; set it to the tokenizer's vocabulary size"
                )
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"model.hidden_size ({self.hidden_size}) must be divisible by "
                    f"model.num_heads ({self.num_heads})"
                )
            kv = self.num_kv_heads or self.num_heads
            if self.num_heads % kv:
                raise ConfigError(
                    f"model.num_heads ({self.num_heads}) must be divisible by "
                    f"model.num_kv_heads ({kv})"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.rope_theta <= 0:
            raise ConfigError(f"model.rope_theta must be > 0, got {self.rope_theta}")


# ----------------------------------------------------------------------------------------------
# builders

# HF `model_type`s each arch accepts from a checkpoint; they share the adapter's module layout.
HF_MODEL_TYPES = {"gpt2": ("gpt2",), "llama": ("llama", "mistral", "qwen2"), "bert": ("bert",)}
# Config attributes that carry dropout, per HF family (set from model.dropout).
_DROPOUT_KEYS = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "llama": ("attention_dropout",),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
}
# One attention kernel everywhere, so a block run alone and the model's own forward agree.
ATTN_IMPLEMENTATION = "sdpa"


def resolve_package_path(spec: str, key: str) -> Path:
    """A plain path, or `pkg:<module>/<subdir>` for a path inside an installed Python package
    (found via importlib, never downloaded); `key` names the config field in errors."""
    if not spec.startswith("pkg:"):
        return Path(spec).expanduser()
    mod, _, sub = spec[4:].partition("/")
    if not mod:
        raise ConfigError(f"{key} {spec!r}: expected pkg:<module>/<subdir>")
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(
            f"{key} {spec!r}: Python package {mod!r} is not installed; "
            f"install it (pip install {mod.replace('_', '-')}) or give a local path"
        )
    if found.submodule_search_locations:
        base = Path(next(iter(found.submodule_search_locations)))
    else:
        base = Path(found.origin).parent
    return base / sub if sub else base


# weight files of a checkpoint that only a pickle loader reads: refused (safetensors only)
PICKLE_WEIGHTS = (".bin", ".bin.index.json", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_checkpoint_path(spec: str) -> Path:
    """A local HF checkpoint dir from `model.checkpoint` (a path or `pkg:<module>/<subdir>`):
    config.json and safetensors weights (a directory holding only pickled .bin weights is
    refused, with how to convert it)."""
    path = resolve_package_path(spec, "model.checkpoint")
    if not path.is_dir():
        raise ConfigError(
            f"model.checkpoint {spec!r}: directory {path} does not exist; give a local HF "
            "checkpoint directory (config.json + *.safetensors) or null for random init"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.checkpoint {spec!r}: {path} has no config.json; it is not an HF checkpoint dir"
        )
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.name.endswith(PICKLE_WEIGHTS))
        what = (
            f"holds only PyTorch pickle weights ({', '.join(pickled[:3])}), which preinfer does "
            "not load (unpickling can run code)"
            if pickled
            else "has no *.safetensors weights"
        )
        raise ConfigError(
            f"model.checkpoint {spec!r}: {path} {what}; convert the checkpoint to safetensors "
            "(load it once with transformers from a copy you trust and save_pretrained() it to a "
            "new directory: that writes model.safetensors), then point model.checkpoint there"
        )
    return path


def default_intermediate(cfg: ModelConfig) -> int:
    """MLP width when model.intermediate_size is null: 4H, or 8/3 H rounded up to a multiple of
    8 for llama (SwiGLU has three matrices, so 8/3 H keeps the parameter count of a 4H MLP)."""
    if cfg.intermediate_size is not None:
        return cfg.intermediate_size
    if cfg.arch == "llama":
        return -(-round(8 * cfg.hidden_size / 3) // 8) * 8
    return 4 * cfg.hidden_size


def make_hf_config(cfg: ModelConfig):
    """The transformers config for `cfg` (None for arch "sequential"): read from the checkpoint
    dir when model.checkpoint is set (its architecture wins; dropout comes from `cfg`), else built
    from the ModelConfig fields."""
    if cfg.arch == "sequential":
        if cfg.checkpoint is not None:
            raise ConfigError(
                "model.checkpoint is not supported for arch 'sequential'; "
                "set model.checkpoint: null (random init) or choose arch gpt2/llama/bert"
            )
        return None
    import transformers as tf

    if cfg.checkpoint is not None:
        hf = tf.AutoConfig.from_pretrained(resolve_checkpoint_path(cfg.checkpoint))
        if hf.model_type not in HF_MODEL_TYPES[cfg.arch]:
            raise ConfigError(
                f"model.checkpoint {cfg.checkpoint!r} is a {hf.model_type!r} model but "
                f"model.arch is {cfg.arch!r} (accepts {', '.join(HF_MODEL_TYPES[cfg.arch])}); "
                "fix model.arch"
            )
        window = (
            getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
        )
        if window and window < getattr(hf, "max_position_embeddings", 0):
            # a window >= every allowed length is plain causal attention; a shorter one is not
            raise ConfigError(
                f"model.checkpoint {cfg.checkpoint!r} uses sliding-window attention ({window} < "
                f"{hf.max_position_embeddings} positions), which the llama adapter does not "
                "recompute; use a checkpoint without it"
            )
        for key in _DROPOUT_KEYS[cfg.arch]:
            setattr(hf, key, cfg.dropout)
        if not cfg.tie_embeddings and getattr(hf, "tie_word_embeddings", False):
            # untied for training: the head (block M-1's) can then train in every visit
            # (train.always_train) without touching the embedding every cache was built from
            hf.tie_word_embeddings = False
    else:
        kv = cfg.num_kv_heads
        if cfg.arch != "llama" and kv is not None and kv != cfg.num_heads:
            raise ConfigError(
                f"model.num_kv_heads ({kv}) is only supported for arch 'llama'; set it to null"
            )
        common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings)
        drop = dict.fromkeys(_DROPOUT_KEYS[cfg.arch], cfg.dropout)
        if cfg.arch == "gpt2":
            hf = tf.GPT2Config(
                n_positions=cfg.max_positions,
                n_embd=cfg.hidden_size,
                n_layer=cfg.num_layers,
                n_head=cfg.num_heads,
                n_inner=default_intermediate(cfg),
                bos_token_id=None,
                eos_token_id=None,
                **common,
                **drop,
            )
        elif cfg.arch == "llama":
            hf = tf.LlamaConfig(
                hidden_size=cfg.hidden_size,
                intermediate_size=default_intermediate(cfg),
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=kv or cfg.num_heads,
                max_position_embeddings=cfg.max_positions,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                pad_token_id=None,
                bos_token_id=None,
                eos_token_id=None,
                **common,
                **drop,
            )
        else:
            hf = tf.BertConfig(
                hidden_size=cfg.hidden_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                intermediate_size=default_intermediate(cfg),
                max_position_embeddings=cfg.max_positions,
                **common,
                **drop,
            )
    hf._attn_implementation = ATTN_IMPLEMENTATION
    return hf


def hf_config_from_dict(data: dict):
    """Rebuild a transformers config from its `to_dict()` (as stored in checkpoint.json)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"stored HF config has unknown model_type {model_type!r}")
    hf = CONFIG_MAPPING[model_type].from_dict(dict(data))
    hf._attn_implementation = ATTN_IMPLEMENTATION
    return hf


def _hf_class(arch: str, model_type: str):
    import transformers as tf

    if arch == "gpt2":
        return tf.GPT2LMHeadModel
    if arch == "bert":
        return tf.BertForMaskedLM
    return {
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
    }[model_type]


# ---- the plain nn.Sequential model: embed, L residual per-token MLPs, head ----


class TokenEmbed(nn.Module):
    """(B, S) long -> (B, S, H)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)


class ResidualMLP(nn.Module):
    """(B, S, H) -> (B, S, H): x + W2 gelu(W1 LN(x)), per token (no mixing across positions)."""

    def __init__(self, hidden: int, inner: int, dropout: float):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class LMHead(nn.Module):
    """(B, S, H) -> (B, S, V): final LayerNorm + linear projection (no bias, tieable)."""

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


def _build_sequential(cfg: ModelConfig) -> nn.Sequential:
    H, L = cfg.hidden_size, cfg.num_layers
    inner = default_intermediate(cfg)
    mods = [TokenEmbed(cfg.vocab_size, H)]
    mods += [ResidualMLP(H, inner, cfg.dropout) for _ in range(L)]
    head = LMHead(H, cfg.vocab_size)
    mods.append(head)
    model = nn.Sequential(*mods)
    with torch.no_grad():  # GPT-style init: N(0, 0.02) weights, zero biases, unit norms
        for m in model.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
    if cfg.tie_embeddings:
        head.proj.weight = mods[0].wte.weight  # one tensor, owned by the embed (block 0)
    return model


@contextlib.contextmanager
def _params_on_meta():
    """Register every new nn.Parameter on the meta device (no memory) while buffers stay real.

    Non-persistent buffers (rotary inv_freq, BERT position ids) are computed in __init__ and live
    in no block file, so they must hold real values; parameters are filled from block files later
    (checkpoint.Checkpoint.load). Like accelerate's init_empty_weights(include_buffers=False).
    HF's weight init (PreTrainedModel.initialize_weights; its tying stays) is skipped: on meta
    tensors it fills nothing, and torch runs it through Python reference kernels (~2 ms a
    tensor: 0.1 s of a 6-layer model's 0.15 s build, paid by every checkpoint load).
    Not thread-safe: it patches nn.Module.register_parameter for the duration."""
    from transformers import PreTrainedModel

    old = nn.Module.register_parameter
    old_init = PreTrainedModel.initialize_weights

    def register(module, name, param):
        old(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    PreTrainedModel.initialize_weights = lambda self: None
    try:
        yield
    finally:
        nn.Module.register_parameter = old
        PreTrainedModel.initialize_weights = old_init


@contextlib.contextmanager
def quiet_transformers(*, progress_bars: bool = True):
    """transformers logs errors only while active: no load report (we record missing/unused
    tensors ourselves) nor save report; progress_bars=False: no progress bars either."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress_bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars and not progress_bars:
            hf_logging.enable_progress_bar()


def build_model(
    cfg: ModelConfig, device: str | torch.device | None = None, *, hf_config: dict | None = None
) -> nn.Module:
    """Build the model of `cfg`, in eval mode (call .train() to train).

    - random init (model.checkpoint null): seeded by model.init_seed inside a forked RNG, so the
      global RNG is untouched and the same config gives the same weights;
    - model.checkpoint set: weights from that local HF dir; tensors the dir lacks (e.g. the MLM
      head of a BertModel checkpoint) are initialised deterministically from model.init_seed and
      listed in `model.init_info["fresh"]`; checkpoint tensors the model has no place for are
      listed in `model.init_info["unused"]`; model.tie_embeddings false on a tied checkpoint
      gives the head its own copy of the embedding matrix (`model.init_info["untied"]` names it);
    - hf_config: build this stored architecture (checkpoint.json's HF config) instead of reading
      model.checkpoint; weights random (or meta), never read from disk;
    - device="meta": parameters on the meta device (no memory), buffers real on CPU; the
      checkpoint loader materialises only the blocks it needs.
    """
    meta = device is not None and torch.device(device).type == "meta"
    if cfg.arch == "sequential":
        if hf_config is not None:
            raise ConfigError("arch 'sequential' has no HF config; pass hf_config=None")
        hf = make_hf_config(cfg)  # None; refuses model.checkpoint
    else:
        hf = hf_config_from_dict(hf_config) if hf_config is not None else make_hf_config(cfg)
    info = {"source": "meta" if meta else "random", "checkpoint": None, "fresh": [], "unused": []}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        if meta:
            with _params_on_meta():
                model = (
                    _build_sequential(cfg) if hf is None else _hf_class(cfg.arch, hf.model_type)(hf)
                )
        elif hf is None:
            model = _build_sequential(cfg)
        elif cfg.checkpoint is not None and hf_config is None:
            path = resolve_checkpoint_path(cfg.checkpoint)
            with quiet_transformers():
                model, loading = _hf_class(cfg.arch, hf.model_type).from_pretrained(
                    path,
                    config=hf,
                    dtype=torch.float32,
                    attn_implementation=ATTN_IMPLEMENTATION,
                    output_loading_info=True,
                    use_safetensors=True,  # never a pickle (.bin) fallback
                )
            if loading.get("mismatched_keys") or loading.get("error_msgs"):
                raise ConfigError(
                    f"model.checkpoint {cfg.checkpoint!r}: tensors do not fit the architecture: "
                    f"{sorted(loading.get('mismatched_keys') or loading['error_msgs'])[:5]}"
                )
            fresh = set(loading["missing_keys"])
            info = {"source": "pretrained", "checkpoint": str(path), "untied": None}
            head = model.get_output_embeddings()
            if not cfg.tie_embeddings and head is not None:
                name = next(n for n, p in model.named_parameters() if p is head.weight)
                if name in fresh:  # a tied checkpoint stores the matrix once, as the embedding
                    with torch.no_grad():
                        head.weight.copy_(model.get_input_embeddings().weight)
                    fresh.discard(name)
                    info["untied"] = name
            info["fresh"] = sorted(fresh)
            info["unused"] = sorted(loading["unexpected_keys"])
        else:
            model = _hf_class(cfg.arch, hf.model_type)(hf)
    if hf is not None and model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    if device is not None and not meta:
        model.to(device)
    model.init_info = info
    return model.eval()


def materialise(model: nn.Module, loaded: dict, tied: dict, device="cpu") -> None:
    """Fill a meta-built model (build_model(device="meta")) with `loaded` name -> tensor: each
    becomes a Parameter (or buffer) on `device`; tied aliases (alias -> owner) share the owner's
    Parameter. The real non-persistent buffers (rotary tables, BERT position ids) move to
    `device`; tensors not in `loaded` stay on meta."""
    state = model.state_dict(keep_vars=True)
    new: dict[str, torch.Tensor] = {}
    for name, t in loaded.items():
        old = state[name]
        if tuple(t.shape) != tuple(old.shape):
            raise ConfigError(
                f"tensor {name} has shape {tuple(t.shape)} but the model expects "
                f"{tuple(old.shape)}; the stored weights belong to another architecture"
            )
        t = t.to(device)
        new[name] = (
            nn.Parameter(t, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else t
        )
    for alias, owner in tied.items():
        if owner in new:
            new[alias] = new[owner]
    for name, t in new.items():
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        if attr in mod._parameters:
            mod._parameters[attr] = t
        else:
            mod._buffers[attr] = t
    for mod in model.modules():
        for k, buf in mod._buffers.items():
            if buf is not None and not buf.is_meta:
                mod._buffers[k] = buf.to(device)
