import numpy as np
import pytest

from core.config import ConfigError
from pipelines.tokenize import run_tokenize
from preinfer.config import load_config
from preinfer.tokenization import is_val, iter_documents
from storage.tokens import TokenStore, TokenStoreError

SMALL = [
    "data.max_documents=40",
    "data.vocab_size=300",
    "data.seq_len=32",
    "model.vocab_size=512",
    "data.val_fraction=0.2",
    "data.shard_rows=100",
]


def cfg_for(tmp_path, *extra):
    return load_config("configs/demo.yaml", [f"run.dir={tmp_path}", *SMALL, *extra])


def quiet(*a, **k):
    pass


def test_tokenize_is_deterministic_and_rerun_does_nothing(tmp_path):
    cfg = cfg_for(tmp_path / "a")
    s1 = run_tokenize(cfg, log=quiet)
    mtime = (s1.path / "manifest.json").stat().st_mtime_ns
    s2 = run_tokenize(cfg, log=quiet)
    assert (s2.path / "manifest.json").stat().st_mtime_ns == mtime
    other = run_tokenize(cfg_for(tmp_path / "b"), log=quiet)
    assert other.fingerprint == s1.fingerprint
    np.testing.assert_array_equal(other.read("train", 0, 50), s1.read("train", 0, 50))
    assert s1.verify() == []
    assert s1.num_samples("train") > 100 and s1.num_samples("val") > 0
    rows = s1.read("train", 95, 105)  # crosses a shard boundary
    assert rows.shape == (10, 33) and rows.dtype == np.int32
    np.testing.assert_array_equal(s1.read_indices("train", np.array([95, 101])), rows[[0, 6]])


@pytest.mark.parametrize(
    "change",
    ["data.seq_len=16", "data.vocab_size=320", "data.split_seed=1", "data.max_documents=39"],
)
def test_fingerprint_changes_with_inputs(tmp_path, change):
    base = run_tokenize(cfg_for(tmp_path / "a"), log=quiet)
    changed = run_tokenize(cfg_for(tmp_path / "b", change), log=quiet)
    assert changed.fingerprint != base.fingerprint


def test_changed_corpus_byte_changes_fingerprint(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 30 for i in range(12)]
    for i, d in enumerate(docs):
        (corpus / f"{i:02d}.txt").write_text(d)
    over = [f"data.source={corpus}", "data.val_fraction=0.3"]
    a = run_tokenize(cfg_for(tmp_path / "a", *over), log=quiet)
    (corpus / "05.txt").write_text(docs[5].replace("return", "retUrn", 1))
    b = run_tokenize(cfg_for(tmp_path / "b", *over), log=quiet)
    assert a.fingerprint != b.fingerprint
    # the old store is not replaced silently
    with pytest.raises(TokenStoreError, match="--force"):
        run_tokenize(cfg_for(tmp_path / "a", *over), log=quiet)
    assert TokenStore(tmp_path / "a" / "tokens").fingerprint == a.fingerprint
    c = run_tokenize(cfg_for(tmp_path / "a", *over), force=True, log=quiet)
    assert c.fingerprint == b.fingerprint


def test_val_and_train_share_no_document(tmp_path):
    cfg = cfg_for(tmp_path)
    docs = list(iter_documents(cfg.data))
    val = {d.text for d in docs if is_val(d, cfg.data)}
    train = {d.text for d in docs if not is_val(d, cfg.data)}
    assert val and train and not (val & train)


def test_jsonl_source(tmp_path):
    import json

    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"document number {i} " * 50}) for i in range(20)))
    cfg = cfg_for(
        tmp_path / "r", f"data.source={f}", "data.text_field=body", "data.val_fraction=0.3"
    )
    store = run_tokenize(cfg, log=quiet)
    assert store.num_samples("train") > 0
    with pytest.raises(ConfigError, match="column 'text' not in"):
        run_tokenize(cfg_for(tmp_path / "s", f"data.source={f}"), log=quiet)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["data.source=/nonexistent/corpus"], "does not exist"),
        (["data.tokenizer=/nonexistent/tok.json"], "neither 'bpe' nor"),
        (["model.vocab_size=280"], "raise model.vocab_size"),
    ],
)
def test_bad_inputs_write_nothing(tmp_path, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        run_tokenize(cfg_for(tmp_path, *extra), log=quiet)
    assert not any(tmp_path.glob("tokens*"))


def test_empty_corpus(tmp_path):
    corpus = tmp_path / "empty"
    corpus.mkdir()
    (corpus / "a.txt").write_text("   \n")
    with pytest.raises(ConfigError, match="no non-empty documents"):
        run_tokenize(cfg_for(tmp_path / "r", f"data.source={corpus}"), log=quiet)
    assert not (tmp_path / "r" / "tokens").exists()


def test_pretrained_tokenizer(tmp_path):
    cfg = load_config(
        "configs/minilm.yaml",
        [
            f"run.dir={tmp_path}",
            "data.max_documents=10",
            "data.seq_len=32",
            "data.val_fraction=0.3",
        ],
    )
    store = run_tokenize(cfg, log=quiet)
    assert store.vocab_size == 30522 and store.manifest["eos_id"] == 102  # [SEP]
