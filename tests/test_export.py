"""`preinfer export`: the checkpoint as a transformers directory that reloads to the same model."""

from __future__ import annotations

import json

import pytest
import torch

from core.config import ConfigError
from pipelines.cli import main
from pipelines.export import run_export
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.format import CheckpointError
from preinfer.checkpoint.store import Checkpoint
from preinfer.data.tokenization import load_tokenizer
from preinfer.model.adapters import forward_blocks
from tests.conftest import MINILM
from tests.pipeline_fixtures import TINY, quiet

TEXT = "def add(a, b):\n    return a + b  # <|endoftext|>"


def _reload(out, arch):
    import transformers as tf

    cls = tf.AutoModelForMaskedLM if arch == "bert" else tf.AutoModelForCausalLM
    model = cls.from_pretrained(out, local_files_only=True, attn_implementation="sdpa")
    tok = tf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    return model.eval(), tok


def _check_same_model(cfg, out, arch):
    """The reloaded model's logits equal preinfer's own forward; the tokenizer encodes as the
    token store's does."""
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    model, adapter = ckpt.load(range(ckpt.num_blocks))
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = forward_blocks(adapter, ckpt.partition, ids, 0, ckpt.num_blocks)
        hf, tok = _reload(out, arch)
        got = hf(input_ids=ids).logits
    assert got.shape == want.shape == (2, 12, ckpt.vocab_size)
    torch.testing.assert_close(got, want)
    ref = load_tokenizer(f"{cfg.data.out_dir}/tokenizer.json")
    for special in (True, False):
        assert tok(TEXT, add_special_tokens=special).input_ids == (
            ref.encode(TEXT, add_special_tokens=special).ids
        )
    return hf, tok, ckpt


