"""Fine-tuning a user's own HF chat model keeps what came in (issue #25, items 3 and 4): the
export carries the input's tokenizer files, chat template, special-token ids and generation
config, and the token store's manifest records the checkpoint's own shape, not config defaults.

The user's model: a tiny tied LLaMA whose tokenizer has <|endoftext|> (0, what the store packs
between documents), bos <|im_start|> (1), eos and pad <|im_end|> (2) and a chat template, and a
generation_config.json of its own (eos 2, max_new_tokens 7)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from tokenizers import Tokenizer

from core.config import ConfigError
from pipelines.bcd import run_bcd
from pipelines.export import run_export
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.export import export_hf
from preinfer.checkpoint.optim_state import SEP
from preinfer.checkpoint.store import Checkpoint
from preinfer.run.config import load_config
from tests.pipeline_fixtures import quiet

TEXT = "def greet(name):\n    return 'hello ' + name\n"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "greet me"}]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _save_chat_model(out) -> None:
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([TEXT * 20, "import os\nprint(os.getcwd())\n" * 20], trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                      eos_token="<|im_end|>", pad_token="<|im_end|>")  # fmt: skip
    fast.chat_template = CHAT
    fast.save_pretrained(out)
    assert [fast.convert_tokens_to_ids(t) for t in SPECIALS] == [0, 1, 2]
    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    model = tf.LlamaForCausalLM(conf)
    model.generation_config = tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                                  max_new_tokens=7)  # fmt: skip
    model.save_pretrained(out, safe_serialization=True)


def _cfg(tmp_path, user):
    return load_config("configs/finetune.yaml", [
        f"run.dir={tmp_path / 'run'}", "model.arch=llama", f"model.checkpoint={user}",
        f"data.tokenizer={user}", "data.max_documents=8", "data.seq_len=16",
        "data.val_fraction=0.25", "cache.dtype=fp32", "preinfer.micro_batch=32",
        "partition.num_blocks=2", "train.batch_size=8", "train.max_steps=2",
        "train.eval_every=0", "train.eval_batches=1", "train.workers=0", "train.epochs=null",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """The chat model tokenized, initialised, trained a couple of steps and exported."""
    tmp_path = tmp_path_factory.mktemp("chat")
    user = tmp_path / "my-chat-model"
    _save_chat_model(user)
    cfg = _cfg(tmp_path, user)
    store = run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    run_bcd(cfg, log=quiet)
    out = tmp_path / "hf"
    res = run_export(cfg, str(out), log=quiet)
    return {"user": user, "out": out, "store": store, "res": res, "cfg": cfg}


def test_export_keeps_the_users_tokenizer_files_and_chat_template(chat_run):
    import transformers as tf

    user, out = chat_run["user"], chat_run["out"]
    for name in TOKENIZER_FILES:  # training changed none of them: byte for byte the input's
        assert (out / name).read_bytes() == (user / name).read_bytes(), name
    assert chat_run["res"]["special_tokens"] == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"
    }  # fmt: skip
    orig = tf.AutoTokenizer.from_pretrained(user, local_files_only=True)
    tok = tf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                             "<|im_end|>")  # fmt: skip
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == orig.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\ngreet me<|im_end|>\n<|im_start|>assistant\n"
    assert tok(TEXT).input_ids == orig(TEXT).input_ids


def test_export_keeps_the_users_token_ids_generation_config_and_tying(chat_run):
    import transformers as tf

    user, out = chat_run["user"], chat_run["out"]
    conf = json.loads((out / "config.json").read_text())
    assert (conf["bos_token_id"], conf["eos_token_id"], conf["pad_token_id"]) == (1, 2, 2)
    assert conf["tie_word_embeddings"] is True

    def values(d):
        return {k: v for k, v in json.loads((d / "generation_config.json").read_text()).items()
                if k != "transformers_version"}  # fmt: skip

    assert values(out) == values(user) == {"bos_token_id": 1, "eos_token_id": 2,
                                           "pad_token_id": 2, "max_new_tokens": 7}  # fmt: skip

    hf = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                 attn_implementation="sdpa").eval()  # fmt: skip
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    assert hf.generation_config.eos_token_id == 2
    tok = tf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)  # fmt: skip
    n = prompt["input_ids"].shape[1]
    with torch.no_grad():
        # greedy, the exported generation config as it is: at most its max_new_tokens (7)
        seq = hf.generate(**prompt, do_sample=False)
        assert n < seq.shape[1] <= n + 7
        # <|im_end|> made the likeliest token: generation stops right after it (with the store's
        # <|endoftext|> as eos it would run on to max_new_tokens)
        seq = hf.generate(**prompt, do_sample=False, sequence_bias={(2,): 100.0})
    assert seq[0, n:].tolist() == [2]


def test_the_token_store_manifest_records_the_checkpoint_that_ran(chat_run):
    user = chat_run["user"]
    model = chat_run["store"].manifest["config"]["model"]
    sha = hashlib.sha256((user / "config.json").read_bytes()).hexdigest()
    assert model == {
        "arch": "llama", "checkpoint": str(user), "model_type": "llama",
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_layers": 4,
        "vocab_size": chat_run["store"].vocab_size, "tie_word_embeddings": True,
        "config_json": str(user / "config.json"), "config_sha256": sha,
    }  # fmt: skip


def test_an_input_tokenizer_changed_since_tokenize_is_refused(chat_run, tmp_path):
    """Its files would not be the tokenizer the weights were trained with: nothing is written."""
    changed = tmp_path / "changed"
    changed.mkdir()
    for name in TOKENIZER_FILES:
        (changed / name).write_bytes((chat_run["user"] / name).read_bytes())
    tok = Tokenizer.from_file(str(changed / "tokenizer.json"))
    tok.add_tokens(["<|tool|>"])
    tok.save(str(changed / "tokenizer.json"))
    cfg = chat_run["cfg"]
    with pytest.raises(ConfigError, match="is not the one the token store .* was made with"):
        export_hf(Checkpoint.open(cfg.run.checkpoint), chat_run["store"].tokenizer_path,
                  tmp_path / "hf", hf_tokenizer=changed, hf_model=chat_run["user"])  # fmt: skip
    assert not (tmp_path / "hf").exists()


def test_a_tied_checkpoint_untied_for_training_trains_its_head_every_visit_and_exports_untied(
    chat_run, tmp_path
):
    """model.tie_embeddings false on the tied chat model: the head starts as a copy of the
    embedding (the same logits as the input model), sits in the last block, trains in every
    visit with train.always_train [head] (block 0's embedding only in block 0's visit), and the
    export is untied and reloads with the checkpoint's own logits."""
    import transformers as tf

    user = chat_run["user"]
    cfg = load_config("configs/finetune.yaml", [
        f"run.dir={tmp_path / 'run'}", "model.arch=llama", f"model.checkpoint={user}",
        "model.tie_embeddings=false", f"data.tokenizer={user}", "data.max_documents=8",
        "data.seq_len=16", "data.val_fraction=0.25", f"data.out_dir={chat_run['cfg'].data.out_dir}",
        "cache.dtype=fp32", "preinfer.micro_batch=32", "partition.num_blocks=2",
        "train.batch_size=8", "train.max_steps=2", "train.eval_every=0", "train.eval_batches=1",
        "train.workers=0", "train.epochs=null", "train.always_train=[head]",
    ])  # fmt: skip
    run_init(cfg, log=quiet)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    assert ckpt.tied == {} and ckpt.index["init"]["untied"] == "lm_head.weight"
    assert ckpt.index["init"]["fresh"] == []
    assert "lm_head.weight" in ckpt.index["blocks"][1]["tensors"]
    ids = torch.tensor([[5, 9, 17, 33, 2, 40]])
    orig = tf.AutoModelForCausalLM.from_pretrained(user, local_files_only=True,
                                                   attn_implementation="sdpa").eval()  # fmt: skip
    model, _ = ckpt.load(range(2))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, orig(ids).logits)
    emb0 = orig.model.embed_tokens.weight.detach().clone()
    res = run_bcd(cfg, log=quiet)
    assert [v["cache"] for v in res["visits"]] == ["tokens", "built"]
    steps = {k.rpartition(SEP)[0]: float(t) for k, t in
             Checkpoint.open(cfg.run.checkpoint).optimizer_state(1)[1].items()
             if k.endswith(f"{SEP}step")}  # fmt: skip
    assert steps["lm_head.weight"] == 4 and steps["model.layers.3.mlp.up_proj.weight"] == 2
    out = tmp_path / "hf"
    assert run_export(cfg, str(out), log=quiet)["tied"] is False
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    hf = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                 attn_implementation="sdpa").eval()  # fmt: skip
    head, emb = hf.lm_head.weight.detach(), hf.model.embed_tokens.weight.detach()
    assert head.data_ptr() != emb.data_ptr()
    # both visits trained the head; the embedding trained in block 0's visit only, so they part
    assert not torch.equal(head, emb) and not torch.equal(head, emb0)
    model, _ = Checkpoint.open(cfg.run.checkpoint).load(range(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids).logits)
