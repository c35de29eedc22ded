import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from core.config import ConfigError
from core.fingerprint import file_hash
from pipelines.tokenize import run_tokenize
from preinfer.data.packing import pack
from preinfer.data.tokenization import is_val, iter_documents
from preinfer.run.config import load_config
from preinfer.train.batches import TokenBatches
from storage.tokens import TokenStore, TokenStoreError, TokenStoreWriter
from tests.pipeline_fixtures import quiet

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


# --------------------------------------------------------------------------- shard checksums

OLD = Path(__file__).resolve().parent / "data" / "cache_0495351"


def _flip_input_ids_byte(path: Path) -> None:
    """Flip one bit in the middle of the input_ids column's data: Parquet still decodes the
    shard, to other ids (what a reader without checksums would train on)."""
    col = pq.ParquetFile(path).metadata.row_group(0).column(1)
    assert col.path_in_schema.startswith("input_ids")
    start = col.dictionary_page_offset or col.data_page_offset
    pos = start + col.total_compressed_size // 2
    before = pq.read_table(path).column("input_ids").to_pylist()
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    assert pq.read_table(path).column("input_ids").to_pylist() != before  # silently other ids


def test_a_flipped_byte_in_a_token_shard_is_refused_when_read(tmp_path):
    cfg = cfg_for(tmp_path)
    store = run_tokenize(cfg, log=quiet)
    assert len(store.manifest["shards"]["train"]) >= 2
    info = store.manifest["shards"]["train"][1]
    assert info["checksum"]["algo"] == "xxh3_128" and info["bytes"] > 0
    good, first = store.read("train", *info["rows"]), store.read("train", 0, 10)
    _flip_input_ids_byte(store.path / info["file"])
    store = TokenStore(store.path)
    np.testing.assert_array_equal(store.read("train", 0, 10), first)  # shard 0 is intact
    needle = rf"shard {info['file']} \(train rows {info['rows'][0]}\.\.\d+\).*checksum.*tokenize"
    with pytest.raises(TokenStoreError, match=needle):
        store.read("train", info["rows"][0], info["rows"][0] + 1)
    with pytest.raises(TokenStoreError, match=needle):  # what the trainer reads (from tokens)
        next(TokenBatches(store, "train", batch_size=store.num_samples("train"), seed=0).epoch(0))
    assert store.verify() == [info["file"]]
    # rerunning tokenize writes the store again (same inputs, same fingerprint)
    said = []
    again = run_tokenize(cfg, log=said.append)
    assert any("fail their checksum" in m for m in said)
    assert again.fingerprint == store.fingerprint and again.verify() == []
    np.testing.assert_array_equal(again.read("train", *info["rows"]), good)


def test_a_format_1_store_opens_and_its_shards_are_checked_in_sha256(tmp_path):
    shutil.copytree(OLD / "tokens", tmp_path / "tokens")
    store = TokenStore(tmp_path / "tokens")
    assert store.manifest["format_version"] == 1 and not store.has_labels
    assert store.verify() == []
    ids, labels = store.read_with_labels("train", 0, store.num_samples("train"))
    np.testing.assert_array_equal(labels, ids[:, 1:])
    _flip_input_ids_byte(tmp_path / "tokens" / "train-00000.parquet")
    with pytest.raises(TokenStoreError, match=r"train-00000\.parquet .*sha256 checksum"):
        TokenStore(tmp_path / "tokens").read("train", 0, 1)


# --------------------------------------------------------------------------- linear, streaming


def _old_pack(docs_ids, eos, seq_len):
    """The packing rule as it was (quadratic in a document's length): the reference."""
    buf: list[int] = []
    for ids in docs_ids:
        buf.extend(ids)
        buf.append(eos)
        while len(buf) >= seq_len + 1:
            yield np.asarray(buf[: seq_len + 1], dtype=np.int32)
            del buf[: seq_len + 1]


def test_pack_gives_the_rows_of_the_old_rule():
    g = np.random.default_rng(0)
    docs = [list(g.integers(1, 500, n)) for n in (0, 3, 17, 16, 1, 5000, 0, 40, 2, 33)]
    for seq_len in (2, 16, 32):
        want = list(_old_pack(docs, 0, seq_len))
        got = list(pack(docs, 0, seq_len))
        assert len(got) == len(want) > 0
        assert all(
            a.dtype == np.int32 and np.array_equal(a, b) for a, b in zip(got, want, strict=True)
        )


WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "import", "class", "self", "lambda",
         "yield", "async", "await", "with", "open", "read", "write", "for", "while", "if", "else",
         "elif", "try", "except"]  # fmt: skip


def _write_corpus(root: Path) -> Path:
    """30 text files; doc07 is one long document (~36k tokens)."""
    root.mkdir(parents=True, exist_ok=True)
    for d in range(30):
        n = 20000 if d == 7 else 40 + (d * 37) % 200
        words = [WORDS[(d * 131 + i * 7919 + (i * i) % 13) % len(WORDS)] for i in range(n)]
        lines = [" ".join(words[j : j + 9]) for j in range(0, n, 9)]
        (root / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


def _shards_digest(store) -> str:
    files = {
        s: [(i["file"], file_hash(store.path / i["file"])) for i in store.manifest["shards"][s]]
        for s in ("train", "val")
    }
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def test_streaming_tokenize_writes_the_bytes_the_old_code_wrote(tmp_path):
    # the fingerprint and shard bytes the code before streaming/linear packing wrote for this
    # corpus (one long document among short ones, 2 train + 15 val shards)
    corpus = _write_corpus(tmp_path / "corpus")
    cfg = load_config("configs/demo.yaml", [
        f"run.dir={tmp_path / 'run'}", f"data.source={corpus}", "data.vocab_size=300",
        "data.seq_len=16", "model.vocab_size=512", "data.val_fraction=0.2",
        "data.shard_rows=256",
    ])  # fmt: skip
    store = run_tokenize(cfg, log=quiet)
    assert store.fingerprint == "4f93c10cfd2f4cc0f2f52d27169cccf0"
    assert store.manifest["counts"] == {"train": 472, "val": 3786}
    assert (
        _shards_digest(store) == "40b750a55a41a4a38e6d938ac9c875494b13f740ac2675fe02aed0cadeebc069"
    )


def test_retokenizing_the_0495351_inputs_rewrites_its_shards_byte_for_byte(tmp_path):
    made = json.loads((OLD / "made_by.json").read_text())
    over = [o for o in made["overrides"] if not o.startswith("run.dir=")]
    store = run_tokenize(load_config(None, [*over, f"run.dir={tmp_path}"]), log=quiet)
    old = TokenStore(OLD / "tokens")
    assert store.fingerprint == old.fingerprint
    for split in ("train", "val"):
        for new, was in zip(
            store.manifest["shards"][split], old.manifest["shards"][split], strict=True
        ):
            assert file_hash(store.path / new["file"]) == was["sha256"]


def test_the_writer_holds_at_most_one_shard_per_split(tmp_path):
    w = TokenStoreWriter(tmp_path / "t", seq_len=4, shard_rows=10)
    g = np.random.default_rng(0)
    blocks = {s: [g.integers(0, 9, (k, 5), dtype=np.int32) for k in (3, 25, 0, 7, 1)] for s in ("train", "val")}  # fmt: skip
    for i in range(5):
        for s in ("train", "val"):  # interleaved, as tokenize adds them
            w.add(s, blocks[s][i])
            assert w._held[s] < 10 and w.rows(s) == sum(len(b) for b in blocks[s][: i + 1])
    store = w.commit({"fingerprint": "x", "vocab_size": 9})
    for s in ("train", "val"):
        assert [i["rows"] for i in store.manifest["shards"][s]] == [
            [0, 10],
            [10, 20],
            [20, 30],
            [30, 36],
        ]
        np.testing.assert_array_equal(store.read(s, 0, 36), np.concatenate(blocks[s]))


def test_a_corpus_that_changes_between_passes_writes_nothing(tmp_path, monkeypatch):
    # the corpus is read in passes (hash, BPE, encode): a document edited after the hash
    # would put other tokens under the hashed fingerprint
    import pipelines.tokenize as stage

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 30)
    real = stage.train_bpe

    def edit_then_train(texts, vocab_size):  # another process edits a file meanwhile
        (corpus / "03.txt").write_text("def g(x):\n    return -x\n" * 30)
        return real(texts, vocab_size)

    monkeypatch.setattr(stage, "train_bpe", edit_then_train)
    cfg = cfg_for(tmp_path / "r", f"data.source={corpus}", "data.val_fraction=0.3")
    with pytest.raises(ConfigError, match="changed while it was tokenized"):
        run_tokenize(cfg, log=quiet)
    assert not any((tmp_path / "r").glob("tokens*"))
