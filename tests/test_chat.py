"""Chat data (data.format=chat, #25 item 2): a messages column rendered with the tokenizer's own
chat template; exact masks (assistant tokens and their <|im_end|> are targets; system, user,
role headers and separators are not), multi-turn, one-line errors that write nothing, a
fingerprint that follows the template, prompt_response ending at the tokenizer's own eos (and
rendered through the template with data.pairs_as_chat), and tokenize -> init -> train -> eval.

The user's tokenizer: a tiny byte-level BPE saved with save_pretrained, ChatML as SmolLM2 has
it (a default system turn when the conversation has none), <|endoftext|> 0, bos
<|im_start|> 1, eos and pad <|im_end|> 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.cli import main
from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.data.tokenization import is_val, iter_documents, load_tokenizer
from preinfer.model.loss import IGNORE
from preinfer.run.visit import Visit, VisitSpec
from storage.tokens import TokenStoreError
from tests.pipeline_fixtures import TINY, quiet, tiny_cfg

S = 96
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYSTEM = "You are a helpful assistant."
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# rewrites the whole conversation by its length: no render of a prefix is a prefix
NOT_PREFIX = "{{ messages | length }}" + CHATML
CHAT = [f"data.seq_len={S}", f"model.max_positions={S}", "model.vocab_size=512",
        "data.max_documents=1000", "data.val_fraction=0.2", "data.format=chat"]  # fmt: skip


def conversation(i: int) -> list[dict]:
    """Deterministic arithmetic chats: some with a system turn, every third with two rounds."""
    a, b = i % 11, i % 7
    turns = [{"role": "system", "content": "Answer briefly."}] if i % 4 == 0 else []
    turns += [{"role": "user", "content": f"Add {a} and {b}."},
              {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]  # fmt: skip
    if i % 3 == 0:
        turns += [{"role": "user", "content": f"And times {b}?"},
                  {"role": "assistant", "content": f"{a} times {b} is {a * b}."}]  # fmt: skip
    return turns


def write_chats(path, n: int = 80, bad: list[dict] | None = None):
    """jsonl, or parquet (a list<struct<role, content>> column) by the suffix of `path`."""
    rows = [{"id": i, "messages": conversation(i)} for i in range(n)] + (bad or [])
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_tokenizer(out, template: str | None = CHATML):
    """The user's chat tokenizer (see the module docstring), as save_pretrained writes it."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    texts = [m["content"] for i in range(40) for m in conversation(i)]
    tok.train_from_iterator(texts + ["system user assistant\n" + SYSTEM] * 20, trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                      eos_token="<|im_end|>", pad_token="<|im_end|>",
                                      unk_token="<|endoftext|>")  # fmt: skip
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(out)
    assert [fast.convert_tokens_to_ids(t) for t in SPECIALS] == [0, 1, 2]
    return out


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("chat_tok") / "tok")


def chat_cfg(run_dir, src, tok_dir, *extra):
    return tiny_cfg(run_dir, *CHAT, f"data.source={src}", f"data.tokenizer={tok_dir}", *extra)


def by_hand(tok, turns: list[dict]) -> tuple[list[int], list[bool]]:
    """ChatML written out piece by piece: (ids, target) with the assistant's content and its
    <|im_end|> targets, everything else (role headers, system / user content, "\\n") not."""
    if turns[0]["role"] != "system":
        turns = [{"role": "system", "content": SYSTEM}, *turns]
    ids, target = [], []
    for t in turns:
        mine = t["role"] == "assistant"
        for text, is_target in ((f"<|im_start|>{t['role']}\n", False),
                                (t["content"] + "<|im_end|>", mine), ("\n", False)):  # fmt: skip
            piece = tok.encode(text, add_special_tokens=False).ids
            ids += piece
            target += [is_target] * len(piece)
    return ids, target