def test_gpt2_export_reloads_tied_with_the_same_logits_and_tokenizer(tiny_run, tmp_path):
    cfg = tiny_run()
    out = tmp_path / "hf"
    res = run_export(cfg, str(out), log=quiet)
    files = set(res["files"])
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == res["files"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf", "run"]  # no temp sibling left
    hf, tok, ckpt = _check_same_model(cfg, out, "gpt2")
    # tied as transformers expects: one tensor, stored once
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.model_max_length == ckpt.max_positions
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["bos_token_id"] == gen["pad_token_id"] == eos
    assert hf.config.eos_token_id == eos
    # it generates (eos/pad known, no warnings needed)
    with torch.no_grad():
        seq = hf.generate(**tok("def", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert seq.shape[1] <= 1 + 3 + 1


def test_llama_gqa_untied_export_reloads_with_the_same_logits(tiny_run, tmp_path):
    cfg = tiny_run(
        "model.arch=llama",
        "model.num_kv_heads=1",
        "model.tie_embeddings=false",
        f"run.checkpoint={tmp_path / 'llama_ckpt'}",
    )
    run_init(cfg, log=quiet)
    out = tmp_path / "hf"
    res = run_export(cfg, str(out), log=quiet)
    assert res["model_class"] == "LlamaForCausalLM" and not res["tied"]
    hf, _, _ = _check_same_model(cfg, out, "llama")
    assert hf.config.num_key_value_heads == 1 < hf.config.num_attention_heads
    assert not hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    assert hf.config.pad_token_id is None  # pad only in generation_config (no padding_idx)
    assert (out / "generation_config.json").is_file()


def test_bert_export_reloads_as_masked_lm(tiny_run, tmp_path):
    # a bert trains on masked-LM rows: its own token store (export refuses the causal one)
    cfg = tiny_run("model.arch=bert", f"run.checkpoint={tmp_path / 'bert_ckpt'}",
                   f"data.out_dir={tmp_path / 'bert_tokens'}")  # fmt: skip
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    out = tmp_path / "hf"
    res = run_export(cfg, str(out), log=quiet)
    assert res["auto_class"] == "AutoModelForMaskedLM"
    assert "generation_config.json" not in res["files"]
    hf, _, _ = _check_same_model(cfg, out, "bert")
    assert type(hf).__name__ == "BertForMaskedLM"


def test_pretrained_minilm_export_keeps_its_wordpiece_tokenizer(tmp_path):
    """configs/minilm.yaml: pretrained BERT (MiniLM-L6) and its own WordPiece tokenizer."""
    from preinfer.model.modeling import resolve_package_path
    from preinfer.run.config import load_config

    over = ["data.max_documents=4", "data.seq_len=16", "data.val_fraction=0.25"]
    cfg = load_config("configs/minilm.yaml", [f"run.dir={tmp_path / 'minilm'}", *over])
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    out = tmp_path / "hf"
    res = run_export(cfg, str(out), log=quiet)
    assert res["special_tokens"] == {"unk_token": "[UNK]", "pad_token": "[PAD]",
        "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}  # fmt: skip
    hf, tok, _ = _check_same_model(cfg, out, "bert")
    import transformers as tf

    orig = tf.AutoTokenizer.from_pretrained(resolve_package_path(MINILM, "minilm"))
    assert tok("Hello, world!").input_ids == orig("Hello, world!").input_ids  # [CLS] ... [SEP]
    with torch.no_grad():
        masked = tok("The capital of France is [MASK].", return_tensors="pt")
        assert hf(**masked).logits.shape[-1] == hf.config.vocab_size


def test_cli_export_and_refusal_of_a_non_empty_dir(tiny_run, tmp_path, capsys):
    cfg = tiny_run()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["export", "--config", "configs/demo.yaml", "--set", f"run.dir={cfg.run.dir}"]
    args += [a for s in TINY for a in ("--set", s)]  # the settings the run was made with
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "preinfer export: error:" in err and "not empty" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ConfigError, match="not empty.*--force"):
        run_export(cfg, str(out), log=quiet)
    # --force replaces a previous export only: this one is the user's, kept
    assert main([*args, "--out", str(out), "--force"]) == 2
    assert "is not a preinfer export" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert main([*args, "--out", str(out)]) == 0  # an empty directory is written
    capsys.readouterr()
    (out / "old.txt").write_text("from before")  # a previous export, changed since
    assert main([*args, "--out", str(out), "--force"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"export: {out}: GPT2LMHeadModel")
    assert json.loads(printed[-1])["out"] == str(out)
    assert (out / "model.safetensors").is_file() and not (out / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # old moved aside, gone


def test_damaged_checkpoint_is_a_clear_error_and_leaves_nothing(tiny_run, tmp_path):
    cfg = tiny_run()
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    f = ckpt.block_file(1)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match=r"block 1's file .* unreadable"):
        run_export(cfg, str(out), log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no out, no temp dir
    # an existing (empty) out is left as it was
    out.mkdir()
    with pytest.raises(CheckpointError):
        run_export(cfg, str(out), force=True, log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    assert not any(out.iterdir())


def test_missing_tokenizer_is_a_clear_error(tiny_run, tmp_path):
    cfg = tiny_run()
    (tmp_path / "run" / "tokens" / "tokenizer.json").unlink()
    out = tmp_path / "hf"
    with pytest.raises(ConfigError, match=r"no tokenizer at .*tokenizer\.json.*preinfer tokenize"):
        run_export(cfg, str(out), log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # no token store at all: the same clear error
    with pytest.raises(ConfigError, match="no tokenizer at"):
        run_export(tiny_run(f"data.out_dir={tmp_path / 'nowhere'}"), str(out), log=quiet)


def test_sequential_has_no_transformers_class(tiny_run, tmp_path):
    cfg = tiny_run("model.arch=sequential", f"run.checkpoint={tmp_path / 'seq_ckpt'}")
    run_init(cfg, log=quiet)
    with pytest.raises(ConfigError, match="sequential.*export supports gpt2"):
        run_export(cfg, str(tmp_path / "hf"), log=quiet)
    assert not (tmp_path / "hf").exists()
