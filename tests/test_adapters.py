"""Adapters and builders: running a model block by block reproduces the model's own forward."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from conftest import ARCHS, MINILM, tiny_input_ids, tiny_model_config
from core.config import ConfigError
from preinfer.model.adapters import AdapterError, block_boundaries, forward_blocks, get_adapter
from preinfer.model.modeling import (
    build_model,
    default_intermediate,
    resolve_checkpoint_path,
)
from preinfer.model.partition import partition_layers, partition_model

TOL = dict(atol=1e-5, rtol=1e-5)


def own_forward(model, arch, ids):
    """(logits, hidden_states or None) from the model's own forward."""
    with torch.no_grad():
        if arch == "sequential":
            return model(ids), None
        out = model(ids, output_hidden_states=True)
        return out.logits, out.hidden_states


def check_parity(model, arch, ids, num_blocks):
    adapter = get_adapter(model, arch)
    part = partition_model(adapter, num_blocks)
    logits, hs = own_forward(model, arch, ids)
    with torch.no_grad():
        assert_close(forward_blocks(adapter, part, ids, 0, part.num_blocks), logits, **TOL)
        bounds, last = block_boundaries(adapter, part, ids)
    assert_close(last, logits, **TOL)
    assert len(bounds) == part.num_blocks
    if hs is not None:
        assert len(hs) == adapter.num_layers + 1
        for b, h in enumerate(bounds):  # entering block b = the hidden entering its first layer
            assert_close(h, hs[part.blocks[b][0]], **TOL)
    # cut anywhere: blocks [0, k) then [k, M) equal the single pass
    with torch.no_grad():
        for k in range(1, part.num_blocks):
            h = forward_blocks(adapter, part, ids, 0, k)
            assert h.shape == (*ids.shape, adapter.hidden_size)
            assert_close(h, bounds[k], **TOL)
            assert_close(forward_blocks(adapter, part, h, k, part.num_blocks), logits, **TOL)
    return adapter, part


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_blocks", [1, 3, 4])
def test_block_parity_tiny(arch, num_blocks, input_ids):
    model = build_model(tiny_model_config(arch))
    check_parity(model, arch, input_ids, num_blocks)


def test_llama_is_gqa_and_parity_holds_untied_and_tied(input_ids):
    cfg = tiny_model_config("llama")
    model = build_model(cfg)
    attn = model.model.layers[0].self_attn
    assert model.config.num_key_value_heads == 2 < model.config.num_attention_heads == 4
    assert attn.k_proj.out_features == 2 * 8 and attn.q_proj.out_features == 4 * 8
    assert model.config.intermediate_size == default_intermediate(cfg) == 88  # 8/3*32 -> 88
    check_parity(
        build_model(tiny_model_config("llama", tie_embeddings=True)), "llama", input_ids, 2
    )


def test_layers_run_from_hidden_alone(input_ids):
    """A layer given only the hidden (no position ids or mask passed) matches the model; the
    causal mask is really applied: changing a late token leaves earlier positions unchanged."""
    for arch in ("gpt2", "llama"):
        model = build_model(tiny_model_config(arch))
        ad = get_adapter(model, arch)
        _, hs = own_forward(model, arch, input_ids)
        with torch.no_grad():
            for i in range(ad.num_layers - 1):
                assert_close(ad.layer(i, hs[i]), hs[i + 1], **TOL)
            h = ad.embed(input_ids)
            h2 = h.clone()
            h2[:, -1] += 1.0
            out, out2 = ad.layer(0, h), ad.layer(0, h2)
        assert_close(out[:, :-1], out2[:, :-1])
        assert not torch.allclose(out[:, -1], out2[:, -1])


def test_minilm_pretrained_parity_and_fresh_head():
    from transformers import BertModel

    cfg = tiny_model_config("bert", checkpoint=MINILM)
    model = build_model(cfg)
    ids = tiny_input_ids(2, 16, vocab=model.config.vocab_size, seed=1)
    adapter, part = check_parity(model, "bert", ids, 3)
    assert (adapter.num_layers, adapter.hidden_size, adapter.vocab_size) == (6, 384, 30522)
    assert part.blocks[0] == (0, 1)  # the 30522-row embedding alone outweighs any layer
    # the encoder really holds the pretrained weights: equal to HF's own BertModel
    ref = BertModel.from_pretrained(resolve_checkpoint_path(MINILM), attn_implementation="sdpa")
    with torch.no_grad():
        h = forward_blocks(adapter, part, ids, 0, part.num_blocks - 1)
        h = forward_blocks(adapter, part, h, part.num_blocks - 1, part.num_blocks)
        assert_close(h, model(ids).logits, **TOL)
        enc = model.bert(ids).last_hidden_state
        assert_close(enc, ref.eval()(ids).last_hidden_state, **TOL)
    # the MLM head was missing from the BertModel checkpoint: fresh, seeded, recorded
    fresh = set(model.init_info["fresh"])
    assert {"cls.predictions.transform.dense.weight", "cls.predictions.bias"} <= fresh
    assert not any(n.startswith("bert.") for n in fresh)
    assert model.init_info["source"] == "pretrained"
    assert "pooler.dense.weight" in model.init_info["unused"]
    same = build_model(cfg).cls.predictions.transform.dense.weight
    other = build_model(tiny_model_config("bert", checkpoint=MINILM, init_seed=1))
    w = model.cls.predictions.transform.dense.weight
    assert torch.equal(w, same)
    assert not torch.equal(w, other.cls.predictions.transform.dense.weight)
    assert torch.equal(
        model.bert.embeddings.word_embeddings.weight, ref.embeddings.word_embeddings.weight
    )