def reference_rows(cfg, split, tok):
    """Conversations packed whole, padded with <|im_end|> (not a target), as the pair rule."""
    n, pad = S + 1, 2
    rows, cur, dropped = [], [], 0
    for doc in iter_documents(cfg.data):
        if is_val(doc, cfg.data) != (split == "val"):
            continue
        ids, target = by_hand(tok, doc.turns())
        conv = list(zip(ids, target, strict=True))
        if len(conv) > n:
            dropped += 1
            continue
        if len(cur) + len(conv) > n:
            rows.append(cur + [(pad, False)] * (n - len(cur)))
            cur = []
        cur += conv
    if cur:
        rows.append(cur + [(pad, False)] * (n - len(cur)))
    ids = np.array([[t for t, _ in r] for r in rows], np.int32)
    labels = np.array([[t if m else IGNORE for t, m in r[1:]] for r in rows], np.int32)
    return ids, labels, dropped


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_masks_are_the_assistant_turns_and_their_end_of_turn_exactly(tmp_path, chat_tok, suffix):
    src = write_chats(tmp_path / f"chat{suffix}")
    cfg = chat_cfg(tmp_path / "run", src, chat_tok)
    said = []
    store = run_tokenize(cfg, log=said.append)
    assert store.has_labels and store.manifest["eos_id"] == 2  # <|im_end|>, the tokenizer's
    tok = load_tokenizer(store.tokenizer_path)
    for split in ("train", "val"):
        ids, labels = store.read_with_labels(split, 0, store.num_samples(split))
        want_ids, want_labels, dropped = reference_rows(cfg, split, tok)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(labels, want_labels)
        assert dropped == 0 and store.manifest["chat"][split]["dropped_too_long"] == 0
    assert store.manifest["chat"]["train"]["conversations"] + store.manifest["chat"]["val"][
        "conversations"] == 80  # fmt: skip
    assert any("80 conversations" in m for m in said)

    # multi-turn: both answers (each through its <|im_end|>) count; the user turn between not
    (ids, target), = [by_hand(tok, conversation(3))]  # fmt: skip
    targets = tok.decode([t for t, m in zip(ids, target, strict=True) if m],
                         skip_special_tokens=False)  # fmt: skip
    assert targets == "3 plus 3 is 6.<|im_end|>3 times 3 is 9.<|im_end|>"
    row_ids, row_labels = store.read_with_labels("train", 0, 1)
    shown = tok.decode([t for t in row_labels[0] if t != IGNORE], skip_special_tokens=False)
    assert " is " in shown and shown.endswith(".<|im_end|>")
    for word in ("user", "system", "assistant", "Add", "briefly", "helpful"):
        assert word not in shown


def one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def cli(capsys, run_dir, *extra) -> tuple[int, str]:
    args = ["tokenize", "--config", "configs/demo.yaml"]
    for s in [*TINY, *CHAT, f"run.dir={run_dir}", *extra]:
        args += ["--set", s]
    code = main(args)
    return code, capsys.readouterr().err


