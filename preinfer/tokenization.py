"""Corpus reading, tokenizer training/loading and packing into fixed-length samples."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.config import ConfigError
from preinfer.modeling import resolve_package_path


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin"
    """'builtin' (the interpreter's stdlib .py files), local file/dir paths (text/jsonl/parquet), or 'hf:<name>[:<config>]'."""
    text_field: str = "text"
    """Column holding the text in jsonl/parquet/HF sources."""
    hf_split: str = "train"
    """Split read from an 'hf:' source."""
    max_documents: int | None = None
    """Use only the first N documents (in source order); null = all."""
    tokenizer: str = "bpe"
    """'bpe' (train a byte-level BPE on the train split) or a local tokenizer.json / HF tokenizer dir."""
    vocab_size: int = 4096
    """Vocabulary size of a trained BPE (ignored for a loaded tokenizer)."""
    seq_len: int = 128
    """S, tokens per training sample (each stored sample holds S+1 tokens)."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation (chosen by a hash of the document)."""
    split_seed: int = 0
    """Seed of the train/val document split."""
    shard_rows: int = 4096
    """Samples per Parquet shard of the token store."""
    out_dir: str | None = None
    """Token store directory; null = <run.dir>/tokens."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size < 260:
            raise ConfigError(
                f"data.vocab_size must be >= 260 (256 bytes + special tokens), got {self.vocab_size}"
            )
        if self.max_documents is not None and self.max_documents < 2:
            raise ConfigError(f"data.max_documents must be >= 2 or null, got {self.max_documents}")
        if self.shard_rows < 1:
            raise ConfigError(f"data.shard_rows must be >= 1, got {self.shard_rows}")


# ---------------------------------------------------------------------------------------------
# Corpus


class CorpusError(ConfigError):
    """The corpus cannot be read or is unusable; the message says why and what to do."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    """Stable name of the document (relative path or row index)."""
    text: str


def builtin_corpus_root() -> Path:
    """The running interpreter's standard library: real text on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def _iter_builtin() -> Iterator[Document]:
    root = builtin_corpus_root()
    files = sorted(
        (f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file()),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            yield Document(f.relative_to(root).as_posix(), text)


_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


def _local_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for spec in paths:
        p = Path(spec).expanduser()
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _FORMATS)
        elif p.is_file():
            files.append(p)
        else:
            raise CorpusError(
                f"data.source: {spec} does not exist; give a file, a directory or 'builtin'"
            )
    if not files:
        raise CorpusError(f"data.source: no .txt/.jsonl/.parquet files under {', '.join(paths)}")
    bad = [f.name for f in files if f.suffix not in _FORMATS]
    if bad:
        raise CorpusError(
            f"data.source: unsupported file type(s) {', '.join(bad)}; use {', '.join(sorted(_FORMATS))}"
        )
    return files


def _iter_datasets(ds, text_field: str, label: str) -> Iterator[Document]:
    if text_field not in ds.column_names:
        raise CorpusError(
            f"data.text_field: column {text_field!r} not in {label} (columns: {', '.join(ds.column_names)})"
        )
    for i, row in enumerate(ds):
        text = row[text_field]
        if isinstance(text, str) and text.strip():
            yield Document(f"{label}#{i}", text)


def _iter_local(paths: list[str], text_field: str) -> Iterator[Document]:
    import datasets

    for f in _local_files(paths):
        kind = _FORMATS[f.suffix]
        kwargs = {"sample_by": "document"} if kind == "text" else {}
        try:
            ds = datasets.load_dataset(kind, data_files=str(f), split="train", **kwargs)
        except Exception as e:  # datasets raises many types for unreadable files
            raise CorpusError(f"data.source: cannot read {f} as {kind}: {e}") from None
        field = "text" if kind == "text" else text_field
        yield from _iter_datasets(ds, field, f.name)


HF_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def force_hf_offline() -> None:
    """HF datasets / hub reach no network, whatever the environment says: the variables are
    assigned (a 0 there does not turn offline mode off) before `datasets` is imported, and the
    flags of modules already imported, which read them once at import, are set as well."""
    for key in HF_OFFLINE_ENV:
        os.environ[key] = "1"
    import datasets.config
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def _iter_hf(spec: str, text_field: str, split: str) -> Iterator[Document]:
    force_hf_offline()  # before the import: datasets reads the environment once, when imported
    import datasets

    name, _, conf = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, conf or None, split=split)
    except Exception as e:
        raise CorpusError(
            f"data.source: hf:{spec} did not resolve offline ({type(e).__name__}: {e}); "
            "point data.source at local files or a dataset already in the HF cache"
        ) from None
    yield from _iter_datasets(ds, text_field, f"hf:{name}")


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    """Documents of the configured corpus in a fixed order (truncated to max_documents)."""
    if cfg.source == "builtin":
        it = _iter_builtin()
    elif cfg.source.startswith("hf:"):
        it = _iter_hf(cfg.source[3:], cfg.text_field, cfg.hf_split)
    else:
        it = _iter_local([s for s in cfg.source.split(",") if s], cfg.text_field)
    for n, doc in enumerate(it):
        if cfg.max_documents is not None and n >= cfg.max_documents:
            break
        yield doc


def is_val(doc: Document, cfg: DataConfig) -> bool:
    """Deterministic by content: identical documents always land in the same split."""
    digest = hashlib.sha256(f"{cfg.split_seed}|".encode() + doc.text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < cfg.val_fraction


# ---------------------------------------------------------------------------------------------
# Tokenizer

SPECIAL_EOS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE with one special token, <|endoftext|>, as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_file(spec: str) -> Path:

    p = resolve_package_path(spec, "data.tokenizer")
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(
            f"data.tokenizer: {spec} is neither 'bpe' nor a tokenizer.json / directory holding one"
        )
    return p


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def eos_id(tok) -> int:
    for name in SPECIAL_EOS:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ConfigError(
        f"tokenizer has none of the end-of-document tokens {', '.join(SPECIAL_EOS)}; add one"
    )


def pack(docs_ids: Iterable[list[int]], eos: int, seq_len: int) -> Iterator[np.ndarray]:
    """Concatenate documents with EOS between them and cut rows of S+1 tokens (tail dropped)."""
    buf: list[int] = []
    for ids in docs_ids:
        buf.extend(ids)
        buf.append(eos)
        while len(buf) >= seq_len + 1:
            yield np.asarray(buf[: seq_len + 1], dtype=np.int32)
            del buf[: seq_len + 1]