def test_local_hf_checkpoint_dir_roundtrip(tmp_path, input_ids):
    """A plain-path checkpoint (here a tiny GPT-2 and a tiny Qwen2 saved by HF) loads exactly."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    src = build_model(tiny_model_config("gpt2"))
    src.save_pretrained(tmp_path / "gpt2")
    model = build_model(tiny_model_config("gpt2", checkpoint=str(tmp_path / "gpt2")))
    for (n, a), (_, b) in zip(src.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert model.init_info["fresh"] == []
    qcfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    Qwen2ForCausalLM(qcfg).save_pretrained(tmp_path / "qwen2")
    qwen = build_model(tiny_model_config("llama", checkpoint=str(tmp_path / "qwen2")))
    check_parity(qwen, "llama", input_ids, 2)


def test_seeded_init_is_deterministic_and_leaves_global_rng():
    state = torch.get_rng_state()
    a = build_model(tiny_model_config("llama")).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    b = build_model(tiny_model_config("llama")).state_dict()
    c = build_model(tiny_model_config("llama", init_seed=1)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
    )


def test_part_names_and_ties():
    gpt2 = get_adapter(build_model(tiny_model_config("gpt2")), "gpt2")
    parts = gpt2.part_names()
    assert gpt2.tied() == {"lm_head.weight": "transformer.wte.weight"}
    assert "transformer.wte.weight" in parts["embed"] and "lm_head.weight" not in parts["head"]
    assert parts["head"] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert all(
        n.startswith(f"transformer.h.{i}.") for i, ns in enumerate(parts["layers"]) for n in ns
    )
    flat = parts["embed"] + sum(parts["layers"], []) + parts["head"]
    assert len(flat) == len(set(flat)) == len(gpt2.tensors()) - 1  # every tensor once, alias out
    untied = get_adapter(build_model(tiny_model_config("gpt2", tie_embeddings=False)), "gpt2")
    assert untied.tied() == {} and "lm_head.weight" in untied.part_names()["head"]
    bert = get_adapter(build_model(tiny_model_config("bert")), "bert")
    assert bert.tied() == {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }
    seq = get_adapter(build_model(tiny_model_config("sequential")))
    assert seq.arch == "sequential" and seq.tied() == {"5.proj.weight": "0.wte.weight"}


def test_meta_build_has_no_weights_but_real_buffers(input_ids):
    model = build_model(tiny_model_config("llama"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta  # non-persistent: in no block file
    bert = build_model(tiny_model_config("bert"), device="meta")
    assert not bert.bert.embeddings.position_ids.is_meta
    ad = get_adapter(model, "llama")
    part = partition_model(ad, 2)  # counting works on meta
    assert sum(part.block_params) == sum(
        p.numel() for p in build_model(tiny_model_config("llama")).parameters()
    )
    with pytest.raises(AdapterError, match="not loaded"):
        forward_blocks(ad, part, input_ids, 0, 1)


def test_bad_inputs_are_clear_errors(tmp_path, input_ids):
    model = build_model(tiny_model_config("gpt2"))
    ad = get_adapter(model, "gpt2")
    part = partition_model(ad, 2)
    with pytest.raises(AdapterError, match="needs a BertForMaskedLM"):
        get_adapter(model, "bert")
    with pytest.raises(AdapterError, match="unknown arch"):
        get_adapter(model, "t5")
    with pytest.raises(AdapterError, match="invalid"):
        forward_blocks(ad, part, input_ids, 1, 1)
    with pytest.raises(AdapterError, match="hidden state"):
        forward_blocks(ad, part, torch.zeros(2, 16, 7), 1, 2)
    with pytest.raises(AdapterError, match="input_ids"):
        forward_blocks(ad, part, torch.zeros(2, 16, 32), 0, 2)
    with pytest.raises(AdapterError, match="exceeds"):
        forward_blocks(ad, part, tiny_input_ids(1, 33), 0, 2)
    with pytest.raises(AdapterError, match="covers 3 layers but the model has 4"):
        forward_blocks(ad, partition_layers([1, 1, 1], 0, 0, 2), input_ids, 0, 2)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_checkpoint_path(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="not installed"):
        resolve_checkpoint_path("pkg:no_such_pkg_xyz/model")
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_checkpoint_path(str(tmp_path))
    with pytest.raises(ConfigError, match="model.arch is 'llama'"):
        build_model(tiny_model_config("llama", checkpoint=MINILM))
    with pytest.raises(ConfigError, match="only supported for arch 'llama'"):
        build_model(tiny_model_config("gpt2", num_kv_heads=2))
    with pytest.raises(ConfigError, match="sequential"):
        build_model(tiny_model_config("sequential", checkpoint=MINILM))
