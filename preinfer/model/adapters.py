"""Model adapters: any supported model seen as embed -> layers[0..L-1] -> head.

    adapter = get_adapter(model, "llama")
    h = adapter.embed(input_ids)                 # (B, S) long -> (B, S, H)
    for i in range(adapter.num_layers):
        h = adapter.layer(i, h)                  # (B, S, H) -> (B, S, H)
    logits = adapter.head(h)                     # (B, S, H) -> (B, S, V)

A layer runs from the hidden state ALONE: position ids, rotary tables and attention masks are
recomputed from it (`context`), never passed in or stored, so a cached hidden state is all a
later block needs. Samples are packed without padding, hence no padding mask.

Parameter ownership: every state-dict tensor belongs to exactly one part (embed, layer i, head).
A tensor shared by several names (GPT-2's lm_head.weight is wte.weight) is owned by the earliest
part (embed before layers before head; within a part the first name in state-dict order) and
listed once; the other names are aliases (`tied()`).
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import nn

from preinfer.model.partition import Partition


class AdapterError(ValueError):
    """The model does not fit the adapter, or a block cannot run (not loaded, bad input)."""


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _first(out):
    """HF layers return a tensor (transformers >= 5) or a tuple whose first item is the hidden."""
    return out[0] if isinstance(out, tuple | list) else out


class Adapter:
    """Base class: subclasses name the modules of each part and implement the three calls."""

    arch = ""

    def __init__(self, model: nn.Module):
        self.model = model
        self._ready: set[tuple[str, int]] = set()

    # ---- structure, per family ----
    def embed_prefixes(self) -> list[str]:
        raise NotImplementedError

    def layer_modules(self) -> nn.ModuleList | list[nn.Module]:
        raise NotImplementedError

    def layer_prefix(self, i: int) -> str:
        raise NotImplementedError

    def head_prefixes(self) -> list[str]:
        raise NotImplementedError

    # ---- the three calls ----
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def context(self, hidden: torch.Tensor) -> dict:
        """Keyword arguments every layer needs besides the hidden, derived from it alone."""
        return {}

    def layer(self, i: int, hidden: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        ctx = self.context(hidden) if ctx is None else ctx
        return _first(self.layer_modules()[i](hidden, **ctx))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head_split(self) -> tuple | None:
        """(features, linear) with head(h) == linear(features(h)), for the fused chunked loss
        (preinfer.model.loss); None = the head has no final linear layer to fuse."""
        return None

    # ---- sizes ----
    @property
    def num_layers(self) -> int:
        return len(self.layer_modules())

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the positions support (None = unbounded)."""
        return None

    # ---- ownership ----
    def _part_prefixes(self) -> list[tuple[str, int, list[str]]]:
        parts = [("embed", 0, self.embed_prefixes())]
        parts += [("layers", i, [self.layer_prefix(i)]) for i in range(self.num_layers)]
        return parts + [("head", 0, self.head_prefixes())]

    @cached_property
    def _ownership(self) -> tuple[dict, dict, dict]:
        """(part_names(), tied(), part_of) computed once from the state dict (meta works)."""
        state = self.model.state_dict(keep_vars=True)
        part_of: dict[str, tuple[int, str, int]] = {}  # name -> (rank, kind, index)
        for rank, (kind, idx, prefixes) in enumerate(self._part_prefixes()):
            for name in state:
                if name not in part_of and _under(name, prefixes):
                    part_of[name] = (rank, kind, idx)
        stray = [n for n in state if n not in part_of]
        if stray:
            raise AdapterError(
                f"{type(self).__name__}: tensors {stray[:5]} belong to no part (embed, layers, "
                f"head) of this {type(self.model).__name__}; the model has modules the adapter "
                "does not know (use the model class build_model makes)"
            )
        order = {n: k for k, n in enumerate(state)}
        owner_of: dict[int, str] = {}  # id(tensor) -> owner name
        for name in sorted(state, key=lambda n: (part_of[n][0], order[n])):
            owner_of.setdefault(id(state[name]), name)
        tied = {n: owner_of[id(t)] for n, t in state.items() if owner_of[id(t)] != n}
        parts = {"embed": [], "layers": [[] for _ in range(self.num_layers)], "head": []}
        for name in state:
            if name in tied:
                continue
            _, kind, idx = part_of[name]
            (parts["layers"][idx] if kind == "layers" else parts[kind]).append(name)
        return parts, tied, {n: (kind, idx) for n, (_, kind, idx) in part_of.items()}

    def part_names(self) -> dict:
        """{"embed": [...], "layers": [[...] per layer], "head": [...]}: owned state-dict names
        (parameters and persistent buffers); tied aliases are left out (owned elsewhere)."""
        parts = self._ownership[0]
        return {"embed": list(parts["embed"]), "layers": [list(x) for x in parts["layers"]],
                "head": list(parts["head"])}  # fmt: skip

    def tied(self) -> dict[str, str]:
        """alias name -> owner name, for every state-dict name that shares its owner's tensor."""
        return dict(self._ownership[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> tensor (parameters keep their nn.Parameter identity), aliases included."""
        return self.model.state_dict(keep_vars=True)

    def part_params(self) -> tuple[int, list[int], int]:
        """(embed, per-layer, head) element counts of the owned tensors (meta models work)."""
        t, parts = self.tensors(), self.part_names()
        count = lambda names: sum(t[n].numel() for n in names)  # noqa: E731
        return count(parts["embed"]), [count(x) for x in parts["layers"]], count(parts["head"])

    # ---- guards ----
    def part_of(self, name: str) -> tuple[str, int]:
        """("embed" | "layers" | "head", layer index or 0) of a state-dict name (aliases too)."""
        return self._ownership[2][name]

    # ---- guards ----
    def require_loaded(self, kind: str, idx: int = 0) -> None:
        """Raise if a part (or an alias it uses) is still on meta: such modules must never run."""
        if (kind, idx) in self._ready:
            return
        t = self.tensors()
        missing = [n for n in t if self.part_of(n) == (kind, idx) and t[n].is_meta]
        if missing:
            what = f"layer {idx}" if kind == "layers" else kind
            raise AdapterError(
                f"{what} is not loaded (tensors on the meta device, e.g. {missing[0]}); load the "
                "block that owns it (Checkpoint.load(blocks=[...])) before running it"
            )
        self._ready.add((kind, idx))


class HFAdapter(Adapter):
    """Sizes from the transformers config (GPT2Config maps hidden_size/max_position_embeddings
    to n_embd/n_positions itself)."""

    @property
    def hidden_size(self):
        return self.model.config.hidden_size

    @property
    def vocab_size(self):
        return self.model.config.vocab_size

    @property
    def max_positions(self):
        return self.model.config.max_position_embeddings


def _causal(config, hidden: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(position ids (1, S), causal mask or None) for a packed, unpadded batch, made the way the
    HF model's own forward makes them (None = the sdpa kernel applies causality itself)."""
    from transformers.masking_utils import create_causal_mask

    pos = torch.arange(hidden.shape[1], device=hidden.device)[None]  # (1, S)
    mask = create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=pos
    )
    return pos, mask


class GPT2Adapter(HFAdapter):
    """transformers GPT2LMHeadModel: embed = wte + wpe (+dropout), layers = transformer.h,
    head = ln_f + lm_head (lm_head.weight tied to wte.weight when tie_embeddings)."""

    arch = "gpt2"

    def embed_prefixes(self):
        return ["transformer.wte", "transformer.wpe"]

    def layer_modules(self):
        return self.model.transformer.h

    def layer_prefix(self, i):
        return f"transformer.h.{i}"

    def head_prefixes(self):
        return ["transformer.ln_f", "lm_head"]

    def embed(self, input_ids):
        tr = self.model.transformer
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # (1, S)
        return tr.drop(tr.wte(input_ids) + tr.wpe(pos))  # (B, S, H)

    def context(self, hidden):
        pos, mask = _causal(self.model.config, hidden)
        return {"attention_mask": mask, "position_ids": pos}

    def head(self, hidden):
        return self.model.lm_head(self.model.transformer.ln_f(hidden))

    def head_split(self):
        return self.model.transformer.ln_f, self.model.lm_head


class LlamaAdapter(HFAdapter):
    """transformers LlamaForCausalLM (also Mistral/Qwen2 without sliding window): embed =
    embed_tokens, layers = model.layers (rotary tables + causal mask recomputed per call),
    head = final RMSNorm + lm_head."""

    arch = "llama"

    def embed_prefixes(self):
        return ["model.embed_tokens"]

    def layer_modules(self):
        return self.model.model.layers

    def layer_prefix(self, i):
        return f"model.layers.{i}"

    def head_prefixes(self):
        return ["model.norm", "lm_head"]

    def embed(self, input_ids):
        return self.model.model.embed_tokens(input_ids)  # (B, S, H)

    def context(self, hidden):
        pos, mask = _causal(self.model.config, hidden)
        # (cos, sin), each (1, S, head_dim), in the hidden's dtype: as LlamaModel.forward does
        rope = self.model.model.rotary_emb(hidden, position_ids=pos)
        return {"attention_mask": mask, "position_embeddings": rope, "position_ids": pos}

    def head(self, hidden):
        return self.model.lm_head(self.model.model.norm(hidden))

    def head_split(self):
        return self.model.model.norm, self.model.lm_head


class BertAdapter(HFAdapter):
    """transformers BertForMaskedLM: embed = word + position + token-type embeddings and their
    LayerNorm, layers = bert.encoder.layer (bidirectional, no padding mask), head = cls (MLM
    transform + decoder, decoder.weight tied to the word embeddings)."""

    arch = "bert"

    def embed_prefixes(self):
        return ["bert.embeddings"]

    def layer_modules(self):
        return self.model.bert.encoder.layer

    def layer_prefix(self, i):
        return f"bert.encoder.layer.{i}"

    def head_prefixes(self):
        return ["cls"]

    def embed(self, input_ids):
        return self.model.bert.embeddings(input_ids=input_ids)  # (B, S, H), token type 0

    def context(self, hidden):
        from transformers.masking_utils import create_bidirectional_mask

        mask = create_bidirectional_mask(
            config=self.model.config, inputs_embeds=hidden, attention_mask=None
        )
        return {"attention_mask": mask}

    def head(self, hidden):
        return self.model.cls(hidden)


class SequentialAdapter(Adapter):
    """nn.Sequential(embed, layer_0, ..., layer_{L-1}, head), e.g. modeling's plain MLP model."""

    arch = "sequential"

    def __init__(self, model):
        super().__init__(model)
        if not isinstance(model, nn.Sequential) or len(model) < 3:
            raise AdapterError(
                "the sequential adapter needs nn.Sequential(embed, layer_0, ..., head) with at "
                f"least one layer, got {type(model).__name__}"
            )

    def embed_prefixes(self):
        return ["0"]

    def layer_modules(self):
        return list(self.model)[1:-1]

    def layer_prefix(self, i):
        return str(i + 1)

    def head_prefixes(self):
        return [str(len(self.model) - 1)]

    @property
    def hidden_size(self):
        return self.model[0].wte.embedding_dim

    @property
    def vocab_size(self):
        return self.model[0].wte.num_embeddings

    def embed(self, input_ids):
        return self.model[0](input_ids)

    def head(self, hidden):
        return self.model[-1](hidden)


ADAPTERS = {a.arch: a for a in (GPT2Adapter, LlamaAdapter, BertAdapter, SequentialAdapter)}
_EXPECTED = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM"}


def get_adapter(model: nn.Module, arch: str | None = None) -> Adapter:
    """The adapter of `model`; arch None = infer from the model class."""
    if arch is None:
        name = type(model).__name__
        if isinstance(model, nn.Sequential):
            arch = "sequential"
        elif name == "GPT2LMHeadModel":
            arch = "gpt2"
        elif name == "BertForMaskedLM":
            arch = "bert"
        elif name.endswith("ForCausalLM") and hasattr(getattr(model, "model", None), "layers"):
            arch = "llama"
        else:
            raise AdapterError(f"no adapter for {name}; pass arch= one of {sorted(ADAPTERS)}")
    if arch not in ADAPTERS:
        raise AdapterError(f"unknown arch {arch!r}; choose one of {sorted(ADAPTERS)}")
    want = _EXPECTED.get(arch)
    if want and type(model).__name__ != want:
        raise AdapterError(f"arch {arch!r} needs a {want}, got {type(model).__name__}")
    if arch == "llama" and not hasattr(getattr(model, "model", None), "rotary_emb"):
        raise AdapterError(f"arch 'llama' needs a LLaMA-layout *ForCausalLM, got {type(model)}")
    return ADAPTERS[arch](model)


def _check_input(adapter: Adapter, x: torch.Tensor, start: int) -> None:
    if start == 0:
        if x.ndim != 2 or x.dtype not in (torch.long, torch.int32, torch.int64):
            raise AdapterError(
                f"block 0 takes input_ids (B, S) of integer dtype, got {tuple(x.shape)} {x.dtype}"
            )
        seq = x.shape[1]
    else:
        if x.ndim != 3 or x.shape[-1] != adapter.hidden_size or not x.is_floating_point():
            raise AdapterError(
                f"block {start} takes a hidden state (B, S, {adapter.hidden_size}) float, got "
                f"{tuple(x.shape)} {x.dtype}; is this cache from another model?"
            )
        seq = x.shape[1]
    if adapter.max_positions is not None and seq > adapter.max_positions:
        raise AdapterError(
            f"sequence length {seq} exceeds the model's {adapter.max_positions} positions"
        )


def forward_blocks(
    adapter: Adapter,
    partition: Partition,
    x: torch.Tensor,
    start: int,
    stop: int,
    *,
    head: bool = True,
) -> torch.Tensor:
    """Run blocks [start, stop). start == 0: x is input_ids (B, S) and embed runs first; else x
    is the hidden (B, S, H) entering block `start`. stop == M: returns logits (B, S, V) (the
    hidden (B, S, H) leaving the last layer if head=False); else the hidden entering `stop`."""
    M = partition.num_blocks
    if partition.num_layers != adapter.num_layers:
        raise AdapterError(
            f"partition covers {partition.num_layers} layers but the model has "
            f"{adapter.num_layers}; re-partition for this model"
        )
    if not 0 <= start < stop <= M:
        raise AdapterError(
            f"block range [{start}, {stop}) is invalid; need 0 <= start < stop <= {M}"
        )
    _check_input(adapter, x, start)
    if start == 0:
        adapter.require_loaded("embed")
        x = adapter.embed(x)  # (B, S, H): hidden entering layer 0
    first, last = partition.blocks[start][0], partition.blocks[stop - 1][1]
    ctx = adapter.context(x) if last > first else {}
    for i in range(first, last):
        adapter.require_loaded("layers", i)
        x = adapter.layer(i, x, ctx)  # (B, S, H): hidden entering layer i + 1
    if stop == M and head:
        adapter.require_loaded("head")
        return adapter.head(x)  # (B, S, V)
    return x


@torch.no_grad()
def block_boundaries(
    adapter: Adapter, partition: Partition, input_ids: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([hidden entering block b for b in 0..M-1], logits): what the cache stores at each
    boundary (boundary 0 = the embedding output), computed in one pass. For tests and tools."""
    _check_input(adapter, input_ids, 0)
    adapter.require_loaded("embed")
    hiddens, x = [adapter.embed(input_ids)], input_ids  # boundary 0: the embedding output
    for b in range(partition.num_blocks):
        x = forward_blocks(adapter, partition, x, b, b + 1)
        if b + 1 < partition.num_blocks:
            hiddens.append(x)  # (B, S, H) entering block b + 1
    return hiddens, x
