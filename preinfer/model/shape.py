"""What the planner's arithmetic needs of a model: its shapes and parameter counts per part,
read off a meta-device build (no weight memory, so 7B/20B configs are fine)."""

from __future__ import annotations

from dataclasses import dataclass

from preinfer.model.adapters import get_adapter
from preinfer.model.modeling import build_model, default_intermediate


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a model, read off its meta-device build."""

    arch: str
    hidden: int
    vocab: int
    heads: int
    kv_dim: int  # key/value width (GQA: kv_heads * head_dim)
    inter: int  # MLP width
    embed: int  # parameters owned by the embedding
    layers: tuple[int, ...]  # parameters per layer
    head: int  # parameters owned by the head (tied matrix excluded)
    head_matrix: int  # elements of the LM-head matrix (V x H), owned or tied
    tied: bool
    max_tensor: int  # largest single tensor (elements)
    max_layer_tensor: int  # largest tensor inside a layer

    @property
    def params(self) -> int:
        return self.embed + sum(self.layers) + self.head


def model_shape(model_cfg) -> ModelShape:
    """Shapes of `model_cfg` from a meta-device build (no weight memory, any size)."""

    model = build_model(model_cfg, device="meta")
    ad = get_adapter(model, model_cfg.arch)
    embed, layers, head = ad.part_params()
    hf = getattr(model, "config", None)
    if hf is None:  # arch sequential
        H, heads, inter = (
            model_cfg.hidden_size,
            model_cfg.num_heads,
            default_intermediate(model_cfg),
        )
        kv = H
    else:
        H, heads = hf.hidden_size, hf.num_attention_heads
        inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * H
        kv = (getattr(hf, "num_key_value_heads", None) or heads) * (H // heads)
    t, tied = ad.tensors(), ad.tied()
    matrix = max(
        (v.numel() for n, v in t.items() if ad.part_of(n)[0] == "head" and v.ndim == 2), default=0
    )
    return ModelShape(arch=model_cfg.arch, hidden=H, vocab=ad.vocab_size, heads=heads,
                      kv_dim=kv, inter=inter, embed=embed, layers=tuple(layers), head=head,
                      head_matrix=matrix, tied=bool(tied),
                      max_tensor=max(v.numel() for v in t.values()),
                      max_layer_tensor=max(t[n].numel() for n in ad.part_names()["layers"][0]))  # fmt: skip