BAD_ROWS = {
    "no_assistant": ([{"messages": [{"role": "user", "content": "Hello?"}]}],
                     "'messages' without an assistant turn"),
    "unknown_role": ([{"messages": [{"role": "human", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello."}]}],
                     "'messages' role 'human' unknown (roles: system, user, assistant, tool)"),
    "not_a_list": ([{"messages": "user: hi / assistant: hello"}],
                   "'messages' not a non-empty list of turns"),
    "not_a_turn": ([{"messages": [{"role": "user", "text": "Hi"}]}],
                   "'messages' holding a turn that is not {'role': str, 'content': str}"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_conversations_are_one_line_errors_and_write_nothing(tmp_path, chat_tok, capsys,
                                                                 case):  # fmt: skip
    bad, needle = BAD_ROWS[case]
    src = write_chats(tmp_path / "chat.jsonl", bad=bad)  # 1 bad row in 81: over 1%
    code, err = cli(capsys, tmp_path / "run", f"data.source={src}", f"data.tokenizer={chat_tok}")
    line = one_line(err)
    assert code == 2 and "1 of 81 rows" in line and needle in line and "chat.jsonl line 81" in line
    assert not (tmp_path / "run").exists()


def test_bad_chat_inputs_are_one_line_errors_and_write_nothing(tmp_path, chat_tok, capsys):
    src = write_chats(tmp_path / "chat.jsonl")
    cases = {
        "no template": (save_tokenizer(tmp_path / "plain", template=None),
                        f"data.tokenizer {tmp_path / 'plain'} has no chat template"),
        "a bare tokenizer.json": (chat_tok / "tokenizer.json",
                                  "is not a Hugging Face tokenizer directory"),
        "template not prefix-stable": (save_tokenizer(tmp_path / "odd", template=NOT_PREFIX),
                                       "does not render conversation"),
        "template refuses": (save_tokenizer(tmp_path / "strict", template="{{ raise_exception("
                                            "'roles must alternate') }}"),
                             "refuses conversation chat.jsonl#0 (TemplateError: roles must"),
    }  # fmt: skip
    for name, (tok_dir, needle) in cases.items():
        code, err = cli(capsys, tmp_path / "run", f"data.source={src}", f"data.tokenizer={tok_dir}")
        assert code == 2 and needle in one_line(err), name
        assert not (tmp_path / "run").exists(), name
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"conversation": conversation(i)}) + "\n" for i in range(9)))
    code, err = cli(capsys, tmp_path / "run", f"data.source={rows}", f"data.tokenizer={chat_tok}")
    assert code == 2 and "data.messages_field: column 'messages' not in rows.jsonl" in one_line(err)
    code, err = cli(capsys, tmp_path / "run", f"data.source={src}", "data.tokenizer=bpe")
    assert code == 2 and "data.tokenizer is bpe" in one_line(err)
    assert not (tmp_path / "run").exists()


def test_a_changed_template_or_format_is_a_new_store(tmp_path, chat_tok):
    src = write_chats(tmp_path / "chat.jsonl")
    cfg = chat_cfg(tmp_path / "run", src, chat_tok)
    fp = run_tokenize(cfg, log=quiet).fingerprint
    assert run_tokenize(cfg, log=quiet).fingerprint == fp  # same inputs: nothing to do
    (chat_tok / "chat_template.jinja").write_text(CHATML.replace(SYSTEM, "Be terse."))
    try:
        with pytest.raises(TokenStoreError, match="holds tokens from other inputs"):
            run_tokenize(cfg, log=quiet)
        assert run_tokenize(cfg, force=True, log=quiet).fingerprint != fp
    finally:
        (chat_tok / "chat_template.jinja").write_text(CHATML)


def write_pairs(path, n: int = 60):
    rows = [{"prompt": f"Add {i % 11} and {i % 7}.", "response": f"{i % 11 + i % 7}."}
            for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pairs_end_at_the_tokenizers_own_eos_or_render_through_its_template(tmp_path, chat_tok):
    src = write_pairs(tmp_path / "pairs.jsonl")
    cfg = chat_cfg(tmp_path / "a", src, chat_tok, "data.format=prompt_response")
    plain = run_tokenize(cfg, log=quiet)
    tok = load_tokenizer(plain.tokenizer_path)
    doc = next(d for d in iter_documents(cfg.data) if not is_val(d, cfg.data))  # first train pair
    prompt = tok.encode(doc.text, add_special_tokens=False).ids
    response = tok.encode(doc.response, add_special_tokens=False).ids
    want = [*prompt, *response, 2]  # ended by <|im_end|>, not the <|endoftext|> (0) text uses
    assert plain.manifest["eos_id"] == 2
    ids, labels = plain.read_with_labels("train", 0, 1)
    np.testing.assert_array_equal(ids[0, : len(want)], want)
    np.testing.assert_array_equal(labels[0, : len(want) - 1],
                                  [IGNORE] * (len(prompt) - 1) + [*response, 2])  # fmt: skip

    # pairs_as_chat: the same pair as a user turn and an assistant turn of the template
    as_chat = chat_cfg(tmp_path / "b", src, chat_tok, "data.format=prompt_response",
                       "data.pairs_as_chat=true")  # fmt: skip
    chat = run_tokenize(as_chat, log=quiet)
    assert chat.fingerprint != plain.fingerprint and chat.manifest["eos_id"] == 2
    want, target = by_hand(tok, doc.turns())
    assert tok.decode(want, skip_special_tokens=False) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{doc.text}<|im_end|>\n"
        f"<|im_start|>assistant\n{doc.response}<|im_end|>\n"
    )
    ids, labels = chat.read_with_labels("train", 0, 1)
    np.testing.assert_array_equal(ids[0, : len(want)], want)
    np.testing.assert_array_equal(labels[0, : len(want) - 1],
                                  np.where(target[1:], want[1:], IGNORE))  # fmt: skip


def test_tokenize_init_train_eval_on_chat_data(tmp_path, chat_tok):
    """A training visit (block 0, from the token store: the loop `preinfer train` and `bcd`
    run) on chat data lowers the val loss over assistant tokens; the full BCD rotation on chat
    data (caches carrying the masks) is the real-model target test's."""
    src = write_chats(tmp_path / "chat.jsonl", n=120)
    cfg = chat_cfg(tmp_path / "run", src, chat_tok, "train.max_steps=8", "train.eval_every=0",
                   "partition.num_blocks=2", "train.lr=0.01")  # fmt: skip
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    before = run_eval(cfg, log=quiet)
    Visit(cfg, VisitSpec(block=0, mode="bcd"), device=torch.device("cpu")).run(log=quiet)
    after = run_eval(cfg, log=quiet)
    assert before["targets"] == after["targets"] == "assistant"
    assert after["tokens"] == before["tokens"]
    assert after["loss"] < before["loss"] - 0.5, (before["loss"], after["loss"])
