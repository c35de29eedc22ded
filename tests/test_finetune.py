"""Fine-tuning a user's own HF checkpoint end to end (configs/finetune.yaml): a tiny GPT-2 or
LLaMA (GQA, untied) and its tokenizer written by `save_pretrained` -> tokenize -> init -> bcd ->
export -> reload in transformers."""

from __future__ import annotations

import pytest
import torch

from pipelines.bcd import run_bcd
from pipelines.export import run_export
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.store import Checkpoint
from preinfer.model.adapters import forward_blocks
from preinfer.run.config import load_config
from tests.pipeline_fixtures import quiet

EOS = "<|endoftext|>"
TEXT = "def greet(name):\n    return 'hello ' + name\n"


def _save_hf_model(out, arch: str) -> int:
    """A user's model dir: a byte-level BPE tokenizer and a random tiny model, both saved with
    save_pretrained (safetensors). Returns the vocabulary size."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([TEXT * 20, "import os\nprint(os.getcwd())\n" * 20], trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(out)
    vocab = len(fast)
    torch.manual_seed(0)
    if arch == "gpt2":
        conf = tf.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=4, n_head=2,
                             bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id)  # fmt: skip
        model = tf.GPT2LMHeadModel(conf)
    else:
        conf = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=64, tie_word_embeddings=False,
                              eos_token_id=fast.eos_token_id)  # fmt: skip
        model = tf.LlamaForCausalLM(conf)
    model.save_pretrained(out, safe_serialization=True)
    return vocab


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_finetune_a_local_hf_checkpoint_and_export_it_back(arch, tmp_path):
    import transformers as tf

    user = tmp_path / "my-model"
    _save_hf_model(user, arch)
    cfg = load_config("configs/finetune.yaml", [
        f"run.dir={tmp_path / 'run'}", f"model.arch={arch}", f"model.checkpoint={user}",
        f"data.tokenizer={user}", "data.max_documents=8", "data.seq_len=16",
        "data.val_fraction=0.25", "cache.dtype=fp32", "preinfer.micro_batch=32",
        "train.batch_size=8", "train.max_steps=3", "train.eval_every=0", "train.eval_batches=1",
        "train.workers=0", "train.lr=0.003", "train.epochs=null",
    ])  # fmt: skip
    store = run_tokenize(cfg, log=quiet)
    orig_tok = tf.AutoTokenizer.from_pretrained(user, local_files_only=True)
    assert store.vocab_size == len(orig_tok)
    ckpt = run_init(cfg, log=quiet)

    # init: preinfer's forward of the user's weights is the user's model
    ids = torch.randint(0, len(orig_tok), (2, 12), generator=torch.Generator().manual_seed(0))
    orig = tf.AutoModelForCausalLM.from_pretrained(user, local_files_only=True,
                                                   attn_implementation="sdpa").eval()  # fmt: skip
    model, adapter = ckpt.load(range(ckpt.num_blocks))
    with torch.no_grad():
        want0 = orig(input_ids=ids).logits
        torch.testing.assert_close(
            forward_blocks(adapter, ckpt.partition, ids, 0, ckpt.num_blocks), want0
        )
    start = [ckpt.block_hash(b) for b in range(ckpt.num_blocks)]

    run_bcd(cfg, log=quiet)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert all(ckpt.block_hash(b) != h for b, h in enumerate(start))  # every block trained

    out = tmp_path / "hf"
    run_export(cfg, str(out), log=quiet)
    hf = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                 attn_implementation="sdpa").eval()  # fmt: skip
    tok = tf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(hf) is type(orig)
    assert hf.config.tie_word_embeddings == (arch == "gpt2")
    if arch == "llama":
        assert hf.config.num_key_value_heads == 2
    model, adapter = ckpt.load(range(ckpt.num_blocks))
    with torch.no_grad():
        got = hf(input_ids=ids).logits
        torch.testing.assert_close(
            got, forward_blocks(adapter, ckpt.partition, ids, 0, ckpt.num_blocks)
        )
        assert not torch.allclose(got, want0)  # the fine-tuned model, not the user's original
    assert tok(TEXT).input_ids == orig_tok(TEXT).input_ids


def test_init_warns_when_a_pretrained_model_reads_a_trained_bpe_store(tmp_path):
    """A pretrained model over a token store made with a BPE trained on the corpus (the same
    vocabulary size, so nothing else refuses it): init says its embeddings would read other
    tokens; with the model's own tokenizer it says nothing (issue #53's note)."""
    user = tmp_path / "my-model"
    vocab = _save_hf_model(user, "gpt2")
    base = ["model.arch=gpt2", f"model.checkpoint={user}", "data.max_documents=8",
            "data.seq_len=16", "data.val_fraction=0.25", "train.batch_size=8"]  # fmt: skip
    said: list[str] = []
    for name, tok in (("bpe", ["data.tokenizer=bpe", f"data.vocab_size={vocab}"]),
                      ("own", [f"data.tokenizer={user}"])):  # fmt: skip
        cfg = load_config("configs/finetune.yaml", [f"run.dir={tmp_path / name}", *base, *tok])
        run_tokenize(cfg, log=quiet)
        run_init(cfg, log=said.append)
        warned = [x for x in said if "a BPE trained on the corpus" in x]
        assert len(warned) == 1, (name, said)  # the bpe store's, and no more for the own one
    assert "rerun `preinfer tokenize --force`" in warned[0] and str(user) in warned[0]
